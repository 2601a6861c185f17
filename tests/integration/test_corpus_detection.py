"""The detection defaults, judged on the recorded corpus (tests/data/corpus:
the stored series of small training runs of several architectures, LR
schedules, faults and seeds) through `foreshock backtest`, which runs the
daemon's own detection code. The verdict is the same on any machine: the
corpus holds the monitor values, not live training.

On the validation seeds, with the daemon's defaults: every faulted run
alerts before its loss diverges with the right label, no healthy run
raises any alert, and the median lead is at least 40% of the time from
fault to divergence (tests/bench/scorecard.py defines each; it prints the
whole table). The tuning seeds are printed too, for the record; they are
not asserted: defaults were chosen on them.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "tests", "bench"))
    import scorecard
    corpus = os.path.join(args.source_dir, "tests", "data", "corpus")
    rows, summaries, by_shape = scorecard.run(args.build_dir, corpus)
    scorecard.print_table(rows, summaries, by_shape)
    val = next(s for s in summaries if s["split"] == "validation")
    check(val["faulted"] > 0 and val["healthy"] > 0, f"no validation runs: {val}")
    bad = [r for r in rows if r["split"] == "validation" and not r["ok"]]
    check(not bad, "validation runs missing the criteria: " +
          ", ".join(f"{r['run']} (first alert {r['first']} {r['label']} {r['rule']}, "
                    f"fault {r['fault']}, diverged {r['div']})" for r in bad))
    check(val["median_lead"] is not None and val["median_lead"] >= scorecard.MIN_MEDIAN_LEAD,
          f"median lead {val['median_lead']} below {scorecard.MIN_MEDIAN_LEAD}")


if __name__ == "__main__":
    fstest.run_main(main)
