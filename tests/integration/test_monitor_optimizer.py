"""The optimizer's class name travels from foreshock.Monitor to the run's
model JSON.

Monitors on a tiny real PyTorch model, one run each, stream a few steps to
the real daemon (loopback, ephemeral ports), which stores each Hello's model
shape as the run's model JSON; GET /api/v1/runs/{run} shows it:
  - optimizer=torch.optim.SGD(...): "optimizer": "SGD". The Monitor here
    monitors no attention or router, so the optimizer is the only field of
    the model shape: such a shape must still be sent;
  - optimizer_name="Muon": the daemon warns once per run (two Monitors)
    that the Delta2 rules see little under an orthogonalized update;
  - optimizer=Adam plus optimizer_name="MyLion": the explicit name wins,
    and `foreshock replay` of that Monitor's recording sends it too;
  - none given, an SGD made before the Monitor or after it (the
    connection then waits for the first report): "SGD"; SGD and Adam over
    one model: nothing; no torch optimizer at all: no "optimizer" key;
  - an optimizer class whose name the daemon would refuse (65 characters;
    not ASCII): training goes on, the name is left out, one warning per
    name however many Monitors see it;
  - optimizer_name= that is not 1..64 printable ASCII: ValueError at
    construction, like Monitor's other bad arguments;
  - a trainer's wrapper around an SGD sends "SGD", not the wrapper's name:
    torch's ZeroRedundancyOptimizer (a gloo group of one rank) everywhere;
    accelerate's AcceleratedOptimizer and Lightning's LightningOptimizer
    where those import (the torch 2.x venv).
"""
import logging
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

STEPS = 5
LONG_NAME = "A" * 65



def train(torch, foreshock, daemon, run, model, opt, step_opt=None, **kw):
    """STEPS real optimizer steps under a Monitor given optimizer=opt (the
    steps taken by step_opt when given: a wrapper that needs its trainer to
    step); returns the run's model JSON as the daemon serves it (None when
    it holds none)."""
    mon = foreshock.Monitor(model, endpoint=daemon.endpoint, run=run, attention=[], routers=[],
                            **({"optimizer": opt} if opt is not None else {}), **kw)
    x = torch.randn(16, 8)
    step_opt = step_opt or opt or torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(1, STEPS + 1):
        loss = ((model(x) - 1.0) ** 2).mean()
        step_opt.zero_grad()
        loss.backward()
        step_opt.step()
        mon.step(step, loss=float(loss), lr=1e-2)
    st = mon.close(30)
    check(st["acked"] == STEPS and st["dropped"] == 0, f"{run}: client counters {st}")
    return daemon.get(f"/api/v1/runs/{run}")["run"]["model"]


class HandStep:
    """Plain gradient descent written by hand: no torch.optim object."""

    def __init__(self, torch, model, lr=1e-2):
        self.torch, self.params, self.lr = torch, list(model.parameters()), lr

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        with self.torch.no_grad():
            for p in self.params:
                p -= self.lr * p.grad


def wrapped_sgds(torch, params, workdir):
    """(what, wrapper, the SGD inside) for each trainer wrapper importable
    here: torch's ZeroRedundancyOptimizer (over a gloo group of one rank)
    everywhere, accelerate's and Lightning's where they are installed."""
    out = []
    try:
        import accelerate
    except ImportError:
        print("  accelerate not installed here: its wrapper is checked in the torch 2.x venv",
              flush=True)
    else:
        sgd = torch.optim.SGD(params(), lr=1e-2)
        acc = accelerate.Accelerator(cpu=True)
        out.append(("accelerate", acc.prepare_optimizer(sgd), sgd))
    try:
        from lightning.pytorch.core.optimizer import LightningOptimizer
    except ImportError:
        print("  lightning not installed here: its wrapper is checked in the torch 2.x venv",
              flush=True)
    else:
        sgd = torch.optim.SGD(params(), lr=1e-2)
        out.append(("lightning", LightningOptimizer(sgd), sgd))
    # Last: the others are made before a process group exists.
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.distributed.init_process_group(
        "gloo", init_method="file://" + os.path.join(workdir, "pg"), rank=0, world_size=1)
    zero = ZeroRedundancyOptimizer(params(), optimizer_class=torch.optim.SGD, lr=1e-2)
    out.append(("torch", zero, zero))
    return out


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(args.build_dir),
                                               "libforeshock.so")
    import torch
    import foreshock
    torch.set_num_threads(1)
    torch.manual_seed(0)
    logs = fstest.CapturedWarnings()
    logging.getLogger("foreshock").addHandler(logs)

    def tiny():
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    daemon = fstest.Daemon(args.build_dir, workdir)
    try:
        model = tiny()
        got = train(torch, foreshock, daemon, "opt-sgd", model,
                    torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
        check(got == {"optimizer": "SGD"}, f"optimizer=SGD: model JSON {got}")
        print(f"  optimizer=SGD(...): {got}", flush=True)
        # Detection learns it too: the update-ratio rules credit SGD's
        # gradient (docs/detection.md), and the daemon says so once.
        said = [line for line in daemon.log_text().splitlines()
                if "run opt-sgd: optimizer SGD steps by the gradient" in line]
        check(len(said) == 1, f"the daemon's log about opt-sgd's optimizer: {said}")

        # Muon: the daemon warns once per run that the Delta2 rules see
        # little under an orthogonalized update, however many Hellos.
        for _ in range(2):
            model = tiny()
            got = train(torch, foreshock, daemon, "opt-muon", model,
                        torch.optim.AdamW(model.parameters(), lr=1e-3), optimizer_name="Muon")
        check(got == {"optimizer": "Muon"}, f"optimizer_name='Muon': model JSON {got}")
        said = [line for line in daemon.log_text().splitlines()
                if "run opt-muon: optimizer Muon orthogonalizes" in line]
        check(len(said) == 1, f"the daemon's log about opt-muon's optimizer: {said}")
        print(f"  optimizer_name='Muon': {got}, warned once", flush=True)

        model = tiny()
        rec = os.path.join(workdir, "named.fsrec")
        got = train(torch, foreshock, daemon, "opt-named", model,
                    torch.optim.Adam(model.parameters(), lr=1e-3), optimizer_name="MyLion",
                    record=rec)
        check(got == {"optimizer": "MyLion"}, f"optimizer_name=: model JSON {got}")
        check(not any("run opt-named: optimizer" in line
                      for line in daemon.log_text().splitlines()),
              "an adaptive optimizer's run logged as stepping by the gradient")
        print(f"  optimizer=Adam(...), optimizer_name='MyLion': {got}", flush=True)
        # The recording's Hello keeps it: `foreshock replay` sends it on.
        r = subprocess.run([os.path.join(args.build_dir, "foreshock"), "replay", rec,
                            "--endpoint", daemon.endpoint, "--run", "opt-replayed",
                            "--timeout", "30"], capture_output=True, text=True, timeout=120)
        check(r.returncode == 0, f"replay: exit {r.returncode}:\n{r.stdout}{r.stderr}")
        got = daemon.get("/api/v1/runs/opt-replayed")["run"]["model"]
        check(got == {"optimizer": "MyLion"}, f"replayed: model JSON {got}")
        print(f"  its recording replayed: {got}", flush=True)

        # Not given, made after the Monitor (train() makes its SGD then): the
        # connection waits for the first report, whose Hello names it.
        got = train(torch, foreshock, daemon, "opt-after", tiny(), None)
        check(got == {"optimizer": "SGD"}, f"an SGD made after the Monitor: model JSON {got}")
        print(f"  not given, an SGD made after the Monitor found: {got}", flush=True)

        # No torch optimizer at all (the update written by hand): nothing.
        model = tiny()
        got = train(torch, foreshock, daemon, "opt-none", model, None,
                    step_opt=HandStep(torch, model))
        check(got is None or "optimizer" not in got, f"no optimizer: model JSON {got}")
        print(f"  no optimizer: model {got}", flush=True)

        # Not given, found: the optimizer made before the Monitor that steps
        # the model's parameters names the run; optimizers of two classes
        # over it name nothing.
        model = tiny()
        sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        got = train(torch, foreshock, daemon, "opt-found", model, None, step_opt=sgd)
        check(got == {"optimizer": "SGD"}, f"an SGD made before the Monitor: model JSON {got}")
        print(f"  not given, an SGD over the model found: {got}", flush=True)
        model = tiny()
        both = [torch.optim.SGD(model[0].parameters(), lr=1e-2),
                torch.optim.Adam(model[2].parameters(), lr=1e-3)]
        got = train(torch, foreshock, daemon, "opt-two", model, None, step_opt=both[0])
        check(got is None or "optimizer" not in got, f"SGD and Adam over it: model JSON {got}")
        print(f"  not given, SGD and Adam over the model: model {got}", flush=True)
        del sgd, both

        # Names the daemon would refuse: left out, one warning per name.
        for i, name in enumerate((LONG_NAME, "Adâm")):
            cls = type(name, (torch.optim.SGD,), {})
            for attempt in range(2):
                model = tiny()
                run = f"opt-refused-{i}-{attempt}"
                got = train(torch, foreshock, daemon, run, model,
                            cls(model.parameters(), lr=1e-2))
                check(got is None or "optimizer" not in got, f"{run}: model JSON {got}")
            said = [m for m in logs.messages if repr(name) in m]
            check(len(said) == 1 and "not sent" in said[0],
                  f"class {name!r}: warnings {said} (want one)")
        print("  class names over 64 characters or not ASCII: left out, warned once each",
              flush=True)

        for bad in ("", LONG_NAME, "Ad\tam", "Adâm", b"SGD", 7):
            try:
                foreshock.Monitor(tiny(), endpoint=daemon.endpoint, run="opt-bad",
                                  attention=[], routers=[], optimizer_name=bad)
                check(False, f"optimizer_name={bad!r} accepted")
            except ValueError as e:
                check("optimizer_name" in str(e), f"optimizer_name={bad!r}: {e}")
        print("  a bad optimizer_name= is a ValueError at construction", flush=True)

        model = tiny()
        for what, opt, sgd in wrapped_sgds(torch, model.parameters, workdir):
            got = train(torch, foreshock, daemon, f"opt-{what}", model, opt, step_opt=sgd)
            check(got == {"optimizer": "SGD"}, f"{what}'s {type(opt).__name__}: model JSON {got}")
            print(f"  {what}'s {type(opt).__name__} around SGD: {got}", flush=True)
        torch.distributed.destroy_process_group()
        check(daemon.stop() == 0, "daemon did not exit 0")
    finally:
        fstest.kill_started(daemon)


if __name__ == "__main__":
    fstest.preload_sanitizers()
    fstest.run_main(main)
