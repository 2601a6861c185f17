"""Records the fifteenth held-out corpus (CORPUS.md, "Fifteenth held-out
look"): SGD with heavy-ball momentum on three shapes no earlier look had.
The daemon now learns the trainer's optimizer class from the Monitor's
Hello (train.py passes its optimizer, so the Hello says "SGD") and, under
SGD, credits the gradient norm's rise in its update-ratio rules: an
attention fault raises the gradient and, under SGD, the step with it, and
should be labelled attention-numerics, not optimizer-hyperparameter. That
credit was set on one shape only (the fifth look's 32-expert top-4 GPT MoE
with a shared expert, d 64, 4 heads of 16, 2 layers, SGD 0.9 at 0.3);
every earlier SGD run is that shape. This look asks whether it holds on
others, and whether hidden learning-rate faults under SGD are still caught
as optimizer-hyperparameter.

Three SGD shapes, seed 151, a sketch every 10 steps over windows 10 and 50
(the Monitor's defaults), gradients clipped at 1.0, --min-lr-frac 0:

- llama-sgd-dh24-h4-kv2-l3 (LLaMA, dense, d 96, 4 query heads of 24 over
  2 KV heads, 3 layers): SGD momentum 0.9, no weight decay, peak 0.2, a
  50-step warm-up; cosine or constant.
- gpt-dense-sgd95-wd-dh32-h4-l2 (GPT, dense, d 128, 4 heads of 32, 2
  layers): SGD momentum 0.95, weight decay 1e-4 (L2), peak 0.1, a 100-step
  warm-up; cosine or WSD.
- moe8-top2-sgd-dh32-h2-l3 (GPT MoE, 8 experts top-2, no shared expert,
  d 64, 2 heads of 32, 3 layers): SGD momentum 0.9, no weight decay, peak
  0.3, a 30-step warm-up; constant or cosine.

Each peak was checked once before recording, by one healthy 400-step run
per shape at that rate (constant after the warm-up, no monitor; not in the
corpus): all three trained without diverging (CORPUS.md gives the losses).

Faults, the learning-rate faults hidden from the logged rate: the
attention fault (bits 12, both O and dO), combined-late (that attention
fault, then a hidden 20x ramp over 200 steps from 100 steps later), a 5x
jump and a 20x ramp over 200 steps. Faulted runs are 1,600 steps with the
fault at step 1,000 (combined-late's ramp from 1,100); two healthy runs of
3,000 steps per shape, one per schedule; the faults alternate the two.
Not calibrated: a fault that does not diverge within its run is counted
apart by the scorecard. Every run is in the validation split: the corpus
only reports.

Recorded in the order PRIORITY gives (the first healthy runs, the
attention faults, combined-late, the second healthy runs, the 5x jumps,
the 20x ramps); no trainer starts after --start-until minutes (default
20), so a corpus cut short holds the first cells and the recorder resumes
the rest if run again.

    FORESHOCK_LIB=$PWD/build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout15.py /work/holdout15-out --jobs 2

The matrix is corpus_shapes.py's planner with one table per shape, and
corpus_shapes' manifest. Recorded as a default Monitor sends (windows 10
and 50, a sketch every 10 steps, the per-step update ratio every step).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

LL, GD, MOE = "llama-sgd-dh24-h4-kv2-l3", "gpt-dense-sgd95-wd-dh32-h4-l2", "moe8-top2-sgd-dh32-h2-l3"
SEED = 151
START_UNTIL_MIN = 20  # no trainer starts later than this
FAULT_STEP, LATE_LR_STEP = 1000, 1100


def scenarios():
    """One shape's table: the same faults on every shape."""
    return {
        "healthy": ("healthy", []),
        "healthy-2": ("healthy", []),
        "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
        "combined-late": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden",
                                       "--lr-mult", "20", "--lr-ramp", "200",
                                       "--lr-fault-step", str(LATE_LR_STEP)]),
        "lr-jump5-hidden": ("lr", ["--lr-hidden", "--lr-mult", "5", "--lr-ramp", "1"]),
        "lr-ramp20-hidden": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]),
    }


def schedules(a, b):
    """Each scenario's schedule, set rather than alternated: the two
    healthy runs take one schedule each, the faults alternate."""
    o = {"healthy": {"schedule": a},
         "healthy-2": {"schedule": b, "steps": 3000, "fault_step": None}}
    for i, sc in enumerate(("attn-strong", "combined-late", "lr-jump5-hidden",
                            "lr-ramp20-hidden")):
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
        fmt={"bits": 12}, manifest_lr_mult=True)


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
# Which scenario on which shape, in recording order: what the look tests
# (a healthy run, the attention fault, combined-late) first.
PRIORITY = [
    ("healthy", ALL), ("attn-strong", ALL), ("combined-late", ALL),
    ("healthy-2", ALL), ("lr-jump5-hidden", ALL), ("lr-ramp20-hidden", ALL),
]
MATRIX = {"description": "Foreshock fifteenth held-out corpus (CORPUS.md)"}


plan, main = corpus_shapes.recorder(PRIORITY, MATRICES, MATRIX, __doc__, START_UNTIL_MIN)


if __name__ == "__main__":
    sys.exit(main())
