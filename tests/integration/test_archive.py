"""History that outlives the job: `foreshock archive` copies a live
daemon's database (whole, or one run) while the daemon runs and ranks
stream into it, and `foreshockd --read-only` serves the copy: the same
/api/v1/alerts and run listing as the live daemon answered, the dashboard
and /metrics, writes refused with 403 read_only, no ingest. `foreshock
backtest --db` reads the archive too; an existing archive is never
overwritten."""
import os
import re
import subprocess
import time
import urllib.request

from fstest import Daemon, Failure, check, run_main

READ_ONLY_RE = re.compile(r"foreshockd ready read-only http=(\S+):(\d+)")
SIM = ["--ranks", "2", "--layers", "2", "--heads", "2", "--dh", "8", "--d", "32",
       "--sketch-every", "5", "--flush-timeout", "120"]


class ReadOnlyDaemon(Daemon):
    """foreshockd --read-only over an archive: HTTP only."""

    def __init__(self, build_dir, workdir, db):  # pylint: disable=super-init-not-called
        self.db = db
        self.log_path = os.path.join(workdir, f"readonly.{int(time.time() * 1000)}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [os.path.join(build_dir, "foreshockd"), "--read-only", "--db", db,
             "--http", "127.0.0.1:0", "--set", "http_write_token=w"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise Failure(f"read-only foreshockd exited {self.proc.returncode}:\n"
                              + self.log_text())
            m = READ_ONLY_RE.search(self.log_text())
            if m:
                self.ingest_port, self.http_port = None, int(m.group(2))
                return
            check(time.monotonic() < deadline, "no read-only ready line:\n" + self.log_text())
            time.sleep(0.05)


def simulate(args, d, run, scenario, steps, extra=()):
    cmd = [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
           "--run", run, "--steps", str(steps), "--scenario", scenario] + SIM + list(extra)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(p):
    out, _ = p.communicate(timeout=600)
    check(p.returncode == 0, f"simulate exited {p.returncode}:\n{out[-2000:]}")


def archive(args, src, dst, run=None, expect=0):
    cmd = [os.path.join(args.build_dir, "foreshock"), "archive", "--db", src, "--out", dst]
    if run:
        cmd += ["--run", run]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    check(p.returncode == expect, f"archive {dst}: exit {p.returncode}, expected {expect}:\n"
          f"{p.stdout}")
    return p.stdout


def settled(d, paths):
    """Waits until the live answers stop changing (the monitors are done)."""
    last, deadline = None, time.monotonic() + 120
    while time.monotonic() < deadline:
        now = [d.get(p) for p in paths]
        if now == last:
            return now
        last = now
        time.sleep(1.0)
    raise Failure("the live daemon's answers never settled")


def test(args, workdir):
    d = Daemon(args.build_dir, workdir)
    try:
        finish(simulate(args, d, "arch-a", "lr-spike", 400, ["--fault-step", "250"]))
        # A second run streams while the database is copied.
        b = simulate(args, d, "arch-b", "healthy", 400, ["--rate", "200"])
        time.sleep(0.5)
        during = os.path.join(workdir, "during.db")
        out = archive(args, d.db, during)
        check(re.search(r"archive: \S+ runs=2 ", out), f"archive while streaming: {out}")
        finish(b)
        paths = ["/api/v1/alerts?run=arch-a", "/api/v1/alerts", "/api/v1/runs",
                 "/api/v1/runs/arch-a", "/api/v1/series?run=arch-a&name=router.zloss"]
        live = settled(d, paths)
        check(len(live[0]["alerts"]) > 0, "the lr-spike run raised no alert to archive")
        whole = os.path.join(workdir, "whole.db")
        one = os.path.join(workdir, "arch-a.db")
        archive(args, d.db, whole)
        archive(args, d.db, one, run="arch-a")
        archive(args, d.db, whole, expect=2)  # never overwritten
        archive(args, d.db, os.path.join(workdir, "x.db"), run="no-such-run", expect=1)
        check(not os.path.exists(os.path.join(workdir, "x.db")), "a failed archive left a file")
        check([d.get(p) for p in paths] == live, "the live daemon changed while archiving")
    finally:
        d.stop()

    # The archive copied while arch-b streamed is a consistent database.
    r = ReadOnlyDaemon(args.build_dir, workdir, during)
    try:
        runs = {x["id"] for x in r.get("/api/v1/runs")["runs"]}
        check(runs == {"arch-a", "arch-b"}, f"archive taken while streaming: runs {runs}")
    finally:
        r.stop()

    r = ReadOnlyDaemon(args.build_dir, workdir, whole)
    try:
        got = [r.get(p) for p in paths]
        for p, a, b in zip(paths, live, got):
            check(a == b, f"{p}: the archive answers differently\nlive {a}\narchive {b}")
        e = r.request("POST", "/api/v1/silences", token="w", expect=403,
                      body={"matchers": [{"name": "run", "value": "arch-a"}],
                            "duration": "1h", "createdBy": "t", "comment": "c"})
        check(e["error"]["code"] == "read_only", f"write on an archive: {e}")
        check(r.get("/readyz")["status"] == "ready", "readyz")
        check("no ingest" in r.log_text(), "no log line saying what a read-only daemon is")
        with urllib.request.urlopen(r.url("/"), timeout=30) as resp:
            check(resp.status == 200, "dashboard")
        with urllib.request.urlopen(r.url("/metrics"), timeout=30) as resp:
            check(b"foreshock_ready 1" in resp.read(), "metrics")
        check(r.stop() == 0, "read-only daemon exit status")
    finally:
        r.stop()

    r = ReadOnlyDaemon(args.build_dir, workdir, one)
    try:
        check([x["id"] for x in r.get("/api/v1/runs")["runs"]] == ["arch-a"],
              "one-run archive holds other runs")
        check(r.get(paths[0]) == live[0], "one-run archive: alerts differ")
    finally:
        r.stop()

    p = subprocess.run([os.path.join(args.build_dir, "foreshock"), "backtest", "--db", one,
                        "--json"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    check(p.returncode == 0 and "arch-a" in p.stdout, f"backtest on the archive: {p.stdout[-800:]}")

    # A truncated database is said to be truncated or damaged, with SQLite's
    # reason; it used to be "not a Foreshock database" (issue 22, Medium).
    size = os.path.getsize(whole)
    with open(whole, "rb") as f:
        data = f.read()
    garbage = os.path.join(workdir, "garbage.db")
    with open(garbage, "wb") as f:
        f.write(b"not a database at all, but longer than a SQLite header. " * 4)
    cases = [(n, "truncated or damaged") for n in (50, 100, 4096, size // 2, size - 1)]
    for n, why in cases + [(None, "not a SQLite database")]:
        src = garbage
        if n is not None:
            src = os.path.join(workdir, f"cut-{n}.db")
            with open(src, "wb") as f:
                f.write(data[:n])
        dst = os.path.join(workdir, f"cut-{n}-archive.db")
        out = archive(args, src, dst, expect=1)
        check(why in out and src in out and "not a Foreshock database" not in out,
              f"archive of {src} ({n} of {size} bytes): {out}")
        check(not os.path.exists(dst), f"a failed archive left {dst}")
        print(f"{n} of {size} bytes: {out.strip()}", flush=True)


if __name__ == "__main__":
    run_main(test)
