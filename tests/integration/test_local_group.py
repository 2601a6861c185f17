"""A daemon per node hears only its node's ranks. Ranks 2-3 of a 4-rank MoE
job stream to one daemon (foreshock simulate, the model sharded over the
two): with the local group declared (Hello.local_ranks) every router series
(weights and token statistics: routing entropy, MaxVio, load entropy,
z-loss, ...) is computed with 0 incomplete steps, the run says what its
monitors cover (topology in the API), and the group's lowest rank's loss is
detected (a NaN fires); without the declaration nothing changes: token
statistics wait for all 4 ranks and are recorded incomplete. The Python
client's default group (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE with a
loopback endpoint) is checked as well."""
import math
import os
import subprocess
import sys
import time

from fstest import Daemon, RawConn, check, hello, proto_module, run_main

STEPS = 60
EVERY = 5
ROUTER_SERIES = ["router.similarity", "router.centered_energy", "router.kappa", "router.erank",
                 "router.srank", "router.entropy", "router.entropy_norm",
                 "router.entropy_spread", "router.maxvio", "router.load_entropy",
                 "router.dead_experts", "router.balance", "router.zloss"]
TOKEN_SERIES = ROUTER_SERIES[5:]


def simulate(args, d, run, declare):
    cmd = [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
           "--run", run, "--ranks", "2", "--world-size", "4", "--first-rank", "2",
           "--steps", str(STEPS), "--layers", "2", "--heads", "2", "--dh", "8", "--d", "32",
           "--sketch-every", str(EVERY), "--experts", "4", "--flush-timeout", "120"]
    if declare:
        cmd.append("--local-group")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    check(p.returncode == 0, f"simulate exited {p.returncode}:\n{p.stdout[-2000:]}")


def series(d, run, name):
    return d.get(f"/api/v1/series?run={run}&name={name}")["series"]


def wait_for(fn, what, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def declared(args, d):
    run = "node1"
    simulate(args, d, run, declare=True)
    last = STEPS - 1
    # The monitors run after the reports commit: wait for the last step.
    wait_for(lambda: all(s["last_step"] == last for s in series(d, run, "router.zloss")) and
             series(d, run, "router.zloss"), "router.zloss up to the last step")
    for name in ROUTER_SERIES:
        ser = series(d, run, name)
        check(len(ser) == 2, f"{name}: {len(ser)} series, expected one per MoE layer")
        for s in ser:
            check(s["points"] > 0, f"{name} layer {s['labels']}: no points")
    inc = d.get(f"/api/v1/runs/{run}/incomplete")["incomplete"]
    check(inc == [], f"incomplete steps with the local group declared: {inc[:5]}")
    doc = d.get(f"/api/v1/runs/{run}")["run"]
    check(doc["incomplete"] == 0, f"run incomplete count {doc['incomplete']}")
    topo = doc["topology"]
    check(topo and topo["local_ranks"] == "2-3" and topo["ranks"] == 2 and
          topo["lead_rank"] == 2, f"topology {topo}")
    check(set(TOKEN_SERIES) <= set(topo["group_only_series"]), f"group-only series {topo}")
    check("local group 2-3" in d.log_text(), "no log line naming the local group")


def undeclared(args, d):
    run = "node0"
    simulate(args, d, run, declare=False)
    inc = wait_for(lambda: d.get(f"/api/v1/runs/{run}/incomplete")["incomplete"],
                   "incomplete token reductions")
    tokens = [r for r in inc if r["kind"] == "router_tokens"]
    check(tokens and all(r["have"] == 2 and r["want"] == 4 for r in tokens),
          f"undeclared: expected router_tokens have 2 want 4, got {inc[:4]}")
    check(series(d, run, "router.entropy") == [], "undeclared: token statistics computed "
          "from half the world")
    check(d.get(f"/api/v1/runs/{run}")["run"]["topology"] is None, "undeclared: topology")


def nan_loss_fires(pb, d, run, local):
    """Rank 2 of 4 sends a NaN loss: detected only when rank 2 leads its group."""
    c = RawConn(pb, d.ingest_port)
    f = hello(pb, run, rank=2, world=4)
    f.hello.local_ranks.extend(local)
    c.send(f)
    w = c.recv()
    check(w.WhichOneof("body") == "welcome", f"expected Welcome, got {w}")
    for seq, step in ((1, 0), (2, 1)):
        r = pb.Frame()
        r.report.seq, r.report.step = seq, step
        r.report.scalars.loss = math.nan if step == 1 else 2.0
        c.send(r)
        ack = c.recv()
        check(ack.WhichOneof("body") == "ack", f"expected Ack: {ack}")
    c.close()


def refused(pb, d):
    c = RawConn(pb, d.ingest_port)
    f = hello(pb, "bad", rank=2, world=4)
    f.hello.local_ranks.extend([0, 1])
    c.send(f)
    e = c.recv()
    check(e.WhichOneof("body") == "error" and "itself" in e.error.message,
          f"a group without the rank itself: {e}")
    c.close()


def python_default(args):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    from foreshock.monitor import resolve_local_ranks
    env = dict(os.environ)
    try:
        os.environ.pop("FORESHOCK_LOCAL_RANKS", None)
        os.environ.update(LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
        check(resolve_local_ranks(None, "127.0.0.1:7781", 3, 4) == [2, 3], "torchrun group")
        check(resolve_local_ranks(None, "10.0.0.5:7781", 3, 4) is None,
              "a remote daemon hears the job")
        check(resolve_local_ranks(False, "127.0.0.1:7781", 3, 4) is None, "opt out")
        check(resolve_local_ranks("2-3", "10.0.0.5:7781", 3, 4) == [2, 3], "explicit")
        os.environ["FORESHOCK_LOCAL_RANKS"] = "none"
        check(resolve_local_ranks(None, "127.0.0.1:7781", 3, 4) is None, "env none")
        try:
            resolve_local_ranks([0, 1], "127.0.0.1:7781", 3, 4)
            check(False, "a group without the rank itself was accepted")
        except ValueError:
            pass
    finally:
        os.environ.clear()
        os.environ.update(env)


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    python_default(args)
    d = Daemon(args.build_dir, workdir, extra=["--set", "reduce_timeout_s=2"])
    try:
        declared(args, d)
        undeclared(args, d)
        refused(pb, d)
        nan_loss_fires(pb, d, "nan-declared", [2, 3])
        nan_loss_fires(pb, d, "nan-undeclared", [])
        fired = wait_for(lambda: [a for a in d.get("/api/v1/alerts?run=nan-declared")["alerts"]
                                  if a["rule"] == "loss"], "the NaN loss alert of rank 2")
        check(fired[0]["state"] == "firing", f"loss alert {fired[0]}")
        time.sleep(1.0)  # the undeclared run's report was evaluated as well by now
        none = d.get("/api/v1/alerts?run=nan-undeclared")["alerts"]
        check(none == [], f"undeclared rank 2's loss was detected: {none}")
    finally:
        d.stop()


if __name__ == "__main__":
    run_main(test)
