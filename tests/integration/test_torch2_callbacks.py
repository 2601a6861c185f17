"""The trainer callbacks of foreshock.integrations, used exactly as their
docstrings show, with real trainers on the CPU into the real daemon
(torch 2.x venv, tests/python-venv.sh).

HF: transformers.Trainer trains a small LlamaForCausalLM (random weights)
on an in-memory dataset for STEPS optimizer steps with
callbacks=[ForeshockCallback(run=...)] and the daemon's endpoint in
$FORESHOCK_ENDPOINT, once with logging_steps=1, once with 5. The daemon
must hold an lr point for each step 1..STEPS, and loss and grad_norm points
at exactly the logged steps, equal (with lr) to what the Trainer logged
there; and qk sketches at the sketch steps the Monitor defaults give for
every head.

Lightning: lightning.pytorch.Trainer trains a small MixtralForCausalLM in a
LightningModule with accumulate_grad_batches=2 and gradient clipping, with
callbacks=[ForeshockLightningCallback(run=...)]. The daemon must hold one
point per optimizer step (step 0, the first micro-batch on the initial
weights, then 1..STEPS): the loss of the micro-batch that completed the
step, the gradient norm before clipping (recomputed here in the module's
own on_before_optimizer_step) and the learning rate; qk sketches for every
head and router series for every MoE layer.

Both: the callback's Monitor acknowledges every report and is closed at the
end of training (`stats` set, `monitor` None).
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

D, H, HKV, LAYERS, VOCAB, FFN, E = 32, 4, 2, 2, 64, 64, 4
STEPS, BATCH, SEQ = 20, 2, 12
REL = 1e-5   # the daemon stores the float32/64 scalars it is sent


def close(a, b):
    return a is not None and b is not None and abs(a - b) <= REL * max(1.0, abs(b))


def wait_series(api, run, name, steps, what):
    """{step: value} of the run's series `name` once it has all `steps`."""
    def points():
        vals = api.values(run, name=name)
        return next(iter(vals.values()), {}) if vals else {}
    deadline = time.monotonic() + 60
    while True:
        pts = points()
        if set(pts) >= set(steps):
            return pts
        if time.monotonic() > deadline:
            raise fstest.Failure(f"{what}: daemon series {name} lacks steps "
                                 f"{sorted(set(steps) - set(pts))}")
        time.sleep(0.2)


def check_sketches(api, run, heads, router_layers, step):
    def have():
        vals = api.values(run, name="qk.d2.erank")
        got = {(int(k[1]), int(k[2])) for k, pts in vals.items() if step in pts}
        rv = api.values(run, prefix="router.") if router_layers else {}
        rgot = {int(k[1]) for k, pts in rv.items() if k[1] is not None and pts}
        return got == heads and rgot == router_layers
    fstest.wait_until(have, timeout=60, what=f"{run}: qk sketches of step {step} for "
                      f"{len(heads)} heads and router series for layers {sorted(router_layers)}")


def hf_llama(torch, transformers):
    """(the Tokens dataset class, a small LlamaForCausalLM with random
    weights, SDPA): what the HF cases train, here and in
    test_torch2_callbacks_ddp.py."""
    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(3)
            self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
                                   num_hidden_layers=LAYERS, num_attention_heads=H,
                                   num_key_value_heads=HKV)
    cfg._attn_implementation = "sdpa"
    return Tokens, transformers.LlamaForCausalLM(cfg)


def hf_case(torch, transformers, api, workdir, logging_steps):
    from foreshock.integrations import ForeshockCallback

    Tokens, model = hf_llama(torch, transformers)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(workdir, "hf"), max_steps=STEPS,
        per_device_train_batch_size=BATCH, learning_rate=1e-3, logging_steps=logging_steps,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, lr_scheduler_type="linear",
        warmup_steps=4, max_grad_norm=1.0)
    run = f"hf-log{logging_steps}"
    cb = ForeshockCallback(run=run)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(STEPS * BATCH),
                                   callbacks=[cb])
    trainer.train()
    check(cb.monitor is None and cb.stats is not None and cb.error is None,
          f"hf: callback not closed cleanly: stats {cb.stats}, error {cb.error!r}")
    check(cb.stats["acked"] == STEPS and cb.stats["dropped"] == 0,
          f"hf: {STEPS} steps, Monitor stats {cb.stats}")
    logged = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    log_steps = list(range(logging_steps, STEPS + 1, logging_steps))
    check(sorted(logged) == log_steps, f"hf: Trainer logged steps {sorted(logged)}")
    # Every step carries its learning rate; loss and grad_norm come with the
    # steps the Trainer logs, and only with those.
    lr = wait_series(api, run, "lr", range(1, STEPS + 1), run)
    check(sorted(lr) == list(range(1, STEPS + 1)), f"{run}: lr at steps {sorted(lr)}")
    for name, key in (("loss", "loss"), ("grad_norm", "grad_norm"), ("lr", "learning_rate")):
        pts = wait_series(api, run, name, log_steps, run)
        check(name == "lr" or sorted(pts) == log_steps, f"{run}: {name} at steps {sorted(pts)}")
        bad = [(s, pts.get(s), logged[s][key]) for s in log_steps
               if not close(pts.get(s), logged[s][key])]
        check(not bad, f"{run}: daemon {name} differs from the Trainer's log (step, daemon, "
              f"trainer): {bad[:5]}")
    heads = {(layer, h) for layer in range(LAYERS) for h in range(H)}
    check_sketches(api, run, heads, set(), STEPS)
    print(f"  HF Trainer + ForeshockCallback, logging_steps={logging_steps}: lr at steps "
          f"1-{STEPS}, the Trainer's loss and grad_norm at its {len(log_steps)} logged steps; "
          f"qk sketches of step {STEPS} for {len(heads)} heads", flush=True)


def mixtral_cfg(transformers):
    """The small MixtralConfig (SDPA) the Lightning cases train, here and in
    test_torch2_callbacks_ddp.py."""
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
                                     num_hidden_layers=LAYERS, num_attention_heads=H,
                                     num_key_value_heads=HKV, num_local_experts=E,
                                     num_experts_per_tok=2)
    cfg._attn_implementation = "sdpa"
    return cfg


def lightning_case(torch, transformers, api):
    import lightning.pytorch as pl
    from foreshock.integrations import ForeshockLightningCallback

    torch.manual_seed(6)
    cfg = mixtral_cfg(transformers)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = transformers.MixtralForCausalLM(cfg)
            self.losses = {}       # batch_idx -> loss
            self.norms = {}        # optimizer step (1-based) -> grad norm before clipping
            self.lrs = {}

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            self.losses[batch_idx] = loss.item()
            return loss

        def on_before_optimizer_step(self, optimizer):
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.norms[self.trainer.global_step + 1] = torch.nn.utils.get_total_norm(grads).item()
            self.lrs[self.trainer.global_step + 1] = optimizer.param_groups[0]["lr"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=2e-3)

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (2 * STEPS * BATCH, SEQ), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BATCH)
    module = Module()
    cb = ForeshockLightningCallback(run="lightning")
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=2,
                         gradient_clip_val=0.5, callbacks=[cb])
    trainer.fit(module, loader)
    check(cb.monitor is None and cb.stats is not None and cb.error is None,
          f"lightning: callback not closed cleanly: stats {cb.stats}, error {cb.error!r}")
    check(cb.stats["acked"] == STEPS + 1 and cb.stats["dropped"] == 0,
          f"lightning: {STEPS} steps + step 0, Monitor stats {cb.stats}")
    steps = range(0, STEPS + 1)
    # Step s >= 1 completes with micro-batch 2s - 1; step 0 is micro-batch 0.
    want_loss = {s: module.losses[max(0, 2 * s - 1)] for s in steps}
    pts = wait_series(api, "lightning", "loss", steps, "lightning")
    bad = [(s, pts.get(s), want_loss[s]) for s in steps if not close(pts.get(s), want_loss[s])]
    check(not bad, f"lightning: daemon loss vs the completing micro-batch's: {bad[:5]}")
    for name, want in (("grad_norm", module.norms), ("lr", module.lrs)):
        pts = wait_series(api, "lightning", name, range(1, STEPS + 1), "lightning")
        bad = [(s, pts.get(s), want[s]) for s in range(1, STEPS + 1)
               if not close(pts.get(s), want[s])]
        check(not bad, f"lightning: daemon {name} vs the module's own: {bad[:5]}")
    clipped = sum(1 for v in module.norms.values() if v > 0.5)
    check(clipped > 0, "lightning: no step had a gradient norm above the clip value: the "
          "pre-clip check cannot tell")
    heads = {(layer, h) for layer in range(LAYERS) for h in range(H)}
    check_sketches(api, "lightning", heads, set(range(LAYERS)), STEPS)
    print(f"  Lightning + ForeshockLightningCallback (2 micro-batches a step): steps 0-{STEPS} "
          f"with the completing micro-batch's loss, the pre-clip grad norm ({clipped} steps "
          f"clipped) and lr; qk sketches for {len(heads)} heads, router series for "
          f"{LAYERS} layers", flush=True)


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python", "experiments"))
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(args.build_dir), "libforeshock.so")
    import torch
    try:
        import transformers
        import lightning  # noqa: F401
    except ImportError as e:
        raise fstest.Skip(f"{e.name} is not installed for {sys.executable} (the torch 2.x venv: "
                          "tests/python-venv.sh, cmake -DFORESHOCK_VENV_PYTHON=...)")
    import logging
    from fsapi import Api
    transformers.logging.set_verbosity_error()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    daemon = fstest.Daemon(args.build_dir, workdir)
    os.environ["FORESHOCK_ENDPOINT"] = daemon.endpoint
    try:
        api = Api(daemon.http)
        hf_case(torch, transformers, api, workdir, logging_steps=1)
        hf_case(torch, transformers, api, workdir, logging_steps=5)
        lightning_case(torch, transformers, api)
    finally:
        daemon.stop()


if __name__ == "__main__":
    fstest.preload_sanitizers()
    fstest.run_main(main)
