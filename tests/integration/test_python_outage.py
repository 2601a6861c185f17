"""The PyTorch client when the daemon is away: training never waits.

1. Daemon down at start, then started, then SIGKILLed mid-run and restarted
   on the same address and database: training runs through every phase,
   the client reconnects and resends, and the daemon ends with every step's
   report exactly once (loss points 1..N, every sketch's monitors), none
   dropped.
2. A replay bound too small for the outage: reports beyond it are dropped,
   counted (stats()["dropped"]) and logged; the daemon has exactly the
   reports that fitted (the steps whose submit succeeded), nothing else.
   Which reports are refused depends on their sizes and the bound only:
   after the reconnect the test waits for the acks before the next report
   (flush), so the daemon's speed cannot change the outcome.
"""
import errno
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

STEPS_PER_PHASE = 30



class Trainer:
    """A tiny GPT trained on a small slice of text: real steps, real weights."""

    def __init__(self, torch, tinygpt, seed=0):
        torch.manual_seed(seed)
        data, vocab = tinygpt.load_corpus(max_bytes=1 << 16)
        self.model = tinygpt.TinyGPT(vocab, d=32, n_layer=2, n_head=2, t=16)
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


def wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise fstest.Failure(f"timed out after {timeout}s waiting for {what}")


def loss_steps(api, run):
    series = api.series(run, name="loss")
    check(len(series) == 1, f"{run}: {len(series)} loss series")
    pts = api.points(series[0]["id"])
    return [s for s, _ in pts]



def phase_reconnect(args, workdir, torch, foreshock, tinygpt, Api):
    port, http_port = fstest.free_port(), fstest.free_port()
    db = os.path.join(workdir, "outage.db")
    tr = Trainer(torch, tinygpt)
    mon = foreshock.Monitor(tr.model, endpoint=f"127.0.0.1:{port}", run="outage", windows=(2,),
                            every=2, backoff_max_s=0.2)
    step = 0

    def train(n):
        nonlocal step
        for _ in range(n):
            step += 1
            loss, gn = tr.step(step)
            t0 = time.perf_counter()
            mon.step(step, loss=loss, grad_norm=gn, lr=1e-3)
            check(time.perf_counter() - t0 < 5.0, "monitor.step blocked")

    train(STEPS_PER_PHASE)  # no daemon yet
    # The sender thread hands reports over in its own time: wait for the
    # count (a fixed flush timeout would depend on the machine's load).
    wait_for(lambda: mon.stats()["buffered_reports"] == STEPS_PER_PHASE, 60,
             f"{STEPS_PER_PHASE} reports buffered while the daemon is down")
    st = mon.stats()
    check(st["connected"] == 0 and st["buffered_reports"] == STEPS_PER_PHASE and
          st["dropped"] == 0, f"daemon down: {st}")
    daemon = fstest.Daemon(args.build_dir, workdir, ingest_port=port, http_port=http_port, db=db)
    train(STEPS_PER_PHASE)
    wait_for(lambda: mon.stats()["acked"] == step, 60, "acks after the daemon started")
    daemon.kill()  # SIGKILL mid-run
    train(STEPS_PER_PHASE)
    daemon = fstest.Daemon(args.build_dir, workdir, ingest_port=port, http_port=http_port, db=db)
    train(STEPS_PER_PHASE)
    st = mon.close(60)
    check(st["reports"] == step and st["submitted"] == step and st["acked"] == step and
          st["dropped"] == 0 and st["dropped_queue"] == 0 and st["reconnects"] >= 1,
          f"after the outages: {st}")
    api = Api(daemon.http)
    steps = loss_steps(api, "outage")
    check(steps == list(range(1, step + 1)), f"loss points: {len(steps)}, expected 1..{step}")
    # Sketch steps 4, 6, ..., N (base step 2 is the first snapshot): their
    # monitors are computed once the spool is re-fed after the kill.
    want = list(range(4, step + 1, 2))

    def sketches_done():
        s = api.series("outage", name="qk.d2.erank.min", layer=1, window=2)
        return s and [p for p, v in api.points(s[0]["id"]) if v is not None] == want
    wait_for(sketches_done, 60, "per-layer qk.d2.erank.min at every sketch step")
    daemon.stop()
    print(f"  reconnect: {step} steps through down/up/SIGKILL/restart, {st['acked']} acked, "
          f"{st['reconnects']} reconnects, {st['resent']} resent, 0 dropped; "
          f"loss points 1..{step} and {len(want)} sketch steps in the daemon", flush=True)


class RecordingClient:
    """libforeshock client that remembers which steps were accepted."""

    def __init__(self, client):
        self.client, self.rc = client, {}

    def submit(self, rep):
        rc = self.client.submit(rep)
        self.rc[rep.step] = rc
        return rc

    def stats(self):
        return self.client.stats()

    def flush(self, t):
        return self.client.flush(t)

    def close(self, t):
        return self.client.close(t)


def phase_overflow(args, workdir, torch, foreshock, tinygpt, Api):
    from foreshock._lib import MIN_REPLAY_BYTES, Client
    port, http_port = fstest.free_port(), fstest.free_port()
    tr = Trainer(torch, tinygpt, seed=1)
    client = RecordingClient(Client("127.0.0.1", port, "overflow",
                                    replay_max_bytes=MIN_REPLAY_BYTES, backoff_max_ms=200))
    cap = fstest.CapturedWarnings()
    logging.getLogger("foreshock").addHandler(cap)
    # Every step carries 4 head sketches (dh 16: ~4 KiB each): the 64 KiB
    # bound holds a few steps of a daemon outage.
    mon = foreshock.Monitor(tr.model, run="overflow", windows=(1,), every=1, transport=client)
    for i in range(1, 41):
        loss, gn = tr.step(i)
        mon.step(i, loss=loss, grad_norm=gn)
    wait_for(lambda: len(client.rc) == 40, 60, "40 reports handed to libforeshock")
    st = mon.stats()
    dropped_down = st["dropped"]
    check(dropped_down > 0 and st["connected"] == 0, f"small buffer, daemon down: {st}")
    # The sender thread logs right after it counts: wait for it, not a time.
    wait_for(lambda: any("dropped" in m for m in cap.messages), 30, "the drop to be logged")
    daemon = fstest.Daemon(args.build_dir, workdir, ingest_port=port, http_port=http_port,
                           db=os.path.join(workdir, "overflow.db"))
    wait_for(lambda: mon.stats()["connected"], 30, "the client to connect")
    # What is refused must depend on counts only, never on how fast the
    # daemon acks (under ASan and a loaded machine the resent backlog can
    # still fill the bound when the next steps come): the backlog is resent
    # and acknowledged first, then each further step's single report goes
    # into an empty buffer and is acknowledged before the next.
    rc = mon.flush(60)
    st = mon.stats()
    check(rc == 0 and st["buffered_reports"] == 0, f"backlog not acknowledged: {rc} {st}")
    for i in range(41, 61):
        loss, gn = tr.step(i)
        mon.step(i, loss=loss, grad_norm=gn)
        rc = mon.flush(60)
        check(rc == 0, f"step {i} not acknowledged: {rc} {mon.stats()}")
    st = mon.close(60)
    logging.getLogger("foreshock").removeHandler(cap)
    accepted = sorted(s for s, rc in client.rc.items() if rc == 0)
    refused = sorted(s for s, rc in client.rc.items() if rc != 0)
    check(all(client.rc[s] == -errno.ENOBUFS for s in refused), "refusals other than ENOBUFS")
    check(len(client.rc) == 60 and st["reports"] == 60, f"reports made: {len(client.rc)}")
    check(st["dropped"] == len(refused) and st["submitted"] == len(accepted) and
          st["acked"] == len(accepted) and st["dropped_submit"] == len(refused),
          f"counts: {st} vs {len(accepted)} accepted, {len(refused)} refused")
    check(all(s <= 40 for s in refused), f"reports refused after reconnecting: {refused}")
    steps = loss_steps(Api(daemon.http), "overflow")
    check(steps == accepted, f"daemon has steps {steps}, accepted {accepted}")
    daemon.stop()
    print(f"  overflow: 64 KiB replay bound, 40 steps with the daemon down: {len(refused)} "
          f"dropped and counted, {len(accepted)} accepted and all in the daemon", flush=True)


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
    phase_reconnect(args, workdir, torch, foreshock, tinygpt, Api)
    phase_overflow(args, workdir, torch, foreshock, tinygpt, Api)


if __name__ == "__main__":
    fstest.preload_sanitizers()
    fstest.run_main(main)
