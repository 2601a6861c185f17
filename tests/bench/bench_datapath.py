"""Data path under a 7B-like Gram-route load: how short a trainer step the
daemon sustains when every rank sends the full attention Gram shards, what
each commit costs, how large the database grows, and how long a new
trainer waits for its Welcome meanwhile.

Load: R ranks (default 8) of one run, each on its own raw protocol
connection, one report per step on a fixed schedule (step time T): every
K-th step (--sketch-every, default 1) carries Gram shards of L layers x H
heads at dh (default 32 x 7 heads, dh 128, shard i of R: 59 MB per rank,
the largest 7B-like shape under the default 64 MiB max_frame_bytes); the
others carry scalars. With --split-heads the heads are split over the
ranks instead, as tensor parallelism does (`foreshock simulate
--split-heads`): each rank sends whole Grams (all of d, shard 0 of 1) of
its block of H/R query heads of every layer, so the full 7B shape fits
(--heads 32 --kv-heads 8: 4 heads x 32 layers, 34 MB per rank). The
frames are built once with numpy (real Grams of random weights, so the
monitor math does its usual work) and only seq/step change, so the
senders cost next to no CPU and the daemon is what is measured. A sender that cannot write its report by the next report's due
time is "behind" (a real trainer's replay buffer would be dropping).

Each step time in --step-times runs on a fresh daemon and database. The
daemon sustains T when no sender fell behind, every sketch step was
evaluated, none incomplete, and the evaluation finished within one sketch
interval (K x T) of the last Ack. Printed per T: commits (count, mean and
worst latency from /metrics), database bytes (file + WAL) and spool bytes
at the end, daemon RSS peak, the evaluation lag, and Hello -> Welcome
latency of probe connections opened every --probe-every seconds during the
load (fair admission: a new trainer is answered within 1 s while ingest is
saturated), with how many of them took longer than 1 s. The probe runs in
this process beside the senders, so on a loaded host its figure includes
its own scheduling delay.

Reference, same run and directory: writing one sketch step's bytes (R
frames) to a file with the daemon's sync policy (write + fdatasync for
synchronous=full, write only for normal), the floor of any durable spool.

    /usr/bin/python3 tests/bench/bench_datapath.py --build-dir build \
        [--step-times 4,2,1] [--steps 20] [--sketch-every 1] [--ranks 8] \
        [--layers 32] [--heads 7] [--dh 128] [--d 4096] [--sync normal] \
        [--split-heads --heads 32 --kv-heads 8] \
        [--foreshockd PATH]   # another daemon binary (e.g. a baseline build)

Exits 1 only when something does not work (the daemon dies, a Welcome
never comes); a step time that is not sustained is a result, not a failure.
"""
import argparse
import os
import re
import statistics
import struct
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from fstest import Daemon, Failure, RawConn, hello, proto_module  # noqa: E402

RUN = "datapath"
ACK_TIMEOUT_S = 600.0      # after the last send, for the last Ack
EVAL_TIMEOUT_S = 900.0     # after the last Ack, for the last sketch step's monitors
SAMPLE_S = 0.25            # /metrics and RSS sampling period
WELCOME_TIMEOUT_S = 120.0  # a probe that waits longer is reported as such


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def rank_heads(a, rank):
    """--split-heads: the query heads [h0, h1) of every layer `rank` holds,
    contiguous blocks as `foreshock simulate` makes them (sim_rank_heads)."""
    h0 = min(a.heads, (rank * a.heads + a.ranks - 1) // a.ranks)
    h1 = min(a.heads, ((rank + 1) * a.heads + a.ranks - 1) // a.ranks)
    return h0, h1


def build_sketches(pb, a):
    """Per rank: the serialized `attention` entries of one report (field 5
    of Report, so they concatenate with a scalars-only Report)."""
    rng = np.random.default_rng(1)
    n = 2 * a.dh
    iu = np.triu_indices(n)  # row-major upper triangle
    cols = a.d if a.split_heads else a.d // a.ranks
    group = a.heads // a.kv_heads if a.kv_heads else 1
    # A few distinct weight shards, reused across heads: building 224
    # distinct Grams per rank would take longer than the run.
    grams = []
    for _ in range(4):
        xa = rng.standard_normal((n, cols)).astype(np.float32)
        xb = xa + 0.01 * rng.standard_normal((n, cols)).astype(np.float32)
        grams.append(((xa @ xa.T)[iu].astype("<f4").tobytes(),
                      (xb @ xb.T)[iu].astype("<f4").tobytes()))
    out = []
    for rank in range(a.ranks):
        r = pb.Report()
        r.seq = 0
        r.step = 0
        h0, h1 = rank_heads(a, rank) if a.split_heads else (0, a.heads)
        for layer in range(a.layers):
            for head in range(h0, h1):
                s = r.attention.add()
                s.layer, s.head, s.window = layer, head, 1
                if a.kv_heads:
                    s.kv_head = head // group
                ga, gb = grams[(layer * a.heads + head) % len(grams)]
                s.gram.dh = a.dh
                s.gram.shard_index = 0 if a.split_heads else rank
                s.gram.shard_count = 1 if a.split_heads else a.ranks
                s.gram.ga = ga
                s.gram.gb = gb
        body = r.SerializeToString()
        # Drop the seq/step fields serialized first (required in proto2):
        # keep the attention entries only (field 5, wire type 2: tag 0x2a).
        out.append(body[body.index(b"\x2a"):])
    return out


def frame(pb, seq, step, rank, sketch):
    """The frame as buffers to send in order (the sketch part is not copied)."""
    r = pb.Report()
    r.seq = seq
    r.step = step
    r.time_unix = time.time()
    r.scalars.loss = 2.0 + 1.0 / (1 + step)
    r.scalars.grad_norm = 1.0
    head = r.SerializeToString()
    n = len(head) + (len(sketch) if sketch else 0)
    body_len = 1 + len(varint(n)) + n
    # Frame.report = 3, wire type 2
    first = struct.pack(">I", body_len) + b"\x1a" + varint(n) + head
    return [first, sketch] if sketch else [first]


def send_buffers(sock, bufs):
    """sendall over several buffers without joining them."""
    views = [memoryview(b) for b in bufs]
    while views:
        k = sock.sendmsg(views)
        while k > 0:
            if k >= len(views[0]):
                k -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][k:]
                k = 0


def metrics(d):
    with urllib.request.urlopen(d.url("/metrics"), timeout=30) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r"^(foreshock_[a-z_]+)(\{[^}]*\})? (\S+)$", text, re.M):
        if m.group(2) and 'le="' in m.group(2):
            out[m.group(1) + m.group(2)] = float(m.group(3))
        else:
            out[m.group(1)] = float(m.group(3))
    return out


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))
    except OSError:
        return 0


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


class Rank:
    """One rank's connection: a sender on a schedule and an Ack reader."""

    def __init__(self, pb, d, a, rank, sketch):
        self.pb, self.a, self.rank, self.sketch = pb, a, rank, sketch
        self.conn = RawConn(pb, d.ingest_port, timeout=WELCOME_TIMEOUT_S)
        h = hello(pb, RUN, rank=rank, world=a.ranks)
        h.hello.model.n_layers = a.layers
        h.hello.model.n_heads = a.heads
        if a.kv_heads:
            h.hello.model.n_kv_heads = a.kv_heads
        h.hello.detect_from_step = 1 << 40  # the math runs; nothing is detected
        self.conn.send(h)
        w = self.conn.recv()
        if w is None or not w.HasField("welcome"):
            raise Failure(f"rank {rank}: no Welcome: {w}")
        self.conn.sock.settimeout(None)
        self.acked = 0
        self.behind = 0       # reports written after the next one was due
        self.worst_late = 0.0
        self.error = None
        self.reader = threading.Thread(target=self.read_acks, daemon=True)
        self.reader.start()

    def read_acks(self):
        try:
            while True:
                f = self.conn.recv()
                if f is None:
                    return
                if f.HasField("ack"):
                    self.acked = max(self.acked, f.ack.seq)
                elif f.HasField("error"):
                    self.error = f.error.message
                    return
        except OSError:
            return

    def send_all(self, t0):
        a = self.a
        for step in range(a.steps):
            due = t0 + step * a.step_time
            now = time.monotonic()
            if now < due:
                time.sleep(due - now)
            sk = self.sketch if step % a.sketch_every == 0 else None
            send_buffers(self.conn.sock, frame(self.pb, step + 1, step, self.rank, sk))
            late = time.monotonic() - (due + a.step_time)
            if late > 0:
                self.behind += 1
                self.worst_late = max(self.worst_late, late)


def probe_welcome(pb, d, n):
    """Hello of a new trainer; seconds until its Welcome (None: none came)."""
    c = RawConn(pb, d.ingest_port, timeout=WELCOME_TIMEOUT_S)
    try:
        t0 = time.monotonic()
        c.send(hello(pb, f"probe-{n}", rank=0, world=1))
        f = c.recv()
        dt = time.monotonic() - t0
        bye = pb.Frame()
        bye.bye.reason = "probe"
        c.send(bye)
        return dt if f is not None and f.HasField("welcome") else None
    except OSError:
        return None
    finally:
        c.close()


def disk_floor(dirpath, nbytes, sync):
    """Seconds to write nbytes to a new file in dirpath with the sync policy."""
    buf = np.random.default_rng(2).bytes(1 << 24)
    path = os.path.join(dirpath, "floor.bin")
    t0 = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[:min(left, len(buf))])
        if sync == "full":
            os.fdatasync(fd)
    finally:
        os.close(fd)
    dt = time.monotonic() - t0
    os.unlink(path)
    return dt


def trial(pb, a, T, sketches, workdir):
    a.step_time = T
    wd = tempfile.mkdtemp(prefix=f"T{T:g}-", dir=workdir)
    extra = ["--set", f"synchronous={a.sync}", "--set", "max_frame_bytes=64M"]
    d = Daemon(a.build_dir if not a.foreshockd else os.path.dirname(a.foreshockd), wd,
               extra=extra)
    res = {"T": T}
    stop = threading.Event()
    samples = []
    probes = []

    def sampler():
        while not stop.is_set():
            try:
                m = metrics(d)
            except OSError:
                m = None
            if m is not None:
                samples.append((time.monotonic(), m, rss_kib(d.pid)))
            stop.wait(SAMPLE_S)

    def prober():
        n = 0
        while not stop.wait(a.probe_every):
            n += 1
            probes.append(probe_welcome(pb, d, n))

    try:
        ranks = [Rank(pb, d, a, r, sketches[r]) for r in range(a.ranks)]
        ts = threading.Thread(target=sampler, daemon=True)
        tp = threading.Thread(target=prober, daemon=True)
        ts.start()
        tp.start()
        t0 = time.monotonic() + 0.5
        senders = [threading.Thread(target=r.send_all, args=(t0,)) for r in ranks]
        for s in senders:
            s.start()
        for s in senders:
            s.join()
        t_sent = time.monotonic()
        deadline = t_sent + ACK_TIMEOUT_S
        while time.monotonic() < deadline and any(r.acked < a.steps for r in ranks):
            if any(r.error for r in ranks):
                break
            time.sleep(0.05)
        t_acked = time.monotonic()
        want = (a.steps - 1) // a.sketch_every + 1
        deadline = t_acked + EVAL_TIMEOUT_S
        m = metrics(d)
        while m["foreshock_monitor_buckets_total"] < want and time.monotonic() < deadline:
            time.sleep(0.1)
            m = metrics(d)
        t_eval = time.monotonic()
        stop.set()
        ts.join()
        tp.join(timeout=WELCOME_TIMEOUT_S)
        m = metrics(d)
        res.update(
            acked=sum(r.acked for r in ranks), sent=a.ranks * a.steps,
            errors=[r.error for r in ranks if r.error],
            behind=sum(r.behind for r in ranks), worst_late=max(r.worst_late for r in ranks),
            buckets=int(m["foreshock_monitor_buckets_total"]), want=want,
            incomplete=int(m["foreshock_incomplete_steps_total"]),
            drain=t_eval - t_acked, ack_wait=t_acked - t_sent,
            commits=int(m["foreshock_commits_total"]),
            commit_mean=m["foreshock_commit_duration_seconds_sum"] /
            max(1, m["foreshock_commit_duration_seconds_count"]),
            commit_over_05=int(m["foreshock_commit_duration_seconds_count"] -
                               m['foreshock_commit_duration_seconds_bucket{le="0.5"}']),
            pauses=int(m["foreshock_backpressure_pauses_total"]),
            rss_peak=max((s[2] for s in samples), default=0),
            math=m.get("foreshock_monitor_seconds_total", 0) / max(1, m["foreshock_monitor_buckets_total"]),
            probes=probes)
        lag = 0
        for _, sm, _ in samples:  # committed steps minus evaluated sketch steps
            committed = sm["foreshock_reports_committed_total"] / a.ranks
            evaluated = sm["foreshock_monitor_buckets_total"] * a.sketch_every
            lag = max(lag, committed - evaluated)
        res["lag_steps"] = lag
        for r in ranks:
            r.conn.close()
        res["stop_rc"] = d.stop(timeout=300)
        res["db_bytes"] = sum(os.path.getsize(p) for p in (d.db, d.db + "-wal")
                              if os.path.exists(p))
        res["spool_dir_bytes"] = dir_bytes(d.db + ".spool") if os.path.isdir(
            d.db + ".spool") else 0
    finally:
        stop.set()
        if d.proc.poll() is None:
            d.kill()
    ok_probes = [p for p in res.get("probes", []) if p is not None]
    res["sustained"] = (res.get("behind", 1) == 0 and res.get("incomplete", 1) == 0 and
                        res.get("buckets") == res.get("want") and
                        res.get("acked") == res.get("sent") and
                        res.get("drain", 1e9) <= a.sketch_every * T)
    res["probe_max"] = max(ok_probes, default=float("nan"))
    res["probe_median"] = statistics.median(ok_probes) if ok_probes else float("nan")
    res["probe_missing"] = len(res.get("probes", [])) - len(ok_probes)
    res["probe_over_1s"] = sum(p > 1.0 for p in ok_probes)
    res["probe_n"] = len(ok_probes)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--source-dir", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    ap.add_argument("--foreshockd", help="daemon binary (default BUILD/foreshockd)")
    ap.add_argument("--step-times", default="4,2,1")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sketch-every", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=7)
    ap.add_argument("--dh", type=int, default=128)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--kv-heads", type=int, default=0,
                    help="key heads per layer (GQA), dividing --heads (default: --heads)")
    ap.add_argument("--split-heads", action="store_true",
                    help="each rank sends whole Grams of its block of heads, not a d-shard "
                    "of every head")
    ap.add_argument("--sync", choices=("normal", "full"), default="normal")
    ap.add_argument("--probe-every", type=float, default=2.0)
    a = ap.parse_args()
    if a.kv_heads and a.heads % a.kv_heads:
        raise SystemExit("--kv-heads must divide --heads")
    if a.foreshockd and os.path.basename(a.foreshockd) != "foreshockd":
        raise SystemExit("--foreshockd must name a file called foreshockd")
    with tempfile.TemporaryDirectory(prefix="foreshock-datapath-") as workdir:
        pb = proto_module(a.source_dir, workdir)
        t0 = time.monotonic()
        sketches = build_sketches(pb, a)
        frame_mb = (len(sketches[0]) + 64) / 1e6
        step_mb = sum(len(sk) + 64 for sk in sketches) / 1e6
        split = (f"heads split over the ranks ({a.layers} x {len(range(*rank_heads(a, 0)))} "
                 f"whole heads per rank)" if a.split_heads else "d split over the ranks")
        print(f"datapath: {a.ranks} ranks x {a.layers} layers x {a.heads} heads"
              f"{f' ({a.kv_heads} KV)' if a.kv_heads else ''}, dh {a.dh}, d {a.d}, {split}: "
              f"{frame_mb:.1f} MB per rank per sketch step, {a.layers * a.heads} heads per "
              f"sketch step, sketches every {a.sketch_every} steps, {a.steps} steps, "
              f"synchronous={a.sync} (frames built in {time.monotonic() - t0:.1f} s; load "
              f"average {os.getloadavg()[0]:.1f})")
        floor = disk_floor(workdir, int(step_mb * 1e6), a.sync)
        print(f"reference: one sketch step ({step_mb:.0f} MB) written to a file "
              f"in the same directory ({'write+fdatasync' if a.sync == 'full' else 'write'}): "
              f"{floor:.3f} s")
        print("| step time | sustained | behind | evaluated | incomplete | drain after last ack "
              "| commits | commit mean | commits > 0.5 s | pauses | DB file | spool dir | RSS peak "
              "| lag (steps) | Welcome median / max (> 1 s of n) | worker s per sketch step "
              "| floor / step time | load average |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for T in [float(x) for x in a.step_times.split(",")]:
            r = trial(pb, a, T, sketches, workdir)
            print(f"| {T:g} s | {'yes' if r['sustained'] else 'no'} | {r['behind']} "
                  f"(worst {r['worst_late']:.1f} s) | {r['buckets']}/{r['want']} | "
                  f"{r['incomplete']} | {r['drain']:.1f} s | {r['commits']} | "
                  f"{r['commit_mean'] * 1e3:.0f} ms | {r['commit_over_05']} | {r['pauses']} | "
                  f"{r['db_bytes'] / 1e6:.1f} MB | {r['spool_dir_bytes'] / 1e6:.1f} MB | "
                  f"{r['rss_peak'] / 1024:.0f} MB | {r['lag_steps']:.0f} | "
                  f"{r['probe_median'] * 1e3:.0f} / {r['probe_max'] * 1e3:.0f} ms "
                  f"({r['probe_over_1s']} of {r['probe_n']})"
                  f"{' (' + str(r['probe_missing']) + ' none)' if r['probe_missing'] else ''} | "
                  f"{r['math']:.2f} | {floor / T:.3f} | {os.getloadavg()[0]:.1f} |", flush=True)
            if r["errors"] or r["stop_rc"] != 0:
                print(f"  errors: {r['errors']}, daemon exit {r['stop_rc']}")
                sys.exit(1)


if __name__ == "__main__":
    main()
