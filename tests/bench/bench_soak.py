"""Soak benchmark: foreshockd under a mixed load for a set time, so that a
leak or a slow-down shows as a ratio between the start and the end of the
same run.

    /usr/bin/python3 tests/bench/bench_soak.py --build-dir build [--seconds 120]

Load, all on loopback: 64 simulated ranks streaming sketches (`foreshock
simulate`, the attention-numerics scenario, so alerts fire and page), HTTP
readers polling alerts, series and /metrics, and a webhook target that
accepts connections and never answers (every page times out and is
retried from the outbox). Measured over the first and the last WINDOW
seconds: the daemon's RSS and open descriptors (from /proc) at the end of
each window, and the HTTP readers' latency percentiles. The reference is
the same daemon at the start of the same run: the ratios say whether memory,
descriptors or latency grow with time under a steady load.
"""
import argparse
import os
import re
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
READY_RE = re.compile(r"ready ingest=127\.0\.0\.1:(\d+) http=127\.0\.0\.1:(\d+)")
RANKS = 64
READERS = 4
WINDOW_S = 15.0
PATHS = ("/api/v1/alerts?limit=50", "/api/v1/runs", "/metrics", "/healthz")


def proc_status(pid):
    with open(f"/proc/{pid}/status") as f:
        rss = int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return rss, fds


def black_hole():
    """A TCP server that accepts and never answers: pages to it time out."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    held = []

    def accept():
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            held.append(c)
            if len(held) > 256:
                held.pop(0).close()
    threading.Thread(target=accept, daemon=True).start()
    return s, s.getsockname()[1]


def reader(http_port, stop, samples):
    i = 0
    while not stop.is_set():
        path = PATHS[i % len(PATHS)]
        i += 1
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}", timeout=30) as r:
                r.read()
            ok = True
        except OSError:
            ok = False
        samples.append((t0, time.monotonic() - t0, ok))


def pct(values, q):
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--seconds", type=float, default=120.0)
    a = ap.parse_args()
    hole, hole_port = black_hole()
    with tempfile.TemporaryDirectory(prefix="foreshock-soak-") as tmp:
        conf = os.path.join(tmp, "soak.conf")
        with open(conf, "w") as f:
            f.write(f'[target "blackhole"]\ntype = webhook\nurl = http://127.0.0.1:{hole_port}/\n'
                    "timeout = 2\nconnect_timeout = 1\nbackoff_initial = 1\nbackoff_max = 5\n")
        log = open(os.path.join(tmp, "foreshockd.log"), "w")
        d = subprocess.Popen([os.path.join(a.build_dir, "foreshockd"), "--listen", "127.0.0.1:0",
                              "--http", "127.0.0.1:0", "--db", os.path.join(tmp, "soak.db"),
                              "--config", conf, "--set",
                              "max_connections=256"], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            m = None
            while m is None and time.monotonic() < deadline:
                time.sleep(0.05)
                with open(log.name) as f:
                    m = READY_RE.search(f.read())
            if m is None:
                raise SystemExit("foreshockd did not log its ready line; see " + log.name)
            ingest, http = int(m.group(1)), int(m.group(2))
            steps = int(a.seconds * 5) + 100
            sim = subprocess.Popen(
                [os.path.join(a.build_dir, "foreshock"), "simulate", "--endpoint",
                 f"127.0.0.1:{ingest}", "--run", "soak", "--ranks", str(RANKS), "--steps",
                 str(steps), "--layers", "2", "--heads", "4", "--dh", "16", "--d", "128",
                 "--sketch-every", "5", "--scenario", "attention-numerics", "--fault-step",
                 str(steps // 2), "--rate", "5", "--flush-timeout", "60"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stop = threading.Event()
            samples = []
            threads = [threading.Thread(target=reader, args=(http, stop, samples))
                       for _ in range(READERS)]
            for t in threads:
                t.start()
            t_start = time.monotonic()
            time.sleep(WINDOW_S)
            start_status = proc_status(d.pid)
            time.sleep(max(0.0, a.seconds - 2 * WINDOW_S))
            t_end_window = time.monotonic()
            time.sleep(WINDOW_S)
            end_status = proc_status(d.pid)
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=30) as r:
                metrics = r.read().decode()
            stop.set()
            for t in threads:
                t.join()
            sim.kill()
            sim.wait()
        finally:
            d.terminate()
            d.wait(timeout=120)
            hole.close()
    first = [dt for t0, dt, ok in samples if ok and t0 < t_start + WINDOW_S]
    last = [dt for t0, dt, ok in samples if ok and t0 >= t_end_window]
    errors = sum(1 for _, _, ok in samples if not ok)
    print(f"soak: {a.seconds:.0f} s, {RANKS} ranks, {READERS} HTTP readers, a webhook target "
          f"that never answers; {len(samples)} HTTP requests, {errors} failed")
    print("| measure | first window | last window | last / first |")
    print("|---|---|---|---|")
    rows = [("daemon RSS (KiB)", start_status[0], end_status[0]),
            ("open descriptors", start_status[1], end_status[1]),
            ("HTTP p50 (ms)", 1e3 * pct(first, 0.5), 1e3 * pct(last, 0.5)),
            ("HTTP p99 (ms)", 1e3 * pct(first, 0.99), 1e3 * pct(last, 0.99)),
            ("HTTP requests", len(first), len(last))]
    for name, x, y in rows:
        ratio = y / x if x else float("nan")
        print(f"| {name} | {x:.1f} | {y:.1f} | {ratio:.2f} |")
    def total(name):
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))
    print(f"alerts fired {total('foreshock_alerts_fired_total'):.0f}, page attempts failed "
          f"{total('foreshock_pages_failed_total'):.0f}, reports committed "
          f"{total('foreshock_reports_committed_total'):.0f}")
    if first and last:
        print(f"(median of all requests: {1e3 * statistics.median(first + last):.2f} ms)")


if __name__ == "__main__":
    main()
