"""Records the sixteenth held-out corpus (CORPUS.md, "Sixteenth held-out
look"): the fifteenth look's three SGD shapes, with an attention fault and
a hidden learning-rate ramp that overlap.

Under SGD (the Monitor's Hello names the optimizer class) the daemon
credits the gradient norm's rise in its update-ratio rules, so an
attention fault (which raises the gradient, and under SGD the step with
it) should read attention-numerics, and a learning-rate fault hidden from
the logged rate optimizer-hyperparameter. The fifteenth look confirmed
both on these shapes, but its attention fault (bits 12) diverged every
combined-late run before the hidden ramp began 100 steps later: the case
where both rises overlap under SGD went untested. This look weakens the
attention fault (bits 9: fewer truncated low bits, so a slower climb) and
starts the ramp with it or 50 steps after it.

Shapes and rates exactly as the fifteenth look's (seed 161 here), a
sketch every 10 steps over windows 10 and 50 (the Monitor's defaults),
gradients clipped at 1.0, --min-lr-frac 0:

- llama-sgd-dh24-h4-kv2-l3: LLaMA dense, d 96, 4 query heads of 24 over 2
  KV heads, 3 layers; SGD momentum 0.9, no weight decay, peak 0.2, 50-step
  warm-up; cosine or constant.
- gpt-dense-sgd95-wd-dh32-h4-l2: GPT dense, d 128, 4 heads of 32, 2
  layers; SGD momentum 0.95, weight decay 1e-4, peak 0.1, 100-step
  warm-up; cosine or WSD.
- moe8-top2-sgd-dh32-h2-l3: GPT MoE, 8 experts top-2, d 64, 2 heads of 32,
  3 layers; SGD momentum 0.9, no weight decay, peak 0.3, 30-step warm-up;
  constant or cosine.

Scenarios per shape, faulted runs 1,600 steps, fault at step 1,000:

- attn-weak: the attention fault at bits 9 on both O and dO;
- combined-now: that fault and a hidden 20x ramp over 200 steps, both
  from step 1,000 (family "combined": optimizer-hyperparameter or combined
  is right);
- combined-late-weak: that fault, the hidden 20x ramp from step 1,050
  (family combined-late, hidden: the first mechanism alert should read
  attention-numerics; one that diverges before 1,050 is scored as an
  attention run);
- lr-ramp5-hidden: a hidden 5x ramp over 200 steps alone.

Then, if time is left, one healthy 3,000-step run per shape. Not
calibrated: a fault that does not diverge within its run is counted apart
by the scorecard. Every run is in the validation split.

corpus_shapes writes lr_fault_step into the manifest for the
combined-late scenarios from the matrix's late_lr_step (when this look was
recorded, only for one named exactly "combined-late"); plan() sets it
here for combined-now (1,000) and combined-late-weak (1,050), the steps
the trainer is given.

    FORESHOCK_LIB=$PWD/build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout16.py /work/holdout16-out --jobs 2

No trainer starts after --start-until minutes (default 15); a corpus cut
short holds the first cells of PRIORITY and the recorder resumes the rest
if run again.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

LL, GD, MOE = "llama-sgd-dh24-h4-kv2-l3", "gpt-dense-sgd95-wd-dh32-h4-l2", "moe8-top2-sgd-dh32-h2-l3"
SEED = 161
START_UNTIL_MIN = 15  # no trainer starts later than this
FAULT_STEP, LATE_LR_STEP = 1000, 1050
BITS = 9  # weaker than the fifteenth look's 12
ATTN = ["--bits", "{bits}", "--fault-on", "both"]
RAMP20 = ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]
LR_STEP = {"combined-now": FAULT_STEP, "combined-late-weak": LATE_LR_STEP}


def scenarios():
    """One shape's table: the same faults on every shape."""
    return {
        "attn-weak": ("attention-numerics", list(ATTN)),
        "combined-now": ("combined", ATTN + RAMP20 + ["--lr-fault-step", str(FAULT_STEP)]),
        "combined-late-weak": ("combined", ATTN + RAMP20 + ["--lr-fault-step",
                                                            str(LATE_LR_STEP)]),
        "lr-ramp5-hidden": ("lr", ["--lr-hidden", "--lr-mult", "5", "--lr-ramp", "200"]),
        "healthy": ("healthy", []),
    }


def schedules(a, b):
    """Each scenario's schedule, set: the faults alternate the two, the
    healthy run takes the first."""
    o = {"healthy": {"schedule": a, "steps": 3000, "fault_step": None}}
    for i, sc in enumerate(("attn-weak", "combined-now", "combined-late-weak",
                            "lr-ramp5-hidden")):
        o[sc] = {"schedule": (a, b)[i % 2]}
    return o


def matrix(shape, args, lr, head_dim, warmup, scheds):
    return dict(corpus_shapes.MATRIX, shapes={shape: {
        "args": args, "lr": lr, "split": "validation", "head_dim": head_dim}},
        scenarios=scenarios(), seeds=(SEED,), schedules=scheds,
        overrides=schedules(*scheds),
        common=["--ctx", "32", "--batch", "16", "--warmup", str(warmup), "--min-lr-frac", "0",
                "--clip", "1.0", "--threads", "1"],
        steps=1600, healthy_steps=3000, fault_step=FAULT_STEP, late_lr_step=LATE_LR_STEP,
        fmt={"bits": BITS}, manifest_lr_mult=True)


MATRICES = {
    LL: matrix(LL, ["--arch", "llama", "--experts", "0", "--d", "96", "--heads", "4",
                    "--kv-heads", "2", "--layers", "3", "--optimizer", "sgd",
                    "--momentum", "0.9", "--weight-decay", "0"],
               0.2, 24, 50, ("cosine", "constant")),
    GD: matrix(GD, ["--arch", "gpt", "--experts", "0", "--d", "128", "--heads", "4",
                    "--layers", "2", "--optimizer", "sgd", "--momentum", "0.95",
                    "--weight-decay", "1e-4"],
               0.1, 32, 100, ("cosine", "wsd")),
    MOE: matrix(MOE, ["--arch", "gpt", "--experts", "8", "--top-k", "2", "--d", "64",
                      "--heads", "2", "--layers", "3", "--optimizer", "sgd",
                      "--momentum", "0.9", "--weight-decay", "0"],
                0.3, 32, 30, ("constant", "cosine")),
}
ALL = (LL, GD, MOE)
# Recording order: the overlap cases first, then the attention fault alone
# (the scorecard's inert check for combined-late needs it), the gentle
# ramp, and healthy runs only if time is left.
PRIORITY = [
    ("combined-now", ALL), ("combined-late-weak", ALL), ("attn-weak", ALL),
    ("lr-ramp5-hidden", ALL), ("healthy", ALL),
]
MATRIX = {"description": "Foreshock sixteenth held-out corpus (CORPUS.md)"}


def plan(shapes=None, scenarios=None, seeds=None):
    runs = corpus_shapes.plan_priority(PRIORITY, MATRICES, shapes, scenarios, seeds)
    for r in runs:
        if r["scenario"] in LR_STEP:
            r["lr_fault_step"] = LR_STEP[r["scenario"]]
    return runs


def main(argv=None):
    return corpus_shapes.record_planned(plan(), MATRIX, __doc__, argv,
                                        start_until_min=START_UNTIL_MIN)


if __name__ == "__main__":
    sys.exit(main())
