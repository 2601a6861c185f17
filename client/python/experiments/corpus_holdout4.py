"""Records the fourth held-out corpus (CORPUS.md, "Fourth held-out look"):
a small matrix recorded blind, after the defaults had been tuned on the
earlier corpora and scored on three held-out looks, with what none of them
holds. Training loops no corpus used: the Lion optimizer (train.py
--optimizer lion: sign updates, peak rate 5e-4, decoupled weight decay
0.3) and gradient accumulation (--accum 2: two micro-batches of 8 a step)
with AdamW and no weight decay. Two shapes no corpus used: a LLaMA layout
with 3 query heads and one KV head (multi-query) of head_dim 32 over 2
layers, and a GPT MoE with 16 experts, top-1 (head_dim 16, 4 heads, 2
layers). A 20-step warm-up with schedules that decay to zero
(--min-lr-frac 0: cosine, and warmup-stable-decay), so most rules detect
from step 60 and every fault (step 600 of 1,200; the combined run's
hidden LR ramp from step 700) comes after 30 warm-ups. A hard negative no
corpus holds: a healthy run whose data changes at step 600 (--data-shift:
from then on batches come from the last quarter of the text, another part
of the standard library), so the loss rises with no fault. Healthy runs
of 3,000 steps, seed 41. The learning-rate faults are all hidden from the
logged rate. Every run is in the validation split: the corpus only
reports. Not calibrated: a fault that does not diverge stays in as
recorded.

    FORESHOCK_LIB=build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout4.py /work/holdout4-out --jobs 1

The matrix is corpus_shapes.py's planner and runner with this file's table,
as corpus_holdout.py does; the run names (SHAPE.SCENARIO.sSEED), the
resuming and the options (--shapes, --scenarios, --seeds, --jobs) are
corpus_shapes.py's. Recorded as a default Monitor sends (windows 10 and 50,
a sketch every 10 steps).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

# The attention fault's bits are corpus_holdout.py's for its layouts (6
# for LLaMA, 10 for the top-1 MoE); the LR multipliers are
# corpus_holdout3.py's. Neither is calibrated for these shapes or
# optimizers. Each shape sets its own batch (argparse: the last one counts,
# and a shape's arguments come before COMMON's).
SHAPES = {
    "llama-lion-dh32-h3-kv1-l2": {"args": ["--arch", "llama", "--d", "96", "--heads", "3",
                                           "--kv-heads", "1", "--layers", "2",
                                           "--optimizer", "lion", "--weight-decay", "0.3",
                                           "--batch", "16"],
                                  "lr": 5e-4, "split": "validation", "head_dim": 32,
                                  "fmt": {"bits": 6}},
    "moe16-top1-accum2-dh16-h4-l2": {"args": ["--arch", "gpt", "--experts", "16",
                                              "--top-k", "1", "--d", "64", "--heads", "4",
                                              "--layers", "2", "--weight-decay", "0",
                                              "--batch", "8", "--accum", "2"],
                                     "lr": 4e-3, "split": "validation", "head_dim": 16,
                                     "fmt": {"bits": 10}},
}
FAULT_STEP, LATE_LR_STEP = 600, 700
SCENARIOS = {
    "healthy": ("healthy", []),
    # train.py's healthy scenario: its family is healthy, any alert is false.
    "healthy-datashift": ("healthy", ["--data-shift", str(FAULT_STEP)]),
    "lr-ramp-hidden": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]),
    "lr-jump-hidden": ("lr", ["--lr-hidden", "--lr-mult", "10", "--lr-ramp", "1"]),
    "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
    "combined-late": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden",
                                   "--lr-mult", "20", "--lr-ramp", "200",
                                   "--lr-fault-step", str(LATE_LR_STEP)]),
}
# corpus_shapes.plan picks a run's schedule by (shape, seed, scenario):
# with two schedules the two shapes alternate, so each scenario runs once
# under each schedule.
MATRIX = dict(corpus_shapes.MATRIX, shapes=SHAPES, scenarios=SCENARIOS, seeds=(41,),
              schedules=("cosine", "wsd"),
              common=["--ctx", "32", "--warmup", "20", "--min-lr-frac", "0", "--clip", "1.0",
                      "--threads", "1"],
              steps=1200, healthy_steps=3000, fault_step=FAULT_STEP,
              late_lr_step=LATE_LR_STEP, fmt={}, manifest_lr_mult=True,
              description="Foreshock fourth held-out corpus (CORPUS.md)")


def plan(shapes=None, scenarios=None, seeds=None):
    return corpus_shapes.plan(shapes, scenarios, seeds, MATRIX)


if __name__ == "__main__":
    sys.exit(corpus_shapes.main(matrix=MATRIX, doc=__doc__))
