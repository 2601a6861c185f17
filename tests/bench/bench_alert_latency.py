"""End-to-end alert latency: from the frame that completes a breaching step to
the alert being visible over HTTP, with N simulated ranks (default 64).

Each rank holds a slice of the model dimension d and sends, per sketched step,
partial Gram shards (docs/monitors.md 1.1) of 1 layer x 4 heads over its own raw
protocol connection. ~30 healthy steps build the baseline (warm-up is 20
samples); then the update collapses to rank one per side, and the 3rd breaching
step (persistence 3) fires qk.d2.erank. The clock starts right before the last
rank's frame of that step is sent (ranks 0..N-2 are already acked, the
reduction waits only for that shard) and stops when GET /api/v1/alerts shows
the firing alert. Same-run references: the bare HTTP round trip of that query
and the ack round trip of one small report.

    /usr/bin/python3 tests/bench/bench_alert_latency.py --build-dir build [--repeats 5] [--ranks 64]

Prints min/median/max latency in ms and the ratios to the references; exits 1
with a message when nothing fires within 30 s or the daemon fails.
"""
import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from fstest import Daemon, Failure, RawConn, hello, proto_module, report  # noqa: E402

LAYERS = 1
HEADS = 4
DH = 16
N = 2 * DH
COLS_PER_RANK = 4
WINDOW = 5
HEALTHY_STEPS = 30
BREACH_STEPS = 3              # persistence of the qk.d2 rules
ALERT_TIMEOUT_S = 30.0
EVAL_TIMEOUT_S = 60.0
REF_SAMPLES = 200
RULES = {"qk.d2.erank", "qk.d2.entropy", "qk.d2.srank"}
TRIU = np.triu_indices(N)     # row-major upper triangle


def tri(g):
    """Upper triangle, row-major, float32 little-endian bytes."""
    return g[TRIU].astype("<f4").tobytes()


class Model:
    """Base Q/K weights of every head, fixed for a run; per step an update
    that is full rank (healthy) or rank one per side (breaching)."""

    def __init__(self, rng, d):
        self.rng = rng
        self.d = d
        self.wq = [rng.standard_normal((DH, d)) for _ in range(HEADS)]
        self.wk = [rng.standard_normal((DH, d)) for _ in range(HEADS)]

    def step_grams(self, breaching, ranks):
        """[rank][head] -> (ga bytes, gb bytes) for one step."""
        out = [[None] * HEADS for _ in range(ranks)]
        for h in range(HEADS):
            if breaching:
                dwq = np.outer(self.rng.standard_normal(DH), self.rng.standard_normal(self.d))
                dwk = np.outer(self.rng.standard_normal(DH), self.rng.standard_normal(self.d))
            else:
                dwq = self.rng.standard_normal((DH, self.d))
                dwk = self.rng.standard_normal((DH, self.d))
            a = np.vstack([dwq, self.wq[h]])
            b = np.vstack([self.wk[h], dwk])
            for r in range(ranks):
                c = slice(r * COLS_PER_RANK, (r + 1) * COLS_PER_RANK)
                ar, br = a[:, c], b[:, c]
                out[r][h] = (tri(ar @ ar.T), tri(br @ br.T))
        return out


def report_frame(pb, seq, step, rank, ranks, grams):
    f = pb.Frame()
    r = f.report
    r.seq, r.step = seq, step
    for h, (ga, gb) in enumerate(grams):
        s = r.attention.add()
        s.layer, s.head, s.window = 0, h, WINDOW
        s.gram.dh = DH
        s.gram.shard_index, s.gram.shard_count = rank, ranks
        s.gram.ga, s.gram.gb = ga, gb
    return f


def expect_ack(conn, seq, who):
    f = conn.recv()
    if f is None or f.WhichOneof("body") != "ack" or f.ack.seq != seq:
        raise Failure(f"{who}: expected Ack {seq}, got {f}")


class Http:
    """One keep-alive HTTP/1.1 connection to the daemon."""

    def __init__(self, port):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def get(self, path):
        self.conn.request("GET", path)
        resp = self.conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise Failure(f"GET {path}: status {resp.status}: {body[:300]!r}")
        return json.loads(body)

    def close(self):
        self.conn.close()


def series_last_step(hc, run):
    ser = hc.get(f"/api/v1/series?run={run}&name=qk.d2.erank.min")["series"]
    return max((s["last_step"] for s in ser if s["last_step"] is not None), default=-1)


def wait_evaluated(hc, daemon, run, step):
    deadline = time.monotonic() + EVAL_TIMEOUT_S
    while time.monotonic() < deadline:
        if series_last_step(hc, run) >= step:
            return
        time.sleep(0.02)
    raise Failure(f"run {run}: step {step} not evaluated within {EVAL_TIMEOUT_S}s\n"
                  + daemon.log_text()[-3000:])


def firing(doc):
    return [a for a in doc["alerts"] if a["rule"] in RULES and a["state"] == "firing"]


def measure_once(pb, daemon, hc, run, ranks, seed):
    """One run: healthy baseline, two breaching steps, then the timed one.
    Returns latency in seconds."""
    rng = np.random.default_rng(seed)
    model = Model(rng, ranks * COLS_PER_RANK)
    conns = []
    try:
        for r in range(ranks):
            c = RawConn(pb, daemon.ingest_port)
            c.send(hello(pb, run, rank=r, world=ranks))
            w = c.recv()
            if w is None or w.WhichOneof("body") != "welcome":
                raise Failure(f"rank {r}: expected Welcome, got {w}")
            conns.append(c)

        def send_step(k, breaching, upto=None):
            grams = model.step_grams(breaching, ranks)
            frames = [report_frame(pb, k, k * WINDOW, r, ranks, grams[r]) for r in range(ranks)]
            last = ranks if upto is None else upto
            for r in range(last):
                conns[r].send(frames[r])
            for r in range(last):
                expect_ack(conns[r], k, f"rank {r}")
            return frames

        for k in range(1, HEALTHY_STEPS + 1):
            send_step(k, False)
        wait_evaluated(hc, daemon, run, HEALTHY_STEPS * WINDOW)
        for k in range(HEALTHY_STEPS + 1, HEALTHY_STEPS + BREACH_STEPS):
            send_step(k, True)
        # the preceding breaching steps must be processed before the clock starts
        wait_evaluated(hc, daemon, run, (HEALTHY_STEPS + BREACH_STEPS - 1) * WINDOW)
        query = f"/api/v1/alerts?run={run}&state=firing"
        if firing(hc.get(query)):
            raise Failure(f"run {run}: alert fired before the last breaching step")
        k = HEALTHY_STEPS + BREACH_STEPS
        frames = send_step(k, True, upto=ranks - 1)
        last_conn, last_frame = conns[ranks - 1], frames[ranks - 1]
        t0 = time.perf_counter()
        last_conn.send(last_frame)
        deadline = t0 + ALERT_TIMEOUT_S
        while True:
            doc = hc.get(query)
            t1 = time.perf_counter()
            got = firing(doc)
            if got:
                break
            if t1 > deadline:
                raise Failure(f"run {run}: no qk.d2 alert within {ALERT_TIMEOUT_S}s of the "
                              f"completing frame (step {k * WINDOW})\n" + daemon.log_text()[-3000:])
        expect_ack(last_conn, k, f"rank {ranks - 1}")
        if got[0]["evidence"].get("fired_step") not in (None, k * WINDOW):
            raise Failure(f"run {run}: alert fired at an unexpected step: {got[0]}")
        return t1 - t0
    finally:
        for c in conns:
            c.close()


def http_rtt(hc, query):
    ts = []
    for _ in range(REF_SAMPLES):
        t = time.perf_counter()
        hc.get(query)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def ack_rtt(pb, daemon, run):
    c = RawConn(pb, daemon.ingest_port)
    try:
        c.send(hello(pb, run, rank=0, world=1))
        w = c.recv()
        if w is None or w.WhichOneof("body") != "welcome":
            raise Failure(f"ack reference: expected Welcome, got {w}")
        ts = []
        for seq in range(1, REF_SAMPLES + 1):
            f = report(pb, seq, seq)
            t = time.perf_counter()
            c.send(f)
            expect_ack(c, seq, "ack reference")
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)
    finally:
        c.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build-dir", default="build")
    p.add_argument("--source-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                        "..", ".."))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ranks", type=int, default=64)
    args = p.parse_args()
    if args.repeats < 1 or args.ranks < 1:
        print("bench_alert_latency: --repeats and --ranks must be >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="foreshock-lat-") as workdir:
        daemon = None
        try:
            pb = proto_module(args.source_dir, workdir)
            daemon = Daemon(args.build_dir, workdir)
            hc = Http(daemon.http_port)
            tag = int(time.time())
            lats = []
            for i in range(args.repeats):
                run = f"lat-{tag}-{i}"
                lat = measure_once(pb, daemon, hc, run, args.ranks, seed=1000 + i)
                lats.append(lat)
                print(f"repeat {i}: run={run} latency={lat * 1e3:.2f} ms", flush=True)
            h = http_rtt(hc, f"/api/v1/alerts?run=lat-{tag}-{args.repeats - 1}&state=firing")
            a = ack_rtt(pb, daemon, f"lat-{tag}-ackref")
            hc.close()
            med = statistics.median(lats)
            print(f"alert latency ({args.ranks} ranks, {LAYERS} layer x {HEADS} heads, dh={DH}, "
                  f"{args.repeats} repeats): min {min(lats) * 1e3:.2f} ms  median {med * 1e3:.2f} ms"
                  f"  max {max(lats) * 1e3:.2f} ms")
            print(f"reference: http rtt {h * 1e3:.3f} ms, ack rtt {a * 1e3:.3f} ms "
                  f"(median of {REF_SAMPLES})")
            print(f"ratio: latency/http_rtt {med / h:.1f}x  latency/ack_rtt {med / a:.1f}x")
        except (Failure, OSError) as e:
            print(f"bench_alert_latency: FAIL: {e}", flush=True)
            return 1
        finally:
            if daemon is not None:
                rc = daemon.stop()
                if rc != 0:
                    print(f"bench_alert_latency: FAIL: daemon exited {rc}:\n"
                          f"{daemon.log_text()[-3000:]}", flush=True)
                    return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
