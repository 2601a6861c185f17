#!/usr/bin/env python3
"""The Python client on an accelerator: spectrum accuracy and step() overhead.

Needs torch and numpy and this repository's client/python/foreshock only: no
libforeshock, no daemon, no network. The Monitor is given a transport that
keeps counts and drops the reports (Monitor's documented `transport=`), so
everything up to the hand-off to libforeshock runs as in training: the
Grams, the snapshots, the device-to-host copies, the sender thread and its
spectra on the device.

1. Accuracy. For a few layer shapes and update sizes, the spectrum route as
   the Monitor runs it (sketch.attention_grams in float32 on the device, then
   Monitor._head_spectra: foreshock.spectra.qk_spectra in float64 on the
   device) against a reference computed here on the CPU in float64 with numpy
   from the same weights, straight from MONITORS' definitions (A = [dWq; Wq],
   B = [Wk; dWk], A1 = [Wq(t); -Wq(t0)], B1 = [Wk(t); Wk(t0)], lambda(G1 G2)
   by the symmetric eigen route). Per quantity, the largest relative error
   over every head: spectra relative to the head's largest value (d2, d1, d3,
   w), the four squared norms and c_qk relative to themselves. Also the
   solver alone: the same float64 Grams solved on the device and on the CPU.
2. Overhead. A decoder-only transformer (LLaMA-like: RMSNorm, q/k/v/o
   projections, SwiGLU; bf16 autocast on CUDA) trained with AdamW on random
   tokens: wall time per training step (synchronised at the end of each
   step) without a Monitor, then with Monitor(model, windows=(10, 50)) at
   its defaults for the device (route spectrum on CUDA, its spectra solved
   on the host CPU: --spectra-on; gram on the CPU),
   then without again. Steps that carried sketches and plain steps are
   reported apart, with the ratio to the mean step without the Monitor and
   the Monitor's own measure of step()'s time on the training thread.

On CUDA the model has ~1B parameters (--preset 1b). Without CUDA everything
runs on the CPU and the model is a small one (--preset small, said in the
output). Prints a table; --out FILE writes everything as JSON.

    python3 tests/device/gpu_check.py --out gpu_check.json
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
import traceback

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
import foreshock  # noqa: E402
from foreshock import sketch as sk  # noqa: E402
from foreshock.layouts import AttentionSpec  # noqa: E402
from foreshock.monitor import Monitor  # noqa: E402
from foreshock.spectra import N_NORMS  # noqa: E402

PRESETS = {
    # d, layers, heads, kv heads, mlp hidden, vocab, seq, batch
    "1b": dict(d=2048, layers=16, heads=16, kv_heads=16, hidden=5632, vocab=32000, seq=1024,
               batch=4),
    "small": dict(d=128, layers=2, heads=2, kv_heads=2, hidden=352, vocab=512, seq=64,
                  batch=2),
}
# Accuracy cases: (name, H, Hkv, dh, d, update scale, frozen keys)
ACC_GPU = [("gqa-7b-warmup", 32, 8, 128, 4096, 1e-4, False),
           ("mha-7b-typical", 32, 32, 128, 4096, 1e-2, False),
           ("gqa-frozen-k", 16, 4, 128, 2048, 1e-3, True)]
ACC_CPU = [("gqa-warmup", 8, 2, 64, 1024, 1e-4, False),
           ("mha-typical", 8, 8, 64, 1024, 1e-2, False),
           ("gqa-frozen-k", 4, 2, 64, 512, 1e-3, True)]
QUANTITIES = ("d2", "d1", "d3", "w", "norms", "cqk")
TOL = 1e-3   # the integration tests' bound for float32 Grams, float64 solves


# ---- accuracy ---------------------------------------------------------------------------

def _product_eigs(g1, g2):
    """lambda(G1 G2), symmetric PSD G1 and G2, descending (float64)."""
    lam, v = np.linalg.eigh(g1)
    s = v * np.sqrt(np.clip(lam, 0, None))
    c = s.T @ g2 @ s
    return np.sort(np.clip(np.linalg.eigvalsh((c + c.T) / 2), 0, None))[::-1]


def reference(wq1, wk1, wq0, wk0, H, Hkv, dh):
    """Per query head, from float64 copies of the weights: dict of arrays."""
    q1, q0 = wq1.reshape(H, dh, -1), wq0.reshape(H, dh, -1)
    k1, k0 = wk1.reshape(Hkv, dh, -1), wk0.reshape(Hkv, dh, -1)
    out = {q: [] for q in QUANTITIES}
    for h in range(H):
        g = h // (H // Hkv)
        dq, dk = q1[h] - q0[h], k1[g] - k0[g]
        a, b = np.concatenate([dq, q0[h]]), np.concatenate([k0[g], dk])
        a1, b1 = np.concatenate([q1[h], -q0[h]]), np.concatenate([k1[g], k0[g]])
        qdd, kdd = dq @ dq.T, dk @ dk.T
        qww, kww = q0[h] @ q0[h].T, k0[g] @ k0[g].T
        out["d2"].append(_product_eigs(a @ a.T, b @ b.T))
        out["d1"].append(_product_eigs(a1 @ a1.T, b1 @ b1.T))
        out["d3"].append(_product_eigs(qdd, kdd))
        out["w"].append(_product_eigs(qww, kww))
        tq, tk = np.trace(qdd), np.trace(kdd)
        out["norms"].append(np.array([tq, np.trace(qww), np.trace(kww), tk]))
        out["cqk"].append(np.array([np.sum(qdd * kdd) / (tq * tk) if tq > 0 and tk > 0
                                    else np.nan]))
    return {k: np.stack(v) for k, v in out.items()}


def unpack_client(packed, dh):
    """Monitor._head_spectra's packed rows -> the same dict."""
    p = packed
    return {"d2": p[:, 0:2 * dh], "d1": p[:, 2 * dh:4 * dh], "d3": p[:, 4 * dh:5 * dh],
            "w": p[:, 5 * dh:6 * dh], "norms": p[:, 6 * dh:6 * dh + N_NORMS],
            "cqk": p[:, 6 * dh + 4:6 * dh + 5]}


def rel_err(got, ref, q):
    """Largest relative error over heads: spectra to the head's largest value."""
    if q in ("d2", "d1", "d3", "w"):
        scale = ref.max(axis=1, keepdims=True)
        diff = np.abs(got - ref)
        err = np.where(scale > 0, diff / np.where(scale > 0, scale, 1.0), diff)
        return float(err.max())
    both_nan = np.isnan(got) & np.isnan(ref)
    if (np.isnan(got) != np.isnan(ref)).any():
        return float("inf")
    g, r = np.where(both_nan, 0, got), np.where(both_nan, 0, ref)
    den = np.abs(r)
    return float(np.max(np.where(den > 0, np.abs(g - r) / np.where(den > 0, den, 1), np.abs(g))))


def accuracy(dev, cases, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    # Untimed first call: the solver libraries' start-up is not the route's cost.
    z = torch.randn(4 * 16, 64, generator=gen).to(dev)
    Monitor._head_spectra(AttentionSpec(0, 4, 4, 16, get=None),
                          *(g.double() for g in sk.attention_grams(z, z, z * 0.9, z * 0.9, 4,
                                                                   4, 16)))
    for name, H, Hkv, dh, d, scale, frozen_k in cases:
        def w(rows_):
            return torch.randn(rows_, d, generator=gen) / math.sqrt(d)
        wq0, wk0 = w(H * dh), w(Hkv * dh)
        # A low-rank part (what training's aligned updates look like) and noise.
        def upd(x):
            r = 4
            lo = torch.randn(x.shape[0], r, generator=gen) @ torch.randn(r, d, generator=gen)
            return x + scale * (lo / math.sqrt(r * d) + 0.3 * torch.randn(x.shape, generator=gen)
                                / math.sqrt(d))
        wq1 = upd(wq0)
        wk1 = wk0.clone() if frozen_k else upd(wk0)
        spec = AttentionSpec(0, H, Hkv, dh, get=None)
        t = [x.to(dev) for x in (wq1, wk1, wq0, wk0)]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ga, gb = sk.attention_grams(*t, H, Hkv, dh, torch.float32)
        packed = Monitor._head_spectra(spec, ga.double(), gb.double())
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        got = unpack_client(packed.cpu().numpy(), dh)
        cpu = unpack_client(Monitor._head_spectra(spec, ga.double().cpu(),
                                                  gb.double().cpu()).numpy(), dh)
        flags = packed[:, 6 * dh + 5].cpu().numpy()
        ref = reference(*(x.double().numpy() for x in (wq1, wk1, wq0, wk0)), H, Hkv, dh)
        row = {"case": name, "H": H, "Hkv": Hkv, "dh": dh, "d": d, "update": scale,
               "frozen_k": frozen_k, "seconds_on_device": dt,
               "nonfinite_flags": int((flags != 0).sum()),
               "route_rel_err": {q: rel_err(got[q], ref[q], q) for q in QUANTITIES},
               "solver_rel_err": {q: rel_err(got[q], cpu[q], q) for q in QUANTITIES}}
        rows.append(row)
    return rows


# ---- overhead ---------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, d, heads, kv_heads):
        super().__init__()
        self.num_heads, self.num_key_value_heads = heads, kv_heads
        self.head_dim = d // heads
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        dh, h, kv = self.head_dim, self.num_heads, self.num_key_value_heads
        q = self.q_proj(x).view(b, t, h, dh).transpose(1, 2)
        k = self.k_proj(x).view(b, t, kv, dh).transpose(1, 2)
        v = self.v_proj(x).view(b, t, kv, dh).transpose(1, 2)
        if kv != h:
            k = k.repeat_interleave(h // kv, dim=1)
            v = v.repeat_interleave(h // kv, dim=1)
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch 1.x
            s = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = s.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h * dh))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["d"])
        self.self_attn = Attention(c["d"], c["heads"], c["kv_heads"])
        self.post_attention_layernorm = RMSNorm(c["d"])
        self.gate_proj = nn.Linear(c["d"], c["hidden"], bias=False)
        self.up_proj = nn.Linear(c["d"], c["hidden"], bias=False)
        self.down_proj = nn.Linear(c["hidden"], c["d"], bias=False)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab"], c["d"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["d"])
        self.lm_head = nn.Linear(c["d"], c["vocab"], bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        for blk in self.layers:
            x = blk(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               targets.reshape(-1))


class CountingTransport:
    """Monitor's transport= interface: counts what it is handed, keeps nothing."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reports = self.attention = 0

    def submit(self, rep):
        with self.lock:
            self.reports += 1
            self.attention += len(rep.attention)
        return 0

    def stats(self):
        with self.lock:
            return {"submitted": self.reports, "acked": self.reports, "dropped": 0,
                    "buffered_reports": 0, "daemon_refused": 0, "connected": 1,
                    "last_error": "", "attention_sketches": self.attention}

    def flush(self, timeout_s=None):
        return 0

    def close(self, timeout_s=0):
        return 0


def overhead(dev, c, args):
    torch.manual_seed(args.seed)
    model = LM(c).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    cuda = dev.type == "cuda"
    gen = torch.Generator(device=dev).manual_seed(args.seed)

    def batch():
        x = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), device=dev, generator=gen)
        return x[:, :-1], x[:, 1:]

    def train_step(i, mon):
        x, y = batch()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sketched = False
        if mon is not None:
            before = mon._overhead["sketch_steps"]
            mon.step(i, loss=loss.detach(), grad_norm=gn, lr=3e-4)
            sketched = mon._overhead["sketch_steps"] > before
        if cuda:
            # The training stream only, as a loop that reads its loss does:
            # torch.cuda.synchronize() would also wait for the sender's
            # spectra on its own stream, which training never waits for.
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t0, sketched

    for i in range(args.warmup):
        train_step(i, None)
    base_a = [train_step(i, None)[0] for i in range(args.baseline_steps)]
    tp = CountingTransport()
    mon = Monitor(model, run="gpu-check", windows=(10, 50), transport=tp, route=args.route,
                  spectra_on=args.spectra_on, spectra_threads=args.spectra_threads)
    t_loop = time.perf_counter()
    with_mon = [train_step(i, mon) for i in range(1, args.steps + 1)]
    loop_s = time.perf_counter() - t_loop
    t_drain = time.perf_counter()
    st = mon.close(60)
    drain_s = time.perf_counter() - t_drain
    base_b = [train_step(i, None)[0] for i in range(args.baseline_steps)]
    base = base_a + base_b
    sketch = [t for t, s in with_mon if s]
    plain = [t for t, s in with_mon if not s]
    mb = statistics.mean(base)

    def summary(ts):
        if not ts:
            return None
        return {"n": len(ts), "mean_s": statistics.mean(ts), "median_s": statistics.median(ts),
                "max_s": max(ts), "ratio_mean": statistics.mean(ts) / mb,
                "ratio_median": statistics.median(ts) / statistics.median(base)}
    return {"params": n_params, "config": c, "route": mon.route, "every": mon.every,
            "spectra_on": mon.spectra_on, "spectra_threads": mon.spectra_threads,
            "windows": mon.windows, "monitored_heads": sum(a.n_heads for a in mon.attention),
            "without": summary(base), "sketch_steps": summary(sketch),
            "plain_steps": summary(plain),
            "monitor_step_overhead_s": {"sketch": st["sketch_step_overhead_s"],
                                        "plain": st["plain_step_overhead_s"]},
            "sender_cpu_per_report_s": st["sender_cpu_per_report_s"],
            "spectra_on_host": st["spectra_on_host"], "reports": tp.reports,
            "sketches_skipped_busy": st["sketches_skipped_busy"],
            "pinned_allocs": st["pinned_allocs"],
            "attention_sketches": tp.attention, "failures": st["failures"],
            "disabled_modules": st["disabled_modules"],
            "monitored_loop_s": loop_s, "monitored_loop_ratio": loop_s / (mb * args.steps),
            "drain_after_loop_s": drain_s}


# ---- output -----------------------------------------------------------------------------

def print_accuracy(out):
    acc = out["accuracy"]
    print(f"\n== accuracy on {out['device']} (max relative error over heads; spectra "
          f"relative to each head's largest value; tolerance {TOL:g})")
    print(f"{'case':<18}{'H/Hkv/dh/d':<18}" + "".join(f"{q:>10}" for q in QUANTITIES) +
          f"{'solver':>10}{'ms':>9}")
    for r in acc:
        shape = f"{r['H']}/{r['Hkv']}/{r['dh']}/{r['d']}"
        e = r["route_rel_err"]
        s = max(r["solver_rel_err"].values())
        s = "n/a" if out["device"] == "cpu" else f"{s:.1e}"  # the same solver twice
        print(f"{r['case']:<18}{shape:<18}" + "".join(f"{e[q]:>10.1e}" for q in QUANTITIES) +
              f"{s:>10}{1e3 * r['seconds_on_device']:>9.1f}")


def print_overhead(out):
    o = out["overhead"]
    c = o["config"]
    print(f"\n== step() overhead: {o['params'] / 1e6:.1f}M parameters ({out['preset']}: d "
          f"{c['d']}, {c['layers']} layers, {c['heads']} heads, seq {c['seq']} x batch "
          f"{c['batch']}), route {o['route']} (spectra_on {o['spectra_on']}, "
          f"{o['spectra_threads']} spectra threads), windows {o['windows']}, every {o['every']}, "
          f"{o['monitored_heads']} heads monitored")
    print(f"{'steps':<22}{'n':>4}{'mean ms':>10}{'median ms':>11}{'max ms':>9}{'ratio':>8}"
          f"{'step() ms':>11}")
    for label, key, own in (("without Monitor", "without", None),
                            ("with, sketch steps", "sketch_steps", "sketch"),
                            ("with, plain steps", "plain_steps", "plain")):
        s = o[key]
        if s is None:
            print(f"{label:<22}{0:>4}")
            continue
        own_ms = "" if own is None else f"{1e3 * o['monitor_step_overhead_s'][own]:>11.2f}"
        print(f"{label:<22}{s['n']:>4}{1e3 * s['mean_s']:>10.1f}{1e3 * s['median_s']:>11.1f}"
              f"{1e3 * s['max_s']:>9.1f}{s['ratio_mean']:>8.3f}{own_ms}")
    print(f"reports {o['reports']}, attention sketches {o['attention_sketches']}, spectra on "
          f"host {o['spectra_on_host']}, sketch steps skipped (sender busy) "
          f"{o['sketches_skipped_busy']}, buffers pinned {o['pinned_allocs']}, sender CPU per "
          f"report "
          f"{1e3 * o['sender_cpu_per_report_s']:.1f} ms, failures "
          f"{ {k: v for k, v in o['failures'].items() if v} }")
    print(f"monitored loop {o['monitored_loop_s']:.2f} s = {o['monitored_loop_ratio']:.3f} x the "
          f"same steps without the Monitor; the sender drained {o['drain_after_loop_s']:.2f} s "
          f"after the last step")


def print_verdict(out):
    acc = "not run" if "accuracy_ok" not in out else (
        "ok" if out["accuracy_ok"] else "OVER TOLERANCE")
    print(f"verdict: accuracy {acc}; errors {out['errors'] or 'none'}; libforeshock "
          f"{'loaded' if out['libforeshock_loaded'] else 'not loaded'}; total "
          f"{out['seconds']:.0f} s")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--device", help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="model size (default: 1b on CUDA, small on the CPU)")
    p.add_argument("--steps", type=int,
                   help="monitored training steps (default 120 on CUDA, 60 on the CPU; the "
                   "50-step window first sketches at step 60)")
    p.add_argument("--baseline-steps", type=int, default=12,
                   help="steps without the Monitor, before and again after")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--route", choices=("spectrum", "gram"),
                   help="the Monitor's route (default: its own, spectrum on CUDA, gram on "
                   "the CPU)")
    p.add_argument("--spectra-on", choices=("host", "device"), default="host",
                   help="where the spectrum route solves spectra (the Monitor's spectra_on)")
    p.add_argument("--spectra-threads", type=int, default=None,
                   help="the Monitor's spectra_threads (default: its own, min(4, CPUs))")
    args = p.parse_args()
    t_start = time.perf_counter()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = args.preset or ("1b" if dev.type == "cuda" else "small")
    args.steps = args.steps or (120 if dev.type == "cuda" else 60)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, min(4, len(os.sched_getaffinity(0)))))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() \
        or platform.machine()
    print(f"foreshock {foreshock.__version__}, torch {torch.__version__}, numpy "
          f"{np.__version__}, device {dev} ({name}); preset {preset}"
          + ("" if dev.type == "cuda" else " (no CUDA: CPU comparison with a small model)"),
          flush=True)
    out = {"device": str(dev), "device_name": name, "torch": torch.__version__,
           "preset": preset, "tolerance": TOL}
    # Each half runs even when the other failed; a failure is printed and
    # kept in the JSON ("errors"), and the exit status is 2.
    errors = {}
    try:
        out["accuracy"] = accuracy(dev, ACC_GPU if dev.type == "cuda" else ACC_CPU, args.seed)
        out["accuracy_ok"] = all(v <= TOL for r in out["accuracy"]
                                 for v in r["route_rel_err"].values())
        print_accuracy(out)
    except Exception as e:  # report, then go on to the other half
        errors["accuracy"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    if not args.skip_overhead:
        try:
            out["overhead"] = overhead(dev, PRESETS[preset], args)
            print_overhead(out)
        except Exception as e:
            errors["overhead"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    out["errors"] = errors
    out["libforeshock_loaded"] = "foreshock._lib" in sys.modules
    out["seconds"] = time.perf_counter() - t_start
    print_verdict(out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")
    if errors:
        return 2
    return 0 if out["accuracy_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
