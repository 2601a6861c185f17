"""Records the seventh held-out corpus (CORPUS.md, "Seventh held-out look"):
a small matrix recorded blind, with the defaults as they stood after six
held-out looks, with what none of the earlier corpora holds.

Shapes: a LLaMA layout with head_dim 48 (d 288, 6 query heads sharing 2 KV
heads, GQA 3:1, 4 layers) trained with Adam (AdamW without weight decay)
and beta2 0.99, peak 2e-3; and a GPT MoE with 8 experts top-1, head_dim 24
(d 48, 2 heads, 3 layers) trained with RMSprop (train.py --optimizer
rmsprop: alpha 0.99, no momentum, no weight decay), peak 1e-3. Both warm up
over 100 steps, then decay linearly to zero (train.py --schedule linear,
--min-lr-frac 0) or as the inverse square root of the step (--schedule
invsqrt), alternating between the shapes.

Faults at step 1,000 of 1,500, hidden from the logged rate: a 5x jump,
a 20x ramp over 200 steps (and a 3x ramp over 100 steps on the MoE), the
earlier looks' attention fault (bits 6 on the LLaMA, 10 on the MoE) and
combined-late (attention at 1,000, the hidden 20x ramp from 1,100).
After the first 17 runs, on their divergence alone and before any scoring
(no MoE fault but combined-late had diverged): a hidden 100x ramp and the
attention fault at bits 12, on the MoE.
Hard negatives, healthy by family (any alert is false): a step decay of
the rate, 10x down at step 1,000 (--schedule step, 2,000 steps); the
sequence length doubled from 32 to 64 tokens at step 1,000 (--ctx-change;
the GPT's learned positions 32-63 are untrained until then); the effective
batch doubled at step 1,000 by accumulating two micro-batches
(--accum-change). Both shapes' healthy runs last 2,000 steps; the hard
negatives train on past a divergence by the loss criterion. Seed 71.
Every run is in the validation split: the corpus only reports. Not
calibrated: a fault that does not diverge stays in as recorded.

    FORESHOCK_LIB=build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout7.py /work/holdout7-out --jobs 2

The matrix is corpus_shapes.py's planner and runner with this file's table,
as corpus_holdout6.py does. Recorded as a default Monitor sends (windows 10
and 50, a sketch every 10 steps).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

LLAMA, MOE = "llama-adam99-dh48-h6-kv2-l4", "moe8-top1-rmsprop-dh24-h2-l3"
SHAPES = {
    LLAMA: {"args": ["--arch", "llama", "--d", "288", "--heads", "6", "--kv-heads", "2",
                     "--layers", "4", "--weight-decay", "0", "--beta2", "0.99",
                     "--warmup", "100"],
            "lr": 2e-3, "split": "validation", "head_dim": 48, "fmt": {"bits": 6}},
    MOE: {"args": ["--arch", "gpt", "--experts", "8", "--top-k", "1", "--d", "48",
                   "--heads", "2", "--layers", "3", "--optimizer", "rmsprop", "--alpha", "0.99",
                   "--weight-decay", "0", "--warmup", "100"],
          "lr": 1e-3, "split": "validation", "head_dim": 24, "fmt": {"bits": 10}},
}
FAULT_STEP, LATE_LR_STEP = 1000, 1100
SCENARIOS = {
    "healthy": ("healthy", []),
    # Hard negatives: train.py's healthy scenario, any alert is false.
    "healthy-stepdecay": ("healthy", ["--step-decay", f"{FAULT_STEP}:0.1"]),
    "healthy-seqlen": ("healthy", ["--ctx-change", f"{FAULT_STEP}:64"]),
    "healthy-accum": ("healthy", ["--accum-change", f"{FAULT_STEP}:2"]),
    "lr-jump5-hidden": ("lr", ["--lr-hidden", "--lr-mult", "5", "--lr-ramp", "1"]),
    "lr-ramp20-hidden": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]),
    "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
    "combined-late": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden",
                                   "--lr-mult", "20", "--lr-ramp", "200",
                                   "--lr-fault-step", str(LATE_LR_STEP)]),
    # Last, so the LLaMA's faults alternate schedules without it.
    "lr-ramp3-hidden": ("lr", ["--lr-hidden", "--lr-mult", "3", "--lr-ramp", "100"]),
    # Appended after the first 17 runs were recorded, on their divergence
    # alone (before any scoring): on the MoE no LR fault (5x jump, 3x and
    # 20x ramps) and not the bits-10 attention fault had diverged. A 100x
    # hidden ramp and the attention fault at bits 12, on the MoE.
    "lr-ramp100-hidden": ("lr", ["--lr-hidden", "--lr-mult", "100", "--lr-ramp", "200"]),
    "attn-strong12": ("attention-numerics", ["--bits", "12", "--fault-on", "both"]),
}
# The hard negatives train on to their end even if their loss meets the
# divergence criterion (a longer context's first batches may).
OVERRIDES = {
    "healthy-stepdecay": {"schedule": "step", "steps": 2000, "post_diverge": -1},
    "healthy-seqlen": {"steps": 1600, "post_diverge": -1},
    "healthy-accum": {"steps": 1600, "post_diverge": -1},
}
# CPU time: the LLaMA (about 0.1 s a step) runs the 3x ramp on the MoE only.
ONLY = {"lr-ramp3-hidden": [MOE], "lr-ramp100-hidden": [MOE], "attn-strong12": [MOE]}
MATRIX = dict(corpus_shapes.MATRIX, shapes=SHAPES, scenarios=SCENARIOS, seeds=(71,),
              schedules=("linear", "invsqrt"), overrides=OVERRIDES, only=ONLY,
              common=["--ctx", "32", "--batch", "16", "--min-lr-frac", "0", "--clip", "1.0",
                      "--threads", "1"],
              steps=1500, healthy_steps=2000, fault_step=FAULT_STEP,
              late_lr_step=LATE_LR_STEP, fmt={}, manifest_lr_mult=True,
              description="Foreshock seventh held-out corpus (CORPUS.md)")


def plan(shapes=None, scenarios=None, seeds=None):
    return corpus_shapes.plan(shapes, scenarios, seeds, MATRIX)


if __name__ == "__main__":
    sys.exit(corpus_shapes.main(matrix=MATRIX, doc=__doc__))
