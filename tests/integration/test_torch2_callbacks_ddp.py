"""The trainer callbacks of foreshock.integrations under multi-process DDP:
2 ranks on the CPU (gloo) into the real daemon (torch 2.x venv,
tests/python-venv.sh), each callback used exactly as its docstring shows.

HF: `python -m torch.distributed.run --nproc_per_node 2` runs this file as
a worker (--worker hf) on each rank: transformers.Trainer (use_cpu,
ddp_backend="gloo", logging_steps=1) trains a small LlamaForCausalLM
(random weights) for STEPS optimizer steps with
callbacks=[ForeshockCallback(run="hf-ddp")] and the daemon's endpoint in
$FORESHOCK_ENDPOINT.

Lightning: this file runs once as a worker (--worker lightning) and
lightning.pytorch.Trainer(accelerator="cpu", devices=2, strategy="ddp")
re-runs it for rank 1 (its subprocess launcher); a small
MixtralForCausalLM in a LightningModule trains STEPS steps with
callbacks=[ForeshockLightningCallback(run="lightning-ddp")].

Each rank makes its own Monitor, whose rank and world size come from
torch.distributed (monitor.py): the daemon must hold one run per trainer
(no other run) with world_size 2 and one stream per rank (0 and 1), each
with STEPS reports; every rank's Monitor acknowledged all its reports and
was closed (the worker writes the callback's stats, error and the
Trainer's own values to a JSON file per rank), and no rank logged a
foreshock warning or raised. Scalars: both ranks' lr, loss and grad_norm
at every step 1..STEPS, equal to what that rank's trainer had (HF: its
log_history, whose loss is the mean over ranks; Lightning: the module's own
loss per batch and gradient norm before the optimizer step). Sketches (rank
0 sends them, weights being replicated; rank 1 sketches no step): qk sketches of step STEPS for
every head; Lightning's Mixtral also has router series for every MoE layer
with the token statistics of both ranks reduced (no incomplete step).
"""
import json
import logging
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

D, H, HKV, LAYERS, VOCAB, FFN, E = 32, 4, 2, 2, 64, 64, 4
STEPS, BATCH, SEQ = 20, 2, 12
RANKS = 2
REL = 1e-5          # the daemon stores the float32/64 scalars it is sent
WORKER_TIMEOUT_S = 300
RUNS = {"hf": "hf-ddp", "lightning": "lightning-ddp"}


def close(a, b):
    return a is not None and b is not None and abs(a - b) <= REL * max(1.0, abs(b))



# --- the workers: one process per rank ------------------------------------------------------

class Said(logging.Handler):
    """foreshock's log records of WARNING and above, kept for the report."""

    def __init__(self):
        logging.Handler.__init__(self, logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(f"{record.levelname}: {record.getMessage()}")


def hf_worker(torch, transformers, out):
    from foreshock.integrations import ForeshockCallback
    from test_torch2_callbacks import hf_llama  # the same data and model

    Tokens, model = hf_llama(torch, transformers)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, "hf"), max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        ddp_backend="gloo", disable_tqdm=True, dataloader_num_workers=0,
        lr_scheduler_type="linear", warmup_steps=4, max_grad_norm=1.0)
    cb = ForeshockCallback(run=RUNS["hf"])
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=Tokens(RANKS * STEPS * BATCH), callbacks=[cb])
    trainer.train()
    logged = {e["step"]: {"loss": e["loss"], "grad_norm": e["grad_norm"],
                          "lr": e["learning_rate"]}
              for e in trainer.state.log_history if "loss" in e}
    return cb, logged


def lightning_worker(torch, transformers, out):
    import lightning.pytorch as pl
    from foreshock.integrations import ForeshockLightningCallback

    from test_torch2_callbacks import mixtral_cfg  # the same model

    torch.manual_seed(6)
    cfg = mixtral_cfg(transformers)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = transformers.MixtralForCausalLM(cfg)
            self.seen = {}   # optimizer step (1-based) -> loss, grad_norm, lr

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            self.seen.setdefault(self.trainer.global_step + 1, {})["loss"] = loss.item()
            return loss

        def on_before_optimizer_step(self, optimizer):
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.seen[self.trainer.global_step + 1].update(
                grad_norm=torch.nn.utils.get_total_norm(grads).item(),
                lr=optimizer.param_groups[0]["lr"])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=2e-3)

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (RANKS * STEPS * BATCH, SEQ), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BATCH)
    module = Module()
    cb = ForeshockLightningCallback(run=RUNS["lightning"])
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=RANKS, strategy="ddp",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb])
    trainer.fit(module, loader)
    return cb, module.seen


def worker(kind, out, source_dir, build_dir):
    """One rank: trains, then writes out/<kind>.rank<R>.json with what the
    test checks (a failure is written there too, then raised)."""
    sys.path.insert(0, os.path.join(source_dir, "client", "python"))
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(build_dir), "libforeshock.so")
    said = Said()
    logging.getLogger("foreshock").addHandler(said)
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    doc = {"pid": os.getpid(), "said": said.records}
    try:
        cb, seen = (hf_worker if kind == "hf" else lightning_worker)(torch, transformers, out)
        dist = torch.distributed
        doc.update(rank=dist.get_rank(), world_size=dist.get_world_size(),
                   closed=cb.monitor is None, stats=cb.stats,
                   error=None if cb.error is None else repr(cb.error),
                   seen={str(k): v for k, v in seen.items()})
    except BaseException as e:
        doc["raised"] = repr(e)
        raise
    finally:
        rank = doc.get("rank", os.environ.get("RANK", os.environ.get("LOCAL_RANK", "x")))
        path = os.path.join(out, f"{kind}.rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, default=str)
        os.replace(path + ".tmp", path)
    # As PyTorch asks of every process that made a group: neither trainer
    # destroys it, and a gloo group left to interpreter exit can abort the
    # rank ("terminate called without an active exception", SIGABRT) after
    # everything above has run (it failed one CI run of this test).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# --- the test ------------------------------------------------------------------------------

def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:   # it exists
        return True


def launch(kind, args, workdir, daemon):
    """Starts the ranks of `kind` in a new session (its own process group)
    and waits for them; on a timeout kills that process group, which holds
    only the processes this started. Returns the launcher's output."""
    out = os.path.join(workdir, kind)
    os.makedirs(out)
    me = [os.path.abspath(__file__), "--worker", kind, out, os.path.abspath(args.source_dir),
          os.path.abspath(args.build_dir)]
    if kind == "hf":
        # --standalone: the launcher binds its own rendezvous port (no
        # free_port() race with concurrent tests).
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(RANKS)] + me
    else:
        cmd = [sys.executable] + me
    env = dict(os.environ, FORESHOCK_ENDPOINT=daemon.endpoint, OMP_NUM_THREADS="1")
    if kind != "hf":  # Lightning's own launcher reads them (a small port race, accepted)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(fstest.free_port()))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=out, start_new_session=True)
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        text, _ = proc.communicate(timeout=WORKER_TIMEOUT_S)
        # A rank the launcher started but did not wait for is still in the
        # process group (signal 0: is any process left in it?).
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_alive(proc.pid):
            raise fstest.Failure(f"{kind}: a rank outlived its launcher by "
                                 f"{WORKER_TIMEOUT_S} s:\n{text[-4000:]}")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate(timeout=30)
        raise fstest.Failure(f"{kind}: the ranks did not finish within {WORKER_TIMEOUT_S} s "
                             f"(a hang?):\n{text[-4000:]}")
    finally:
        # Whatever of this session is left (a hang, a failure) is this
        # test's own: its process group, killed by its id.
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            proc.wait(timeout=30)
    check(proc.returncode == 0, f"{kind}: launcher exited {proc.returncode}:\n{text[-4000:]}")
    docs = []
    for r in range(RANKS):
        path = os.path.join(out, f"{kind}.rank{r}.json")
        check(os.path.exists(path), f"{kind}: rank {r} wrote no report:\n{text[-4000:]}")
        with open(path) as f:
            docs.append(json.load(f))
    return docs, text


def check_ranks(kind, docs):
    for r, doc in enumerate(docs):
        what = f"{kind} rank {r}"
        check("raised" not in doc, f"{what} raised {doc.get('raised')}")
        check(doc["rank"] == r and doc["world_size"] == RANKS,
              f"{what}: torch.distributed says rank {doc['rank']} of {doc['world_size']}")
        check(doc["closed"] and doc["stats"] is not None and doc["error"] is None,
              f"{what}: callback not closed cleanly: stats {doc['stats']}, error {doc['error']}")
        st = doc["stats"]
        check(st["acked"] == STEPS and st["dropped"] == 0 and st.get("buffered_reports", 0) == 0,
              f"{what}: {STEPS} steps, Monitor stats {st}")
        check(not doc["said"], f"{what}: foreshock logged on healthy training: {doc['said']}")
        # Replicated weights: rank 0 sketches them, no other rank.
        check((st["sketch_steps"] > 0) == (r == 0),
              f"{what}: {st['sketch_steps']} sketch steps")
        check(sorted(int(s) for s in doc["seen"]) == list(range(1, STEPS + 1)),
              f"{what}: the trainer's own values at steps {sorted(doc['seen'])}")


def check_run(daemon, kind):
    """One run of world_size RANKS, one stream per rank with every report."""
    run = RUNS[kind]
    info = daemon.get(f"/api/v1/runs/{run}")["run"]
    check(info["world_size"] == RANKS, f"{run}: world_size {info['world_size']}")
    streams = sorted((s["attempt"], s["rank"], s["reports"]) for s in info["streams_detail"])
    check(streams == [(0, r, STEPS) for r in range(RANKS)],
          f"{run}: streams (attempt, rank, reports) {streams}")
    return info


def wait_points(api, run, name, rank, steps):
    """{step: value} of rank's series `name` once it has all `steps`."""
    def points():
        vals = api.values(run, name=name, rank=rank)
        check(len(vals) <= 1, f"{run}: {len(vals)} {name} series of rank {rank}: {list(vals)}")
        pts = next(iter(vals.values()), {})
        return pts if set(pts) >= set(steps) else None
    return fstest.wait_until(points, timeout=60, what=f"{run}: rank {rank} {name} at steps "
                             f"{steps[0]}-{steps[-1]}")


def check_scalars(api, kind, docs):
    run, steps = RUNS[kind], list(range(1, STEPS + 1))
    for r, doc in enumerate(docs):
        for name in ("lr", "loss", "grad_norm"):
            pts = wait_points(api, run, name, r, steps)
            check(sorted(pts) == steps, f"{run}: rank {r} {name} at steps {sorted(pts)}")
            want = {s: doc["seen"][str(s)][name] for s in steps}
            bad = [(s, pts[s], want[s]) for s in steps if not close(pts[s], want[s])]
            check(not bad, f"{run}: rank {r} daemon {name} vs the trainer's (step, daemon, "
                  f"trainer): {bad[:5]}")


def check_sketches(api, daemon, kind, router_layers):
    run = RUNS[kind]
    heads = {(layer, h) for layer in range(LAYERS) for h in range(H)}

    def have():
        vals = api.values(run, name="qk.d2.erank")
        got = {(int(k[1]), int(k[2])) for k, pts in vals.items() if STEPS in pts}
        rv = api.values(run, prefix="router.") if router_layers else {}
        rgot = {int(k[1]) for k, pts in rv.items() if k[1] is not None and STEPS in pts}
        return got == heads and rgot == router_layers
    fstest.wait_until(have, timeout=60, what=f"{run}: qk sketches of step {STEPS} for "
                      f"{len(heads)} heads and router series of layers {sorted(router_layers)}")
    if router_layers:
        inc = daemon.get(f"/api/v1/runs/{run}/incomplete")["incomplete"]
        check(inc == [], f"{run}: reductions incomplete (a rank's tokens missing): {inc[:5]}")
    return len(heads)


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python", "experiments"))
    import torch
    try:
        import transformers  # noqa: F401
        import lightning  # noqa: F401
    except ImportError as e:
        raise fstest.Skip(f"{e.name} is not installed for {sys.executable} (the torch 2.x venv: "
                          "tests/python-venv.sh, cmake -DFORESHOCK_VENV_PYTHON=...)")
    check(torch.distributed.is_available() and torch.distributed.is_gloo_available(),
          f"torch {torch.__version__} of {sys.executable} has no gloo backend")
    from fsapi import Api
    daemon = fstest.Daemon(args.build_dir, workdir)
    try:
        api = Api(daemon.http)
        for kind, routers in (("hf", set()), ("lightning", set(range(LAYERS)))):
            t0 = time.monotonic()
            docs, _ = launch(kind, args, workdir, daemon)
            check_ranks(kind, docs)
            check_run(daemon, kind)
            check_scalars(api, kind, docs)
            n_heads = check_sketches(api, daemon, kind, routers)
            print(f"  {kind}: ranks 0 and 1 ({time.monotonic() - t0:.0f} s): one run of "
                  f"world_size {RANKS}, {STEPS} reports acked per rank, each rank's lr, loss "
                  f"and grad_norm at steps 1-{STEPS} as its trainer had them; qk sketches of "
                  f"step {STEPS} for {n_heads} heads"
                  + (f", router series of {len(routers)} layers, none incomplete"
                     if routers else ""), flush=True)
        runs = sorted(r["id"] for r in fstest.run_all_pages(daemon, "/api/v1/runs", "runs"))
        check(runs == sorted(RUNS.values()), f"runs in the daemon: {runs}")
    finally:
        daemon.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:6])
        sys.exit(0)
    fstest.preload_sanitizers()
    fstest.run_main(main)
