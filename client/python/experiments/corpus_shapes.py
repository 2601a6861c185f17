"""Records the shapes corpus (CORPUS.md, "Shapes corpus"): small runs of
model shapes the detection defaults were not tuned on, with the faults the
first corpus could not show: learning-rate faults hidden from the logged
rate (a ramp and a jump), a peak rate too large from the start, faults late
in the run (step 400 of 1,000, baselines warm), three schedules (constant,
cosine, warmup-stable-decay) and healthy runs of 3,000 steps. Whole shapes
are held out: the `tuning` shapes may inform the defaults, the
`validation` shapes only report on them.

    FORESHOCK_LIB=build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_shapes.py /tmp/shapes-out

Writes what corpus.py writes (runs/NAME.fsrec, .jsonl, .log, .meta.json,
manifest.json), named SHAPE.SCENARIO.sSEED. Resumable like corpus.py.
Recorded as a default Monitor sends (windows 10 and 50, a sketch every 10
steps): the scorecard replays exactly that.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from corpus import complete, log, paths, run_trainers  # noqa: E402
from run_experiment import divergence_step, read_jsonl  # noqa: E402

COMMON = ["--ctx", "32", "--batch", "16", "--warmup", "50", "--clip", "1.0", "--threads", "1"]
MONITOR = ["--windows", "10,50", "--every", "10", "--detect-from", "0"]
POST_DIVERGE = 30  # steps recorded after divergence (the scorecard stops there)

# Shapes: (d, layers, heads) give head_dim d / heads. The first corpus was
# d 48, 3 layers, 4 heads (dh 12); none of these is that shape.
SHAPES = {
    "moe-dh8-h8-l2": {"args": ["--arch", "gpt", "--experts", "4", "--top-k", "2",
                               "--d", "64", "--layers", "2", "--heads", "8"],
                      "split": "tuning", "head_dim": 8},
    "moe-dh32-h4-l2": {"args": ["--arch", "gpt", "--experts", "8", "--top-k", "2",
                                "--d", "128", "--layers", "2", "--heads", "4"],
                       "split": "validation", "head_dim": 32},
    "moe-dh16-h6-l4": {"args": ["--arch", "gpt", "--experts", "4", "--top-k", "2",
                                "--d", "96", "--layers", "4", "--heads", "6"],
                       "split": "validation", "head_dim": 16},
    "moe-dh8-h16-l2": {"args": ["--arch", "gpt", "--experts", "4", "--top-k", "2",
                                "--d", "128", "--layers", "2", "--heads", "16"],
                       "split": "validation", "head_dim": 8},
    # head_dim 64 with 2 heads: d 256 with 4 heads ran at 0.5-0.7 s a step
    # on the shared cores, too slow to record here.
    "moe-dh64-h2-l2": {"args": ["--arch", "gpt", "--experts", "4", "--top-k", "2",
                                "--d", "128", "--layers", "2", "--heads", "2"],
                       "split": "validation", "head_dim": 64},
    "dense-dh16-h4-l6": {"args": ["--arch", "gpt", "--experts", "0",
                                  "--d", "64", "--layers", "6", "--heads", "4"],
                         "split": "validation", "head_dim": 16},
}
LR = 6e-3
STEPS, HEALTHY_STEPS, FAULT_STEP, LATE_LR_STEP = 1000, 3000, 400, 500
PEAK_STEPS = 600  # lr-peak: too large from step 1; a run that lasts 600 steps lasts
# scenario -> (train.py scenario, extra arguments). The LR faults are all
# hidden from the logged rate (--lr-hidden, --peak-mult): only the
# mechanism can show them.
SCENARIOS = {
    "healthy": ("healthy", []),
    "lr-ramp-hidden": ("lr", ["--lr-hidden", "--lr-mult", "10", "--lr-ramp", "200"]),
    "lr-jump-hidden": ("lr", ["--lr-hidden", "--lr-mult", "6", "--lr-ramp", "1"]),
    "lr-peak": ("healthy", ["--peak-mult", "10"]),
    "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
    "combined-late": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden",
                                   "--lr-mult", "10", "--lr-ramp", "200",
                                   "--lr-fault-step", str(LATE_LR_STEP)]),
    # Recorded last (appended so the schedules of the others stay put): 10x
    # over 200 steps left three of six shapes undiverged in 1,000 steps.
    "lr-ramp20-hidden": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]),
}
# One seed: on 2 cores shared with other work (load 10-14) a step took
# 0.1-0.7 s, so the matrix is one seed per shape; shapes, not seeds, are
# what the defaults must generalise over.
SEEDS = (1,)
SCHEDULES = ("constant", "cosine", "wsd")
# The whole matrix, as one value: plan(), write_manifest() and main() take
# another (corpus_holdout.py's) in its place. Scenario arguments may name
# "{KEY}"s, filled from "fmt" and a shape's own "fmt" (a shape may also set
# its own "lr"); "bits" is the attention fault's. manifest_lr_mult: the
# manifest gives each run's --lr-mult (this corpus's leaves it null).
# warmup_of (optional): {schedule: warm-up steps}, each run's --warmup by
# its schedule (and a "warmup" in its manifest entry); without it, COMMON's.
# overrides (optional): {scenario: {"schedule", "steps", "fault_step"}},
# any of them, in place of the alternation, the step tables and the
# matrix's fault step for that scenario's runs (the manifest's fault_step;
# train.py still gets the matrix's --fault-step), and "post_diverge" (-1:
# train on after a divergence, for a hard negative whose loss spike meets
# the divergence criterion).
# only (optional): {scenario: [shapes]}, that scenario on those shapes
# alone (a router fault needs an MoE); the others' schedules stay put.
MATRIX = {"shapes": SHAPES, "scenarios": SCENARIOS, "seeds": SEEDS, "schedules": SCHEDULES,
          "lr": LR, "common": COMMON, "monitor": MONITOR, "steps": STEPS,
          "healthy_steps": HEALTHY_STEPS, "peak_steps": PEAK_STEPS, "fault_step": FAULT_STEP,
          "late_lr_step": LATE_LR_STEP, "post_diverge": POST_DIVERGE, "fmt": {"bits": 12},
          "description": "Foreshock shapes corpus (CORPUS.md)"}


def plan(shapes=None, scenarios=None, seeds=None, matrix=MATRIX):
    m = matrix
    runs = []
    names = list(m["shapes"])
    for seed in seeds or m["seeds"]:
        for shape in shapes or names:
            c = m["shapes"][shape]
            fmt = dict(m["fmt"], **c.get("fmt", {}))
            for sc in scenarios or m["scenarios"]:
                if shape not in m.get("only", {}).get(sc, [shape]):
                    continue
                sched = m["schedules"][(names.index(shape) + seed + list(m["scenarios"]).index(sc))
                                       % len(m["schedules"])]
                steps = {"healthy": m["healthy_steps"], "lr-peak": m["peak_steps"]}.get(
                    sc, m["steps"])
                train_sc, extra = m["scenarios"][sc]
                extra = [x.format(**fmt) for x in extra]
                fault = None if sc == "healthy" else (1 if sc == "lr-peak" else m["fault_step"])
                o = m.get("overrides", {}).get(sc, {})
                sched, steps = o.get("schedule", sched), o.get("steps", steps)
                post = o.get("post_diverge", m["post_diverge"])
                fault = o.get("fault_step", fault)
                args = c["args"] + ["--lr", str(c.get("lr", m["lr"]))] + m["common"] + \
                    m["monitor"] + extra + [
                    "--steps", str(steps), "--seed", str(seed), "--schedule", sched,
                    "--scenario", train_sc, "--fault-step", str(m["fault_step"]),
                    "--stop-after-diverge", str(post)]
                warmup = m.get("warmup_of", {}).get(sched)
                if warmup is not None:  # after COMMON's --warmup: the last one counts
                    args += ["--warmup", str(warmup)]
                runs.append({"name": f"{shape}.{sc}.s{seed}", "arch": shape, "shape": shape,
                             "head_dim": c["head_dim"], "scenario": sc, "schedule": sched,
                             "seed": seed, "split": c["split"], "steps": steps,
                             "fault_step": fault,
                             # Every combined-late variant (-ft, -weak): where
                             # its hidden LR fault begins (scorecard.score_run).
                             "lr_fault_step": (m.get("late_lr_step")
                                               if sc.startswith("combined-late") else None),
                             "bits": int(fmt["bits"]) if "--bits" in extra else None,
                             "lr_mult": (float(extra[extra.index("--lr-mult") + 1])
                                         if m.get("manifest_lr_mult") and "--lr-mult" in extra
                                         else None),
                             "train_scenario": train_sc,
                             "lr_hidden": "--lr-hidden" in extra or "--peak-mult" in extra,
                             "train_args": args})
                if warmup is not None:
                    runs[-1]["warmup"] = warmup
                # The windows and cadence the run's Monitor sends, for the
                # manifest (scorecard.py replays a run at them when they
                # are not a default Monitor's).
                mon = m["monitor"]
                if "--windows" in mon and "--every" in mon:
                    runs[-1]["windows"] = mon[mon.index("--windows") + 1]
                    runs[-1]["every"] = int(mon[mon.index("--every") + 1])
    return runs


def entry(out, r):
    p = paths(out, r["name"])
    e = {k: v for k, v in r.items() if k != "train_args"}
    e["complete"] = complete(out, r)
    e["recording"] = os.path.relpath(p["recording"], out)
    e["steps_recorded"] = e["divergence_step"] = e["recording_bytes"] = None
    if e["complete"]:
        recs, _ = read_jsonl(p["out"])
        e["steps_recorded"] = recs[-1]["step"] if recs else 0
        e["divergence_step"] = divergence_step(recs)
        e["recording_bytes"] = os.path.getsize(p["recording"])
    e["train_args"] = r["train_args"]
    return e


def write_manifest(out, runs, matrix=MATRIX):
    tmp = os.path.join(out, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"description": matrix["description"],
                   "runs": [entry(out, r) for r in runs]}, f, indent=1)
    os.replace(tmp, os.path.join(out, "manifest.json"))


def main(argv=None, matrix=MATRIX, doc=__doc__):
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--shapes", default=None)
    p.add_argument("--scenarios", default=None)
    p.add_argument("--seeds", default=None)
    a = p.parse_args(argv)
    split = lambda s, f=str: [f(x) for x in s.split(",")] if s else None  # noqa: E731
    runs = plan(split(a.shapes), split(a.scenarios), split(a.seeds, int), matrix)
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    # Healthy runs first, then the scenarios in the table's order, validation
    # shapes before tuning ones: a corpus cut short still holds whole
    # scenarios.
    order = list(matrix["scenarios"])
    todo = sorted([r for r in runs if not complete(a.out, r)],
                  key=lambda r: (order.index(r["scenario"]), r["split"] != "validation"))
    log(f"{len(runs)} runs, {len(todo)} to run, {a.jobs} at a time")
    failed = []

    def finished(r, returncode, wall, pending, running):
        e = entry(a.out, r)
        if not e["complete"]:
            failed.append(r["name"])
        log(f"done {r['name']}: rc={returncode} steps={e['steps_recorded']} "
            f"diverged={e['divergence_step']} ({pending} left)")

    # As this corpus was recorded: a rerun leaves an earlier attempt's files
    # in place until train.py writes them again (corpus.py removes them).
    run_trainers(a.out, todo, a.jobs, finished, clear_stale=False)
    write_manifest(a.out, runs, matrix)
    return 1 if failed else 0


def plan_priority(priority, matrices, shapes=None, scenarios=None, seeds=None, matrix_of=None):
    """A later look's plan in its recording order: priority is a list of
    (scenario, shapes) or (scenario, shapes, seeds), each shape planned
    with its own matrix (matrices[shape], or matrix_of(scenario, shape) when
    given: a scenario that changes the matrix); shapes, scenarios and seeds
    narrow it (seeds wins over an entry's own)."""
    runs = []
    for sc, on, *seeds_of in priority:
        for shape in on:
            if (shapes and shape not in shapes) or (scenarios and sc not in scenarios):
                continue
            m = matrix_of(sc, shape) if matrix_of else matrices[shape]
            runs += plan([shape], [sc], seeds or (seeds_of or [None])[0], m)
    return runs


def record_planned(runs, matrix, doc, argv=None, start_until_min=None):
    """Records `runs` (a later look's plan, in its priority order) into the
    directory argv names: the ones not yet complete, --jobs at a time,
    rewriting the manifest after each (a corpus cut short has one). With
    start_until_min, no trainer starts after that many minutes
    (--start-until). --manifest-only rewrites the manifest from what the
    directory holds; --list prints the plan. Returns the exit status: 1
    when a run failed or was not started."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--jobs", type=int, default=2)
    if start_until_min is not None:
        p.add_argument("--start-until", type=float, default=start_until_min,
                       help="minutes after which no trainer starts")
    p.add_argument("--manifest-only", action="store_true",
                   help="only rewrite manifest.json from what OUT holds")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    a = p.parse_args(argv)
    if a.list:
        for r in runs:
            print(r["name"], r["schedule"], r["steps"], r["fault_step"], r.get("lr_fault_step"))
        return 0
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    todo = [] if a.manifest_only else [r for r in runs if not complete(a.out, r)]
    log(f"{len(runs)} runs, {len(todo)} to run, {a.jobs} at a time")
    failed = []

    def finished(r, returncode, wall, pending, running):
        e = entry(a.out, r)
        if not e["complete"]:
            failed.append(r["name"])
        log(f"done {r['name']}: rc={returncode} steps={e['steps_recorded']} "
            f"diverged={e['divergence_step']} wall={wall:.0f}s ({pending} left)")
        write_manifest(a.out, runs, matrix)  # a corpus cut short has one

    until = None if start_until_min is None else time.monotonic() + 60 * a.start_until
    left = run_trainers(a.out, todo, a.jobs, finished, start_until=until)
    if left:
        log(f"not started (run again to record them): {', '.join(r['name'] for r in left)}")
    write_manifest(a.out, runs, matrix)
    return 1 if failed or left else 0


def late_look_scenarios(fault, late_after, batch):
    """The scenario table the eighteenth, nineteenth and twenty-first looks
    share, faults and healthy disturbances at step `fault` (each look plans
    the ones its PRIORITY names): the attention fault (bits from fmt, O and
    dO); combined-late, that fault and a hidden 20x ramp over 200 steps
    from fault + late_after; a hidden 5x jump; and hard negatives, train.py's
    healthy scenario with one change (any alert false, a loss-spike page
    right for healthy-corrupt): a context of 64, three batches of random
    tokens, shifted data, the batch of `batch` sequences halved, harder
    data."""
    attn = ["--bits", "{bits}", "--fault-on", "both"]
    return {
        "healthy": ("healthy", []),
        "attn-strong": ("attention-numerics", list(attn)),
        "combined-late": ("combined", attn + ["--lr-hidden", "--lr-mult", "20", "--lr-ramp",
                                              "200", "--lr-fault-step",
                                              str(fault + late_after)]),
        "lr-jump5-hidden": ("lr", ["--lr-hidden", "--lr-mult", "5", "--lr-ramp", "1"]),
        "healthy-seqlen": ("healthy", ["--ctx-change", f"{fault}:64"]),
        "healthy-corrupt": ("healthy", ["--corrupt", f"{fault}:3"]),
        "healthy-datashift": ("healthy", ["--data-shift", str(fault)]),
        "healthy-batchhalf": ("healthy", ["--batch-change", f"{fault}:{batch // 2}"]),
        "healthy-datahard": ("healthy", ["--data-hard", str(fault)]),
    }

def recorder(priority, matrices, matrix, doc, start_until_min):
    """A later look's plan() and main(): plan(shapes, scenarios, seeds) is
    plan_priority over its priority order, main(argv) records it with
    record_planned (the recorders from the fourteenth look on)."""
    def plan(shapes=None, scenarios=None, seeds=None):
        return plan_priority(priority, matrices, shapes, scenarios, seeds)

    def main(argv=None):
        return record_planned(plan(), matrix, doc, argv, start_until_min=start_until_min)

    return plan, main


if __name__ == "__main__":
    sys.exit(main())
