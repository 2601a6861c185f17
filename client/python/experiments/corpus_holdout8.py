"""Records the eighth held-out corpus (CORPUS.md, "Eighth held-out look"):
a small matrix recorded blind, with the defaults as they stood after seven
held-out looks, with what none of the earlier corpora holds.

Shapes: a deep narrow Qwen3 dense model (train.py --arch qwen3moe
--experts 0: per-head qk-norm, RoPE, GQA, a dense SwiGLU MLP; d 64, 4
query heads of 16 sharing 2 KV heads, 10 layers) trained with AdamW betas
0.9/0.98, eps 1e-6, weight decay 0.1, peak 2e-3, a 400-step warm-up; and a
Qwen3-MoE with 16 SwiGLU experts top-2 and head_dim 32 (d 64, 2 heads, 2
KV heads, 3 layers) trained with AdamW betas 0.85/0.97, eps 1e-10, weight
decay 0.02, peak 3e-3, a 300-step warm-up. Schedules WSD and cosine
(decaying to 10%), alternating between the shapes.

Hard negatives, healthy by family (any alert is false), each a change at
step 1,200 of 1,800: the optimizer's state dropped (train.py --opt-reset:
a resume that loads the weights without the optimizer state, the logged
rate unchanged); the first half of the layers frozen until then
(--freeze-until); the weight decay changed (--wd-change: 0.1 to 0 on the
dense model, 0.02 to 0.2 on the MoE); the rate warmed up again over 100
steps (--rewarmup, the logged rate too: a resume with a re-warm-up). The
hard negatives train on past a divergence by the loss criterion. Healthy
runs of 2,000 steps.

Faults at step 1,200 of 1,800, the LR faults hidden from the logged rate:
a 3x jump, a 10x jump, a 20x ramp over 200 steps, the earlier looks'
attention fault (bits 10) and combined-late (attention at 1,200, the
hidden 10x jump at 1,250). After the first 20 runs, on their divergence
alone and before any scoring (the bits-10 attention fault had diverged on
neither shape): the attention fault at bits 12, on both. Seed 81. Every run is in the validation split:
the corpus only reports. Not calibrated: a fault that does not diverge
stays in as recorded.

    FORESHOCK_LIB=$PWD/build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout8.py /work/holdout8-out --jobs 2

The matrix is corpus_shapes.py's planner and runner with this file's table,
as corpus_holdout7.py does. Recorded as a default Monitor sends (windows 10
and 50, a sketch every 10 steps).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

DENSE, MOE = "qwen3dense-dh16-h4-kv2-l10", "qwen3moe16-top2-dh32-h2-kv2-l3"
SHAPES = {
    DENSE: {"args": ["--arch", "qwen3moe", "--experts", "0", "--d", "64", "--heads", "4",
                     "--kv-heads", "2", "--layers", "10", "--beta1", "0.9", "--beta2", "0.98",
                     "--eps", "1e-6", "--weight-decay", "0.1", "--warmup", "400"],
            "lr": 2e-3, "split": "validation", "head_dim": 16,
            "fmt": {"bits": 10, "wd_to": "0"}},
    MOE: {"args": ["--arch", "qwen3moe", "--experts", "16", "--top-k", "2", "--d", "64",
                   "--heads", "2", "--kv-heads", "2", "--layers", "3", "--beta1", "0.85",
                   "--beta2", "0.97", "--eps", "1e-10", "--weight-decay", "0.02",
                   "--warmup", "300"],
          "lr": 3e-3, "split": "validation", "head_dim": 32,
          "fmt": {"bits": 10, "wd_to": "0.2"}},
}
FAULT_STEP, LATE_LR_STEP = 1200, 1250
SCENARIOS = {
    "healthy": ("healthy", []),
    # Hard negatives: train.py's healthy scenario, any alert is false.
    "healthy-optreset": ("healthy", ["--opt-reset", str(FAULT_STEP)]),
    "healthy-unfreeze": ("healthy", ["--freeze-until", str(FAULT_STEP)]),
    "healthy-wdchange": ("healthy", ["--wd-change", f"{FAULT_STEP}:{{wd_to}}"]),
    "healthy-rewarmup": ("healthy", ["--rewarmup", f"{FAULT_STEP}:100"]),
    "lr-jump3-hidden": ("lr", ["--lr-hidden", "--lr-mult", "3", "--lr-ramp", "1"]),
    "lr-jump10-hidden": ("lr", ["--lr-hidden", "--lr-mult", "10", "--lr-ramp", "1"]),
    "lr-ramp20-hidden": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]),
    "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
    "combined-late": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden",
                                   "--lr-mult", "10", "--lr-ramp", "1",
                                   "--lr-fault-step", str(LATE_LR_STEP)]),
    # Appended after the first 20 runs were recorded, on their divergence
    # alone (before any scoring): the bits-10 attention fault had diverged
    # on neither shape. The attention fault at bits 12.
    "attn-strong12": ("attention-numerics", ["--bits", "12", "--fault-on", "both"]),
}
# The hard negatives train on to their end even if their loss meets the
# divergence criterion (a resume without the optimizer state may).
HARD = ("healthy-optreset", "healthy-unfreeze", "healthy-wdchange", "healthy-rewarmup")
OVERRIDES = {sc: {"post_diverge": -1} for sc in HARD}
MATRIX = dict(corpus_shapes.MATRIX, shapes=SHAPES, scenarios=SCENARIOS, seeds=(81,),
              schedules=("wsd", "cosine"), overrides=OVERRIDES,
              common=["--ctx", "32", "--batch", "16", "--clip", "1.0", "--threads", "1"],
              steps=1800, healthy_steps=2000, fault_step=FAULT_STEP,
              late_lr_step=LATE_LR_STEP, fmt={}, manifest_lr_mult=True,
              description="Foreshock eighth held-out corpus (CORPUS.md)")


def plan(shapes=None, scenarios=None, seeds=None):
    return corpus_shapes.plan(shapes, scenarios, seeds, MATRIX)


if __name__ == "__main__":
    sys.exit(corpus_shapes.main(matrix=MATRIX, doc=__doc__))
