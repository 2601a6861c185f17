"""Records the twenty-first held-out corpus (CORPUS.md, "Twenty-first
held-out look"): faults late in long runs.

Every fault of the earlier corpora starts by step 2,400, while the rate is
near its peak and the updates are large. A real run can break much later,
in the slow phase the twentieth look recorded healthy: the loss flat, the
rate decayed towards its floor, the updates small. A fault there may grow
slowly or not at all, and the baselines a rule compares against have had
thousands of steps to settle. This look puts the earlier looks' faults
into that phase, on the twentieth look's three shapes with its arguments
and schedules, seed 201: each faulted run trains exactly like its healthy
twin in tests/data/corpus-holdout20 until the fault at step 6,000.

The three shapes, their arguments and schedules are corpus_holdout20.py's
(SHAPES, common(): taken from there, so the twins cannot drift apart): a
LLaMA under cosine decay to 10%, an 8-expert top-2 MoE under
warmup-stable-decay, a dense GPT with heads of 24 decaying linearly to
zero, a sketch every 10 steps over windows 10 and 50 (the Monitor's
defaults).

Scenarios per shape, the fault at step 6,000, the LR faults hidden from
the logged rate:

- attn-strong: the attention fault (bits 12, O and dO, every layer);
- combined-late: that fault, then a hidden 20x ramp over 200 steps from
  step 6,100;
- lr-jump5-hidden: a hidden 5x jump;
- one hard negative per shape at step 6,000, healthy (any alert is false;
  for healthy-corrupt a loss-spike page is right), training on past a
  divergence by the loss criterion: LLaMA healthy-corrupt (--corrupt
  6000:3, three batches of random tokens), MoE healthy-datashift
  (--data-shift 6000, the data mix moved to the text's last quarter), GPT
  healthy-batchhalf (--batch-change 6000:4, 8 to 4 sequences).

train.py's schedules run to --steps, so every run is given --steps 10000
(the healthy twins' length; a shorter --steps would decay the rate
sooner and the run would not train like its twin). A faulted run stops
30 steps after a divergence; one that does not diverge, and every hard
negative, runs the 10,000 steps. No healthy runs: the twentieth look's
are the twins. Seed 201, every run in the validation split: the corpus
only reports.

    FORESHOCK_LIB=$PWD/build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout21.py /work/holdout21-out --jobs 2

No trainer starts after --start-until minutes (default 28); a corpus cut
short holds the first cells of PRIORITY and the recorder resumes the rest
if run again.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_holdout20 as twins  # noqa: E402
import corpus_shapes  # noqa: E402

LL, MOE, GD = twins.LL, twins.MOE, twins.GD
SEED = twins.SEED
START_UNTIL_MIN = 28  # no trainer starts later than this
STEPS = twins.STEPS  # the schedule's length, as the healthy twins'
FAULT = 6000
LATE_AFTER = 100  # combined-late: the hidden ramp starts this many steps after the fault

SCENARIOS = {sc: t for sc, t in
             corpus_shapes.late_look_scenarios(FAULT, LATE_AFTER, twins.BATCH).items()
             if sc != "healthy"}
HARD = {LL: "healthy-corrupt", MOE: "healthy-datashift", GD: "healthy-batchhalf"}


def matrix(shape, args, lr, head_dim, warmup, schedule, min_lr_frac):
    o = {sc: {"schedule": schedule, "steps": STEPS} for sc in SCENARIOS}
    for sc in set(HARD.values()):
        o[sc]["post_diverge"] = -1
    return dict(corpus_shapes.MATRIX, shapes={shape: {
        "args": args, "lr": lr, "split": "validation", "head_dim": head_dim}},
        scenarios=SCENARIOS, seeds=(SEED,), schedules=(schedule,), overrides=o,
        common=twins.common(warmup, min_lr_frac),
        steps=STEPS, healthy_steps=STEPS, fault_step=FAULT, late_lr_step=FAULT + LATE_AFTER,
        fmt={"bits": 12}, manifest_lr_mult=True)


ALL = twins.ALL
MATRICES = {shape: matrix(shape, *twins.SHAPES[shape]) for shape in ALL}
# Recording order: the attention faults, combined-late, the 5x jumps, the
# hard negatives.
PRIORITY = [("attn-strong", ALL), ("combined-late", ALL), ("lr-jump5-hidden", ALL),
            ("healthy-corrupt", (LL,)), ("healthy-datashift", (MOE,)),
            ("healthy-batchhalf", (GD,))]
MATRIX = {"description": "Foreshock twenty-first held-out corpus (CORPUS.md)"}


plan, main = corpus_shapes.recorder(PRIORITY, MATRICES, MATRIX, __doc__, START_UNTIL_MIN)


if __name__ == "__main__":
    sys.exit(main())
