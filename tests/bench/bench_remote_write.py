"""Remote write: its throughput and what it costs ingest.

Same run of this script, same simulated load (`foreshock simulate`, R ranks,
S steps, sketches every K steps of L layers x H heads; --scenario lr-spike
adds MoE routers and per-layer norms), a Prometheus with its remote-write
receiver on loopback:

  1. baseline: a daemon without remote write takes the load; its CPU time
     (utime + stime from /proc/PID/stat) once the run is stored and
     evaluated;
  2. with remote write: a fresh daemon with a [remote_write] section to the
     Prometheus takes the same load; its CPU time once every cursor is at
     the end (so the sending is in it). cost = CPU 2 / CPU 1;
  3. throughput: the baseline's database, reopened with remote write on, sends
     its whole stored run as a backlog as fast as the receiver takes it:
     samples/s = samples sent / wall time until its cursors are at the end
     (Prometheus is on the same cores: on a shared host the figure is the
     pair's).

    /usr/bin/python3 tests/bench/bench_remote_write.py --build-dir build \\
        [--ranks 4] [--steps 2000] [--layers 8] [--heads 8] [--sketch-every 10] \\
        [--scenario lr-spike] [--per-head]

Exits 1 only when something does not work; the numbers are the result.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from fstest import (Daemon, Failure, db_rows, free_port, http_call, metrics,  # noqa: E402
                    wait_until)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



def caught_up(db, target):
    last = dict(db_rows(db, "SELECT id, last_step FROM runs"))
    cur = {r: p for r, p in db_rows(
        db, "SELECT run_id, pos FROM remote_write_cursor WHERE target = ? AND kind = 0",
        (target,))}
    return all(cur.get(r, -1) >= s for r, s in last.items())


def samples_sent(d):
    """foreshock_remote_write_samples_sent_total over the daemon's targets."""
    return sum(v for k, v in metrics(d).items()
               if k.startswith("foreshock_remote_write_samples_sent_total{"))


def evaluated(db):
    """Every spooled sketch evaluated (the monitor stage is done)."""
    return db_rows(db, "SELECT count(*) FROM spool_frames")[0][0] == 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build-dir", required=True)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dh", type=int, default=16)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--sketch-every", type=int, default=10)
    p.add_argument("--scenario", default="lr-spike")
    p.add_argument("--per-head", action="store_true", help="send the heads' own series too")
    args = p.parse_args()
    if not shutil.which("prometheus"):
        print("prometheus is not installed (deploy/install-deps.sh)")
        return 1
    work = tempfile.mkdtemp(prefix="foreshock-bench-rw-")
    procs = []
    try:
        port = free_port()
        with open(os.path.join(work, "prometheus.yml"), "w") as f:
            f.write("global: {}\nstorage:\n  tsdb:\n    out_of_order_time_window: 2h\n")
        prom = subprocess.Popen(
            ["prometheus", f"--config.file={work}/prometheus.yml",
             f"--storage.tsdb.path={work}/prom", f"--web.listen-address=127.0.0.1:{port}",
             "--web.enable-remote-write-receiver"],
            stdout=open(os.path.join(work, "prometheus.log"), "w"), stderr=subprocess.STDOUT)
        procs.append(prom)
        def ready():
            if prom.poll() is not None:
                raise Failure(f"prometheus exited {prom.returncode}")
            try:
                return http_call(f"http://127.0.0.1:{port}/-/ready", timeout=2)[0] == 200
            except OSError:
                return False
        wait_until(ready, timeout=60, what="prometheus ready")

        def config(name, target):
            path = os.path.join(work, f"{name}.conf")
            with open(path, "w") as f:
                if target:
                    f.write(f'[remote_write "{target}"]\n'
                            f"url = http://127.0.0.1:{port}/api/v1/write\n"
                            f"per_head = {'true' if args.per_head else 'false'}\n")
            return path

        def load(d, run):
            t0 = time.monotonic()
            sim = subprocess.run(
                [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
                 "--run", run, "--ranks", str(args.ranks), "--steps", str(args.steps),
                 "--layers", str(args.layers), "--heads", str(args.heads), "--dh", str(args.dh),
                 "--d", str(args.d), "--sketch-every", str(args.sketch_every),
                 "--scenario", args.scenario, "--flush-timeout", "600"],
                capture_output=True, text=True, timeout=3600)
            if sim.returncode != 0:
                raise Failure(f"simulate exited {sim.returncode}: {sim.stdout[-1000:]}")
            return time.monotonic() - t0

        # 1. baseline
        base_dir = os.path.join(work, "base")
        os.makedirs(base_dir)
        d = Daemon(args.build_dir, base_dir, config=config("base", None))
        procs.append(d.proc)
        wall = load(d, "bench")
        wait_until(lambda: evaluated(d.db), timeout=600, what="baseline evaluated")
        cpu_base = cpu_seconds(d.pid)
        points = db_rows(d.db, "SELECT count(*) FROM points")[0][0]
        d.stop()
        print(f"load: {args.ranks} ranks x {args.steps} steps, {args.layers} x {args.heads} heads, "
              f"sketches every {args.sketch_every}, scenario {args.scenario}: {points} points "
              f"stored, {wall:.1f} s")
        print(f"baseline (no remote write): daemon CPU {cpu_base:.2f} s")

        # 2. the same load with remote write on
        rw_dir = os.path.join(work, "rw")
        os.makedirs(rw_dir)
        d = Daemon(args.build_dir, rw_dir, config=config("rw", "prom"))
        procs.append(d.proc)
        load(d, "bench")
        wait_until(lambda: evaluated(d.db) and caught_up(d.db, "prom"), timeout=600,
                   what="remote write caught up")
        cpu_rw = cpu_seconds(d.pid)
        sent = samples_sent(d)
        d.stop()
        print(f"with remote write: daemon CPU {cpu_rw:.2f} s, {sent:.0f} samples sent; "
              f"cost to ingest: {cpu_rw / cpu_base:.2f}x the baseline's CPU")

        # 3. throughput: the baseline's stored run as a backlog
        d = Daemon(args.build_dir, base_dir, config=config("drain", "drain"), db=d_db(base_dir))
        procs.append(d.proc)
        t0, c0 = time.monotonic(), cpu_seconds(d.pid)
        wait_until(lambda: caught_up(d.db, "drain"), timeout=1800, what="backlog sent",
                   interval=0.05)
        dt, dc = time.monotonic() - t0, cpu_seconds(d.pid) - c0
        sent = samples_sent(d)
        d.stop()
        print(f"throughput: a backlog of {sent:.0f} samples sent in {dt:.2f} s = "
              f"{sent / dt:,.0f} samples/s ({dc:.2f} daemon CPU s, "
              f"{sent / dc if dc else float('inf'):,.0f} samples per daemon CPU s)")
        return 0
    except Failure as e:
        print(f"FAIL: {e}")
        return 1
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.send_signal(signal.SIGKILL)
                pr.wait()
        shutil.rmtree(work, ignore_errors=True)


def d_db(dirname):
    return os.path.join(dirname, "foreshock.db")


if __name__ == "__main__":
    sys.exit(main())
