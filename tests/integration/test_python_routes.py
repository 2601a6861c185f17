"""The spectrum route (the Python client solves each head's spectra on the
weights' device and sends spectrum sketches) and the Gram route (it sends
the Grams and the daemon solves) store the same monitor series, with
grouped-query attention, and both agree with a float64 dense reference.

One deterministic trajectory W(t) of a 3-layer LLaMA-style model (8 query
heads reading 2 KV heads, dh 8, d 48; float32 weights): layer 0 updates Q
and K, layer 1 freezes K (no Delta3, no c_qk; the daemon factors GB, which
is singular), layer 2 freezes Q (GA singular: the eigen-route fallback), and
at the last step one query head of layer 0 turns NaN (a non-finite head:
absent in every series). Windows 2 and 4, a sketch every 2 steps, three runs
into one real daemon:
  gram      route="gram": float32 Grams on the wire, the daemon solves
  spectrum  route="spectrum" (the default on a GPU; this model is on the
            CPU, whose default is gram), from the same float32 Grams
  exact     the spectrum route with gram_dtype=float64
Checked:
  - the spectrum runs sent spectrum sketches (one per head, 6 dh floats,
    the key head h // 4 named), the gram run Gram sketches;
  - every stored qk.* series (per head and the per-layer min/mean/max/argmin)
    of "spectrum" equals "gram": same points, same absences, values within
    1e-6 relative;
  - every per-head value of "exact", and of "gram", equals the float64
    reference (Delta1, Delta2, Delta3 and K(t0) formed as d x d matrices
    from the float32 weights widened to float64, their singular values,
    docs/monitors.md 1.3's scalars with the daemon's drop floor) within 1e-6
    relative, absences included.
"""
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

LAYERS, H, HKV, DH, D = 3, 8, 2, 8, 48
STEPS, WINDOWS, EVERY = 8, (2, 4), 2
NAN_LAYER, NAN_HEAD = 0, 3       # a Q head that turns NaN at the last step
REL = 1e-6
HEAD_SERIES = [f"qk.{sp}.{sc}" for sp in ("d2", "d1", "d3")
               for sc in ("entropy", "erank", "srank", "fro")] + ["qk.w.entropy", "qk.cqk"]


def trajectory():
    """{step: [(wq [H dh, D], wk [HKV dh, D]) per layer]}, float32."""
    rng = np.random.default_rng(20261)
    w = [((rng.standard_normal((H * DH, D)) / math.sqrt(D)).astype(np.float32),
          (rng.standard_normal((HKV * DH, D)) / math.sqrt(D)).astype(np.float32))
         for _ in range(LAYERS)]
    out = {0: w}
    for t in range(1, STEPS + 1):
        nxt = []
        for layer, (q, k) in enumerate(w):
            def upd(rows, r):
                return (0.03 * rng.standard_normal((rows, r)) @ rng.standard_normal((r, D)) /
                        math.sqrt(D) + 0.01 * rng.standard_normal((rows, D)) / math.sqrt(D))
            q2 = q if layer == 2 else (q + upd(H * DH, 3)).astype(np.float32)
            k2 = k if layer == 1 else (k + upd(HKV * DH, 2)).astype(np.float32)
            nxt.append((q2, k2))
        w = nxt
        out[t] = w
    q, k = out[STEPS][NAN_LAYER]
    q = q.copy()
    q[NAN_HEAD * DH:(NAN_HEAD + 1) * DH] = np.nan
    out[STEPS] = list(out[STEPS])
    out[STEPS][NAN_LAYER] = (q, k)
    return out


# ---- the float64 reference ------------------------------------------------------------------

def scalars(s, m):
    """docs/monitors.md 1.3 with spectrum.c's cleaning: None when absent."""
    s = np.asarray(s, dtype=np.float64)
    if not np.all(np.isfinite(s)):
        return None
    smax = s.max() if s.size else 0.0
    if not smax > 0:
        return None
    s = s[s >= smax * m * np.finfo(np.float64).eps]
    p = s / s.sum()
    h = float(-(p * np.log(p)).sum())
    return {"entropy": h, "erank": math.exp(h), "srank": float(s.sum() / smax),
            "fro": math.sqrt(float(s.sum()))}


def reference(traj):
    """{(name, layer, head, window, step): value or None} for HEAD_SERIES."""
    out = {}
    for t in range(EVERY, STEPS + 1, EVERY):
        for win in WINDOWS:
            if t - win < 0:
                continue
            for layer in range(LAYERS):
                q1, k1 = (x.astype(np.float64) for x in traj[t][layer])
                q0, k0 = (x.astype(np.float64) for x in traj[t - win][layer])
                for h in range(H):
                    g = h // (H // HKV)
                    a0, a1 = q0[h * DH:(h + 1) * DH], q1[h * DH:(h + 1) * DH]
                    b0, b1 = k0[g * DH:(g + 1) * DH], k1[g * DH:(g + 1) * DH]
                    vals = {}
                    if np.all(np.isfinite(a1)) and np.all(np.isfinite(b1)):
                        dq, dk = a1 - a0, b1 - b0
                        d2 = dq.T @ b0 + a0.T @ dk
                        d3 = dq.T @ dk
                        mats = {"d2": (d2, 2 * DH), "d1": (d2 + d3, 2 * DH), "d3": (d3, DH),
                                "w": (a0.T @ b0, DH)}
                        for sp, (mat, m) in mats.items():
                            sc = scalars(np.linalg.svd(mat, compute_uv=False) ** 2, m)
                            for k, v in (sc or {}).items():
                                vals[f"qk.{sp}.{k}"] = v
                        nq, nk = float((dq * dq).sum()), float((dk * dk).sum())
                        if nq > 0 and nk > 0:
                            vals["qk.cqk"] = float((d3 * d3).sum()) / (nq * nk)
                    for name in HEAD_SERIES:
                        out[(name, layer, h, win, t)] = vals.get(name)
    return out


# ---- the runs -------------------------------------------------------------------------------

class Tee:
    """Passes every report to the Monitor's real libforeshock transport and
    keeps what kinds of attention sketches it carried."""

    def __init__(self, real):
        self.real = real
        self.kinds = []   # (type name, layer, head, kv_head, window, n values)

    def submit(self, rep):
        for a in rep.attention:
            n = (a.d2.size + a.d1.size + a.d3.size + a.w.size) if hasattr(a, "d2") else \
                a.ga.size + a.gb.size
            self.kinds.append((type(a).__name__, a.layer, a.head, a.kv_head, a.window, n))
        return self.real.submit(rep)

    def stats(self):
        return self.real.stats()

    def flush(self, timeout_s=None):
        return self.real.flush(timeout_s)

    def close(self, timeout_s=0):
        return self.real.close(timeout_s)


def build_model(torch, nn):
    import types
    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(LAYERS):
        blk = nn.Module()
        blk.self_attn = nn.Module()
        a = blk.self_attn
        a.q_proj = nn.Linear(D, H * DH, bias=False)
        a.k_proj = nn.Linear(D, HKV * DH, bias=False)
        a.v_proj = nn.Linear(D, HKV * DH, bias=False)
        a.config = types.SimpleNamespace(num_attention_heads=H, num_key_value_heads=HKV,
                                         head_dim=DH)
        model.layers.append(blk)
    return model


def stream(torch, foreshock, model, traj, endpoint, run, **kw):
    mon = foreshock.Monitor(model, endpoint=endpoint, run=run, windows=WINDOWS, every=EVERY,
                            routers=[], **kw)
    tee = Tee(mon.transport)
    mon.transport = tee
    for t in range(STEPS + 1):
        with torch.no_grad():
            for blk, (q, k) in zip(model.layers, traj[t]):
                blk.self_attn.q_proj.weight.copy_(torch.from_numpy(q))
                blk.self_attn.k_proj.weight.copy_(torch.from_numpy(k))
        mon.step(t, loss=1.0)
    st = mon.close(60)
    check(st["acked"] == STEPS + 1 and st["dropped"] == 0 and st["refused"] == 0,
          f"{run}: client stats {st}")
    return mon, tee


def sketches_expected():
    return sum(1 for t in range(EVERY, STEPS + 1, EVERY) for w in WINDOWS if t - w >= 0)


def check_kinds(run, tee, kind):
    n = sketches_expected() * LAYERS * H
    check(len(tee.kinds) == n, f"{run}: {len(tee.kinds)} attention sketches sent, expected {n}")
    for name, layer, head, kv, win, size in tee.kinds:
        want = 6 * DH if kind == "AttentionSpectrum" else (2 * DH) * (2 * DH + 1)
        check(name == kind and size == want and kv == head // (H // HKV),
              f"{run}: layer {layer} head {head} window {win} sent {name} of {size} values "
              f"kv_head {kv}; expected {kind} of {want}, kv_head {head // (H // HKV)}")


def stored(api, run):
    """{(name, layer, head, window): {step: value}} of the run's qk.* series."""
    return {k[:4]: v for k, v in api.values(run).items() if k[0].startswith("qk.")}


def wait_stored(api, runs):
    """Waits until every run has every per-head point of the last step, then
    reads once more (the last step commits all its series together)."""
    want = len(WINDOWS) * LAYERS * H * len(HEAD_SERIES)
    deadline = time.monotonic() + 120
    while True:
        done = all(sum(1 for k, pts in stored(api, r).items()
                       if k[0] in HEAD_SERIES and k[2] is not None and k[2] >= 0 and
                       STEPS in pts) == want for r in runs)
        if done:
            return {r: stored(api, r) for r in runs}
        check(time.monotonic() < deadline, "the daemon did not store every series in 120 s")
        time.sleep(0.2)


def close(a, b):
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= REL * max(abs(b), 1e-300)


def compare_runs(a, b, name_a, name_b):
    check(sorted(a) == sorted(b), f"{name_a} and {name_b} stored different series: "
          f"{sorted(set(a) ^ set(b))[:10]}")
    worst, n = 0.0, 0
    for key in a:
        pa, pb = a[key], b[key]
        check(sorted(pa) == sorted(pb), f"{key}: steps {sorted(pa)} vs {sorted(pb)}")
        for step in pa:
            x, y = pa[step], pb[step]
            check(close(x, y), f"{key} step {step}: {name_a} {x} vs {name_b} {y}")
            if x is not None:
                worst = max(worst, abs(x - y) / max(abs(y), 1e-300))
                n += 1
    return worst, n


def compare_reference(got, ref, run):
    worst, n, absent = 0.0, 0, 0
    for (name, layer, head, win, step), want in ref.items():
        have = got.get((name, layer, head, win), {}).get(step)
        check(close(have, want), f"{run}: {name} layer {layer} head {head} window {win} step "
              f"{step}: {have} vs float64 reference {want}")
        if want is None:
            absent += 1
        else:
            worst = max(worst, abs(have - want) / max(abs(want), 1e-300))
            n += 1
    return worst, n, absent


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python", "experiments"))
    import torch
    import torch.nn as nn
    import foreshock
    from fsapi import Api
    torch.set_num_threads(1)
    os.environ["FORESHOCK_LIB"] = os.path.join(args.build_dir, "libforeshock.so")
    traj = trajectory()
    model = build_model(torch, nn)
    daemon = fstest.Daemon(args.build_dir, workdir)
    try:
        mon, tee = stream(torch, foreshock, model, traj, daemon.endpoint, "gram", route="gram")
        check(mon.route == "gram", f"route {mon.route}")
        check_kinds("gram", tee, "AttentionGram")
        mon, tee = stream(torch, foreshock, model, traj, daemon.endpoint, "spectrum",
                          route="spectrum")
        check(mon.route == "spectrum", f"route {mon.route}, expected spectrum")
        from foreshock.testing import RecordingTransport
        cpu = foreshock.Monitor(model, run="default", routers=[], transport=RecordingTransport())
        check(cpu.route == "gram", f"a model on the CPU got route {cpu.route} by default")
        cpu.close(10)
        check_kinds("spectrum", tee, "AttentionSpectrum")
        mon, tee = stream(torch, foreshock, model, traj, daemon.endpoint, "exact",
                          gram_dtype=torch.float64, route="spectrum")
        check_kinds("exact", tee, "AttentionSpectrum")
        print(f"  sent: {len(tee.kinds)} sketches per run; a spectrum sketch is {6 * DH} "
              f"floats, a Gram pair {(2 * DH) * (2 * DH + 1)}", flush=True)

        api = Api(daemon.http)
        got = wait_stored(api, ["gram", "spectrum", "exact"])
        worst, n = compare_runs(got["spectrum"], got["gram"], "spectrum", "gram")
        print(f"  spectrum == gram: {len(got['gram'])} qk series, {n} values, max rel diff "
              f"{worst:.1e}", flush=True)
        ref = reference(traj)
        for run in ("exact", "gram"):
            worst, n, absent = compare_reference(got[run], ref, run)
            print(f"  {run} == float64 reference: {n} per-head values (max rel err "
                  f"{worst:.1e}), {absent} absent in both", flush=True)
        check(absent > 0 and n > 0, "the reference has no absent value: the frozen and NaN "
              "heads are not exercised")
    finally:
        daemon.stop()


if __name__ == "__main__":
    fstest.preload_sanitizers()
    fstest.run_main(main)
