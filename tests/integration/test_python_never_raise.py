"""foreshock.Monitor never breaks training: a failure anywhere in the client
after Monitor(...) returned is counted, logged and survived.

Each phase trains a tiny MoE GPT (3 blocks: attention + a 4-expert router
each) streamed to the real daemon, with one stage of the client made to
fail by replacing one of its functions with one that raises:

  discovery  discover() raises: the Monitor starts with nothing to sketch,
             the training scalars still reach the daemon
  sketch     attention_grams raises for block 1's attention, router_gram
             for block 2's router: those two modules are disabled, the
             other attentions and routers are stored at every sketch step
  spectrum   the spectra of block 0's heads raise (route="spectrum"), and
             packing block 2's sketches raises: both disabled, block 1 stored
  hook       block 1's router forward hook raises inside the model's
             forward: the forward completes, that router is disabled
  send       building the reports of two steps raises: those two reports
             are dropped and counted, every other step is stored
  transport  the daemon is SIGKILLed mid-run and the transport then raises
             from every call (submit, stats, flush, close, poll_advice):
             step(), flush(), stats(), close() and the context manager
             return; step() after close() and a bad step number too
  closed     the libforeshock client frees its handle at close: stats()
             (the counts close() returned), flush() and step() on a closed
             Monitor, and
             every call on a closed Client, return (the Client's say it is
             closed: -EBADF, {}, []); four threads calling submit, stats,
             flush and poll_advice while another closes the Client all
             finish, every report submitted before close began is acked and
             stored and every one after is refused -EBADF (under the ASan
             build a use of the freed handle aborts the run)

In every phase: no exception reaches the loop, the WARNING naming a
disabled module is logged exactly once, stats()["failures"] and
stats()["disabled_modules"] say what failed, and the daemon holds the
series of exactly the modules still monitored.

  sharded    two gloo ranks reduce their partial Grams in the trainer
             (shard_reduce="trainer"); block 1's Grams fail on rank 1 only.
             Both ranks finish (the all_reduce keeps one layout: the failed
             module's slot is zeros with a flag), both disable block 1, the
             daemon holds block 0's attention and both routers, and no
             partial Gram of block 1

Then nn.MultiheadAttention(embed_dim=32, num_heads=4, kdim=16, vdim=16)
(queries and keys of different widths: Wq^T Wk is a 32 x 16 operator)
trains end to end on both routes: the daemon's per-head qk.d2 erank and
srank equal the float64 SVD of the test's own Delta2 = dWq^T Wk + Wq^T dWk.
"""
import argparse
import errno
import logging
import math
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

STEPS = 12
WINDOW = 2
EVERY = 2
LAYERS = 3
QK_STEPS = list(range(2 * EVERY, STEPS + 1, EVERY))    # sketch steps with a base
ROUTER_STEPS = list(range(EVERY, STEPS + 1, EVERY))    # router Grams need no base
REL_SPEC = 1e-3
# The Monitor claims every head at connect; a disabled attention's heads
# are then recorded missing when a step's bucket times out: keep it short.
DAEMON_ARGS = ["--set", "reduce_timeout_s=2"]



class Trainer:
    """A tiny MoE GPT on a slice of text: real steps, real weights."""

    def __init__(self, torch, tinygpt, seed=0):
        torch.manual_seed(seed)
        data, vocab = tinygpt.load_corpus(max_bytes=1 << 16)
        self.model = tinygpt.TinyGPT(vocab, d=32, n_layer=LAYERS, n_head=2, t=16, moe=(4, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.batches = tinygpt.Batches(data, 4, 16, seed)
        self.torch = torch

    def step(self, i):
        x, y = self.batches.get(i)
        loss, _ = self.model(x, y)
        self.opt.zero_grad()
        loss.backward()
        gn = self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss, gn


class Env:
    def __init__(self, args, workdir, torch, foreshock, tinygpt, Api):
        self.args, self.workdir = args, workdir
        self.torch, self.foreshock, self.tinygpt, self.Api = torch, foreshock, tinygpt, Api
        self.daemon = None


def train(mon, tr, steps=STEPS, first=1):
    """The user's loop: any exception out of the client fails the test."""
    for i in range(first, first + steps):
        loss, gn = tr.step(i)
        mon.step(i, loss=loss, grad_norm=gn, lr=1e-3)


def layers_with(api, run, name):
    """{layer: [steps with a value]} of the run's series `name` (per layer)."""
    out = {}
    for s in api.series(run, name=name):
        layer = (s.get("labels") or {}).get("layer")
        if layer is not None:
            out[int(layer)] = sorted(p for p, v in api.points(s["id"]) if v is not None)
    return out


def wait_stored(api, run, loss_steps, qk_layers, router_layers, token_layers):
    """Waits until the daemon holds the loss at loss_steps, qk.d2.erank.min
    of qk_layers at every sketch step, router.erank (Gram) of router_layers
    and router.entropy (tokens) of token_layers at every router step; then
    checks that no other layer has them."""
    want = {"qk.d2.erank.min": (qk_layers, QK_STEPS), "router.erank": (router_layers,
                                                                       ROUTER_STEPS),
            "router.entropy": (token_layers, ROUTER_STEPS)}

    def done():
        loss = api.series(run, name="loss")
        if not loss or [p for p, _ in api.points(loss[0]["id"])] != loss_steps:
            return False
        for name, (layers, steps) in want.items():
            got = layers_with(api, run, name)
            if any(got.get(layer) != steps for layer in layers):
                return False
        return True
    fstest.wait_until(done, 120, f"{run}: the series of the monitored modules")
    for name, (layers, steps) in want.items():
        got = layers_with(api, run, name)
        check(sorted(got) == sorted(layers), f"{run}: {name} stored for layers {sorted(got)}, "
              f"expected exactly {sorted(layers)}")


def run_phase(env, run, patch, expect, **mon_kw):
    """Trains STEPS steps with `patch(mon)` applied after construction
    (or before it, for patch=("before", fn)). expect: failures by stage,
    disabled module name parts, the layers still stored."""
    torch, foreshock = env.torch, env.foreshock
    tr = Trainer(torch, env.tinygpt)
    cap = fstest.CapturedWarnings()
    logging.getLogger("foreshock").addHandler(cap)
    undo = []
    try:
        if expect.get("before"):
            undo.append(patch(None))
        mon = foreshock.Monitor(tr.model, endpoint=env.daemon.endpoint, run=run,
                                windows=(WINDOW,), every=EVERY, **mon_kw)
        if not expect.get("before"):
            undo.append(patch(mon))
        train(mon, tr)
        st = mon.close(60)
    finally:
        for u in undo:
            u()
        logging.getLogger("foreshock").removeHandler(cap)
    fails = {k: v for k, v in st["failures"].items() if v}
    check(fails == expect["failures"], f"{run}: failures {fails}, expected {expect['failures']}")
    disabled = sorted(st["disabled_modules"])
    check(len(disabled) == len(expect["disabled"]) and
          all(any(p in d for d in disabled) for p in expect["disabled"]),
          f"{run}: disabled {disabled}, expected {expect['disabled']}")
    for name in disabled:
        check(cap.count(name, "no longer monitored") == 1,
              f"{run}: the WARNING for {name} was logged {cap.count(name)} times: "
              f"{cap.messages}")
    loss_steps = expect.get("loss_steps", list(range(1, STEPS + 1)))
    check(st["reports"] == STEPS and st["acked"] == len(loss_steps),
          f"{run}: {st['reports']} reports, {st['acked']} acked")
    api = env.Api(env.daemon.http)
    wait_stored(api, run, loss_steps, expect["qk"], expect["routers"],
                expect.get("tokens", expect["routers"]))
    print(f"  {run}: {STEPS} steps trained, failures {fails}, disabled {disabled}; the daemon "
          f"holds attention {expect['qk']} and routers {expect['routers']}", flush=True)


def replace(obj, name, fn):
    """obj.name = fn(original); returns the undo, which puts back what the
    class or module held (a staticmethod stays one)."""
    raw = vars(obj)[name]
    setattr(obj, name, fn(getattr(obj, name)))
    return lambda: setattr(obj, name, raw)


def raising_for(orig, pred, what):
    def f(*a, **kw):
        if pred(*a, **kw):
            raise RuntimeError(f"injected {what} failure")
        return orig(*a, **kw)
    return f


def phases(env):
    mon_mod, sk = sys.modules["foreshock.monitor"], sys.modules["foreshock.sketch"]
    all_layers = list(range(LAYERS))

    # discovery: construction survives, scalars only.
    run_phase(env, "nr-discovery",
              lambda _: replace(mon_mod, "discover", lambda o: raising_for(
                  o, lambda *a, **k: True, "discovery")),
              {"before": True, "failures": {"discovery": 1}, "disabled": [], "qk": [],
               "routers": []})

    # sketch: block 1's attention Grams and block 2's router Gram raise.
    def patch_sketch(mon):
        q1 = mon.attention[1].get()[0].data_ptr()
        r2 = mon.routers[2].get().data_ptr()
        u1 = replace(sk, "attention_grams", lambda o: raising_for(
            o, lambda wq, *a, **k: wq.data_ptr() == q1, "Gram"))
        u2 = replace(sk, "router_gram", lambda o: raising_for(
            o, lambda wr, *a, **k: wr.data_ptr() == r2, "router Gram"))
        return lambda: (u1(), u2())
    run_phase(env, "nr-sketch", patch_sketch,
              {"failures": {"sketch": 2}, "disabled": ["attention h.1.", "router h.2."],
               "qk": [0, 2], "routers": [0, 1]})

    # spectrum and pack: block 0's spectra and block 2's packing raise.
    def patch_spectrum(mon):
        cls = type(mon)
        u1 = replace(cls, "_head_spectra", lambda o: staticmethod(raising_for(
            o, lambda a, *r: a.layer == 0, "spectrum")))
        u2 = replace(cls, "_spectrum_sketches", lambda o: staticmethod(raising_for(
            o, lambda a, *r: a.layer == 2, "packing")))
        return lambda: (u1(), u2())
    run_phase(env, "nr-spectrum", patch_spectrum,
              {"failures": {"spectrum": 1, "pack": 1},
               "disabled": ["attention h.0.", "attention h.2."], "qk": [1],
               "routers": all_layers}, route="spectrum")

    # hook: block 1's router hook raises once, inside the first forward.
    calls = {"n": 0}

    def patch_hook(mon):
        def wrap(orig):
            def add(self, logits, top_k):
                calls["n"] += 1
                if calls["n"] == 2:  # blocks run in order: block 1's router
                    raise RuntimeError("injected hook failure")
                return orig(self, logits, top_k)
            return add
        return replace(sk.TokenStats, "add", wrap)
    run_phase(env, "nr-hook", patch_hook,
              {"failures": {"hook": 1}, "disabled": ["router h.1."], "qk": all_layers,
               "routers": [0, 2]})

    # send: two whole reports (of steps without sketches) cannot be built.
    def patch_send(mon):
        return replace(type(mon), "_materialize", lambda o: raising_for(
            o, lambda self, job: job.step in (5, 7), "report"))
    run_phase(env, "nr-send", patch_send,
              {"failures": {"send": 2}, "disabled": [], "qk": all_layers,
               "routers": all_layers,
               "loss_steps": [s for s in range(1, STEPS + 1) if s not in (5, 7)]})


class BreakingTransport:
    """The real libforeshock client, until broken: then every call raises."""

    def __init__(self, client):
        self.client, self.broken = client, False

    def _call(self, name, *a):
        if self.broken:
            raise OSError(f"injected transport failure in {name}")
        return getattr(self.client, name)(*a)

    def submit(self, rep):
        return self._call("submit", rep)

    def stats(self):
        return self._call("stats")

    def flush(self, t):
        return self._call("flush", t)

    def close(self, t):
        self.client.close(0)  # the real one is always released
        return self._call("close", t)

    def poll_advice(self):
        return self._call("poll_advice")


def phase_transport(env):
    """The daemon dies, then the transport raises from every call."""
    from foreshock._lib import Client
    torch, fs = env.torch, env.foreshock
    daemon = fstest.Daemon(env.args.build_dir, env.workdir, extra=DAEMON_ARGS)
    tr = Trainer(torch, env.tinygpt, seed=3)
    tp = BreakingTransport(Client("127.0.0.1", daemon.ingest_port, "nr-transport",
                                  backoff_max_ms=200))
    with fs.Monitor(tr.model, run="nr-transport", windows=(WINDOW,), every=EVERY,
                    transport=tp) as mon:
        train(mon, tr, 4)
        check(mon.flush(60) == 0, f"acks before the kill: {mon.stats()}")
        daemon.kill()
        train(mon, tr, 4, first=5)            # daemon gone: buffered
        check(mon.flush(0.5) != 0, "flush with the daemon gone reported success")
        tp.broken = True
        train(mon, tr, 4, first=9)            # every transport call raises
        rc = mon.flush(1)
        st = mon.stats()
        mon.step("not a step")                # bad input: counted, not raised
    # __exit__ closed it; a step after close is ignored
    mon.step(13, loss=1.0)
    st2 = mon.close()
    fails = {k: v for k, v in st2["failures"].items() if v}
    check(rc != 0 and "submitted" not in st and st["reports"] == 12,
          f"broken transport: flush {rc}, stats {st}")
    check(fails.get("send", 0) >= 4 + 1 + 1 and fails.get("advice", 0) >= 4 and
          fails.get("step") == 1 and not st2["disabled_modules"],
          f"broken transport: failures {fails}, disabled {st2['disabled_modules']}")
    print(f"  nr-transport: daemon SIGKILLed at step 4, transport raising from step 9: 12 steps "
          f"trained, flush -> {rc}, failures {fails}", flush=True)


def phase_closed(env):
    """Calls after close, and close racing calls on other threads."""
    import threading
    from foreshock._lib import Client
    from foreshock.report import Report
    fs = env.foreshock
    tr = Trainer(env.torch, env.tinygpt, seed=4)
    mon = fs.Monitor(tr.model, endpoint=env.daemon.endpoint, run="nr-closed",
                     windows=(WINDOW,), every=EVERY)
    train(mon, tr, 3)
    st = mon.close(60)
    check(st.get("acked") == 3, f"nr-closed: {st}")
    after = mon.stats()
    rc = mon.flush(1)
    mon.step(4, loss=1.0)
    check(after == st and mon.stats() == st and mon.advice == [],
          f"closed Monitor: stats {after} (close gave {st}), flush {rc}, advice {mon.advice}")
    c = Client("127.0.0.1", env.daemon.ingest_port, "nr-closed-client")
    check(c.close(30) == 0 and c.close() == 0, "a Client closes once, then returns 0")
    got = (c.submit(Report(step=1, time_unix=time.time())), c.flush(1), c.stats(),
           c.poll_advice())
    check(got == (-errno.EBADF, -errno.EBADF, {}, []), f"closed Client: {got}")

    c = Client("127.0.0.1", env.daemon.ingest_port, "nr-close-race")
    results = {"submit": [], "seen": {}, "errors": []}
    closed = threading.Event()

    def hammer(kind):
        """Calls until it sees the Client closed (submit and flush -EBADF,
        stats {}), or, for poll_advice, which cannot tell, until 10 calls
        after close returned."""
        after = 0
        try:
            for i in range(1_000_000):
                if kind == "submit":
                    rep = Report(step=i, time_unix=time.time())
                    rep.scalars["loss"] = 1.0
                    rc = c.submit(rep)
                    results["submit"].append(rc)
                    gone = rc == -errno.EBADF
                elif kind == "stats":
                    gone = c.stats() == {}
                elif kind == "flush":
                    gone = c.flush(0) == -errno.EBADF
                else:
                    c.poll_advice()
                    after += closed.is_set()
                    gone = after > 10
                if gone:
                    results["seen"][kind] = i
                    return
        except Exception as e:  # noqa: BLE001 (the test reports it)
            results["errors"].append(f"{kind}: {e!r}")
    threads = [threading.Thread(target=hammer, args=(k,))
               for k in ("submit", "stats", "flush", "advice")]
    for t in threads:
        t.start()
    fstest.wait_until(lambda: len(results["submit"]) >= 50, timeout=30,
                      what="50 reports submitted before close")
    rc = c.close(30)
    closed.set()
    for t in threads:
        t.join(60)
    codes = results["submit"]
    ok = codes.count(0)
    alive = [k for k, t in zip(("submit", "stats", "flush", "advice"), threads) if t.is_alive()]
    check(not results["errors"] and not alive and len(results["seen"]) == 4,
          f"close racing calls: errors {results['errors']}, still running {alive}, "
          f"saw it closed: {results['seen']}")
    check(ok >= 50 and codes[-1] == -errno.EBADF and codes == [0] * ok + [-errno.EBADF],
          f"close racing submit: {sorted(set(codes))}, {ok} accepted, then not only -EBADF")
    check(rc == 0, f"close racing calls: close {rc}")

    api = env.Api(env.daemon.http)

    def stored():
        pts = [p for k, p in api.values("nr-close-race", prefix="loss").items()
               if k[0] == "loss"]
        return len(pts) == 1 and len(pts[0]) == ok
    fstest.wait_until(stored, timeout=30, what=f"the {ok} accepted reports stored")
    print(f"  nr-closed: calls after close return; close racing 4 threads: {ok} reports "
          f"submitted before it, all acked and stored, the next refused -EBADF", flush=True)


# ---- shards reduced in the trainer, a failure on one rank ----------------------------------

SH_D, SH_H, SH_DH, SH_E = 32, 4, 8, 6


def sharded_worker(argv):
    """One rank of the sharded phase (a subprocess): trains, checks itself."""
    p = argparse.ArgumentParser()
    for k in ("--endpoint", "--source-dir", "--build-dir", "--rendezvous"):
        p.add_argument(k, required=True)
    p.add_argument("--rank", type=int, required=True)
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.join(a.source_dir, "client", "python"))
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(a.build_dir), "libforeshock.so")
    import types
    import torch
    import torch.distributed as dist
    import foreshock
    from foreshock import sketch as sk
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=a.rendezvous, rank=a.rank,
                            world_size=2)
    torch.manual_seed(100 + a.rank)
    cols = SH_D // 2  # this rank's columns of every weight
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for _ in range(2):
        blk = torch.nn.Module()
        blk.self_attn = torch.nn.Module()
        blk.self_attn.q_proj = torch.nn.Linear(cols, SH_H * SH_DH, bias=False)
        blk.self_attn.k_proj = torch.nn.Linear(cols, SH_H * SH_DH, bias=False)
        blk.self_attn.config = types.SimpleNamespace(num_attention_heads=SH_H, head_dim=SH_DH)
        blk.mlp = torch.nn.Module()
        blk.mlp.gate = torch.nn.Linear(cols, SH_E, bias=False)
        blk.mlp.experts = torch.nn.ModuleList()
        blk.mlp.num_experts_per_tok = 2
        model.layers.append(blk)
    mon = foreshock.Monitor(model, endpoint=a.endpoint, run="nr-sharded", rank=a.rank,
                            world_size=2, windows=(WINDOW,), every=EVERY, send_tokens=False,
                            shard_group=dist.group.WORLD, shard_reduce="trainer",
                            local_ranks=False)
    if a.rank == 1:
        bad = model.layers[1].self_attn.q_proj.weight.data_ptr()
        orig = sk.attention_grams

        def grams(wq, *rest):
            if wq.data_ptr() == bad:
                raise RuntimeError("injected Gram failure on rank 1")
            return orig(wq, *rest)
        sk.attention_grams = grams
    for step in range(1, STEPS + 1):
        with torch.no_grad():
            for prm in model.parameters():
                prm.add_(0.01 * torch.randn_like(prm))
        mon.step(step, loss=1.0 / step, grad_norm=1.0, lr=1e-3)
    st = mon.close(60)
    fails = {k: v for k, v in st["failures"].items() if v}
    want = {"sketch": 1} if a.rank == 1 else {}
    dis = list(st["disabled_modules"])
    ok = (fails == want and len(dis) == 1 and "layers.1.self_attn" in dis[0] and
          st["acked"] == STEPS)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {a.rank}: failures {fails}, disabled {st['disabled_modules']}, acked "
          f"{st['acked']}", flush=True)
    return 0 if ok else 1


def phase_sharded(env):
    rdv = fstest.rendezvous(env.workdir, "sharded")
    procs = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(r), "--endpoint",
         env.daemon.endpoint, "--rendezvous", rdv, "--source-dir", env.args.source_dir,
         "--build-dir", env.args.build_dir],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = []
    try:
        for r, pr in enumerate(procs):
            out, _ = pr.communicate(timeout=300)
            outs.append(out)
            check(pr.returncode == 0, f"sharded rank {r} exited {pr.returncode}:\n{out}")
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
    api = env.Api(env.daemon.http)
    wait_stored(api, "nr-sharded", list(range(1, STEPS + 1)), [0], [0, 1], [])
    qk1 = [s for s in api.series("nr-sharded") if s["name"].startswith("qk.") and
           (s.get("labels") or {}).get("layer") == 1]
    check(not qk1, f"nr-sharded: partial Grams of block 1 were stored: {qk1[:2]}")
    norms = layers_with(api, "nr-sharded", "weight_norm")
    check(sorted(norms) == [0, 1] and all(v == QK_STEPS for v in norms.values()),
          f"nr-sharded: weight_norm {norms}")
    print(f"  nr-sharded: 2 gloo ranks, block 1's Grams failing on rank 1 only: both ranks "
          f"trained {STEPS} steps, both dropped block 1; the daemon holds attention [0], "
          f"routers [0, 1], weight_norm of both layers", flush=True)
    for out in outs:
        print("   " + out.strip().splitlines()[-1], flush=True)


# ---- nn.MultiheadAttention with kdim != embed_dim -------------------------------------------

def mha_model(torch, nn):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(embed_dim=32, num_heads=4, kdim=16, vdim=16)
            self.out = nn.Linear(32, 8)

        def forward(self, x, mem):
            y, _ = self.attn(x, mem, mem, need_weights=False)
            return self.out(torch.tanh(y))

    model = nn.Module()
    model.layers = nn.ModuleList([Block()])
    return model


def srank_erank(s):
    s = np.sort(np.asarray(s, dtype=np.float64))[::-1]
    s = s[s > s[0] * len(s) * np.finfo(np.float32).eps * 10]
    p = s / s.sum()
    return math.exp(float(-(p * np.log(p)).sum())), float(s.sum() / s[0])


def phase_mha(env):
    torch, fs = env.torch, env.foreshock
    nn = torch.nn
    H, dh = 4, 8
    for route in ("spectrum", "gram"):
        run = f"nr-mha-{route}"
        torch.manual_seed(7)
        model = mha_model(torch, nn)
        blk = model.layers[0]
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        mon = fs.Monitor(model, endpoint=env.daemon.endpoint, run=run, windows=(WINDOW,),
                         every=EVERY, route=route)
        check(len(mon.attention) == 1 and mon.attention[0].n_heads == H and
              mon.attention[0].head_dim == dh, f"MHA discovered as {mon.attention}")
        weights = {}
        g = torch.Generator().manual_seed(11)
        for i in range(1, STEPS + 1):
            x = torch.randn(6, 3, 32, generator=g)
            mem = torch.randn(5, 3, 16, generator=g)
            loss = (model.layers[0](x, mem) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(i, loss=loss)
            weights[i] = (blk.attn.q_proj_weight.detach().double().numpy().copy(),
                          blk.attn.k_proj_weight.detach().double().numpy().copy())
        st = mon.close(60)
        check(st["acked"] == STEPS and not any(st["failures"].values()),
              f"{run}: {st}")
        api = env.Api(env.daemon.http)
        wait_stored(api, run, list(range(1, STEPS + 1)), [0], [], [])
        vals = {(k[0], k[1], k[2], k[3]): v for k, v in api.values(run).items()
                if k[1] is not None and k[2] is not None}
        worst = 0.0
        for t in QK_STEPS:
            (q1, k1), (q0, k0) = weights[t], weights[t - WINDOW]
            for h in range(H):
                rows = slice(h * dh, (h + 1) * dh)
                d2 = (q1[rows] - q0[rows]).T @ k0[rows] + q0[rows].T @ (k1[rows] - k0[rows])
                check(d2.shape == (32, 16), f"Delta2 is {d2.shape}")
                want = srank_erank(np.linalg.svd(d2, compute_uv=False) ** 2)
                for name, w in zip(("qk.d2.erank", "qk.d2.srank"), want):
                    got = vals.get((name, 0, h, WINDOW), {}).get(t)
                    check(got is not None, f"{run}: no {name} head {h} step {t}: "
                          f"{sorted(k for k in vals if k[0] == name)[:4]}")
                    err = abs(got - w) / abs(w)
                    worst = max(worst, err)
                    check(err < REL_SPEC, f"{run}: {name} head {h} step {t}: {got} vs the "
                          f"float64 SVD's {w}")
        print(f"  {run}: MHA embed 32 / kdim 16, {H} heads: {len(QK_STEPS) * H * 2} per-head "
              f"qk.d2 erank/srank values match the SVD of the 32 x 16 Delta2 (max rel err "
              f"{worst:.1e})", flush=True)


def main(args, workdir):
    for sub in ("", "experiments"):
        sys.path.insert(0, os.path.join(args.source_dir, "client", "python", sub))
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(args.build_dir),
                                               "libforeshock.so")
    import torch
    import foreshock
    import tinygpt
    from fsapi import Api
    torch.set_num_threads(1)
    env = Env(args, workdir, torch, foreshock, tinygpt, Api)
    env.daemon = fstest.Daemon(args.build_dir, workdir, extra=DAEMON_ARGS)
    try:
        phases(env)
        phase_closed(env)
        phase_sharded(env)
        phase_mha(env)
    finally:
        env.daemon.stop()
    phase_transport(env)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(sharded_worker(sys.argv[2:]))
    fstest.preload_sanitizers()
    fstest.run_main(main)
