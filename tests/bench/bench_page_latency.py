"""Paging latency: from sending the report that fires an alert to the page
arriving at a webhook receiver, through the durable outbox (decode, monitor
stage, writer commit of the transition and its outbox row, pager wakeup,
libcurl POST).

Each repeat streams a fresh run: 5 normal reports (acked), then one with a
NaN loss (the non-finite rule fires at once). The clock starts right before
that frame is sent and stops when the receiver (an HTTP server in this
process, on loopback) records the page. Same-run references: the Ack round
trip of one report (receipt -> commit -> Ack) plus a bare HTTP POST round
trip from this process to the same receiver.

    /usr/bin/python3 tests/bench/bench_page_latency.py --build-dir build [--repeats 20]

Prints min/median/max in ms and the ratio of the median to the reference.
"""
import argparse
import http.client
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from fstest import Daemon, Failure, RawConn, Receiver, hello, proto_module, report  # noqa: E402

PAGE_TIMEOUT_S = 30.0
REF_SAMPLES = 200
CONFIG = """
[target "hook"]
type = webhook
url = {url}/hook
"""


def wait_ack(c, seq):
    while True:
        f = c.recv()
        if f is None:
            raise Failure("connection closed before the Ack")
        if f.HasField("ack") and f.ack.seq >= seq:
            return


def ack_rtt(pb, d):
    """Median round trip of one small report to its Ack (commit included)."""
    c = RawConn(pb, d.ingest_port)
    out = []
    try:
        c.send(hello(pb, "ack-ref"))
        c.recv()
        for i in range(REF_SAMPLES):
            t0 = time.perf_counter()
            c.send(report(pb, i + 1, i, loss=0.5))
            wait_ack(c, i + 1)
            out.append(time.perf_counter() - t0)
    finally:
        c.close()
    return statistics.median(out)


def fire_once(pb, d, rx, run):
    """Streams 5 normal reports and a NaN one; returns seconds from sending
    the NaN report to the page's arrival."""
    c = RawConn(pb, d.ingest_port)
    try:
        c.send(hello(pb, run))
        w = c.recv()
        if w is None or not w.HasField("welcome"):
            raise Failure(f"no Welcome: {w}")
        for i in range(5):
            c.send(report(pb, i + 1, i, loss=0.5))
        wait_ack(c, 5)
        t0 = time.time()
        c.send(report(pb, 6, 5, loss=float("nan")))
        wait_ack(c, 6)
    finally:
        c.close()
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    while time.monotonic() < deadline:
        for r in rx.snapshot():
            doc = r["json"]
            if doc and doc["alert"]["run"] == run:
                return r["time"] - t0
        time.sleep(0.0005)
    raise Failure(f"no page for run {run} within {PAGE_TIMEOUT_S} s")


def post_rtt(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    out = []
    body = b'{"alert":{"run":"ref"}}'
    for _ in range(REF_SAMPLES):
        t0 = time.perf_counter()
        conn.request("POST", "/ref", body=body, headers={"Content-Type": "application/json"})
        conn.getresponse().read()
        out.append(time.perf_counter() - t0)
    conn.close()
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build-dir", required=True)
    p.add_argument("--source-dir", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as work, Receiver() as rx:
        pb = proto_module(args.source_dir, work)
        conf = os.path.join(work, "foreshockd.conf")
        with open(conf, "w") as f:
            f.write(CONFIG.format(url=rx.url))
        d = Daemon(args.build_dir, work, config=conf)
        try:
            lat = [fire_once(pb, d, rx, f"page-{i}") for i in range(args.repeats)]
            ack = ack_rtt(pb, d)
            ref = post_rtt(rx.port)
        finally:
            d.stop()
    med = statistics.median(lat)
    print(f"page latency (firing report sent -> page at the receiver), {args.repeats} runs: "
          f"median {med * 1e3:.2f} ms (min {min(lat) * 1e3:.2f}, max {max(lat) * 1e3:.2f})")
    print(f"references: report Ack round trip {ack * 1e3:.3f} ms, HTTP POST round trip to the "
          f"receiver {ref * 1e3:.3f} ms; median / (ack + post) = {med / (ack + ref):.1f}x")


if __name__ == "__main__":
    try:
        main()
    except Failure as e:
        print(f"bench_page_latency: {e}", file=sys.stderr)
        sys.exit(1)
