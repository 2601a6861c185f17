"""Records the third held-out look's second half (CORPUS.md, "Third
held-out look"): corpus_holdout3.py's shapes, scenarios and schedules with
the faults after detection has started on the WSD runs. foreshockd starts
detecting at 3 x the LR warm-up (daemon/evaluate.h, EVAL_START_WARMUPS):
step 900 after corpus_holdout3.py's 300-step warm-up, so its WSD runs'
faults at step 700 came before detection and every one of them that
diverged did so by step 843, unseen. Here the faults start at step 1,000
of 1,700 (the combined run's LR ramp at 1,100), the peak-rate runs last
1,400 steps, the healthy runs 3,000, and the seed is 32: with corpus_shapes'
alternation each shape runs each scenario under the other schedule than in
corpus_holdout3.py. Designed after the first half was scored (it knew the
detection start, no detection outcome of these runs), not calibrated, all
validation.

    FORESHOCK_LIB=build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout3_late.py /work/holdout3-late-out --jobs 1
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_holdout3  # noqa: E402
import corpus_shapes  # noqa: E402

FAULT_STEP, LATE_LR_STEP = 1000, 1100
SCENARIOS = dict(corpus_holdout3.SCENARIOS)
SCENARIOS["combined-late"] = ("combined", [
    "--bits", "{bits}", "--fault-on", "both", "--lr-hidden", "--lr-mult", "20",
    "--lr-ramp", "200", "--lr-fault-step", str(LATE_LR_STEP)])
MATRIX = dict(corpus_holdout3.MATRIX, scenarios=SCENARIOS, seeds=(32,), steps=1700,
              healthy_steps=3000, peak_steps=1400, fault_step=FAULT_STEP,
              late_lr_step=LATE_LR_STEP,
              description="Foreshock third held-out corpus, faults after detection starts "
                          "(CORPUS.md)")


def plan(shapes=None, scenarios=None, seeds=None):
    return corpus_shapes.plan(shapes, scenarios, seeds, MATRIX)


if __name__ == "__main__":
    sys.exit(corpus_shapes.main(matrix=MATRIX, doc=__doc__))
