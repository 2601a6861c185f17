"""A rewind, then a crash before the new attempt is evaluated: no
acknowledged frame of the new attempt is lost.

Attempt 0 of a 2-rank run is evaluated to its last step S. Attempt 1
rewinds to R < S; only rank 0 of it streams steps R+1..S, so none of them
can be evaluated (their Gram shards wait for rank 1's; reduce_timeout_s is
long). The run's evaluated step must then be R, not S: the spool keeps
rank 0's acknowledged frames and a start replays them. The daemon is
SIGKILLed and restarted; rank 1 of attempt 1 streams the same steps. Every
sketch step after R must be evaluated from both ranks (a point of every
monitor, no incomplete reduction, no sketch counted late), as in an
uninterrupted daemon that saw the same frames."""
import os
import subprocess
import time

from fstest import Daemon, check, db_rows, metrics, run_main, wait_until

RUN = "rwspool"
RANKS, STEPS, EVERY = 2, 200, 5
RESUME = 100
# Routers: a step waits for every rank's token counts (run_tokens_want), so
# rank 0 alone cannot complete one.
SHAPE = ["--layers", "2", "--heads", "2", "--dh", "8", "--d", "32", "--sketch-every", str(EVERY),
         "--experts", "4", "--top-k", "2"]
LAST_SKETCH = (STEPS - 1) // EVERY * EVERY


def simulate(args, d, extra):
    cmd = [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
           "--run", RUN, "--steps", str(STEPS), "--flush-timeout", "300"] + SHAPE + extra
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    check(p.returncode == 0, f"simulate {' '.join(extra)} exited {p.returncode}:\n"
                             f"{p.stdout[-2000:]}")
    return p.stdout


def done_step(d):
    rows = db_rows(d.db, "SELECT spool_done_step FROM runs WHERE name = ?", (RUN,))
    return rows[0][0] if rows else None


def erank_steps(d, after):
    """{layer: [steps]} of the run's qk.d2.erank.min points after `after`."""
    out = {}
    for layer, step in db_rows(d.db, "SELECT s.layer, p.step FROM points p JOIN series s ON "
                                     "s.id = p.series_id JOIN runs r ON r.id = s.run_id WHERE "
                                     "r.name = ? AND s.name = 'qk.d2.erank.min' AND p.step > ? "
                                     "ORDER BY p.step", (RUN, after)):
        out.setdefault(layer, []).append(step)
    return out


def test(args, workdir):
    extra = ["--set", "reduce_timeout_s=900"]
    d = Daemon(args.build_dir, workdir, extra=extra)
    try:
        simulate(args, d, ["--ranks", str(RANKS)])
        wait_until(lambda: done_step(d) == STEPS - 1 and
                   metrics(d).get("foreshock_writer_queue_items", 1) == 0,
                   timeout=300, what="attempt 0 evaluated")
        # Attempt 1, rank 0 alone: acknowledged, not evaluable.
        simulate(args, d, ["--ranks", "1", "--world-size", str(RANKS), "--first-rank", "0",
                           "--attempt", "1", "--resume-step", str(RESUME)])
        wait_until(lambda: d.get(f"/api/v1/runs/{RUN}")["run"]["attempts"][-1]["rebuilt_at"],
                   timeout=120, what="the rewind rebuilt")
        wait_until(lambda: metrics(d).get("foreshock_writer_queue_items", 1) == 0,
                   timeout=120, what="the writer idle")
        check(done_step(d) == RESUME,
              f"after the rewind to {RESUME} the run's evaluated step is {done_step(d)}: the new "
              "attempt's frames up to it count as evaluated (released, skipped by a start)")
        spooled = metrics(d).get("foreshock_spool_bytes", 0)
        check(spooled > 0, "rank 0's unevaluated frames are not in the spool")
        ports = (d.ingest_port, d.http_port)
        d.kill()
        time.sleep(0.5)
        d = Daemon(args.build_dir, workdir, ingest_port=ports[0], http_port=ports[1], db=d.db,
                   extra=extra)
        simulate(args, d, ["--ranks", "1", "--world-size", str(RANKS), "--first-rank", "1",
                           "--attempt", "1", "--resume-step", str(RESUME)])
        wait_until(lambda: done_step(d) == STEPS - 1 and
                   metrics(d).get("foreshock_writer_queue_items", 1) == 0,
                   timeout=300, what="attempt 1 evaluated")
        want = list(range((RESUME // EVERY + 1) * EVERY, LAST_SKETCH + 1, EVERY))
        got = erank_steps(d, RESUME)
        for layer in range(2):
            check(got.get(layer) == want,
                  f"layer {layer}: qk.d2.erank.min steps after {RESUME}: {got.get(layer)}, "
                  f"want {want}")
        m = metrics(d)
        check(m.get("foreshock_sketches_late_total", 0) == 0,
              f"{m.get('foreshock_sketches_late_total'):.0f} sketches counted late")
        incomplete = db_rows(d.db, "SELECT count(*) FROM incomplete i JOIN runs r ON "
                                   "r.id = i.run_id WHERE r.name = ? AND i.step > ?",
                             (RUN, RESUME))[0][0]
        check(incomplete == 0, f"{incomplete} incomplete reductions after the rewind step")
        print(f"rewind to {RESUME} after {STEPS - 1} evaluated: evaluated step {RESUME} with "
              f"{spooled / 1e3:.0f} kB of rank 0 spooled; after SIGKILL and restart all "
              f"{len(want)} sketch steps after it evaluated from both ranks")
    finally:
        d.stop()


if __name__ == "__main__":
    run_main(test)
