"""1,024 ranks with sketches against a spool bound far below one sketch
step: ranks that run ahead must not lock out the shards that complete the
oldest step. Every sketch step is evaluated with every shard (0 incomplete)
and no report is dropped. Before, the writer refused every report at the
spool bound, so ranks ahead filled it, the lagging ranks' shards could not
get in, and each step waited for the reduce timeout and was recorded
incomplete."""
import os
import re
import subprocess
import time

from fstest import Daemon, check, db_rows, kill_started, parse_simulate_summary, run_main

RANKS = 1024
STEPS = 12
SKETCH_EVERY = 4
# Attention sketches need a snapshot WINDOW (= K) steps back: steps K, 2K, ...
SKETCH_STEPS = len(range(SKETCH_EVERY, STEPS, SKETCH_EVERY))
RUN = "many-ranks"


def test(args, workdir):
    # 1 MiB (the smallest bound) against ~17 MB of shards per sketch step:
    # the bound holds for every step of the run.
    d = Daemon(args.build_dir, workdir,
               extra=["--set", "spool_max_bytes=1M", "--set", "max_connections=1100"])
    try:
        t0 = time.monotonic()
        sim = subprocess.run(
            [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
             "--run", RUN, "--ranks", str(RANKS), "--steps", str(STEPS), "--layers", "2",
             "--heads", "2", "--dh", "16", "--d", str(RANKS), "--sketch-every",
             str(SKETCH_EVERY), "--flush-timeout", "600"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
        took = time.monotonic() - t0
        check(sim.returncode == 0, f"simulate exited {sim.returncode}: {sim.stdout[-2000:]}")
        s = parse_simulate_summary(sim.stdout)
        check(s["acked"] == RANKS * STEPS and s["dropped"] == 0, f"summary {s}")
        deadline = time.monotonic() + 600
        buckets = 0
        while time.monotonic() < deadline:
            rows = db_rows(d.db, "SELECT count(DISTINCT p.step) FROM points p JOIN series s "
                                 "ON s.id = p.series_id WHERE s.name = 'qk.d2.erank.min'")
            buckets = rows[0][0]
            if buckets == SKETCH_STEPS or db_rows(d.db, "SELECT count(*) FROM incomplete")[0][0]:
                break
            time.sleep(0.2)
        log = d.log_text()
        check(re.search(r"reached spool_max_bytes", log),
              "the spool bound was never reached: the test did not test it\n" + log[-2000:])
        incomplete = db_rows(d.db, "SELECT count(*) FROM incomplete")[0][0]
        check(incomplete == 0, f"{incomplete} reductions recorded incomplete")
        check(buckets == SKETCH_STEPS, f"{buckets} of {SKETCH_STEPS} sketch steps evaluated")
        heads = db_rows(d.db, "SELECT count(*), min(points), max(points) FROM series "
                              "WHERE run_id = (SELECT id FROM runs WHERE name = ?) "
                              "AND name = 'qk.d2.erank'", (RUN,))[0]
        check(heads[0] == 4 and heads[1] == heads[2] == buckets, f"per-head series {heads}")
        print(f"{RANKS} ranks x {STEPS} steps: {buckets} sketch steps evaluated, 0 incomplete, "
              f"0 dropped, in {took:.1f} s")
        check(d.stop() == 0, "daemon did not exit 0")
    finally:
        kill_started(d)


if __name__ == "__main__":
    run_main(test)
