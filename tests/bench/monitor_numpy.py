#!/usr/bin/python3
"""The QK head monitors of daemon/monitor_qk.c in numpy, for bench_monitor.

Reads the Grams bench_monitor wrote ("FSGRAMS1", u32 dh, u32 heads, then per
head the GA and GB upper triangles, row-major, float64) and computes per head
exactly what qk_head_from_grams does: unpack, the four squared norms, c_qk,
the spectra d2, d1, d3, w, and the section 1.3 scalars. Two routes for
lambda(G1 G2), each with the same LAPACK/BLAS calls as its C counterpart in
bench_monitor, so that the ratio measures the language and its overheads,
not a different algorithm:
  chol  the module's route: G1 = L L^T (np.linalg.cholesky: dpotrf),
        C = L^T G2 L by two triangular products (scipy.linalg.blas.dtrmm,
        as monitor_qk.c does; two general products would do twice the
        flops), eigvalsh(C) (dsyevd without vectors: the same tridiagonal
        reduction and dsterf as the module's dsyev('N')). numpy has no
        pivoted Cholesky; the bench's Grams are full rank.
  eig   docs/monitors.md's wording: G1 = V diag(w) V^T (eigh: dsyevd('V')),
        C = (V w^1/2)^T G2 (V w^1/2) by two dgemm, eigvalsh(C), as
        bench_monitor's eig column.
Prints one line per route:
  route=<chol|eig> heads_per_s=<best of --rounds> checksum=<sum of erank2>
heads_per_s is per CPU second of this thread (time.thread_time), as
bench_monitor measures its own columns.
The checksum (sum over heads and spectra of erank_2) must match the C
module's; bench_monitor checks it. Run with OPENBLAS_NUM_THREADS=1 for a
one-thread comparison (bench_monitor does).

usage: monitor_numpy.py --input FILE [--seconds 0.5] [--rounds 3]
"""
import argparse
import os
import struct
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402  (after the thread setting)
from scipy.linalg.blas import dtrmm  # noqa: E402  (Debian python3-scipy)

EPS = np.finfo(np.float64).eps


def read_grams(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"FSGRAMS1":
        raise SystemExit("monitor_numpy: not a FSGRAMS1 file")
    dh, heads = struct.unpack_from("<II", data, 8)
    n = 2 * dh
    tri = n * (n + 1) // 2
    vals = np.frombuffer(data, dtype="<f8", offset=16)
    if vals.size != heads * 2 * tri:
        raise SystemExit("monitor_numpy: truncated file")
    vals = vals.reshape(heads, 2, tri)
    return dh, [(vals[h, 0], vals[h, 1]) for h in range(heads)]


def scalars(s, m):
    """docs/monitors.md 1.3 with the module's cleaning; None when absent."""
    smax = s.max(initial=0.0)
    if not smax > 0:
        return None
    s = s[s >= smax * m * EPS]
    u = s / smax
    p2 = u / u.sum()
    sig = np.sqrt(u)
    p1 = sig / sig.sum()
    h2 = -np.sum(p2 * np.log(p2))
    h1 = -np.sum(p1 * np.log(p1))
    return {"entropy2": h2, "entropy1": h1, "erank2": np.exp(h2), "erank1": np.exp(h1),
            "srank": u.sum(), "fro": np.sqrt(u.sum() * smax), "smax": np.sqrt(smax),
            "rank": s.size}


def make_pair_chol():
    def factor(g1):
        # Column-major, as LAPACK/BLAS want it: dtrmm then copies nothing.
        return np.asfortranarray(np.linalg.cholesky(g1))

    def project(f, g2):
        # X = G2 L (dtrmm, right side; G2 symmetric, so its transpose, a
        # column-major view, is G2; the copy into X is the one the module
        # makes too), then C = L^T X in place (dtrmm, left, transposed).
        x = dtrmm(1.0, f, g2.T, side=1, lower=1)
        c = dtrmm(1.0, f, x, side=0, lower=1, trans_a=1, overwrite_b=1)
        return np.linalg.eigvalsh(c)
    return factor, project


def make_pair_eig():
    def factor(g1):
        w, v = np.linalg.eigh(g1)
        keep = w > w[-1] * g1.shape[0] * EPS
        return v[:, keep] * np.sqrt(w[keep])

    def project(f, g2):
        return np.linalg.eigvalsh(f.T @ g2 @ f)
    return factor, project


def head(ga_tri, gb_tri, dh, iu, factor, project):
    n = 2 * dh
    ga = np.empty((n, n))
    gb = np.empty((n, n))
    ga[iu] = ga_tri
    ga.T[iu] = ga_tri
    gb[iu] = gb_tri
    gb.T[iu] = gb_tri
    h = slice(0, dh)
    l = slice(dh, n)
    qdd, qww, kww, kdd = ga[h, h], ga[l, l], gb[h, h], gb[l, l]
    qd, qw, kw, kd = np.trace(qdd), np.trace(qww), np.trace(kww), np.trace(kdd)
    out = {"norms": (qd, qw, kw, kd)}
    if qd > 0 and kd > 0:
        out["cqk"] = np.sum((qdd / qd) * (kdd / kd))
        out["d3"] = project(factor(qdd), kdd)
    if qw > 0 and kw > 0:
        out["w"] = project(factor(qww), kww)
    if qd > 0 or kd > 0:
        s = np.sqrt(qd / qw) if qd > 0 and qw > 0 else 1.0
        # balance: GA' = D GA D, GB' = D^-1 GB D^-1, D = diag(I, sI)
        ga[:, l] *= s
        ga[l, :] *= s
        gb[:, l] /= s
        gb[l, :] /= s
        f = factor(ga)
        out["d2"] = project(f, gb)
        # d1: GB1' = W' GB' W'^T, W' = [[I, sI], [0, I]]
        gb[h, h] += s * (gb[h, l] + gb[l, h]) + s * s * gb[l, l]
        gb[h, l] += s * gb[l, l]
        gb[l, h] += s * gb[l, l]
        out["d1"] = project(f, gb)
    for k, m in (("d2", n), ("d1", n), ("d3", dh), ("w", dh)):
        if k in out:
            out[k + ".scalars"] = scalars(np.maximum(out[k][::-1], 0.0), m)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", required=True)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--route", choices=("chol", "eig", "both"), default="both")
    args = ap.parse_args()
    dh, heads = read_grams(args.input)
    iu = np.triu_indices(2 * dh)
    routes = ("chol", "eig") if args.route == "both" else (args.route,)
    for route in routes:
        factor, project = make_pair_chol() if route == "chol" else make_pair_eig()
        checksum = 0.0
        for ga, gb in heads:
            out = head(ga, gb, dh, iu, factor, project)
            for k in ("d2", "d1", "d3", "w"):
                sc = out.get(k + ".scalars")
                if sc:
                    checksum += sc["erank2"]
        best = 0.0
        for _ in range(args.rounds):
            done = 0
            t0 = time.thread_time()  # CPU time, as bench_monitor measures
            while True:
                for ga, gb in heads:
                    head(ga, gb, dh, iu, factor, project)
                    done += 1
                t = time.thread_time() - t0
                if t >= args.seconds:
                    break
            best = max(best, done / t)
        print(f"route={route} heads_per_s={best:.3f} checksum={checksum:.15g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
