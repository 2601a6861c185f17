"""The sketch spool across a crash: 2 ranks stream Gram sketches every step
faster than the monitors evaluate them; the daemon is SIGKILLed while acked
steps wait in the spool log, and restarted on the same ports. Every sketch
step must end up evaluated, once: the acked ones from the log (the restart
re-feeds them), the rest as the clients resend them. And the database holds
live rows only: no raw frame ever entered it, and the spool directory is
emptied as steps are evaluated."""
import os
import re
import subprocess
import time

from fstest import Daemon, check, db_rows, kill_started, metrics, parse_simulate_summary, run_main

RANKS = 2
STEPS = 300
RUN = "spool-crash"
LAYERS, HEADS, DH, D = 4, 8, 64, 512
# Gram shards per report: LAYERS x HEADS heads, two triangles of 2 DH.
SKETCH_BYTES = LAYERS * HEADS * 2 * (2 * DH) * (2 * DH + 1) // 2 * 4


def simulate(args, d, rank):
    """Rank `rank` alone of a RANKS-rank run: its partial Grams only."""
    return subprocess.Popen(
        [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
         "--run", RUN, "--ranks", "1", "--world-size", str(RANKS), "--first-rank", str(rank),
         "--steps", str(STEPS), "--layers", str(LAYERS), "--heads", str(HEADS), "--dh", str(DH),
         "--d", str(D), "--sketch-every", "1", "--rate", "40", "--replay-mb", "1024",
         "--flush-timeout", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test(args, workdir):
    # Rank 0 streams first and rank 1 only after the restart: every step
    # rank 0 sent is acknowledged but cannot be evaluated (its Gram shards
    # wait for rank 1's), so acked steps sit in the spool when the kill
    # lands, whatever the machine's speed. reduce_timeout_s is long enough
    # that none of them is given up as incomplete meanwhile.
    extra = ["--set", "reduce_timeout_s=900"]
    d = Daemon(args.build_dir, workdir, extra=extra)
    ingest_port, http_port, db = d.ingest_port, d.http_port, d.db
    sim = simulate(args, d, 0)
    sim1 = None
    restarted = None
    try:
        deadline = time.monotonic() + 300
        m = {}
        while time.monotonic() < deadline:
            try:
                m = metrics(d)
            except OSError:
                m = {}
            # Killed at the first scrape that shows an acked report's worth
            # of frames in the spool after a third of the run.
            if m.get("foreshock_reports_committed_total", 0) >= STEPS // 3 and \
                    m.get("foreshock_spool_bytes", 0) >= SKETCH_BYTES:
                break
            time.sleep(0.05)
        committed = m.get("foreshock_reports_committed_total", 0)
        evaluated = m.get("foreshock_monitor_buckets_total", 0)  # scalars evaluate alone
        spooled = m.get("foreshock_spool_bytes", 0)
        check(spooled >= SKETCH_BYTES and committed < STEPS,
              f"no crash window: {committed} steps committed, {spooled:.0f} bytes spooled")
        d.kill()
        time.sleep(0.5)
        restarted = Daemon(args.build_dir, workdir, ingest_port=ingest_port,
                           http_port=http_port, db=db, extra=extra)
        out, _ = sim.communicate(timeout=600)
        check(sim.returncode == 0, f"simulate rank 0 exited {sim.returncode}: {out[-2000:]}")
        s = parse_simulate_summary(out)
        check(s["acked"] == STEPS and s["dropped"] == 0, f"rank 0 summary {s}")
        check(s["reconnects"] >= 1, "rank 0 never reconnected")
        refed = re.search(r"re-fed (\d+) spooled reports", restarted.log_text())
        check(refed and int(refed.group(1)) > 0,
              "the restart re-fed nothing from the spool:\n" + restarted.log_text()[-3000:])
        print(f"SIGKILL with {committed:.0f} steps committed, {evaluated:.0f} evaluated, "
              f"{spooled / 1e6:.1f} MB spooled; restart: {refed.group(0)}")
        sim1 = simulate(args, restarted, 1)
        out, _ = sim1.communicate(timeout=600)
        check(sim1.returncode == 0, f"simulate rank 1 exited {sim1.returncode}: {out[-2000:]}")
        s = parse_simulate_summary(out)
        check(s["acked"] == STEPS and s["dropped"] == 0, f"rank 1 summary {s}")

        # Every sketch step evaluated exactly once, none incomplete.
        deadline = time.monotonic() + 600
        series = []
        while time.monotonic() < deadline:
            series = restarted.get(f"/api/v1/series?run={RUN}&name=qk.d2.erank.min")["series"]
            if len(series) == LAYERS and all(x["last_step"] == STEPS - 1 for x in series):
                break
            time.sleep(0.2)
        check(len(series) == LAYERS, f"series {series}")
        for x in series:
            want = x["last_step"] - x["first_step"] + 1
            check(x["last_step"] == STEPS - 1 and x["first_step"] <= 2 and x["points"] == want,
                  f"steps lost or never evaluated: {x}")
        heads = restarted.get(f"/api/v1/series?run={RUN}&name=qk.d2.erank&limit=1000")["series"]
        check(len(heads) == LAYERS * HEADS and
              all(h["points"] == series[0]["points"] for h in heads),
              f"per-head series: {[(h['labels'], h['points']) for h in heads]}")
        check(metrics(restarted)["foreshock_incomplete_steps_total"] == 0, "incomplete steps")
        check(db_rows(db, "SELECT count(*) FROM incomplete")[0][0] == 0, "incomplete rows")

        # Live data only: no frame in the database, the spool emptied.
        check(db_rows(db, "SELECT count(*) FROM spool")[0][0] == 0, "frames in the spool table")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and metrics(restarted)["foreshock_spool_bytes"] > 0:
            time.sleep(0.1)
        check(os.path.isdir(db + ".spool"), "no spool directory beside the database")
        left = sum(os.path.getsize(os.path.join(db + ".spool", f))
                   for f in os.listdir(db + ".spool"))
        check(left == 0, f"{left} bytes left in the spool directory after every step was evaluated")
        rc, restarted = restarted.stop(), None
        check(rc == 0, f"restarted daemon exited {rc}")
        size = sum(os.path.getsize(p) for p in (db, db + "-wal") if os.path.exists(p))
        sent = RANKS * STEPS * SKETCH_BYTES
        print(f"database {size / 1e6:.2f} MB for {sent / 1e6:.0f} MB of sketches received")
        check(size < sent // 20, f"database {size} bytes: it holds more than live rows")
    finally:
        kill_started(sim, sim1, d, restarted)


if __name__ == "__main__":
    run_main(test)
