"""Records the sixth held-out corpus (CORPUS.md, "Sixth held-out look"): a
small matrix recorded blind, with the defaults as they stood after five
held-out looks, with what none of the earlier corpora holds.

Shapes: a LLaMA layout 8 layers deep (d 64, 2 query heads of 32 sharing
one KV head; the deepest earlier shape had 6 layers) with a 200-step
warm-up, and a GPT MoE with 16 experts top-2 at d 48 (3 heads of 16, 3
layers) with a 100-step warm-up. Both AdamW, betas 0.9/0.95, weight decay
0.1, peak 3e-3, decaying to 10% (cosine and wsd alternating).

Faults at step 700 of 1,200: the MoE routers alone (train.py
--router-lr-mult 30: the routers' own optimizer group ramps to 30x the
rate over 100 steps, hidden from the logged rate and from the rest of the
model; and --aux-off: the load-balancing loss switched off), the attention
fault in one layer only (train.py --fault-layers: layer 3 of the LLaMA's
8, layer 1 of the MoE's 3) and in every layer; a milder router fault
(10x, lr-router10-hidden) was appended before any result was seen; after
the first 11 runs, on their divergence alone, a 100x router ramp, the
attention fault at bits 10 on the LLaMA and a hidden 20x ramp of the whole
rate on the LLaMA. The router faults are named lr-router-*, so the scorecard's family() counts
them as learning-rate faults (right label optimizer-hyperparameter).
Hard negatives, healthy by family (any alert is false): three corrupted
batches (random tokens, steps 700-702, train.py --corrupt) and a mid-run
tightening of gradient clipping (1.0 to 0.25 at step 700,
--clip-change); the corrupted batches meet the loss's divergence
criterion, so those runs train on to step 1,200. Healthy runs of 2,500 steps, seed 61. Every run is in the
validation split: the corpus only reports. Not calibrated: a fault that
does not diverge stays in as recorded.

    FORESHOCK_LIB=build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout6.py /work/holdout6-out --jobs 2

The matrix is corpus_shapes.py's planner and runner with this file's table,
as corpus_holdout5.py does. Recorded as a default Monitor sends (windows 10
and 50, a sketch every 10 steps).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

MOE, LLAMA = "moe16-top2-dh16-h3-l3", "llama-dh32-h2-kv1-l8"
SHAPES = {
    LLAMA: {"args": ["--arch", "llama", "--d", "64", "--heads", "2",
                                      "--kv-heads", "1", "--layers", "8", "--warmup", "200"],
                             "split": "validation", "head_dim": 32,
                             "fmt": {"bits": 6, "layer": 3}},
    MOE: {"args": ["--arch", "gpt", "--experts", "16", "--top-k", "2", "--d", "48",
                   "--heads", "3", "--layers", "3", "--warmup", "100"],
          "split": "validation", "head_dim": 16, "fmt": {"bits": 10, "layer": 1}},
}
FAULT_STEP = 700
SCENARIOS = {
    "healthy": ("healthy", []),
    # Hard negatives: train.py's healthy scenario, any alert is false.
    "healthy-corrupt": ("healthy", ["--corrupt", f"{FAULT_STEP}:3"]),
    "healthy-clipchange": ("healthy", ["--clip-change", f"{FAULT_STEP}:0.25"]),
    # Router-only faults (MoE): --lr-mult 1, so only the routers' group moves.
    "lr-router-hidden": ("lr", ["--lr-hidden", "--lr-mult", "1", "--router-lr-mult", "30",
                                "--lr-ramp", "100"]),
    "lr-router-auxoff": ("healthy", ["--aux-off", str(FAULT_STEP)]),
    "attn-layer": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both",
                                          "--fault-layers", "{layer}"]),
    "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
    # Appended while the runs above were recording, before any result was
    # seen (last, so their schedules stay put): a milder router fault.
    "lr-router10-hidden": ("lr", ["--lr-hidden", "--lr-mult", "1", "--router-lr-mult", "10",
                                  "--lr-ramp", "100"]),
    # Appended after the first 11 runs were recorded, on their divergence
    # alone (before any scoring): neither the 30x router fault nor the
    # LLaMA's attention faults (bits 6) had diverged. A 100x router ramp,
    # the attention fault at the MoE's bits (10) on the LLaMA, and the
    # earlier looks' hidden 20x ramp on the LLaMA.
    "lr-router100-hidden": ("lr", ["--lr-hidden", "--lr-mult", "1", "--router-lr-mult", "100",
                                   "--lr-ramp", "100"]),
    "attn-strong10": ("attention-numerics", ["--bits", "10", "--fault-on", "both"]),
    "lr-ramp20-hidden": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]),
}
# The three random batches lift the 25-step mean loss past 1.2x its best
# (the divergence criterion; seen on the first recording, which stopped 30
# steps after): these healthy runs train on to their end.
OVERRIDES = {"healthy-corrupt": {"post_diverge": -1}}
ONLY = {"lr-router-hidden": [MOE], "lr-router-auxoff": [MOE], "lr-router10-hidden": [MOE],
        "lr-router100-hidden": [MOE], "attn-strong10": [LLAMA], "lr-ramp20-hidden": [LLAMA]}
MATRIX = dict(corpus_shapes.MATRIX, shapes=SHAPES, scenarios=SCENARIOS, seeds=(61,),
              schedules=("cosine", "wsd"), overrides=OVERRIDES, only=ONLY, lr=3e-3,
              common=["--ctx", "32", "--batch", "16", "--clip", "1.0", "--threads", "1"],
              steps=1200, healthy_steps=2500, fault_step=FAULT_STEP,
              late_lr_step=None, fmt={}, manifest_lr_mult=True,
              description="Foreshock sixth held-out corpus (CORPUS.md)")


def plan(shapes=None, scenarios=None, seeds=None):
    return corpus_shapes.plan(shapes, scenarios, seeds, MATRIX)


if __name__ == "__main__":
    sys.exit(corpus_shapes.main(matrix=MATRIX, doc=__doc__))
