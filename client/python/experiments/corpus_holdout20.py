"""Records the twentieth held-out corpus (CORPUS.md, "Twentieth held-out
look"): healthy runs more than three times longer than any earlier
look's.

Every earlier healthy run stopped by step 3,000, so the false-alert rate
the scorecard reports covers the first 3,000 steps of training at
most: the fast early phase. A real run spends most of its steps later, in
a slow phase where the loss flattens, the model starts to memorize a small
corpus, the rate decays towards zero and the updates shrink. A rule whose
baseline drifts there, or whose relative floors meet an update too small
to have structure, pages a run nobody broke. This look records three
healthy runs of 10,000 steps (the LLaMA's shape is the thirteenth look's,
trained otherwise; no earlier look had the other two) and reports any
alert on them as false.

Three shapes, a sketch every 10 steps over windows 10 and 50 (the
Monitor's defaults), gradients clipped at 1.0, --ctx 32 --batch 8:

- llama-dh16-h4-kv2-l4: LLaMA, d 64, 4 query heads of 16 over 2 KV heads,
  4 layers; AdamW 0.9/0.95, weight decay 0.1, peak 1.5e-3, 200-step
  warm-up, cosine decay to 10% at step 10,000.
- moe8-top2-dh16-h4-l3: GPT MoE, 8 experts top-2, d 64, 4 heads of 16, 3
  layers; AdamW 0.9/0.95, weight decay 0.1, peak 1e-3, 300-step warm-up,
  warmup-stable-decay (the last 20% linear to 10%).
- gpt-dense-dh24-h4-l3: GPT, dense, d 96, 4 heads of 24, 3 layers; AdamW
  0.9/0.999, weight decay 0.01, peak 2e-3, 100-step warm-up, linear decay
  to zero at step 10,000.

Seed 201, every run in the validation split: the corpus only reports.

    FORESHOCK_LIB=$PWD/build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout20.py /work/holdout20-out --jobs 1

No trainer starts after --start-until minutes (default 30); the recorder
resumes what is missing if run again.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

LL, MOE, GD = "llama-dh16-h4-kv2-l4", "moe8-top2-dh16-h4-l3", "gpt-dense-dh24-h4-l3"
SEED = 201
START_UNTIL_MIN = 30  # no trainer starts later than this
STEPS = 10000
BATCH = 8  # sequences a step


# Each shape's train.py arguments, peak rate, head_dim, warm-up, schedule
# and final rate fraction. The twenty-first look's recorder faults these
# same runs and takes them from here.
SHAPES = {
    LL: (["--arch", "llama", "--experts", "0", "--d", "64", "--heads", "4", "--kv-heads", "2",
          "--layers", "4", "--beta2", "0.95", "--weight-decay", "0.1"],
         1.5e-3, 16, 200, "cosine", 0.1),
    MOE: (["--arch", "gpt", "--experts", "8", "--top-k", "2", "--d", "64", "--heads", "4",
           "--layers", "3", "--beta2", "0.95", "--weight-decay", "0.1"],
          1e-3, 16, 300, "wsd", 0.1),
    GD: (["--arch", "gpt", "--experts", "0", "--d", "96", "--heads", "4", "--layers", "3",
          "--beta2", "0.999", "--weight-decay", "0.01"],
         2e-3, 24, 100, "linear", 0),
}
ALL = (LL, MOE, GD)


def common(warmup, min_lr_frac):
    """The train.py arguments every run of a shape shares, its twins' too."""
    return ["--ctx", "32", "--batch", str(BATCH), "--warmup", str(warmup), "--min-lr-frac",
            str(min_lr_frac), "--clip", "1.0", "--threads", "1"]


def matrix(shape, args, lr, head_dim, warmup, schedule, min_lr_frac):
    return dict(corpus_shapes.MATRIX, shapes={shape: {
        "args": args, "lr": lr, "split": "validation", "head_dim": head_dim}},
        scenarios={"healthy": ("healthy", [])}, seeds=(SEED,), schedules=(schedule,),
        overrides={"healthy": {"schedule": schedule, "steps": STEPS, "fault_step": None,
                               "post_diverge": -1}},
        common=common(warmup, min_lr_frac),
        steps=STEPS, healthy_steps=STEPS, fault_step=STEPS, late_lr_step=None, fmt={})


MATRICES = {shape: matrix(shape, *SHAPES[shape]) for shape in ALL}
PRIORITY = [("healthy", ALL)]
MATRIX = {"description": "Foreshock twentieth held-out corpus (CORPUS.md)"}


plan, main = corpus_shapes.recorder(PRIORITY, MATRICES, MATRIX, __doc__, START_UNTIL_MIN)


if __name__ == "__main__":
    sys.exit(main())
