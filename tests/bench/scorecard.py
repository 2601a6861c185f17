"""The detection scorecard: `foreshock backtest` over the recorded corpora
(stored series of small training runs, healthy and faulted, tuning and
validation splits) with the daemon's default settings (or any
--set/--windows/--every), scored per run and summed per split and shape.

    /usr/bin/python3 tests/bench/scorecard.py --build-dir build [--rows] [--corpus DIR ...]
        [--split validation] [--set RULE.KEY=VALUE ...] [--windows 5,25] [--every 5] [--check]

Per run: fault step, divergence step, the first alert of any rule, the
first mechanism alert (step, label, rule: loss, grad-norm and weight-norm
alerts page too but name no mechanism), lead of the mechanism alert as a
fraction of the time from fault to divergence ((divergence - alert) /
(divergence - fault)), and whether its label is right:
  attention-numerics runs: every mechanism alert before divergence reads
  attention-numerics;
  lr runs: every one reads optimizer-hyperparameter (a Delta2 collapse that
  follows the LR ramp is its consequence, not a second fault);
  combined-late runs (attention fault, then the LR ramp 100 steps later):
  the first reads attention-numerics, and some alert before divergence reads
  combined (column "both");
  combined runs (both faults at once): optimizer-hyperparameter or combined
  (the run diverges before an attention fault alone could show, so nothing
  tells its Delta2 collapse from the LR ramp's consequence);
  combined-late runs whose LR fault is hidden from the logged rate: the
  first reads attention-numerics, "both" is not required; one that
  diverged before its LR fault began is scored as an attention run;
  combined-late runs whose attention fault is inert on the model (the
  same fault alone, same shape, seed, step and bits, never diverged: a
  qk-norm layout clamps the logits it would inflate) are scored as LR
  runs that may also name the attention fault: the LR fault is what makes
  them diverge, and the right page says to lower the rate.
Column "wrong": mechanism alerts before divergence with a label outside the
run's set; a run with any is not ok.
Healthy runs with corrupted batches (scenario healthy-corrupt*: random
tokens for a few steps, the loss jumping 3x and recovering) should page a
loss spike: loss and grad-norm alerts labelled loss-spike are right there;
any other alert, or a spike alert labelled with a mechanism, is false.
Per split: faulted runs caught before divergence, label accuracy, median
lead, healthy runs with any alert and false alerts per 1,000 healthy steps
(after the start of detection: every healthy alert is false).
--check exits 1 unless, on the chosen split: every faulted run alerts before
divergence with the right label, no healthy run alerts, no alert in a
healthy phase, median lead >= 40%.

Corpora (--corpus, repeatable; default all three): tests/data/corpus (three
architectures of one shape, d 48, head_dim 12, fault at step 200) and
tests/data/corpus-shapes (six other shapes, head_dim 8-64, 2-16 heads, 2-6
layers, constant/cosine/WSD, LR faults hidden from the logged rate, a peak
rate too large from the start, faults at step 400 of 1,000, healthy runs of
3,000 steps). Whole shapes are held out there: its validation split holds
shapes the defaults were never tuned on. tests/data/corpus-holdout, recorded
after the defaults were tuned on the other two and never tuned on: LLaMA
shapes (GQA and not) and a top-1 MoE, peak rate 2e-3/4e-3 with a 100-step
warm-up, faults at step 500 of 1,200, every LR fault hidden; all validation.

Scored twice: with the defaults, and with the `lr` rule disabled (the
learning rate itself rising: a hidden LR fault never shows there, so LR
faults must be caught by the mechanism). Also per shape (a row each).
A faulted run that did not diverge within its length counts in neither
"caught" nor "missed"; it is listed apart (alerted or not): whether such a
fault deserves a warning is not judged. Alerts of a faulted run before its
fault step are false alerts of a healthy phase ("healthy-phase alerts"),
counted per 1,000 steps of those phases (from step 100, the earliest start
of detection, to the fault).
"""
import argparse
import json
import lzma
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))
MIN_MEDIAN_LEAD = 0.40
# What a foreshock.Monitor with its defaults sends (windows=(10, 50), a sketch
# every 10 steps); the corpus was recorded richer (windows 5, 10, 25, 50
# every 5 steps) and backtest replays it as this subset.
MONITOR_WINDOWS = "10,50"
MONITOR_EVERY = 10

# Per fault family: the labels the first mechanism alert may read, and the
# labels any mechanism alert before divergence may read.
ACCEPT_FIRST = {
    "attention-numerics": {"attention-numerics"},
    "lr": {"optimizer-hyperparameter"},
    "combined": {"optimizer-hyperparameter", "combined"},
    "combined-late": {"attention-numerics", "combined"},
    "combined-late-hidden": {"attention-numerics", "combined"},
    "combined-inert": {"optimizer-hyperparameter", "attention-numerics", "combined"},
}
ACCEPT_ANY = {
    "attention-numerics": {"attention-numerics"},
    "lr": {"optimizer-hyperparameter"},
    "combined": {"optimizer-hyperparameter", "combined"},
    "combined-late": {"attention-numerics", "combined"},
    "combined-late-hidden": {"attention-numerics", "combined", "optimizer-hyperparameter"},
    "combined-inert": {"optimizer-hyperparameter", "attention-numerics", "combined"},
}


# Earliest step detection can start (evaluate.c EVAL_START_MIN): the
# healthy phase of a faulted run is counted from here to its fault.
EARLIEST_START = 100


def family(scenario):
    """attn-strong / attn-weak / attention-numerics... -> the fault family."""
    if scenario.startswith("attn") or scenario.startswith("attention"):
        return "attention-numerics"
    if scenario.startswith("combined-late-hidden"):
        return "combined-late-hidden"
    if scenario.startswith("lr"):
        return "lr"
    if scenario.startswith("combined-late"):
        return "combined-late"
    if scenario.startswith("comb"):
        return "combined"
    return "healthy"


def load_corpus(corpus_dir, workdir):
    db = os.path.join(workdir, os.path.basename(os.path.normpath(corpus_dir)) + ".db")
    with lzma.open(os.path.join(corpus_dir, "corpus.db.xz"), "rb") as f, open(db, "wb") as g:
        shutil.copyfileobj(f, g)
    with open(os.path.join(corpus_dir, "manifest.json")) as f:
        runs = json.load(f)["runs"]
    for r in runs:  # the first corpus is one shape (d 48, 3 layers, 4 heads)
        r.setdefault("shape", r.get("arch") + "-dh12-h4-l3")
    return db, runs


def mark_inert_attention(runs):
    """Sets attn_inert on each combined-late run whose attention fault alone
    (the attention-numerics run of the same shape, seed, fault step and
    bits) was recorded and never diverged: on that model the attention
    fault does not lead to divergence, the LR fault does."""
    def key(r):
        return (r.get("shape"), r.get("seed"), r.get("fault_step"), r.get("bits"))
    alone = {}
    for r in runs:
        if family(r["scenario"]) == "attention-numerics":
            alone.setdefault(key(r), []).append(r)
    for r in runs:
        if family(r["scenario"]) == "combined-late" and alone.get(key(r)):
            r["attn_inert"] = all(a.get("divergence_step") is None for a in alone[key(r)])


def backtest(build_dir, db, sets=(), windows=None, every=None):
    cmd = [os.path.join(build_dir, "foreshock"), "backtest", "--db", db, "--json"]
    for s in sets:
        cmd += ["--set", s]
    if windows:
        cmd += ["--windows", windows]
    if every:
        cmd += ["--every", str(every)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit(f"backtest failed ({p.returncode}): {p.stderr}")
    by_run = {}
    for x in json.loads(p.stdout):
        by_run.setdefault(x["run"], []).append(x)
    for v in by_run.values():
        v.sort(key=lambda x: (x["fired_step"], x["rule"]))
    return by_run


# Symptom rules: they page (loss and grad-norm spikes are the classic
# baselines), but name no mechanism; the label is judged on the first
# mechanism alert. (update_ratio names one: the effective step size,
# detect.c.)
SYMPTOM_RULES = {"loss", "grad_norm", "weight_norm"}


def score_run(meta, incidents):
    fam = family(meta["scenario"])
    if fam == "combined-late" and meta.get("lr_hidden"):
        # The late LR fault is hidden from the logged rate: no `lr`
        # evidence, so "combined" cannot be required (router growth after a
        # Delta2 collapse reads attention-numerics by design).
        fam = "combined-late-hidden"
    lr_at, div = meta.get("lr_fault_step"), meta.get("divergence_step")
    if fam.startswith("combined-late") and lr_at and div is not None and div <= lr_at:
        # Diverged from the attention fault before the late LR fault began:
        # an attention-numerics run, whatever it was meant to be.
        fam = "attention-numerics"
    elif fam.startswith("combined-late") and meta.get("attn_inert"):
        fam = "combined-inert"
    row = {"run": meta["name"], "split": meta.get("split"), "family": fam,
           "shape": meta.get("shape"),
           "fault": meta.get("fault_step"), "div": meta.get("divergence_step"),
           "steps": meta.get("steps"), "n_alerts": len(incidents)}
    row["any_first"] = incidents[0]["fired_step"] if incidents else None
    row["any_rule"] = incidents[0]["rule"] if incidents else None
    mech = [x for x in incidents if x["rule"] not in SYMPTOM_RULES]
    first = mech[0] if mech else None
    row["first"] = first["fired_step"] if first else None
    row["label"] = first["label"] if first else None
    row["rule"] = first["rule"] if first else None
    if fam == "healthy":
        if meta["scenario"].startswith("healthy-corrupt"):
            # A few batches of garbage spike the loss: a loss-spike page is
            # the right answer, not a false alert; any other alert, or a
            # spike page naming a mechanism, is.
            incidents = [x for x in incidents if x["rule"] not in SYMPTOM_RULES
                         or x["label"] != "loss-spike"]
            row["n_alerts"] = len(incidents)
        row["ok"] = not incidents
        return row
    div, fault = row["div"], row["fault"]
    row["phase_alerts"] = sum(1 for x in incidents if x["fired_step"] < fault)
    row["phase_steps"] = max(0, fault - EARLIEST_START)
    row["diverged"] = div is not None
    before = first is not None and first["fired_step"] > fault and (
        div is None or first["fired_step"] < div)
    in_time = [x for x in mech if div is None or x["fired_step"] < div]
    row["wrong"] = sum(1 for x in in_time if x["label"] not in ACCEPT_ANY[fam])
    label_ok = first is not None and first["label"] in ACCEPT_FIRST[fam] and row["wrong"] == 0
    if fam == "combined-late":
        row["both"] = any(x["label"] == "combined" for x in in_time)
        label_ok = label_ok and row["both"]
    row["caught"] = before
    row["label_ok"] = label_ok
    row["lead"] = ((div - first["fired_step"]) / (div - fault)
                   if before and div is not None and div > fault else None)
    row["ok"] = before and label_ok and row["phase_alerts"] == 0
    return row


def summarize(rows, split=None, shape=None, name=None):
    rs = [r for r in rows if split in (None, r["split"]) and shape in (None, r["shape"])]
    faulted_all = [r for r in rs if r["family"] != "healthy"]
    faulted = [r for r in faulted_all if r["diverged"]]
    undiverged = [r for r in faulted_all if not r["diverged"]]
    healthy = [r for r in rs if r["family"] == "healthy"]
    leads = [r["lead"] for r in faulted if r.get("lead") is not None]
    # Steps after the earliest start of detection: before it nothing fires.
    healthy_steps = sum(max(0, int(r["steps"] or 0) - EARLIEST_START) for r in healthy)
    false_alerts = sum(r["n_alerts"] for r in healthy)
    phase_steps = sum(r["phase_steps"] for r in faulted_all)
    phase_alerts = sum(r["phase_alerts"] for r in faulted_all)
    lr = [r for r in faulted if r["family"] == "lr"]
    return {
        "split": name or split or "all", "faulted": len(faulted),
        "caught": sum(1 for r in faulted if r["caught"]),
        "label_ok": sum(1 for r in faulted if r["caught"] and r["label_ok"]),
        "lr": len(lr), "lr_ok": sum(1 for r in lr if r["ok"]),
        "median_lead": statistics.median(leads) if leads else None,
        "undiverged": len(undiverged),
        "undiverged_alerted": sum(1 for r in undiverged if r["first"] is not None),
        "healthy": len(healthy), "healthy_alerting": sum(1 for r in healthy if r["n_alerts"]),
        "healthy_steps": healthy_steps,
        "false_per_1000": 1000.0 * false_alerts / healthy_steps if healthy_steps else 0.0,
        "phase_alerts": phase_alerts,
        "phase_per_1000": 1000.0 * phase_alerts / phase_steps if phase_steps else 0.0,
    }


def fmt(v, pct=False):
    if v is None:
        return "-"
    return f"{100 * v:.0f}%" if pct else str(v)


def print_summaries(summaries, first="split"):
    print(f"| {first} | faulted caught before divergence | right label | LR faults right "
          "| median lead | faulted, not diverged (alerted) | healthy runs alerting | healthy steps "
          "| false alerts / 1,000 healthy steps | healthy-phase alerts (/ 1,000 steps) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        print(f"| {s['split']} | {s['caught']}/{s['faulted']} | {s['label_ok']}/{s['faulted']} | "
              f"{s['lr_ok']}/{s['lr']} | {fmt(s['median_lead'], True)} | "
              f"{s['undiverged']} ({s['undiverged_alerted']}) | "
              f"{s['healthy_alerting']}/{s['healthy']} | {s['healthy_steps']} | "
              f"{s['false_per_1000']:.2f} | {s['phase_alerts']} ({s['phase_per_1000']:.2f}) |")


def print_table(rows, summaries, by_shape=()):
    print("| run | split | fault | diverged | first alert (any rule) | first mechanism alert | "
          "label | rule | lead | both | wrong | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        anyf = f"{r['any_first']} {r['any_rule']}" if r["any_first"] is not None else "-"
        print(f"| {r['run']} | {r['split']} | {fmt(r['fault'])} | {fmt(r['div'])} | {anyf} | "
              f"{fmt(r['first'])} | {fmt(r['label'])} | {fmt(r['rule'])} | "
              f"{fmt(r.get('lead'), True)} | "
              f"{'-' if 'both' not in r else ('yes' if r['both'] else 'no')} | "
              f"{fmt(r.get('wrong'))} | {'yes' if r['ok'] else 'NO'} |")
    print()
    print_summaries(summaries)
    if by_shape:
        print()
        print_summaries(by_shape, "shape (split)")


DEFAULT_CORPORA = [os.path.join(SOURCE, "tests", "data", d)
                   for d in ("corpus", "corpus-shapes", "corpus-holdout")]


def cadence(meta):
    """(windows, every) a run is replayed at: what a default Monitor sends,
    when the run's recording holds it (its manifest names no cadence, or
    one with the default windows at a cadence dividing the default's: a
    corpus recorded richer), else the windows and cadence it was sent at
    (a Monitor set to sketch less often: backtest would drop its windows)."""
    w, e = meta.get("windows"), meta.get("every")
    if not w or not e:
        return MONITOR_WINDOWS, MONITOR_EVERY
    sent = sorted({int(x) for x in str(w).split(",")})
    default = {int(x) for x in MONITOR_WINDOWS.split(",")}
    if default <= set(sent) and MONITOR_EVERY % int(e) == 0:
        return MONITOR_WINDOWS, MONITOR_EVERY
    return ",".join(str(x) for x in sent), int(e)


def run(build_dir, corpus_dirs=None, sets=(), windows=None, every=None):
    """(rows, per-split summaries, per-shape summaries) over every corpus.
    windows/every (None: each run's cadence()) replay every run at that."""
    if isinstance(corpus_dirs, str):
        corpus_dirs = [corpus_dirs]
    rows = []
    with tempfile.TemporaryDirectory(prefix="foreshock-score-") as tmp:
        for d in corpus_dirs or [c for c in DEFAULT_CORPORA if os.path.isdir(c)]:
            db, manifest = load_corpus(d, tmp)
            mark_inert_attention(manifest)
            at = {m["name"]: cadence(m) for m in manifest}
            if windows or every:
                at = {n: (windows or w, every or e) for n, (w, e) in at.items()}
            by_cadence = {c: backtest(build_dir, db, sets, *c) for c in sorted(set(at.values()))}
            rows += [score_run(m, by_cadence[at[m["name"]]].get(m["name"], [])) for m in manifest]
    summaries = [summarize(rows, s) for s in ("tuning", "validation", None)]
    shapes = sorted({(r["split"], r["shape"]) for r in rows})
    by_shape = [summarize(rows, sp, sh, f"{sh} ({sp})") for sp, sh in shapes]
    return rows, summaries, by_shape


def passes(summary):
    return (summary["caught"] == summary["faulted"] and summary["label_ok"] == summary["faulted"]
            and summary["healthy_alerting"] == 0 and summary["phase_alerts"] == 0
            and summary["median_lead"] is not None
            and summary["median_lead"] >= MIN_MEDIAN_LEAD)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--corpus", action="append", default=None,
                    help="corpus directory (repeatable; default: corpus, corpus-shapes and "
                         "corpus-holdout)")
    ap.add_argument("--rows", action="store_true", help="print the per-run table too")
    ap.add_argument("--set", action="append", default=[], help="RULE.KEY=VALUE (repeatable)")
    ap.add_argument("--windows", default=None,
                    help=f"sketch windows sent, for every run (default: {MONITOR_WINDOWS}, the "
                         "Monitor's, or a run's own when it was sent at another cadence)")
    ap.add_argument("--every", type=int, default=None,
                    help=f"sketch cadence, for every run (default: {MONITOR_EVERY}, the "
                         "Monitor's, or a run's own as for --windows)")
    ap.add_argument("--split", default="validation", help="split --check judges")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    rows, summaries, by_shape = run(a.build_dir, a.corpus, a.set, a.windows, a.every)
    if a.rows:
        print_table(rows, summaries, by_shape)
    else:
        print_summaries(summaries)
        print()
        print_summaries(by_shape, "shape (split)")
    if "lr.enabled=false" not in a.set:
        print()
        print("Without the `lr` rule (--set lr.enabled=false):")
        print()
        _, s2, b2 = run(a.build_dir, a.corpus, list(a.set) + ["lr.enabled=false"], a.windows,
                        a.every)
        print_summaries(s2)
        print()
        print_summaries(b2, "shape (split)")
    if a.check:
        s = next(x for x in summaries if x["split"] == a.split)
        if not passes(s):
            print(f"scorecard: the {a.split} split misses the criteria", flush=True)
            sys.exit(1)
        print(f"scorecard: the {a.split} split meets the criteria", flush=True)


if __name__ == "__main__":
    main()
