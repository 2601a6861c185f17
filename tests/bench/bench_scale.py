"""Scale: the shortest trainer step time one daemon sustains for the full 7B
and 70B shapes on both routes, with sketches every 10 steps, its RSS peak and
the disk it writes per 1,000 steps.

Shapes (all with grouped-query attention, dh 128): 7B = 32 layers x 32 query
heads, 8 KV heads, d 4096; 70B = 80 layers x 64 query heads, 8 KV heads,
d 8192; 8 ranks holding whole heads (tensor parallel: 1/8 of each layer's
heads per rank).

Routes:
- spectrum: the trainer computes the spectra on its device and sends
  spectrum sketches (about 3 KB a head). Load: `foreshock simulate --route
  spectrum` at --rate 1/T (spectra synthesised from the scenario's update
  statistics, so the senders cost little CPU).
- gram: each rank sends the whole Grams of its heads (`--split-heads`) and
  the daemon does the eigen-solves. Load: tests/bench/bench_datapath.py's
  senders (real Grams built once with numpy, only seq/step change), so the
  daemon is what is measured. A shape whose per-rank report exceeds
  max_frame_bytes (64 MiB) is printed as refused, with its size: the 70B
  Gram report is 170 MB a rank at 8 ranks.

A step time T is sustained when every report was acknowledged (none
dropped or late), every sketch step was evaluated, none incomplete, and the
last one within one sketch interval (10 T) of the last Ack. Each (shape,
route, T) runs on a fresh daemon and database. Disk per 1,000 steps is the
database (file + WAL) and spool directory at the end, divided by the steps
run (the spool is empty once every step is evaluated; retention and
head_points_every at their defaults).

    /usr/bin/python3 tests/bench/bench_scale.py --build-dir build \\
        [--shapes 7b,70b] [--routes spectrum,gram] [--steps 100] [--gram-steps 40] \\
        [--spectrum-step-times 1,0.5,0.25] [--gram-step-times 6,4,2]

The LAPACK floor for the Gram route's heads (the same work at its
minimum) is printed by `build/bench_monitor --dh 128 --numpy none
--sketch-heads 1024` (7B: 1,024 heads a sketch step). Exits 1 only when
something does not work; a step time not sustained is a result.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
sys.path.insert(0, HERE)
from fstest import Daemon, proto_module  # noqa: E402
import bench_datapath as dp  # noqa: E402

SHAPES = {
    "7b": dict(layers=32, heads=32, kv_heads=8, dh=128, d=4096),
    "70b": dict(layers=80, heads=64, kv_heads=8, dh=128, d=8192),
}
RANKS = 8
SKETCH_EVERY = 10
MAX_FRAME = 64 << 20
EVAL_TIMEOUT_S = 600


def vmhwm_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))
    except (OSError, AttributeError):
        return 0


def disk_bytes(d):
    n = sum(os.path.getsize(p) for p in (d.db, d.db + "-wal") if os.path.exists(p))
    return n + (dp.dir_bytes(d.db + ".spool") if os.path.isdir(d.db + ".spool") else 0)


def gram_report_bytes(shape):
    """Bytes of one rank's whole-head Grams (two n x n upper triangles, float32, n = 2 dh)."""
    n = 2 * shape["dh"]
    per_head = 2 * (n * (n + 1) // 2) * 4
    return shape["layers"] * (shape["heads"] // RANKS) * per_head


def spectrum_trial(a, name, shape, T, workdir):
    wd = tempfile.mkdtemp(prefix=f"{name}-spectrum-T{T:g}-", dir=workdir)
    d = Daemon(a.build_dir, wd)
    res = {}
    try:
        cmd = [os.path.join(a.build_dir, "foreshock"), "simulate", "--endpoint",
               f"127.0.0.1:{d.ingest_port}", "--run", "scale", "--ranks", str(RANKS),
               "--steps", str(a.steps), "--route", "spectrum", "--layers", str(shape["layers"]),
               "--heads", str(shape["heads"]), "--kv-heads", str(shape["kv_heads"]),
               "--dh", str(shape["dh"]), "--d", str(shape["d"]), "--sketch-every",
               str(SKETCH_EVERY), "--rate", f"{1.0 / T:g}", "--flush-timeout", "600"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.steps * T + 900)
        t_acked = time.monotonic()
        m = re.search(r"run=\S+ ranks=\d+ steps=\d+ submitted=(\d+) acked=(\d+) dropped=(\d+)", p.stdout)
        if p.returncode not in (0, 1) or not m:
            raise dp.Failure(f"simulate exited {p.returncode}: {p.stderr[-500:]}")
        want = (a.steps - 1) // SKETCH_EVERY  # sketch steps 10, 20, ... (none at step 0)
        mt = dp.metrics(d)
        while mt["foreshock_monitor_buckets_total"] < want and \
                time.monotonic() < t_acked + EVAL_TIMEOUT_S:
            time.sleep(0.1)
            mt = dp.metrics(d)
        drain = time.monotonic() - t_acked
        res.update(sent=int(m.group(1)), acked=int(m.group(2)), dropped=int(m.group(3)),
                   buckets=int(mt["foreshock_monitor_buckets_total"]), want=want,
                   incomplete=int(mt["foreshock_incomplete_steps_total"]), drain=drain,
                   rss=vmhwm_kib(d.pid))
        rc = d.stop(timeout=300)
        res["disk"] = disk_bytes(d)
        if rc != 0:
            raise dp.Failure(f"daemon exited {rc}")
    finally:
        if d.proc.poll() is None:
            d.kill()
    res["sustained"] = (res["dropped"] == 0 and res["acked"] == res["sent"] and
                        res["incomplete"] == 0 and res["buckets"] == res["want"] and
                        res["drain"] <= SKETCH_EVERY * T)
    return res


def gram_trial(a, pb, sketches, shape, T, workdir):
    ns = types.SimpleNamespace(build_dir=a.build_dir, foreshockd=None, sync="normal",
                               steps=a.gram_steps, sketch_every=SKETCH_EVERY, ranks=RANKS,
                               split_heads=True, probe_every=5.0, **shape)
    r = dp.trial(pb, ns, T, sketches, workdir)
    if r.get("errors") or r.get("stop_rc") != 0:
        raise dp.Failure(f"gram trial at {T:g} s: errors {r.get('errors')}, "
                         f"daemon exit {r.get('stop_rc')}")
    return dict(sustained=r["sustained"], sent=r["sent"], acked=r["acked"], dropped=r["behind"],
                buckets=r["buckets"], want=r["want"], incomplete=r["incomplete"],
                drain=r["drain"], rss=r["rss_peak"], disk=r["db_bytes"] + r["spool_dir_bytes"])


def row(name, route, T, r, steps):
    per_k = r["disk"] / steps * 1000 / 1e6
    print(f"| {name} | {route} | {T:g} s | {'yes' if r['sustained'] else 'no'} | "
          f"{r['acked']}/{r['sent']} | {r['dropped']} | {r['buckets']}/{r['want']} | "
          f"{r['incomplete']} | {r['drain']:.1f} s | {r['rss'] / 1024:.0f} MB | "
          f"{per_k:.1f} MB | {os.getloadavg()[0]:.1f} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--source-dir", default=os.path.join(HERE, "..", ".."))
    ap.add_argument("--shapes", default="7b,70b")
    ap.add_argument("--routes", default="spectrum,gram")
    ap.add_argument("--steps", type=int, default=100, help="steps per spectrum-route trial")
    ap.add_argument("--gram-steps", type=int, default=40, help="steps per Gram-route trial")
    ap.add_argument("--spectrum-step-times", default="1,0.5,0.25")
    ap.add_argument("--gram-step-times", default="6,4,2")
    a = ap.parse_args()
    a.build_dir = os.path.abspath(a.build_dir)
    workdir = tempfile.mkdtemp(prefix="fs-scale-")
    pb = None
    print(f"scale: {RANKS} ranks holding whole heads, dh 128, sketches every {SKETCH_EVERY} "
          f"steps, {a.steps} steps per spectrum trial, {a.gram_steps} per Gram trial, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| shape | route | step time | sustained | acked | dropped/late | evaluated "
          "| incomplete | drain after last ack | RSS peak | disk per 1,000 steps | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        for route in a.routes.split(","):
            if route == "spectrum":
                for T in [float(x) for x in a.spectrum_step_times.split(",")]:
                    row(name, route, T, spectrum_trial(a, name, shape, T, workdir), a.steps)
                continue
            size = gram_report_bytes(shape)
            if size > MAX_FRAME:
                print(f"| {name} | gram | - | refused | report {size / 1e6:.0f} MB a rank > "
                      f"max_frame_bytes {MAX_FRAME >> 20} MiB (its heads "
                      f"over >= {-(-size * RANKS // MAX_FRAME)} ranks would fit) | | | | | | | |", flush=True)
                continue
            if pb is None:
                pb = proto_module(a.source_dir, workdir)
            ns = types.SimpleNamespace(ranks=RANKS, split_heads=True, **shape)
            sketches = dp.build_sketches(pb, ns)
            for T in [float(x) for x in a.gram_step_times.split(",")]:
                row(name, route, T, gram_trial(a, pb, sketches, shape, T, workdir), a.gram_steps)
            del sketches


if __name__ == "__main__":
    main()
