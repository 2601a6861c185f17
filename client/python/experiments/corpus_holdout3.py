"""Records the third held-out corpus (CORPUS.md, "Third held-out look"): a
small matrix recorded blind, after the detection defaults had been tuned
on the earlier corpora, with what none of them holds. Two layouts no
corpus used (train.py --arch qwen3moe: a Qwen3-MoE/OLMoE-style LLaMA
decoder with per-head RMSNorm qk-norm and 8 routed SwiGLU experts, top-2;
--arch parallel: a GPT-J/Cohere-style parallel attention+MLP block with
per-head LayerNorm qk-norm), at shapes no corpus used (head_dim 64 with 2
query heads and 1 KV head, 3 layers; head_dim 8 with 16 query heads and 4
KV heads, 6 layers), a peak rate no corpus used (3e-3), two schedules with
warm-ups no corpus used (warmup-stable-decay after 300 warm-up steps;
constant with none, --warmup 1), faults later than in any corpus (step
700 of 1,400; the combined run's LR ramp from step 800), healthy runs of
4,000 steps, a peak rate 10x too large from step 1, and a seed no corpus
used (31). The learning-rate faults are all hidden from the logged rate.
Every run is in the validation split: the corpus only reports. It was not
calibrated: a fault that does not diverge stays in as recorded.

    FORESHOCK_LIB=build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout3.py /work/holdout3-out --jobs 1

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

# The attention fault's bits are corpus_holdout.py's for the LLaMA layout
# (6), whose attention these two share; the LR multipliers are
# corpus_holdout2.py's. Neither is calibrated for these shapes.
SHAPES = {
    "qwen3moe-dh64-h2-kv1-l3": {"args": ["--arch", "qwen3moe", "--experts", "8", "--top-k", "2",
                                         "--d", "128", "--heads", "2", "--kv-heads", "1",
                                         "--layers", "3"],
                                "split": "validation", "head_dim": 64},
    "parallel-dh8-h16-kv4-l6": {"args": ["--arch", "parallel", "--d", "128", "--heads", "16",
                                         "--kv-heads", "4", "--layers", "6"],
                                "split": "validation", "head_dim": 8},
}
FAULT_STEP, LATE_LR_STEP = 700, 800
SCENARIOS = {
    "healthy": ("healthy", []),
    "lr-ramp-hidden": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]),
    "lr-jump-hidden": ("lr", ["--lr-hidden", "--lr-mult", "10", "--lr-ramp", "1"]),
    "lr-peak": ("healthy", ["--peak-mult", "10"]),
    "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
    "combined-late": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden",
                                   "--lr-mult", "20", "--lr-ramp", "200",
                                   "--lr-fault-step", str(LATE_LR_STEP)]),
}
# corpus_shapes.plan picks a run's schedule by (shape, seed, scenario):
# with two schedules and seed 31 the two shapes alternate, so each
# scenario runs once under each schedule. Each schedule has its warm-up.
MATRIX = dict(corpus_shapes.MATRIX, shapes=SHAPES, scenarios=SCENARIOS, seeds=(31,),
              schedules=("wsd", "constant"), warmup_of={"wsd": 300, "constant": 1},
              lr=3e-3,
              common=["--ctx", "32", "--batch", "16", "--warmup", "50", "--clip", "1.0",
                      "--threads", "1"],
              steps=1400, healthy_steps=4000, peak_steps=800, fault_step=FAULT_STEP,
              late_lr_step=LATE_LR_STEP, fmt={"bits": 6}, manifest_lr_mult=True,
              description="Foreshock third held-out corpus (CORPUS.md)")


def plan(shapes=None, scenarios=None, seeds=None):
    return corpus_shapes.plan(shapes, scenarios, seeds, MATRIX)


if __name__ == "__main__":
    sys.exit(corpus_shapes.main(matrix=MATRIX, doc=__doc__))
