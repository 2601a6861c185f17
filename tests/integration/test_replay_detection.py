"""Detection on recorded training, end to end, with the defaults a new user
gets: each recording under tests/data/recordings (manifest.json says what
the run was; kept as a default Monitor sends, windows 10 and 50 every 10
steps) is replayed by `foreshock replay` into a real foreshockd with no
configuration, and the alerts it raises are checked against what the run
was with the scorecard's criteria (tests/bench/scorecard.py): a healthy run
raises nothing; in a faulted one the first mechanism alert fires after the
fault and before the loss diverged, labelled with the fault.
Then `foreshock backtest --db` on the same database, with the same (default)
settings, must report exactly the incidents the live daemon raised: the
backtest runs the daemon's own detection code.

Recordings replay to the same monitor values on any machine, unlike live
training (whose trajectory depends on the CPU model), so these verdicts do
not depend on where CI runs.
"""
import json
import lzma
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402

EVAL_TIMEOUT_S = 900  # the ASan daemon is slow; the verdict never depends on time


def recording_path(src, workdir):
    """Recordings are kept xz-compressed; decompress into workdir."""
    if not src.endswith(".xz"):
        return src
    dst = os.path.join(workdir, os.path.basename(src)[:-3])
    with lzma.open(src, "rb") as f, open(dst, "wb") as g:
        shutil.copyfileobj(f, g)
    return dst


def key_of(rule, labels, step, label):
    labels = labels or {}
    return (rule, labels.get("layer"), labels.get("head"), labels.get("window"),
            labels.get("rank"), step, label)


def check_verdict(scorecard, entry, firings):
    """The scorecard's criteria (tests/bench/scorecard.py) on the live alerts."""
    incidents = [{"rule": f["rule"], "fired_step": f["step"], "label": f["attribution"]}
                 for f in firings]
    row = scorecard.score_run(entry, incidents)
    check(row["ok"], f"{entry['run']}: first mechanism alert {row['first']} {row['label']} "
          f"({row['rule']}), fault {row['fault']}, diverged {row['div']}; all: "
          f"{[(f['step'], f['rule'], f['attribution']) for f in firings][:8]}")
    if row["family"] == "healthy":
        return "quiet"
    return f"{row['label']} at {row['first']} ({row['rule']}), lead {row['lead']:.0%}"


def main(args, workdir):
    exp = os.path.join(args.source_dir, "client", "python", "experiments")
    sys.path.insert(0, exp)
    from fsapi import Api
    sys.path.insert(0, os.path.join(args.source_dir, "tests", "bench"))
    import scorecard
    data = os.path.join(args.source_dir, "tests", "data", "recordings")
    with open(os.path.join(data, "manifest.json")) as f:
        manifest = json.load(f)["runs"]
    check(manifest, "no recordings in the manifest")
    cli = os.path.join(args.build_dir, "foreshock")
    for entry in manifest:
        rec = recording_path(os.path.join(data, entry["file"]), workdir)
        db = os.path.join(workdir, entry["run"] + ".db")
        daemon = fstest.Daemon(args.build_dir, workdir, db=db)
        try:
            r = subprocess.run([cli, "replay", rec, "--endpoint", daemon.endpoint],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=EVAL_TIMEOUT_S)
            check(r.returncode == 0, f"replay {entry['file']}: {r.returncode}\n{r.stdout}")
            api = Api(daemon.http)
            last = entry["last_sketch_step"]
            deadline = time.monotonic() + EVAL_TIMEOUT_S
            while True:
                s = api.series(entry["run"], name="qk.d2.entropy.min")
                if s and min(x["last_step"] for x in s) >= last:
                    break
                check(time.monotonic() < deadline,
                      f"{entry['run']}: monitors not evaluated up to step {last}")
                time.sleep(0.5)
            firings = api.firings(entry["run"])
        finally:
            # SIGTERM: the daemon finishes and commits what it evaluated.
            daemon.stop()
        verdict = check_verdict(scorecard, entry, firings)

        b = subprocess.run([cli, "backtest", "--db", db, "--json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=EVAL_TIMEOUT_S)
        check(b.returncode == 0, f"backtest: {b.returncode}\n{b.stderr}")
        check("left out" not in b.stderr, f"backtest without --windows left series out: {b.stderr}")
        # Asked for fewer windows than the run sent, backtest says what it
        # left out (a run sent at other windows would lose its attention
        # series without a word otherwise).
        w = subprocess.run([cli, "backtest", "--db", db, "--json", "--windows", "10"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=EVAL_TIMEOUT_S)
        check(w.returncode == 0 and f"run {entry['run']}: " in w.stderr and
              "of window(s) 50 left out" in w.stderr,
              f"backtest --windows 10 did not say it left window 50 out: {w.stderr!r}")
        incidents = json.loads(b.stdout)
        live = sorted(key_of(f["rule"], f["labels"], f["step"], f["attribution"])
                      for f in firings)
        back = sorted(key_of(x["rule"], {"layer": x["layer"], "head": x["head"],
                                         "window": x["window"], "rank": x["rank"]},
                             x["fired_step"], x["label"]) for x in incidents)
        check(back == live, f"{entry['run']}: backtest differs from the live daemon:\n"
              f"  live     {live}\n  backtest {back}")
        print(f"  {entry['run']}: {verdict}; backtest reproduces {len(live)} incident(s)",
              flush=True)


if __name__ == "__main__":
    fstest.run_main(main)
