"""Records the fifth held-out corpus (CORPUS.md, "Fifth held-out look"): a
small matrix recorded blind, with the defaults as they stood after four
held-out looks, with what none of the earlier corpora holds.

Shapes: a LLaMA layout with head_dim 128 (d 256, 2 query heads sharing one
KV head, 2 layers), and a fine-grained GPT MoE: 32 routed experts, top-4,
plus one always-on shared expert (train.py --shared-expert; d 64, 4 heads
of 16, 2 layers). Optimizers: AdamW with beta2 0.999 (every earlier AdamW
run used 0.95), no weight decay and a 250-step warm-up on the LLaMA; SGD
with heavy-ball momentum 0.9 (train.py --optimizer sgd, peak rate 0.3, no
weight decay, 30-step warm-up) on the MoE. Schedules decay to zero
(--min-lr-frac 0), cosine and constant alternating.

Faults, all learning-rate ones hidden from the logged rate: a resume that
forgot the scheduler's state (train.py --lr-restart 1300: late in a cosine
decay the optimizer's schedule starts over, warm-up then peak, while the
logged rate continues the decay), a skipped warm-up (--skip-warmup: the
optimizer is at the peak from step 1 while the logged rate warms up), a
3x ramp over 100 steps at step 1,000, the attention fault at step 1,000
and the combined fault (attention at 1,000, a 20x ramp over 200 steps from
1,100). Hard negatives, healthy by family (any alert is false): cosine
with warm restarts every 500 steps (train.py --schedule cosine-restarts:
the logged rate jumps back to the peak by design) and a batch-size change
(16 to 8 sequences at step 1,000, the rate unchanged). Healthy runs of
3,000 steps, seed 51. Every run is in the validation split: the corpus
only reports. Not calibrated: a fault that does not diverge stays in as
recorded.

    FORESHOCK_LIB=build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout5.py /work/holdout5-out --jobs 2

The matrix is corpus_shapes.py's planner and runner with this file's table,
as corpus_holdout4.py does; the run names (SHAPE.SCENARIO.sSEED), the
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
# for LLaMA, 10 for its MoE); the 20x ramp is corpus_holdout3.py's. None is
# calibrated for these shapes or optimizers. Each shape sets its own
# warm-up (COMMON has none).
SHAPES = {
    "llama-b2-999-dh128-h2-kv1-l2": {"args": ["--arch", "llama", "--d", "256", "--heads", "2",
                                              "--kv-heads", "1", "--layers", "2",
                                              "--beta2", "0.999", "--weight-decay", "0",
                                              "--warmup", "250"],
                                     "lr": 1.5e-3, "split": "validation", "head_dim": 128,
                                     "fmt": {"bits": 6}},
    "moe32-top4-shared-sgd-dh16-h4-l2": {"args": ["--arch", "gpt", "--experts", "32",
                                                  "--top-k", "4", "--shared-expert",
                                                  "--d", "64", "--heads", "4", "--layers", "2",
                                                  "--optimizer", "sgd", "--momentum", "0.9",
                                                  "--weight-decay", "0", "--warmup", "30"],
                                         "lr": 0.3, "split": "validation", "head_dim": 16,
                                         "fmt": {"bits": 10}},
}
FAULT_STEP, LATE_LR_STEP, RESUME_STEP = 1000, 1100, 1300
SCENARIOS = {
    "healthy": ("healthy", []),
    # Hard negatives: train.py's healthy scenario, any alert is false.
    "healthy-restarts": ("healthy", ["--restart-period", "500"]),
    "healthy-batchchange": ("healthy", ["--batch-change", f"{FAULT_STEP}:8"]),
    # --lr-mult 1: no ramp, only the restart or the skipped warm-up.
    "lr-resume-hidden": ("lr", ["--lr-hidden", "--lr-mult", "1",
                                "--lr-restart", str(RESUME_STEP)]),
    "lr-warmup-skipped": ("lr", ["--lr-hidden", "--lr-mult", "1", "--skip-warmup"]),
    "lr-ramp3-hidden": ("lr", ["--lr-hidden", "--lr-mult", "3", "--lr-ramp", "100"]),
    "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
    "combined-late": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden",
                                   "--lr-mult", "20", "--lr-ramp", "200",
                                   "--lr-fault-step", str(LATE_LR_STEP)]),
    # Appended after the runs above were recorded, on their divergence
    # alone (before any scoring): none of their learning-rate faults
    # diverged, so the earlier looks' hidden 20x ramp over 200 steps, a
    # learning-rate fault that might. Last, so the others' schedules stay.
    "lr-ramp20-hidden": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]),
}
OVERRIDES = {
    "healthy-restarts": {"schedule": "cosine-restarts", "steps": 2000, "fault_step": None},
    "healthy-batchchange": {"steps": 2000},
    # Late in a cosine decay to zero: at step 1,300 of 1,600 the rate is
    # about a tenth of the peak.
    "lr-resume-hidden": {"schedule": "cosine", "fault_step": RESUME_STEP},
    "lr-warmup-skipped": {"steps": 1000, "fault_step": 1},
}
# corpus_shapes.plan picks the other runs' schedules by (shape, seed,
# scenario): the two shapes alternate.
MATRIX = dict(corpus_shapes.MATRIX, shapes=SHAPES, scenarios=SCENARIOS, seeds=(51,),
              schedules=("cosine", "constant"), overrides=OVERRIDES,
              common=["--ctx", "32", "--batch", "16", "--min-lr-frac", "0", "--clip", "1.0",
                      "--threads", "1"],
              steps=1600, healthy_steps=3000, fault_step=FAULT_STEP,
              late_lr_step=LATE_LR_STEP, fmt={}, manifest_lr_mult=True,
              description="Foreshock fifth held-out corpus (CORPUS.md)")


def plan(shapes=None, scenarios=None, seeds=None):
    return corpus_shapes.plan(shapes, scenarios, seeds, MATRIX)


if __name__ == "__main__":
    sys.exit(corpus_shapes.main(matrix=MATRIX, doc=__doc__))
