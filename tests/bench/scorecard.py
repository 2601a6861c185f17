"""The detection scorecard: `foreshock backtest` over the recorded corpus
(tests/data/corpus: stored series of small training runs, healthy and
faulted, tuning and validation seeds) with the daemon's default settings
(or any --set/--windows/--every), scored per run and summed per split.

    /usr/bin/python3 tests/bench/scorecard.py --build-dir build [--split validation]
        [--set RULE.KEY=VALUE ...] [--windows 5,25] [--every 5] [--check]

Per run: fault step, divergence step, the first alert of any rule, the
first mechanism alert (step, label, rule: loss, grad-norm, weight-norm and
update-ratio alerts page too but name no mechanism), lead of the mechanism alert as a
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
  tells its Delta2 collapse from the LR ramp's consequence).
Column "wrong": mechanism alerts before divergence with a label outside the
run's set; a run with any is not ok.
Per split: faulted runs caught before divergence, label accuracy, median
lead, healthy runs with any alert and false alerts per 1,000 healthy steps
(after the start of detection: every healthy alert is false).
--check exits 1 unless, on the chosen split: every faulted run alerts before
divergence with the right label, no healthy run alerts, median lead >= 40%.
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
}
ACCEPT_ANY = {
    "attention-numerics": {"attention-numerics"},
    "lr": {"optimizer-hyperparameter"},
    "combined": {"optimizer-hyperparameter", "combined"},
    "combined-late": {"attention-numerics", "combined"},
}


def family(scenario):
    """attn-strong / attn-weak / attention-numerics... -> the fault family."""
    if scenario.startswith("attn") or scenario.startswith("attention"):
        return "attention-numerics"
    if scenario.startswith("lr"):
        return "lr"
    if scenario.startswith("combined-late"):
        return "combined-late"
    if scenario.startswith("comb"):
        return "combined"
    return "healthy"


def load_corpus(corpus_dir, workdir):
    db = os.path.join(workdir, "corpus.db")
    with lzma.open(os.path.join(corpus_dir, "corpus.db.xz"), "rb") as f, open(db, "wb") as g:
        shutil.copyfileobj(f, g)
    with open(os.path.join(corpus_dir, "manifest.json")) as f:
        return db, json.load(f)["runs"]


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
# mechanism alert.
SYMPTOM_RULES = {"loss", "grad_norm", "weight_norm", "update_ratio"}


def score_run(meta, incidents):
    fam = family(meta["scenario"])
    row = {"run": meta["name"], "split": meta.get("split"), "family": fam,
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
        row["ok"] = not incidents
        return row
    div, fault = row["div"], row["fault"]
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
    row["ok"] = before and label_ok
    return row


def summarize(rows, split):
    rs = [r for r in rows if split in (None, r["split"])]
    faulted = [r for r in rs if r["family"] != "healthy"]
    healthy = [r for r in rs if r["family"] == "healthy"]
    leads = [r["lead"] for r in faulted if r.get("lead") is not None]
    healthy_steps = sum(int(r["steps"] or 0) for r in healthy)
    false_alerts = sum(r["n_alerts"] for r in healthy)
    return {
        "split": split or "all", "faulted": len(faulted),
        "caught": sum(1 for r in faulted if r["caught"]),
        "label_ok": sum(1 for r in faulted if r["caught"] and r["label_ok"]),
        "median_lead": statistics.median(leads) if leads else None,
        "healthy": len(healthy), "healthy_alerting": sum(1 for r in healthy if r["n_alerts"]),
        "false_per_1000": 1000.0 * false_alerts / healthy_steps if healthy_steps else 0.0,
    }


def fmt(v, pct=False):
    if v is None:
        return "-"
    return f"{100 * v:.0f}%" if pct else str(v)


def print_table(rows, summaries):
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
    print("| split | faulted caught before divergence | right label | median lead | "
          "healthy runs alerting | false alerts / 1,000 healthy steps |")
    print("|---|---|---|---|---|---|")
    for s in summaries:
        print(f"| {s['split']} | {s['caught']}/{s['faulted']} | {s['label_ok']}/{s['faulted']} | "
              f"{fmt(s['median_lead'], True)} | {s['healthy_alerting']}/{s['healthy']} | "
              f"{s['false_per_1000']:.2f} |")


def run(build_dir, corpus_dir, sets=(), windows=MONITOR_WINDOWS, every=MONITOR_EVERY):
    with tempfile.TemporaryDirectory(prefix="foreshock-score-") as tmp:
        db, manifest = load_corpus(corpus_dir, tmp)
        by_run = backtest(build_dir, db, sets, windows, every)
    rows = [score_run(m, by_run.get(m["name"], [])) for m in manifest]
    summaries = [summarize(rows, s) for s in ("tuning", "validation", None)]
    return rows, summaries


def passes(summary):
    return (summary["caught"] == summary["faulted"] and summary["label_ok"] == summary["faulted"]
            and summary["healthy_alerting"] == 0 and summary["median_lead"] is not None
            and summary["median_lead"] >= MIN_MEDIAN_LEAD)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--corpus", default=os.path.join(SOURCE, "tests", "data", "corpus"))
    ap.add_argument("--set", action="append", default=[], help="RULE.KEY=VALUE (repeatable)")
    ap.add_argument("--windows", default=MONITOR_WINDOWS,
                    help=f"sketch windows sent (default {MONITOR_WINDOWS}: the Monitor's)")
    ap.add_argument("--every", type=int, default=MONITOR_EVERY,
                    help=f"sketch cadence (default {MONITOR_EVERY}: the Monitor's)")
    ap.add_argument("--split", default="validation", help="split --check judges")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    rows, summaries = run(a.build_dir, a.corpus, a.set, a.windows, a.every)
    print_table(rows, summaries)
    if a.check:
        s = next(x for x in summaries if x["split"] == a.split)
        if not passes(s):
            print(f"scorecard: the {a.split} split misses the criteria", flush=True)
            sys.exit(1)
        print(f"scorecard: the {a.split} split meets the criteria", flush=True)


if __name__ == "__main__":
    main()
