"""A trainer rolls back to the rollback step its advice suggested and is
monitored correctly as a new attempt.

Attempt 0 of run `rw` runs the attention-numerics scenario (four ranks);
its advice lines give the rollback step R (the earliest one). Attempt 1
restarts from a checkpoint at R (`simulate --attempt 1 --resume-step R`)
with the cause removed LINGER steps later (`--fault-until R+1+LINGER`:
healthy from there on). The
reference run `ref` is one uninterrupted attempt with the same fault cut off
at R+1+LINGER: the same model state at R and the same steps after it. Then:

- every stored point of `rw` after R equals `ref`'s (the re-done steps were
  evaluated as attempt 1's, none counted late), and the incidents `rw`
  transitions in attempt 1 (pending, inactive, ...) are `ref`'s after R:
  detection went on from the state the run had at R, rebuilt from the
  stored points;
- every incident attempt 0 opened after R and had not resolved ends as
  `superseded` (a to_superseded event of attempt 0), none as resolved;
- attempt 1 is advised of none of them (its advice lines name only alerts
  with a transition in attempt 1);
- /api/v1/runs/rw lists the attempts (R, rebuilt) and ?attempt= filters.

Variant `rw2`: the daemon is SIGKILLed right after attempt 1's Hello and its
rebuild marked undone, so the next start rebuilds (stage_load); the outcome
must be the same as `ref`'s."""
import os
import re
import subprocess
import urllib.request

from fstest import (Daemon, RawConn, check, db_exec, hello, proto_module, run_all_pages,
                    run_main, wait_until)

RANKS = 4
STEPS = 600
FAULT_STEP = 300
LAST_SKETCH = 595
# Steps the fault goes on after the restart at R before its cause is
# removed: the first alert (a Δ2 collapse at rank one, two sketches after
# the fault began) advises a rollback 5 steps into the fault, and a fault
# cut off there leaves the reference no incident after R to compare.
LINGER = 20
ADVICE_RE = re.compile(r"simulate: advice rank=(\d+) step=(-?\d+) action=(\S+) alert=(\d+) "
                       r"rule=(\S+) label=(\S+) rollback=(\S+) at=(\d+)")


def simulate(args, d, run, extra=()):
    cmd = [os.path.join(args.build_dir, "foreshock"), "simulate", "--endpoint", d.endpoint,
           "--run", run, "--ranks", str(RANKS), "--steps", str(STEPS), "--layers", "2",
           "--heads", "4", "--dh", "16", "--d", "128", "--sketch-every", "5",
           "--scenario", "attention-numerics", "--fault-step", str(FAULT_STEP),
           "--flush-timeout", "300"] + list(extra)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=900)
    print(f"--- {run} {' '.join(extra)}\n" + p.stdout[-1500:])
    check(p.returncode == 0, f"simulate {run} exited {p.returncode}")
    return p.stdout


def last_common_sketch(out):
    """The last sketch step every rank of a simulate run sent (ranks told to
    stop stop where the advice found them)."""
    sub = [int(m.group(1)) for m in re.finditer(r"simulate: rank=\d+ submitted=(\d+)", out)]
    check(len(sub) == RANKS, f"rank summaries: {sub}")
    return (min(sub) - 1) // 5 * 5


def evaluated(d, run, step):
    ser = run_all_pages(d, f"/api/v1/series?run={run}&name=qk.d2.erank.min", "series")
    return ser and all((s["last_step"] or 0) >= step for s in ser)


def points(d, run, after):
    """{(name, labels, step): value} of every series of run, steps > after."""
    out = {}
    for s in run_all_pages(d, f"/api/v1/series?run={run}", "series"):
        labels = tuple(sorted(s["labels"].items()))
        doc = d.get(f"/api/v1/series/{s['id']}/points?from={after + 1}&limit=10000")
        for step, value in doc["points"]:
            out[(s["name"], labels, step)] = value
    return out


def transitions(d, run, attempt=None, after=-1):
    """(rule, labels, change, step) of every lifecycle transition (of attempt)
    after step `after`: pending and inactive ones too, which depend on the
    baselines as much as firing does."""
    out = set()
    for a in run_all_pages(d, f"/api/v1/alerts?run={run}", "alerts"):
        for e in d.get(f"/api/v1/alerts/{a['id']}")["alert"]["history"]:
            if e["change"] != "to_superseded" and e["step"] > after and \
                    (attempt is None or e["attempt"] == attempt):
                out.add((a["rule"], tuple(sorted(a["labels"].items())), e["change"], e["step"]))
    return out


def attempt_evaluated(d, buckets):
    """Whether this daemon has evaluated `buckets` steps and committed them.
    A rewound run's series still end at the old attempt's last step (its
    points after R stay until re-done: docs/alerting.md, "Rewind"), so
    evaluated() is true before the new attempt is evaluated at all."""
    return metric(d, "foreshock_monitor_buckets_total") >= buckets and \
        metric(d, "foreshock_writer_queue_items") == 0


def check_rewound(d, run, r, ref_points, ref_incidents, attempt1_out, buckets=None):
    wait_until(lambda: evaluated(d, run, LAST_SKETCH), timeout=300, what=f"{run} evaluated")
    if buckets is not None:
        wait_until(lambda: attempt_evaluated(d, buckets), timeout=300,
                   what=f"{run}: attempt 1's {buckets} steps evaluated")
    got = points(d, run, r)
    check(got.keys() == ref_points.keys(),
          f"{run}: {len(got)} points after {r}, ref {len(ref_points)}; "
          f"missing {sorted(set(ref_points) - set(got))[:3]}")
    diff = [k for k in got if got[k] != ref_points[k]]
    check(not diff, f"{run}: {len(diff)} points differ from ref, e.g. {diff[:3]}")
    mine = transitions(d, run, attempt=1)
    check(mine == ref_incidents,
          f"{run}: attempt 1's transitions {sorted(mine)}, ref's {sorted(ref_incidents)}")
    superseded, with_attempt1 = 0, set()
    for a in run_all_pages(d, f"/api/v1/alerts?run={run}", "alerts"):
        hist = d.get(f"/api/v1/alerts/{a['id']}")["alert"]["history"]
        if any(e["attempt"] == 1 for e in hist):
            with_attempt1.add(a["id"])
        # The last transition of attempt 0: an incident still open then, that
        # opened after R, must end superseded (not resolved, not left open).
        last0 = [e for e in hist if e["attempt"] == 0 and e["change"] != "to_superseded"]
        sup = [e for e in hist if e["change"] == "to_superseded"]
        if last0 and last0[-1]["to"] in ("pending", "firing") and \
                last0[-1]["evidence"]["first_breach_step"] > r:
            check(len(sup) == 1 and sup[0]["attempt"] == 0 and sup[0]["step"] == r and
                  sup[0]["from"] == last0[-1]["to"],
                  f"{run} alert {a['id']} {a['rule']}: open at the rewind, history {hist}")
            # The row stays superseded until the alert opens a new incident.
            check(a["state"] == "superseded" or any(e["attempt"] == 1 for e in hist),
                  f"{run} alert {a['id']}: state {a['state']}, history {hist}")
            superseded += 1
        else:
            check(not sup, f"{run} alert {a['id']}: superseded though not open after {r}: {hist}")
    check(superseded > 0, f"{run}: nothing superseded")
    superseded_ids = {a["id"] for a in run_all_pages(d, f"/api/v1/alerts?run={run}&state=superseded",
                                                     "alerts")}
    check(superseded_ids, f"{run}: no alert in state superseded")
    for m in ADVICE_RE.finditer(attempt1_out):
        check(int(m.group(4)) not in superseded_ids,
              f"{run}: attempt 1 was advised about superseded alert {m.group(4)}")
    doc = d.get(f"/api/v1/runs/{run}")["run"]
    att = {a["attempt"]: a for a in doc["attempts"]}
    check(att.keys() == {0, 1} and att[0]["resume_step"] is None and
          att[1]["resume_step"] == r and att[1]["rebuilt_at"] is not None,
          f"{run}: attempts {doc['attempts']}")
    in1 = {a["id"] for a in run_all_pages(d, f"/api/v1/alerts?run={run}&attempt=1", "alerts")}
    check(in1 == with_attempt1, f"{run}: ?attempt=1 lists {in1}, want {with_attempt1}")
    print(f"  {run}: {len(got)} points after step {r} equal ref's; {superseded} incidents "
          f"superseded; attempt 1's {len(mine)} transitions are ref's", flush=True)


def metric(d, name):
    with urllib.request.urlopen(d.url("/metrics"), timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def test(args, workdir):
    pb = proto_module(args.source_dir, workdir)
    # Attempt 0 is told to stop by its first attention-numerics alert, as a
    # trainer that takes the advice would be (the default only checkpoints).
    conf = os.path.join(workdir, "foreshockd.conf")
    with open(conf, "w") as f:
        f.write("[advice]\nattention-numerics = checkpoint_and_stop\n")
    d = Daemon(args.build_dir, workdir, config=conf)
    try:
        out0 = simulate(args, d, "rw", ["--advice-wait", "600", "--stop-on-advice"])
        rollbacks = [int(m.group(7)) for m in ADVICE_RE.finditer(out0)
                     if m.group(6) == "attention-numerics" and m.group(7) != "none"]
        check(rollbacks, "attempt 0 got no attention-numerics advice with a rollback step")
        r = min(rollbacks)
        check(FAULT_STEP < r < STEPS - 1, f"rollback step {r}")
        last0 = last_common_sketch(out0)
        wait_until(lambda: evaluated(d, "rw", last0), timeout=300, what="rw evaluated")
        out1 = simulate(args, d, "rw", ["--attempt", "1", "--resume-step", str(r),
                                        "--fault-until", str(r + 1 + LINGER), "--advice-wait", "2"])
        simulate(args, d, "ref", ["--fault-until", str(r + 1 + LINGER)])
        wait_until(lambda: evaluated(d, "ref", LAST_SKETCH), timeout=300, what="ref evaluated")
        ref_points = points(d, "ref", r)
        ref_incidents = transitions(d, "ref", after=r)
        check(ref_incidents, "ref has no transition after the rollback step: nothing to compare")
        check_rewound(d, "rw", r, ref_points, ref_incidents, out1)
        check(metric(d, "foreshock_sketches_late_total") == 0, "late sketches counted")
        check(metric(d, "foreshock_rewinds_total") == 1, "rewinds counted")

        # Variant: a crash right after attempt 1's Hello, the rebuild undone.
        out0 = simulate(args, d, "rw2", ["--advice-wait", "600", "--stop-on-advice"])
        last0 = last_common_sketch(out0)
        wait_until(lambda: evaluated(d, "rw2", last0), timeout=300, what="rw2 evaluated")
        c = RawConn(pb, d.ingest_port)
        h = hello(pb, "rw2", attempt=1, world=RANKS)
        h.hello.resume_step = r
        c.send(h)
        w = c.recv()
        check(w is not None and w.HasField("welcome"), f"no Welcome: {w}")
        d.kill()
        c.close()
        db_exec(d.db, "UPDATE attempts SET rebuilt_at = NULL WHERE attempt = 1 AND run_id = "
                      "(SELECT id FROM runs WHERE name = 'rw2')")
        d = Daemon(args.build_dir, workdir, ingest_port=d.ingest_port, http_port=d.http_port,
                   config=conf)
        wait_until(lambda: d.get("/api/v1/runs/rw2")["run"]["attempts"][-1]["rebuilt_at"],
                   timeout=120, what="rw2's rewind rebuilt at the start")
        out2 = simulate(args, d, "rw2", ["--attempt", "1", "--resume-step", str(r),
                                         "--fault-until", str(r + 1 + LINGER), "--advice-wait", "2"])
        # This daemon evaluates nothing but attempt 1's sketch steps after R.
        check_rewound(d, "rw2", r, ref_points, ref_incidents, out2,
                      buckets=LAST_SKETCH // 5 - r // 5)
        check(metric(d, "foreshock_sketches_late_total") == 0, "rw2: late sketches counted")
    finally:
        d.stop()


if __name__ == "__main__":
    run_main(test)
