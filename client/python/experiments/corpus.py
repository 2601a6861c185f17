"""Records a corpus of small training runs for backtesting Foreshock's
detection defaults (CORPUS.md): 3 architectures x 6 scenarios x 5 seeds,
each run recorded by foreshock.Monitor(record=...) with no daemon.

    /usr/bin/python3 client/python/experiments/corpus.py /work/corpus-out

Writes into OUT:
  runs/NAME.fsrec   the recording (`foreshock backtest runs/*.fsrec`)
  runs/NAME.jsonl   per-step loss, grad_norm, lr, timings; a last summary line
  runs/NAME.log     the trainer's log
  runs/NAME.meta.json  what the runner knew of the finished run (wall seconds)
  manifest.json     one entry per run of the matrix (rewritten after each run)

Runs are named ARCH.SCENARIO.sSEED (gpt-dense.attn-strong.s3). Odd seeds use
the constant schedule, even seeds cosine. Seeds 1-3 are the tuning split,
4-5 validation. Resumable: a run whose recording and per-step file are
complete and that was made with the current table's arguments is not run
again (--force reruns it anyway).
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run_experiment import divergence_step, read_jsonl  # noqa: E402

# Model and optimizer shared by all architectures: small enough that the
# 75-run matrix records in about 50 minutes on 2 shared cores, large enough
# that the attention fault collapses the Q/K update spectra and diverges.
# d 48, 3 layers, 4 heads (head_dim 12), context 32, batch 16.
COMMON = ["--d", "48", "--layers", "3", "--heads", "4", "--ctx", "32", "--batch", "16",
          "--warmup", "50", "--clip", "1.0", "--threads", "1"]
# Monitor settings of every recording. --detect-from 0: a recording carries
# no experiment-only setting; backtests choose their own warm-up.
MONITOR = ["--windows", "5,10,25,50", "--every", "5", "--detect-from", "0"]
# Steps recorded after the loss diverged (faulted runs stop there; the
# loss-based detector often fires around divergence, so keep some after).
POST_DIVERGE = 100

# Calibrated on seeds 1 (constant) and 2 (cosine) with short trial runs
# (CORPUS.md, "Calibration"). Per architecture: peak learning rate, steps
# (every scenario of a seed runs the same schedule length), fault step,
# BF16 low bits truncated (tinygpt.truncate_bf16; 8 and more also clear
# exponent bits) for the strong and weak attention fault and for combined,
# the learning-rate fault's multiplier and ramp.
# The GPT layouts resist the fault: at lr 3e-3 even 9-16 bits left cosine
# runs undiverged after 1,000 steps, so they train at 6e-3 (healthy runs
# still never pass 1.08x their best 25-step mean). Divergence steps are not
# monotone in the bits beyond 8 (gpt-moe: 16 bits, D = 0, did not diverge
# on seed 2, 12 did); the labels follow the bits. gpt-dense first recorded
# with 9 / 8 bits: 8 bits left seed 2 (cosine) at 1.185x, undiverged after
# 1,000 steps, so its cell moved up one bit (10 / 9; 9 bits diverged on all
# five seeds, 10 on seeds 2 and 4 in trials at 471 and 338).
ARCHS = {
    "gpt-dense": {"args": ["--arch", "gpt", "--experts", "0", "--lr", "6e-3"],
                  "lr": 6e-3, "steps": 1000, "fault_step": 200,
                  "attn_strong_bits": 10, "attn_weak_bits": 9, "combined_bits": 10,
                  "lr_mult": 100.0, "lr_ramp": 200},
    "gpt-moe": {"args": ["--arch", "gpt", "--experts", "4", "--top-k", "2", "--lr", "6e-3"],
                "lr": 6e-3, "steps": 1000, "fault_step": 200,
                "attn_strong_bits": 12, "attn_weak_bits": 9, "combined_bits": 12,
                "lr_mult": 100.0, "lr_ramp": 200},
    "llama": {"args": ["--arch", "llama", "--kv-heads", "2", "--lr", "3e-3"],
              "lr": 3e-3, "steps": 1100, "fault_step": 200,
              "attn_strong_bits": 7, "attn_weak_bits": 6, "combined_bits": 7,
              "lr_mult": 100.0, "lr_ramp": 200},
}
SCENARIOS = ("healthy", "attn-strong", "attn-weak", "lr", "combined", "combined-late")
# combined-late: the attention fault from the fault step, the learning-rate
# ramp from this step. With both at once the LR ramp diverges the run 22-36
# steps after the fault, before any attention evidence can exist (the
# attention fault alone takes 40+ steps to show in Delta2), so nothing can
# tell that Delta2 collapse from a consequence of the large steps; staggered,
# each fault has its own evidence before the run diverges.
LATE_LR_STEP = 300
SEEDS = (1, 2, 3, 4, 5)
TUNING_SEEDS = (1, 2, 3)


def schedule_of(seed):
    return "constant" if seed % 2 else "cosine"


def plan(archs=None, scenarios=None, seeds=None):
    """The matrix, in the order it runs: seed-major so that a partial
    corpus holds whole seeds of every architecture and scenario."""
    runs = []
    for seed in seeds or SEEDS:
        for arch in archs or ARCHS:
            c = ARCHS[arch]
            for sc in scenarios or SCENARIOS:
                r = {"name": f"{arch}.{sc}.s{seed}", "arch": arch, "scenario": sc,
                     "schedule": schedule_of(seed), "seed": seed,
                     "split": "tuning" if seed in TUNING_SEEDS else "validation",
                     "steps": c["steps"], "fault_step": None if sc == "healthy" else c["fault_step"],
                     "lr": c["lr"], "bits": None, "fault_on": None, "lr_mult": None,
                     "lr_ramp": None}
                args = ["--steps", str(c["steps"]), "--seed", str(seed),
                        "--schedule", r["schedule"]]
                r["lr_fault_step"] = None
                if sc in ("attn-strong", "attn-weak", "combined", "combined-late"):
                    r["bits"] = c[{"attn-strong": "attn_strong_bits", "attn-weak": "attn_weak_bits",
                                   "combined": "combined_bits",
                                   "combined-late": "combined_bits"}[sc]]
                    r["fault_on"] = "both"
                    args += ["--bits", str(r["bits"]), "--fault-on", "both"]
                if sc in ("lr", "combined", "combined-late"):
                    r["lr_mult"], r["lr_ramp"] = c["lr_mult"], c["lr_ramp"]
                    args += ["--lr-mult", str(c["lr_mult"]), "--lr-ramp", str(c["lr_ramp"])]
                if sc == "combined-late":
                    r["lr_fault_step"] = LATE_LR_STEP
                    args += ["--lr-fault-step", str(LATE_LR_STEP)]
                train_sc = {"healthy": "healthy", "attn-strong": "attention-numerics",
                            "attn-weak": "attention-numerics", "lr": "lr",
                            "combined": "combined", "combined-late": "combined"}[sc]
                args += ["--scenario", train_sc, "--fault-step", str(c["fault_step"]),
                         "--stop-after-diverge", str(POST_DIVERGE)]
                r["train_scenario"] = train_sc
                r["train_args"] = c["args"] + COMMON + MONITOR + args
                runs.append(r)
    return runs


def paths(out, name):
    d = os.path.join(out, "runs")
    return {k: os.path.join(d, name + ext) for k, ext in
            (("recording", ".fsrec"), ("out", ".jsonl"), ("log", ".log"), ("meta", ".meta.json"))}


def complete(out, r):
    """True when the run's per-step file ends in its summary, every report
    was recorded, the recording exists, and the run was made with the
    trainer arguments the table gives now (a changed table reruns its
    cells)."""
    p = paths(out, r["name"])
    if not all(os.path.exists(p[k]) for k in ("recording", "out", "meta")):
        return False
    try:
        with open(p["meta"]) as f:
            if json.load(f).get("cmd_args") != r["train_args"]:
                return False
    except (ValueError, OSError):
        return False
    try:
        _, summary = read_jsonl(p["out"])
    except (ValueError, OSError):
        return False
    if not summary:
        return False
    client = summary.get("client") or {}
    return (client.get("record_failed") == 0 and client.get("recorded") == client.get("reports")
            and os.path.getsize(p["recording"]) > 0)


def entry(out, r):
    """The manifest entry of run r (complete or not)."""
    p = paths(out, r["name"])
    e = {k: r[k] for k in ("name", "arch", "schedule", "scenario", "seed", "split",
                           "fault_step", "steps", "lr", "bits", "fault_on", "lr_mult", "lr_ramp",
                           "lr_fault_step")}
    e["train_scenario"] = r["train_scenario"]
    e["complete"] = complete(out, r)
    e["recording"] = os.path.relpath(p["recording"], out)
    e["out"] = os.path.relpath(p["out"], out)
    e["steps_recorded"] = e["divergence_step"] = e["wall_s"] = e["train_wall_s"] = None
    e["recording_bytes"] = None
    if e["complete"]:
        recs, summary = read_jsonl(p["out"])
        e["steps_recorded"] = recs[-1]["step"] if recs else 0
        e["divergence_step"] = divergence_step(recs)
        e["train_wall_s"] = round(summary["wall_s"], 2)
        e["recording_bytes"] = os.path.getsize(p["recording"])
        if os.path.exists(p["meta"]):
            with open(p["meta"]) as f:
                e["wall_s"] = json.load(f).get("wall_s")
    e["train_args"] = r["train_args"]
    return e


def write_manifest(out, runs):
    m = {"description": "Foreshock backtest corpus: small runs recorded with no daemon "
                        "(client/python/experiments/CORPUS.md)",
         "splits": {"tuning": list(TUNING_SEEDS),
                    "validation": [s for s in SEEDS if s not in TUNING_SEEDS]},
         "schedules": "odd seeds constant, even seeds cosine",
         "monitor": {"windows": [5, 10, 25, 50], "every": 5, "detect_from_step": 0},
         "divergence": "run_experiment.divergence_step: loss not finite, or its 25-step mean "
                       "> 1.2x the lowest 25-step mean so far; faulted runs stop "
                       f"{POST_DIVERGE} steps after it",
         "archs": ARCHS, "common_args": COMMON,
         "runs": [entry(out, r) for r in runs]}
    tmp = os.path.join(out, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump(m, f, indent=1)
    os.replace(tmp, os.path.join(out, "manifest.json"))


def log(msg):
    print(time.strftime("%H:%M:%S ") + msg, flush=True)


def run_trainers(out, todo, jobs, finished, clear_stale=True, started=None, start_until=None):
    """Runs train.py once for each run of todo, in order, `jobs` at a time,
    each writing its recording and per-step file where paths(out, name)
    says and its output into runs/NAME.log. clear_stale: first remove the
    recording, per-step and meta files an earlier attempt left. started(r),
    when given, is called once r's trainer has started. When a trainer
    exits, a zero exit status writes r's meta file (wall seconds, trainer
    arguments: what complete() compares), then finished(r, returncode,
    wall_s, pending, running) is called, pending and running counting the
    runs not yet started and still running. start_until (a time.monotonic()
    value), when given: no trainer starts after it. Returns, once every
    started trainer has exited, the runs of todo never started."""
    train = os.path.join(HERE, "train.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    pending, active = list(todo), []

    def may_start():
        return pending and (start_until is None or time.monotonic() < start_until)

    while may_start() or active:
        while may_start() and len(active) < jobs:
            r = pending.pop(0)
            pt = paths(out, r["name"])
            for k in ("recording", "out", "meta"):
                if clear_stale and os.path.exists(pt[k]):
                    os.remove(pt[k])
            cmd = [sys.executable, train, "--run", r["name"], "--record", pt["recording"],
                   "--out", pt["out"]] + r["train_args"]
            logf = open(pt["log"], "w")
            active.append((r, subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                               env=env), logf, time.monotonic()))
            if started:
                started(r)
        time.sleep(0.5)
        for item in list(active):
            r, proc, logf, t0 = item
            if proc.poll() is None:
                continue
            logf.close()
            active.remove(item)
            wall = time.monotonic() - t0
            if proc.returncode == 0:
                with open(paths(out, r["name"])["meta"], "w") as f:
                    json.dump({"wall_s": round(wall, 2), "cmd_args": r["train_args"]}, f)
            finished(r, proc.returncode, wall, len(pending), len(active))
    return pending


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output directory (large: keep it outside git checkouts)")
    p.add_argument("--jobs", type=int, default=2, help="trainers at once")
    p.add_argument("--archs", default=None, help="comma separated subset")
    p.add_argument("--scenarios", default=None, help="comma separated subset")
    p.add_argument("--seeds", default=None, help="comma separated subset")
    p.add_argument("--force", action="store_true", help="rerun complete runs too")
    p.add_argument("--manifest-only", action="store_true",
                   help="only rewrite manifest.json from what OUT holds")
    a = p.parse_args(argv)
    split = lambda s, f=str: [f(x) for x in s.split(",")] if s else None  # noqa: E731
    runs = plan(split(a.archs), split(a.scenarios), split(a.seeds, int))
    matrix = plan()  # the manifest always lists the whole matrix
    os.makedirs(os.path.join(a.out, "runs"), exist_ok=True)
    if a.manifest_only:
        write_manifest(a.out, matrix)
        return 0
    todo = [r for r in runs if a.force or not complete(a.out, r)]
    log(f"{len(runs)} runs, {len(runs) - len(todo)} already complete, {len(todo)} to run, "
        f"{a.jobs} at a time, into {a.out}")
    write_manifest(a.out, matrix)
    done, failed, t_start = 0, [], time.monotonic()

    def finished(r, returncode, wall, pending, running):
        nonlocal done
        ok = returncode == 0 and complete(a.out, r)
        if ok:
            done += 1
        else:
            failed.append(r["name"])
        e = entry(a.out, r)
        elapsed = time.monotonic() - t_start
        eta = elapsed / (done + len(failed)) * (pending + running)
        log(f"done  {r['name']}: {'ok' if ok else 'FAILED rc=%s' % returncode} "
            f"{wall:.0f}s steps={e['steps_recorded']} diverged={e['divergence_step']} "
            f"rec={(e['recording_bytes'] or 0) / 1e6:.1f}MB | {done + len(failed)}/"
            f"{len(todo)} finished, ~{eta / 60:.0f} min left")
        write_manifest(a.out, matrix)

    run_trainers(a.out, todo, a.jobs, finished,
                 started=lambda r: log(f"start {r['name']}"))
    write_manifest(a.out, matrix)
    ent = [entry(a.out, r) for r in matrix]
    bad = [e["name"] for e in ent if e["scenario"] == "healthy" and e["divergence_step"]]
    undiv = [e["name"] for e in ent if e["scenario"] != "healthy" and e["complete"]
             and not e["divergence_step"]]
    log(f"finished in {(time.monotonic() - t_start) / 60:.1f} min; "
        f"{sum(e['complete'] for e in ent)}/{len(ent)} complete; failed: {failed or 'none'}; "
        f"healthy runs that diverged: {bad or 'none'}; faulted runs that did not: "
        f"{undiv or 'none'}; recordings "
        f"{sum(e['recording_bytes'] or 0 for e in ent) / 1e6:.0f} MB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
