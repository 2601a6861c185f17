"""Weights sharded along the model dimension d over two gloo processes give
the daemon the same monitor values as one process holding all of d.

The weights follow one deterministic trajectory W(t) (seeded updates, the
same in every process); rank r holds columns [r d/2, (r+1) d/2) of every
q_proj, k_proj (GQA) and MoE router gate. Three runs into one daemon:
  full     one process, all columns
  trainer  2 ranks, partial Grams all_reduced over the gloo group by the
           client, sent once by rank 0 (shard_reduce="trainer")
  daemon   2 ranks, each sends its partial Grams with (shard_index,
           shard_count) and the daemon sums them (shard_reduce="daemon")
Every per-head qk.* and per-layer router.* value of the sharded runs must
equal the full run's (relative 1e-4 of max(1, |value|)); so must the
per-layer weight_norm/update_ratio of the trainer run (reduced by the client).
"""
import argparse
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

D, H, HKV, DH, E, LAYERS = 32, 4, 2, 8, 6, 2
STEPS, WINDOWS, EVERY = 24, (3, 6), 3
REL = 1e-4



def trajectory(step):
    """Full weights at `step`: {name: float32 array [rows, D]}."""
    rng = np.random.default_rng(1234)
    shapes = {}
    for layer in range(LAYERS):
        shapes[f"{layer}.q"] = H * DH
        shapes[f"{layer}.k"] = HKV * DH
        shapes[f"{layer}.gate"] = E
    w = {n: (rng.standard_normal((rows, D)) / np.sqrt(D)).astype(np.float32)
         for n, rows in shapes.items()}
    for t in range(1, step + 1):
        r = np.random.default_rng(t)
        for n in sorted(w):
            rows = w[n].shape[0]
            upd = 0.02 * r.standard_normal((rows, 2)) @ r.standard_normal((2, D)) / D
            w[n] = (w[n] + upd + 0.002 * r.standard_normal((rows, D))).astype(np.float32)
    return w


def build_model(torch, nn, cols):
    """Two blocks of LLaMA-style attention and a MoE router over `cols`."""
    import types
    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(LAYERS):
        blk = nn.Module()
        blk.self_attn = nn.Module()
        blk.self_attn.q_proj = nn.Linear(len(cols), H * DH, bias=False)
        blk.self_attn.k_proj = nn.Linear(len(cols), HKV * DH, bias=False)
        blk.self_attn.config = types.SimpleNamespace(num_attention_heads=H,
                                                     num_key_value_heads=HKV, head_dim=DH)
        blk.mlp = nn.Module()
        blk.mlp.gate = nn.Linear(len(cols), E, bias=False)
        blk.mlp.experts = nn.ModuleList()
        blk.mlp.num_experts_per_tok = 2
        model.layers.append(blk)

    def load(step):
        w = trajectory(step)
        with torch.no_grad():
            for layer, blk in enumerate(model.layers):
                blk.self_attn.q_proj.weight.copy_(torch.from_numpy(w[f"{layer}.q"][:, cols]))
                blk.self_attn.k_proj.weight.copy_(torch.from_numpy(w[f"{layer}.k"][:, cols]))
                blk.mlp.gate.weight.copy_(torch.from_numpy(w[f"{layer}.gate"][:, cols]))
    return model, load


def train(torch, foreshock, run, endpoint, rank, world, cols, **kw):
    model, load = build_model(torch, torch.nn, cols)
    mon = foreshock.Monitor(model, endpoint=endpoint, run=run, rank=rank, world_size=world,
                            windows=WINDOWS, every=EVERY, send_tokens=False, **kw)
    for step in range(0, STEPS + 1):
        load(step)
        mon.step(step, loss=1.0 / (1 + step), grad_norm=1.0, lr=1e-3)
    st = mon.close(60)
    check(st["acked"] == STEPS + 1 and st["dropped"] == 0, f"{run} rank {rank}: {st}")


def worker(argv):
    p = argparse.ArgumentParser()
    for k in ("--mode", "--endpoint", "--source-dir", "--build-dir", "--rendezvous"):
        p.add_argument(k, required=True)
    p.add_argument("--rank", type=int, required=True)
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.join(a.source_dir, "client", "python"))
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(a.build_dir), "libforeshock.so")
    import torch
    import torch.distributed as dist
    import foreshock
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=a.rendezvous, rank=a.rank,
                            world_size=2)
    half = D // 2
    cols = list(range(a.rank * half, (a.rank + 1) * half))
    train(torch, foreshock, a.mode, a.endpoint, a.rank, 2, cols,
          shard_group=dist.group.WORLD, shard_reduce=a.mode)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def comparable(api, run, with_norms):
    vals = {}
    for prefix in ("qk.", "router.") + (("weight_norm", "update_ratio") if with_norms else ()):
        for key, pts in api.values(run, prefix=prefix).items():
            name, layer, head, window, _rank = key
            vals[(name, layer, head, window)] = pts
    return vals


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python", "experiments"))
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(args.build_dir), "libforeshock.so")
    import torch
    import foreshock
    from fsapi import Api
    torch.set_num_threads(1)
    daemon = fstest.Daemon(args.build_dir, workdir)
    try:
        train(torch, foreshock, "full", daemon.endpoint, 0, 1, list(range(D)))
        for mode in ("trainer", "daemon"):
            rdv = fstest.rendezvous(workdir, mode)
            procs = [subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode,
                 "--rank", str(r), "--endpoint", daemon.endpoint, "--rendezvous", rdv,
                 "--source-dir", args.source_dir, "--build-dir", args.build_dir],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
            for r, pr in enumerate(procs):
                out, _ = pr.communicate(timeout=300)
                check(pr.returncode == 0, f"{mode} rank {r} exited {pr.returncode}:\n{out}")
        api = Api(daemon.http)
        last = STEPS - STEPS % EVERY

        def done(run):
            s = api.series(run, name="qk.d2.erank.min")
            return len(s) == LAYERS * len(WINDOWS) and all(x["last_step"] >= last for x in s)
        deadline = time.monotonic() + 60
        while not all(done(r) for r in ("full", "trainer", "daemon")):
            check(time.monotonic() < deadline, "monitors of the three runs not all computed")
            time.sleep(0.2)
        full = comparable(api, "full", True)
        n_full = sum(len(v) for v in full.values())
        check(n_full > 0 and any(k[0] == "router.similarity" for k in full) and
              any(k[0] == "weight_norm" for k in full), "full run: no qk/router/norm values")
        for run in ("trainer", "daemon"):
            got = comparable(api, run, run == "trainer")
            want = full if run == "trainer" else {k: v for k, v in full.items()
                                                  if k[0] not in ("weight_norm", "update_ratio")}
            n, worst = fstest.same_series(got, want, REL, run, "unsharded")
            print(f"  {run}-reduced shards: {n} values in {len(want)} series equal the unsharded "
                  f"run (max rel err {worst:.1e})", flush=True)
    finally:
        daemon.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2:]))
    fstest.preload_sanitizers()
    fstest.run_main(main)
