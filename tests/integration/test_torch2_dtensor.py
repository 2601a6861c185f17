"""DTensor weights (torch 2.x venv, tests/python-venv.sh): FSDP2
`fully_shard` and tensor parallel `parallelize_module` over two gloo
processes on the CPU give the daemon the same series as one process.

Each run trains a real transformers class from a small config (same seed,
so the same initial weights in every process) on the same batches with SGD
for STEPS steps, Monitor defaults but short windows, router token
statistics off (data-parallel ranks each send their own tokens: their sum is
not one process's). Runs, all into one daemon:
  single-<model>  one process, plain parameters
  fsdp-<model>    2 ranks, fully_shard on every decoder block and the root;
                  both ranks get the same batch (so the averaged gradient is
                  the single process's)
  tp-llama        2 ranks, LLaMA with q/k/v and gate/up column-parallel,
                  o/down row-parallel (each rank holds half the heads)
models: mixtral (separate q/k projections, 3-D experts, routers) and gpt2
(fused, transposed c_attn, sliced by discovery's getter). Every qk.*,
router.*, weight_norm, update_ratio and loss value of each distributed run
must equal the single run's (relative REL of max(1, |value|)), over the
same series and steps. A Monitor made before fully_shard must say so on the
rank that reads the weights, not hang in a gather the others never join.
"""
import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

D, H, HKV, LAYERS, VOCAB, FFN, E = 32, 4, 2, 2, 64, 64, 4
STEPS, WINDOWS, EVERY, BATCH, SEQ = 12, (3, 6), 3, 2, 12
REL = 1e-4
RUNS = (("fsdp", "mixtral"), ("fsdp", "gpt2"), ("tp", "llama"))



def build(torch, transformers, name):
    torch.manual_seed(21)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=D, n_head=H, n_layer=LAYERS,
                                      n_positions=64)
        cls = transformers.GPT2LMHeadModel
    elif name == "mixtral":
        cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
                                         num_hidden_layers=LAYERS, num_attention_heads=H,
                                         num_key_value_heads=HKV, num_local_experts=E,
                                         num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    else:
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
                                       num_hidden_layers=LAYERS, num_attention_heads=H,
                                       num_key_value_heads=HKV)
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "sdpa"
    cfg.pad_token_id = cfg.eos_token_id = cfg.bos_token_id = 0
    return cls(cfg)


def blocks(model):
    return list(model.transformer.h) if hasattr(model, "transformer") else list(model.model.layers)


def train(torch, foreshock, model, run, endpoint):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = foreshock.Monitor(model, endpoint=endpoint, run=run, windows=WINDOWS, every=EVERY,
                            send_tokens=False)
    g = torch.Generator().manual_seed(9)
    mon.step(0)
    for step in range(1, STEPS + 1):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(step, loss=loss, lr=0.1)
    st = mon.close(60)
    check(st["acked"] == STEPS + 1 and st["dropped"] == 0, f"{run} rank {mon.rank}: {st}")
    return mon


def worker(argv):
    p = argparse.ArgumentParser()
    for k in ("--mode", "--model", "--endpoint", "--source-dir", "--build-dir", "--rendezvous"):
        p.add_argument(k, required=True)
    p.add_argument("--rank", type=int, required=True)
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.join(a.source_dir, "client", "python"))
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(a.build_dir), "libforeshock.so")
    # What torchrun would set: this node's ranks are the whole job.
    os.environ.update(LOCAL_RANK=str(a.rank), LOCAL_WORLD_SIZE="2")
    import torch
    import torch.distributed as dist
    import transformers
    import foreshock
    from foreshock import dtensor
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo", init_method=a.rendezvous, rank=a.rank,
                            world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,))
    model = build(torch, transformers, a.model)
    if a.mode == "late":
        return late_worker(torch, foreshock, dtensor, model, mesh, a)
    if a.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for blk in blocks(model):
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for blk in blocks(model):
            parallelize_module(blk, mesh, plan)
    check(dtensor.has_dtensors(model), f"{a.mode}: no DTensor parameters")
    mon = train(torch, foreshock, model, f"{a.mode}-{a.model}", a.endpoint)
    check(mon.send_sketches == (a.rank == 0), f"rank {a.rank}: send_sketches {mon.send_sketches}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def late_worker(torch, foreshock, dtensor, model, mesh, a):
    """Monitor made before fully_shard: the rank that reads weights must
    say so (raise, or log once when the Monitor guards its steps), never
    wait in a gather the other rank does not join."""
    import logging
    from torch.distributed.fsdp import fully_shard
    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())
    logging.getLogger("foreshock").addHandler(Keep())
    mon = foreshock.Monitor(model, endpoint=a.endpoint, run="late", windows=WINDOWS,
                            every=EVERY, send_tokens=False)
    for blk in blocks(model):
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(9)
    for step in range(0, EVERY + 1):
        if step:
            ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        try:
            mon.step(step)
        except RuntimeError as e:
            said.append(str(e))
    mon.close(30)
    told = any(dtensor.SHARDED_LATE in m for m in said)
    check(told == (a.rank == 0), f"late rank {a.rank}: told {told}: {said[-3:]}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def comparable(api, run):
    vals = {}
    for prefix in ("qk.", "router.", "weight_norm", "update_ratio", "loss"):
        for key, pts in api.values(run, prefix=prefix).items():
            name, layer, head, window, rank = key
            if name == "loss" and rank not in (None, "0", 0):
                continue
            vals[(name, layer, head, window)] = pts
    return vals


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python", "experiments"))
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(args.build_dir), "libforeshock.so")
    import torch
    try:
        import transformers
        from torch.distributed.fsdp import fully_shard  # noqa: F401  (torch >= 2.6)
    except ImportError as e:
        raise fstest.Skip(f"{e.name or e} is not available to {sys.executable} (the torch 2.x "
                          "venv: tests/python-venv.sh, cmake -DFORESHOCK_VENV_PYTHON=...)")
    import foreshock
    from fsapi import Api
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    daemon = fstest.Daemon(args.build_dir, workdir)
    try:
        for model_name in sorted({m for _, m in RUNS}):
            train(torch, foreshock, build(torch, transformers, model_name), f"single-{model_name}",
                  daemon.endpoint)
        for mode, model_name in RUNS:
            rdv = fstest.rendezvous(workdir, f"{mode}-{model_name}")
            procs = [subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode,
                 "--model", model_name, "--rank", str(r), "--endpoint", daemon.endpoint,
                 "--rendezvous", rdv, "--source-dir", args.source_dir,
                 "--build-dir", args.build_dir],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
            for r, pr in enumerate(procs):
                out, _ = pr.communicate(timeout=600)
                check(pr.returncode == 0, f"{mode}-{model_name} rank {r} exited "
                      f"{pr.returncode}:\n{out[-4000:]}")
        rdv = fstest.rendezvous(workdir, "late")
        procs = [subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--mode", "late",
             "--model", "llama", "--rank", str(r), "--endpoint", daemon.endpoint,
             "--rendezvous", rdv, "--source-dir", args.source_dir,
             "--build-dir", args.build_dir],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        for r, pr in enumerate(procs):
            try:
                out, _ = pr.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                fstest.kill_started(*procs)
                raise fstest.Failure("Monitor made before fully_shard: the ranks hang")
            check(pr.returncode == 0, f"late rank {r} exited {pr.returncode}:\n{out[-4000:]}")
        print("  Monitor made before fully_shard: rank 0 says so (no hang)", flush=True)
        api = Api(daemon.http)
        last = STEPS - STEPS % EVERY

        def done(run):
            s = api.series(run, name="qk.d2.erank.min")
            return len(s) == LAYERS * len(WINDOWS) and all(x["last_step"] >= last for x in s)
        runs = [f"single-{m}" for m in sorted({m for _, m in RUNS})] + \
            [f"{mode}-{m}" for mode, m in RUNS]
        fstest.wait_until(lambda: all(done(r) for r in runs), timeout=60,
                          what="the monitors of every run")
        for mode, model_name in RUNS:
            run, ref = f"{mode}-{model_name}", f"single-{model_name}"
            want, got = comparable(api, ref), comparable(api, run)
            check(any(k[0].startswith("qk.") for k in want) and any(k[0] == "weight_norm"
                                                                    for k in want),
                  f"{ref}: no qk / weight_norm series")
            if model_name == "mixtral":
                check(any(k[0].startswith("router.") for k in want), f"{ref}: no router series")
            n, worst = fstest.same_series(got, want, REL, run, ref)
            print(f"  {run}: {n} values in {len(want)} series equal one process's "
                  f"(max rel err {worst:.1e})", flush=True)
    finally:
        daemon.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2:]))
    fstest.preload_sanitizers()
    fstest.run_main(main)
