"""End to end: 8 simulated ranks x 5,000 reports through the real daemon.

Every report must be acknowledged, every one must be queryable over HTTP,
and none may be stored twice."""
import os
import subprocess

from fstest import Daemon, check, kill_started, parse_simulate_summary, run_all_pages, run_main

RANKS = 8
STEPS = 5000


def test(args, workdir):
    d = Daemon(args.build_dir, workdir)
    try:
        sim = subprocess.run(
            [os.path.join(args.build_dir, "foreshock"), "simulate",
             "--endpoint", d.endpoint, "--run", "e2e-run", "--ranks", str(RANKS),
             "--steps", str(STEPS), "--layers", "2", "--heads", "2", "--dh", "16",
             "--d", "64", "--sketch-every", "100"],
            capture_output=True, text=True, timeout=600)
        print(sim.stdout[-2000:], sim.stderr[-2000:])
        check(sim.returncode == 0, f"simulate exited {sim.returncode}")
        s = parse_simulate_summary(sim.stdout + sim.stderr)
        check(s["submitted"] == RANKS * STEPS, f"submitted {s['submitted']}")
        check(s["acked"] == RANKS * STEPS, f"acked {s['acked']} of {RANKS * STEPS}")
        check(s["dropped"] == 0, f"dropped {s['dropped']}")

        runs = run_all_pages(d, "/api/v1/runs", "runs")
        check([r["id"] for r in runs] == ["e2e-run"], f"runs: {runs}")
        check(runs[0]["reports"] == RANKS * STEPS, f"run reports {runs[0]['reports']}")
        check(runs[0]["last_step"] == STEPS - 1, f"last_step {runs[0]['last_step']}")

        run = d.get("/api/v1/runs/e2e-run")["run"]
        streams = run["streams_detail"]
        check(len(streams) == RANKS, f"{len(streams)} streams")
        for st in streams:
            check(st["last_seq"] == STEPS and st["reports"] == STEPS,
                  f"stream {st}: expected last_seq = reports = {STEPS}")

        loss = run_all_pages(d, "/api/v1/series?run=e2e-run&name=loss", "series")
        check(sorted(x["labels"]["rank"] for x in loss) == list(range(RANKS)),
              f"loss series: {loss}")
        for ser in loss:
            check(ser["points"] == STEPS and ser["first_step"] == 0
                  and ser["last_step"] == STEPS - 1, f"series {ser}")
        # Read one rank's points back in full through pagination: exactly
        # one value per step, in order.
        sid = loss[0]["id"]
        steps, frm = [], 0
        while frm is not None:
            doc = d.get(f"/api/v1/series/{sid}/points?from={frm}&limit=1000")
            steps += [p[0] for p in doc["points"]]
            frm = doc["next_from"]
        check(steps == list(range(STEPS)), "points of loss series are not exactly steps 0..N-1")
        check(d.stop() == 0, "daemon did not exit 0 on SIGTERM")
    finally:
        kill_started(d)


if __name__ == "__main__":
    run_main(test)
