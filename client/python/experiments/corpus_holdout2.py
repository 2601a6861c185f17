"""Records the second held-out corpus (CORPUS.md, "Second held-out look"):
a small matrix recorded after the detection defaults had been tuned on all
three earlier corpora, to score those defaults blind. Two shapes no corpus
holds (a LLaMA with head_dim 8 and 4 layers; a dense GPT with head_dim 32,
2 heads, 4 layers), a warm-up no corpus used (150 steps), faults at step
500 of 1,100, one seed, the learning-rate faults hidden from the logged
rate. Every run is in the validation split: the corpus only reports. It
was not calibrated: a fault that does not diverge stays in as recorded.

    FORESHOCK_LIB=build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout2.py /work/holdout2-out

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
import corpus_holdout  # noqa: E402
import corpus_shapes  # noqa: E402

# The attention fault's bits per architecture are corpus_holdout.py's for
# the same architecture (llama 6, gpt 10); the LR multipliers are fixed,
# not calibrated per shape.
SHAPES = {
    "llama-dh8-h8-kv4-l4": {"args": ["--arch", "llama", "--d", "64", "--heads", "8",
                                     "--kv-heads", "4", "--layers", "4"],
                            "lr": 2e-3, "split": "validation", "head_dim": 8,
                            "fmt": {"bits": 6}},
    "gpt-dense-dh32-h2-l4": {"args": ["--arch", "gpt", "--experts", "0",
                                      "--d", "64", "--heads", "2", "--layers", "4"],
                             "lr": 4e-3, "split": "validation", "head_dim": 32,
                             "fmt": {"bits": 10}},
}
FAULT_STEP, LATE_LR_STEP = 500, 600
SCENARIOS = {
    "healthy": ("healthy", []),
    "lr-ramp-hidden": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]),
    "lr-jump-hidden": ("lr", ["--lr-hidden", "--lr-mult", "10", "--lr-ramp", "1"]),
    "attn-strong": corpus_holdout.SCENARIOS["attn-strong"],
    "combined-late": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden",
                                   "--lr-mult", "20", "--lr-ramp", "200",
                                   "--lr-fault-step", str(LATE_LR_STEP)]),
}
MATRIX = dict(corpus_shapes.MATRIX, shapes=SHAPES, scenarios=SCENARIOS, seeds=(21,),
              common=["--ctx", "32", "--batch", "16", "--warmup", "150", "--clip", "1.0",
                      "--threads", "1"],
              steps=1100, healthy_steps=2500, fault_step=FAULT_STEP, late_lr_step=LATE_LR_STEP,
              fmt={}, manifest_lr_mult=True,
              description="Foreshock second held-out corpus (CORPUS.md)")


def plan(shapes=None, scenarios=None, seeds=None):
    return corpus_shapes.plan(shapes, scenarios, seeds, MATRIX)


if __name__ == "__main__":
    sys.exit(corpus_shapes.main(matrix=MATRIX, doc=__doc__))
