"""A torch.compile'd model under the Monitor (torch 2.x venv,
tests/python-venv.sh): discovery through the compiled wrapper, router
forward hooks inside the compiled forward, sketches equal to eager mode's.

A small MixtralForCausalLM (SDPA; attention and MoE routers) is built twice
from the same seed: once run eagerly, once wrapped by torch.compile (the
default inductor backend on the CPU). Each trains STEPS SGD steps on the
same batches with a Monitor into the real daemon. Checks:
  - the compiled model really ran compiled graphs (dynamo counted frames);
  - discovery on the compiled wrapper finds the same specs (numbers and
    layer indices) as on the eager model;
  - every qk.*, router.* (weights and the token statistics of the hooks),
    weight_norm, update_ratio and loss value of the compiled run equals the
    eager run's within REL (compiled kernels round differently).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

D, H, HKV, LAYERS, VOCAB, FFN, E = 32, 4, 2, 2, 64, 64, 4
STEPS, WINDOWS, EVERY, BATCH, SEQ = 12, (3, 6), 3, 2, 12
REL = 2e-3


def build(torch, transformers):
    torch.manual_seed(31)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
                                     num_hidden_layers=LAYERS, num_attention_heads=H,
                                     num_key_value_heads=HKV, num_local_experts=E,
                                     num_experts_per_tok=2)
    cfg._attn_implementation = "sdpa"
    cfg.pad_token_id = cfg.eos_token_id = cfg.bos_token_id = 0
    return transformers.MixtralForCausalLM(cfg)


def train(torch, foreshock, model, run, endpoint):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = foreshock.Monitor(model, endpoint=endpoint, run=run, windows=WINDOWS, every=EVERY)
    g = torch.Generator().manual_seed(8)
    mon.step(0)
    model.train()
    for step in range(1, STEPS + 1):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(step, loss=loss, lr=0.1)
    st = mon.close(60)
    check(st["acked"] == STEPS + 1 and st["dropped"] == 0 and st["refused"] == 0,
          f"{run}: {st}")
    return mon


def shape(disc):
    return ([(a.layer, a.n_heads, a.n_kv_heads, a.head_dim) for a in disc.attention],
            [(r.layer, r.n_experts, r.top_k) for r in disc.routers])


def comparable(api, run):
    vals = {}
    for prefix in ("qk.", "router.", "weight_norm", "update_ratio", "loss"):
        for key, pts in api.values(run, prefix=prefix).items():
            vals[key] = pts
    return vals


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python", "experiments"))
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(args.build_dir), "libforeshock.so")
    # inductor's compiled kernels go under the test's own directory.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(workdir, "inductor")
    import torch
    try:
        import transformers
    except ImportError:
        raise fstest.Skip(f"transformers is not installed for {sys.executable} (the torch 2.x "
                          "venv: tests/python-venv.sh, cmake -DFORESHOCK_VENV_PYTHON=...)")
    if not hasattr(torch, "compile"):
        raise fstest.Skip(f"torch {torch.__version__} has no torch.compile")
    import foreshock
    from fsapi import Api
    from torch._dynamo.utils import counters
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    daemon = fstest.Daemon(args.build_dir, workdir)
    try:
        eager = train(torch, foreshock, build(torch, transformers), "eager", daemon.endpoint)
        compiled_model = torch.compile(build(torch, transformers))
        compiled = train(torch, foreshock, compiled_model, "compiled", daemon.endpoint)
        frames = counters["stats"]["unique_graphs"]
        check(frames > 0, f"torch.compile ran no compiled graph: {dict(counters['stats'])}")
        check(shape(compiled.discovery) == shape(eager.discovery),
              f"discovery through torch.compile: {shape(compiled.discovery)} vs eager "
              f"{shape(eager.discovery)}")
        check(len(eager.discovery.attention) == LAYERS and len(eager.discovery.routers) == LAYERS,
              f"eager discovery: {eager.discovery.summary()}")
        api = Api(daemon.http)
        last = STEPS - STEPS % EVERY

        def done(run):
            s = api.series(run, name="qk.d2.erank.min")
            tok = api.series(run, prefix="router.")
            return (len(s) == LAYERS * len(WINDOWS) and all(x["last_step"] >= last for x in s)
                    and tok)
        fstest.wait_until(lambda: done("eager") and done("compiled"), timeout=60,
                          what="the monitors of both runs")
        want, got = comparable(api, "eager"), comparable(api, "compiled")
        check(any(k[0].startswith("router.") for k in want), "eager: no router series")
        n, worst = fstest.same_series(got, want, REL, "compiled", "eager")
        print(f"  torch.compile ({frames} graphs): {n} values in {len(want)} series equal "
              f"eager mode's (max rel err {worst:.1e})", flush=True)
    finally:
        daemon.stop()


if __name__ == "__main__":
    fstest.preload_sanitizers()
    fstest.run_main(main)
