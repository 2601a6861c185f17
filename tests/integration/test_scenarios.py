"""Each simulator scenario against a real daemon gives the expected alerts
over HTTP: none for healthy; an attention-numerics alert that fires before
the simulated loss diverges; optimizer-hyperparameter (or combined) for a
too-large learning rate; combined when both faults are injected. Healthy and
attention-numerics also run on the spectrum route with grouped-query
attention (8 query heads, 2 key heads; each rank sends whole heads' spectrum
sketches). The last case restarts the daemon in the middle of the run: the
outcome must not change (no re-fired alert, no forgotten one)."""
import os
import re
import subprocess
import time

from fstest import Daemon, check, kill_started, run_all_pages, run_main

RANKS = 4
STEPS = 600
SKETCH_EVERY = 5
FAULT_STEP = 300
TRUTH_RE = re.compile(r"simulate: scenario=(\S+) fault_step=(\S+) diverge_step=(\S+)")

# scenario -> (labels of which at least one must fire, labels none may carry)
EXPECT = {
    "healthy": (set(), None),
    "attention-numerics": ({"attention-numerics"}, {"optimizer-hyperparameter"}),
    "lr-spike": ({"optimizer-hyperparameter", "combined"}, {"attention-numerics"}),
    "combined": ({"combined"}, set()),
}


SPECTRUM_GQA = ("--route", "spectrum", "--heads", "8", "--kv-heads", "2")


def simulate(args, endpoint, run, scenario, extra=()):
    cmd = [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", endpoint,
           "--run", run, "--ranks", str(RANKS), "--steps", str(STEPS), "--layers", "2",
           "--heads", "4", "--dh", "16", "--d", "128", "--sketch-every", str(SKETCH_EVERY),
           "--scenario", scenario, "--flush-timeout", "300"]
    if scenario != "healthy":
        cmd += ["--fault-step", str(FAULT_STEP)]
    return subprocess.Popen(list(cmd) + list(extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(p):
    out, _ = p.communicate(timeout=900)
    print(out[-1500:])
    check(p.returncode == 0, f"simulate exited {p.returncode}")
    m = TRUTH_RE.search(out)
    check(m is not None, "no ground-truth line from simulate")
    div = None if m.group(3) == "none" else int(m.group(3))
    return div


def wait_evaluated(d, run, last_step):
    """Monitors run after the reports commit; wait until the last sketched
    step's series exists (bounded)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ser = d.get(f"/api/v1/series?run={run}&name=qk.d2.erank.min")["series"]
        if ser and max(s["last_step"] or 0 for s in ser) >= last_step:
            return
        time.sleep(0.2)
    raise AssertionError(f"{run}: monitors never reached step {last_step}")


def check_outcome(d, run, scenario, diverge):
    alerts = run_all_pages(d, f"/api/v1/alerts?run={run}", "alerts")
    fired = [a for a in alerts if a["evidence"]["fired_step"] is not None]
    for a in fired:
        print(f"  {run}: {a['rule']} {a['attribution']} fired at {a['evidence']['fired_step']}"
              f" labels={a['labels']} state={a['state']}")
    want, forbid = EXPECT[scenario]
    if scenario == "healthy":
        check(not fired, f"healthy run fired {len(fired)} alert(s): {fired[:3]}")
        return
    mech = [a for a in fired if a["rule"] not in ("loss", "grad_norm")]
    labels = {a["attribution"] for a in mech}
    check(labels & want, f"{scenario}: wanted one of {want}, got {labels}")
    check(not (labels & forbid), f"{scenario}: unexpected {labels & forbid}")
    first = min(a["evidence"]["fired_step"] for a in mech if a["attribution"] in want)
    check(diverge is not None and first < diverge,
          f"{scenario}: first mechanism alert at {first}, loss diverges at {diverge}")
    loss_alerts = [a["evidence"]["fired_step"] for a in fired if a["rule"] in ("loss", "grad_norm")]
    if loss_alerts:
        check(first < min(loss_alerts), f"{scenario}: loss detector fired first")
    print(f"  {scenario}: lead time {diverge - first} steps over divergence")
    # Every alert carries its evidence and a stable identity.
    one = d.get(f"/api/v1/alerts/{mech[0]['id']}")["alert"]
    check(one["dedup_key"].startswith("fs-") and one["history"], f"alert detail: {one}")
    check(one["history"][0]["change"] == "to_pending", "history does not start with to_pending")


def test(args, workdir):
    d = Daemon(args.build_dir, workdir)
    restarted = None
    try:
        procs = {(s, f"sc-{s}"): simulate(args, d.endpoint, f"sc-{s}", s)
                 for s in ("healthy", "attention-numerics", "lr-spike")}
        procs.update({(s, f"sc-{s}-spectrum"): simulate(args, d.endpoint, f"sc-{s}-spectrum", s,
                                                        extra=SPECTRUM_GQA)
                      for s in ("healthy", "attention-numerics")})
        for (s, run), p in procs.items():
            div = finish(p)
            wait_evaluated(d, run, STEPS - SKETCH_EVERY)
            check_outcome(d, run, s, div)
        # The spectrum runs sent each head once, as a spectrum sketch: 8
        # heads' series per layer, and no incomplete reduction.
        heads = run_all_pages(d, "/api/v1/series?run=sc-attention-numerics-spectrum"
                              "&name=qk.d2.erank", "series")
        check(sorted({(x["labels"]["layer"], x["labels"]["head"]) for x in heads}) ==
              [(layer, h) for layer in range(2) for h in range(8)],
              f"spectrum run heads: {[x['labels'] for x in heads][:20]}")

        # combined, with a daemon restart (SIGTERM) in the middle of the run.
        p = simulate(args, d.endpoint, "sc-combined", "combined", extra=("--rate", "100"))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            runs = {r["id"]: r for r in run_all_pages(d, "/api/v1/runs", "runs")}
            r = runs.get("sc-combined")
            if r and (r["last_step"] or 0) >= FAULT_STEP + 10:
                break
            time.sleep(0.2)
        ingest, http, db = d.ingest_port, d.http_port, d.db
        check(d.stop() == 0, "daemon did not stop cleanly")
        restarted = Daemon(args.build_dir, workdir, ingest_port=ingest, http_port=http, db=db)
        div = finish(p)
        wait_evaluated(restarted, "sc-combined", STEPS - SKETCH_EVERY)
        check_outcome(restarted, "sc-combined", "combined", div)
        # No alert identity appears twice and no incident fired twice.
        alerts = run_all_pages(restarted, "/api/v1/alerts?run=sc-combined", "alerts")
        keys = [a["alert_key"] for a in alerts]
        check(len(keys) == len(set(keys)), "duplicate alert identities after restart")
        for a in alerts:
            h = restarted.get(f"/api/v1/alerts/{a['id']}")["alert"]["history"]
            fires = [e for e in h if e["change"] == "to_firing"]
            check(len(fires) <= a["incidents"], f"{a['alert_key']} fired more than its incidents")
        check(restarted.stop() == 0, "restarted daemon did not stop cleanly")
    finally:
        kill_started(d, restarted)


if __name__ == "__main__":
    run_main(test)
