"""The monitor stage across daemon restarts: a faulty scenario streamed
through a daemon that is killed (SIGKILL, then SIGTERM) mid-run and
restarted on the same ports must end with exactly the alerts, transitions
and attribution labels of an uninterrupted run: detector and alert state
survive, the spool is re-fed, nothing re-fires and nothing is forgotten.
The last stop passes its shutdown deadline at once, so the math it had
queued is abandoned to the spool: the restart must make up for it."""
import os
import signal
import subprocess
import time

from fstest import Daemon, check, kill_started, parse_simulate_summary, run_all_pages, run_main

RANKS = 2
STEPS = 600
SKETCH_EVERY = 10
LAST_SKETCH = (STEPS - 1) // SKETCH_EVERY * SKETCH_EVERY
SCENARIO = "combined"


def simulate(args, d, run, rate=0):
    cmd = [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
           "--run", run, "--ranks", str(RANKS), "--steps", str(STEPS), "--scenario", SCENARIO,
           "--sketch-every", str(SKETCH_EVERY), "--flush-timeout", "300"]
    if rate:
        cmd += ["--rate", str(rate)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(sim):
    out, _ = sim.communicate(timeout=600)
    check(sim.returncode == 0, f"simulate exited {sim.returncode}: {out[-2000:]}")
    s = parse_simulate_summary(out)
    check(s["acked"] == RANKS * STEPS and s["dropped"] == 0, f"summary {s}")
    return s


def wait_evaluated(d, run, timeout=120):
    """Until the last sketch step's monitors are stored, then a little more
    for the scalars behind it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ser = d.get(f"/api/v1/series?run={run}&name=qk.d2.erank.min")["series"]
        if ser and all(s["last_step"] == LAST_SKETCH for s in ser):
            time.sleep(1.0)
            return
        time.sleep(0.2)
    raise AssertionError(f"{run}: monitors of step {LAST_SKETCH} never stored")


def outcome(d, run):
    """Every alert identity with its state, steps, incidents, attribution
    and full history (change, step, attribution)."""
    res = {}
    for a in run_all_pages(d, f"/api/v1/alerts?run={run}", "alerts"):
        detail = d.get(f"/api/v1/alerts/{a['id']}")["alert"]
        hist = tuple((h["change"], h["step"], h["attribution"]) for h in detail["history"])
        ev = a["evidence"]
        res[a["alert_key"].split(",", 1)[1]] = (
            a["state"], ev["first_breach_step"], ev["fired_step"], ev["resolved_step"],
            a["incidents"], a["attribution"], a["dedup_key"], hist)
    return res


def interrupted(args, workdir, sig, run, extra=()):
    d = Daemon(args.build_dir, workdir, extra=extra)
    ingest_port, http_port, db = d.ingest_port, d.http_port, d.db
    # --rate spreads the stream over seconds so that the stop lands mid-run,
    # after some alerts went pending or fired.
    sim = simulate(args, d, run, rate=150)
    restarted = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                n = d.get(f"/api/v1/runs/{run}")["run"]["reports"]
            except Exception:
                n = 0
            if n >= RANKS * STEPS * 45 // 100:
                break
            time.sleep(0.05)
        before = d.get(f"/api/v1/runs/{run}")["run"]["reports"]
        check(before < RANKS * STEPS, "the run finished before the stop; slow it down")
        if sig == signal.SIGKILL:
            d.kill()
        else:
            d.stop()
        time.sleep(0.5)
        stop_log = d.log_text()
        restarted = Daemon(args.build_dir, workdir, ingest_port=ingest_port,
                           http_port=http_port, db=db, extra=extra)
        s = finish(sim)
        check(s["reconnects"] >= 1, "clients never reconnected")
        wait_evaluated(restarted, run)
        print(f"{signal.Signals(sig).name} after {before} of {RANKS * STEPS} reports")
        for line in stop_log.splitlines():
            if "shutdown deadline" in line:
                print("  stopping daemon:", line)
        for line in restarted.log_text().splitlines():
            if " warn " in line or " error " in line or "re-fed" in line or "restored" in line:
                print("  daemon:", line)
        got = outcome(restarted, run)
        rc, restarted = restarted.stop(), None
        check(rc == 0, f"restarted daemon exited {rc}")
        return got
    finally:
        kill_started(sim)
        if restarted:
            restarted.stop()


def test(args, workdir):
    ref_dir = os.path.join(workdir, "ref")
    os.makedirs(ref_dir)
    d = Daemon(args.build_dir, ref_dir)
    try:
        finish(simulate(args, d, "mon-run"))
        wait_evaluated(d, "mon-run")
        want = outcome(d, "mon-run")
    finally:
        rc = d.stop()
    check(rc == 0, f"daemon exited {rc}")
    fired = [k for k, v in want.items() if v[2] is not None]
    check(len(fired) >= 4, f"the reference run fired too little to compare: {want}")
    labels = {v[5] for k, v in want.items() if v[2] is not None}
    print(f"reference: {len(want)} alerts, {len(fired)} fired, attribution {sorted(labels)}")
    # The third stop passes its shutdown deadline at once (one monitor
    # thread, 1 ms): math still queued is cancelled and left spooled, and the
    # next start must evaluate it to the same outcome.
    variants = [("SIGKILL", signal.SIGKILL, ()), ("SIGTERM", signal.SIGTERM, ()),
                ("SIGTERM-deadline", signal.SIGTERM,
                 ("--set", "shutdown_timeout_s=0.001", "--set", "monitor_threads=1"))]
    for name, sig, extra in variants:
        sub = os.path.join(workdir, name)
        os.makedirs(sub)
        got = interrupted(args, sub, sig, "mon-run", extra)
        for key in sorted(set(want) | set(got)):
            check(key in got, f"{name}: alert {key} forgotten: {want[key]}")
            check(key in want, f"{name}: alert {key} not in the uninterrupted run: {got[key]}")
            check(got[key] == want[key], f"{name}: alert {key}\n"
                  f"  uninterrupted {want[key]}\n  restarted     {got[key]}")
        print(f"{name}: {len(got)} alerts identical to the uninterrupted run")


if __name__ == "__main__":
    run_main(test)
