"""Records the seventeenth held-out corpus (CORPUS.md, "Seventeenth held-out
look"): Muon on three shapes. No earlier corpus trains with Muon
(orthogonalized momentum for the hidden 2-D matrices, AdamW for the rest),
which is now common in large runs. Under Muon each hidden matrix's update is
near-orthogonal (its singular values pushed towards equal, its size set by
the rate and the matrix's shape, not by the gradient's), which may change
how an attention fault and a learning-rate fault look to the monitor. This
look asks, blind, whether the defaults stay quiet on healthy Muon training
and catch attention faults and hidden rate faults before divergence with
the right label.

train.py --optimizer muon: one optimizer of class Muon (the Monitor's Hello
says "Muon") steps both parts: every 2-D matrix inside the transformer
blocks (attention, MLP, experts, routers) by Nesterov momentum 0.95,
orthogonalized by 5 quintic Newton-Schulz steps and scaled by
0.2 sqrt(max(rows, cols)); embeddings, head, norms and biases by AdamW
(betas 0.9/0.95); decoupled weight decay on both; the rate (and every rate
fault) applies to both.

Three Muon shapes, seed 171, a sketch every 10 steps over windows 10 and 50
(the Monitor's defaults), gradients clipped at 1.0, --min-lr-frac 0:

- llama-muon-dh32-h3-kv1-l2 (LLaMA, dense, d 96, 3 query heads of 32 over
  1 KV head, 2 layers): peak 1e-2, weight decay 0.1, a 100-step warm-up;
  cosine or constant.
- gpt-dense-muon-dh16-h4-l4 (GPT, dense, d 64, 4 heads of 16, 4 layers):
  peak 8e-3, weight decay 0.01, a 50-step warm-up; WSD or cosine.
- moe8-top2-muon-dh32-h2-l2 (GPT MoE, 8 experts top-2, no shared expert,
  d 64, 2 heads of 32, 2 layers): peak 1e-2, weight decay 0.1, a 30-step
  warm-up; constant or cosine.

Each peak was chosen before recording by healthy 400-step runs (constant
after the warm-up, no monitor; not in the corpus): CORPUS.md gives the
losses.

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
15), so a corpus cut short holds the first cells and the recorder resumes
the rest if run again.

    FORESHOCK_LIB=$PWD/build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout17.py /work/holdout17-out --jobs 2

The matrix is corpus_shapes.py's planner with one table per shape, and
corpus_shapes' manifest. Recorded as a default Monitor sends (windows 10
and 50, a sketch every 10 steps, the per-step update ratio every step).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

LL, GD, MOE = "llama-muon-dh32-h3-kv1-l2", "gpt-dense-muon-dh16-h4-l4", "moe8-top2-muon-dh32-h2-l2"
SEED = 171
START_UNTIL_MIN = 15  # no trainer starts later than this
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
    LL: matrix(LL, ["--arch", "llama", "--experts", "0", "--d", "96", "--heads", "3",
                    "--kv-heads", "1", "--layers", "2", "--optimizer", "muon",
                    "--weight-decay", "0.1"],
               1e-2, 32, 100, ("cosine", "constant")),
    GD: matrix(GD, ["--arch", "gpt", "--experts", "0", "--d", "64", "--heads", "4",
                    "--layers", "4", "--optimizer", "muon", "--weight-decay", "0.01"],
               8e-3, 16, 50, ("wsd", "cosine")),
    MOE: matrix(MOE, ["--arch", "gpt", "--experts", "8", "--top-k", "2", "--d", "64",
                      "--heads", "2", "--layers", "2", "--optimizer", "muon",
                      "--weight-decay", "0.1"],
                1e-2, 32, 30, ("constant", "cosine")),
}
ALL = (LL, GD, MOE)
# Which scenario on which shape, in recording order: what the look tests
# (a healthy run, the attention fault, combined-late) first.
PRIORITY = [
    ("healthy", ALL), ("attn-strong", ALL), ("combined-late", ALL),
    ("healthy-2", ALL), ("lr-jump5-hidden", ALL), ("lr-ramp20-hidden", ALL),
]
MATRIX = {"description": "Foreshock seventeenth held-out corpus (CORPUS.md)"}


plan, main = corpus_shapes.recorder(PRIORITY, MATRICES, MATRIX, __doc__, START_UNTIL_MIN)


if __name__ == "__main__":
    sys.exit(main())
