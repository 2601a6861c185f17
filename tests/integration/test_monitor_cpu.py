"""foreshock_monitor_seconds_total counts CPU time, not wall time.

The daemon runs with 4 monitor workers, every one of its threads pinned to
one CPU, beside a busy loop pinned to the same CPU (both started here and
stopped by PID): a worker then waits for the core most of the time it is
"working". The simulator streams Gram sketches (2 layers x 8 heads, dh 64,
a sketch every step) whose monitor math takes seconds of CPU. Afterwards the
metric must be positive and at most the CPU time the whole daemon process
used (utime + stime from /proc/PID/stat, plus two clock ticks): a sum of
thread CPU clocks cannot exceed it, while the wall time of the same work
exceeds it several times over (4 workers and the busy loop share one core).
The verdict is that inequality, not a speed.
"""
import os
import re
import subprocess
import sys
import time
import urllib.request

from fstest import Daemon, check, parse_simulate_summary, run_main

STEPS = 40
CPU = "0"
TICKS = os.sysconf("SC_CLK_TCK")


def metric(d, name):
    with urllib.request.urlopen(d.url("/metrics"), timeout=30) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    check(m is not None, f"{name} missing from /metrics")
    return float(m.group(1))


def process_cpu_s(pid):
    """utime + stime of every thread of pid, seconds (proc(5))."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def test(args, workdir):
    conf = os.path.join(workdir, "foreshockd.conf")
    with open(conf, "w") as f:
        f.write("monitor_threads = 4\n")
    d = Daemon(args.build_dir, workdir, config=conf)
    busy = None
    try:
        # Every thread of the daemon on one CPU; the monitor workers, made
        # later by the loop thread, inherit its affinity.
        subprocess.run(["taskset", "-a", "-p", "-c", CPU, str(d.pid)], check=True,
                       stdout=subprocess.DEVNULL)
        busy = subprocess.Popen(["taskset", "-c", CPU, sys.executable, "-c", "while True: pass"])
        sim = subprocess.run(
            [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
             "--run", "cpu", "--ranks", "1", "--steps", str(STEPS), "--layers", "2", "--heads",
             "8", "--dh", "64", "--d", "256", "--sketch-every", "1", "--window", "1",
             "--flush-timeout", "600"], capture_output=True, text=True, timeout=900)
        check(sim.returncode == 0, f"simulate exited {sim.returncode}:\n{sim.stdout[-2000:]}"
              f"{sim.stderr[-2000:]}")
        s = parse_simulate_summary(sim.stdout)
        check(s["acked"] == STEPS and s["dropped"] == 0, f"simulate: {s}")
        want_heads = (STEPS - 1) * 2 * 8
        deadline = time.monotonic() + 600
        while metric(d, "foreshock_monitor_heads_total") < want_heads:
            check(time.monotonic() < deadline, "the daemon did not compute every head in 600 s")
            time.sleep(0.2)
        mon = metric(d, "foreshock_monitor_seconds_total")
        cpu = process_cpu_s(d.pid)
        print(f"  {want_heads} heads: foreshock_monitor_seconds_total {mon:.3f} s, daemon "
              f"process CPU {cpu:.3f} s", flush=True)
        check(mon > 0, "no monitor time counted")
        check(mon <= cpu + 2.0 / TICKS, f"foreshock_monitor_seconds_total {mon:.3f} s exceeds the "
              f"CPU time of the whole daemon ({cpu:.3f} s): it is counting wall time")
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
        check(d.stop() == 0, "daemon did not stop cleanly")


if __name__ == "__main__":
    run_main(test)
