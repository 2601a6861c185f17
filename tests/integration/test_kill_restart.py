"""Crash safety: the daemon is SIGKILLed mid-stream and restarted on the same
ports. Clients reconnect, resume from Welcome, and the final counts are
exact: no acknowledged report lost, none stored twice."""
import os
import subprocess
import time

from fstest import Daemon, check, kill_started, parse_simulate_summary, run_all_pages, run_main

RANKS = 8
STEPS = 5000


def stored_reports(d, run):
    return d.get(f"/api/v1/runs/{run}")["run"]["reports"]


def test(args, workdir):
    d = Daemon(args.build_dir, workdir)
    ingest_port, http_port, db = d.ingest_port, d.http_port, d.db
    # --rate spreads the run over a few seconds so the kill lands mid-stream.
    sim = subprocess.Popen(
        [os.path.join(args.build_dir, "foreshock"), "simulate",
         "--endpoint", d.endpoint, "--run", "crash-run", "--ranks", str(RANKS),
         "--steps", str(STEPS), "--rate", "1000", "--no-sketches",
         "--flush-timeout", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    restarted = None
    try:
        # Wait until a good part of the stream is committed, then crash.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                n = stored_reports(d, "crash-run")
            except Exception:
                n = 0
            if n >= RANKS * STEPS // 4:
                break
            time.sleep(0.1)
        before = stored_reports(d, "crash-run")
        check(before < RANKS * STEPS, "the run finished before the crash; slow it down")
        d.kill()
        time.sleep(1.0)  # clients see the connection drop and back off
        restarted = Daemon(args.build_dir, workdir, ingest_port=ingest_port,
                           http_port=http_port, db=db)
        out, _ = sim.communicate(timeout=600)
        print(out[-3000:])
        check(sim.returncode == 0, f"simulate exited {sim.returncode}")
        s = parse_simulate_summary(out)
        check(s["reconnects"] >= 1, "clients never reconnected")
        check(s["acked"] == RANKS * STEPS and s["dropped"] == 0, f"summary {s}")

        run = restarted.get("/api/v1/runs/crash-run")["run"]
        check(run["reports"] == RANKS * STEPS,
              f"stored {run['reports']} reports, expected {RANKS * STEPS} (before crash: {before})")
        for st in run["streams_detail"]:
            check(st["last_seq"] == STEPS and st["reports"] == STEPS, f"stream {st}")
        for ser in run_all_pages(restarted, "/api/v1/series?run=crash-run&name=loss", "series"):
            check(ser["points"] == STEPS, f"series {ser}: duplicated or lost points")
        print(f"crash at {before} committed reports; lost 0, duplicated 0")
        check(restarted.stop() == 0, "restarted daemon did not exit 0")
    finally:
        kill_started(sim, d, restarted)


if __name__ == "__main__":
    run_main(test)
