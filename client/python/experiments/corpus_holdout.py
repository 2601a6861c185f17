"""Records the held-out corpus (CORPUS.md, "Held-out corpus"): runs that no
detection default was tuned on, with what the first two corpora lack: the
LLaMA layout (RMSNorm, RoPE, SwiGLU, GQA) at shapes other than the first
corpus's, top-1 expert routing, a lower peak rate (2e-3) and a longer
warm-up (100 steps), faults later in the run (step 500 of 1,200), and the
learning-rate faults all hidden from the logged rate. Every run is in the
validation split: the whole corpus only reports.

    FORESHOCK_LIB=build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout.py /work/holdout-out

The matrix is corpus_shapes.py's planner and runner with this file's table
(corpus_shapes.MATRIX's keys); what it writes, the run names
(SHAPE.SCENARIO.sSEED), the resuming and the options (--shapes,
--scenarios, --seeds, --jobs) are corpus_shapes.py's. Recorded as a
default Monitor sends (windows 10 and 50, a sketch every 10 steps).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

# Calibrated with trial runs (CORPUS.md, "Held-out corpus"): the bits of
# the attention fault and the hidden LR faults' multipliers per shape.
# head_dim is d / heads. None of these is a shape of the first two corpora.
SHAPES = {
    "llama-dh16-h6-kv2-l3": {"args": ["--arch", "llama", "--d", "96", "--heads", "6",
                                      "--kv-heads", "2", "--layers", "3"],
                             "lr": 2e-3, "split": "validation", "head_dim": 16,
                             "fmt": {"bits": 6, "ramp_mult": 10, "jump_mult": 6}},
    "llama-dh32-h4-kv4-l2": {"args": ["--arch", "llama", "--d", "128", "--heads", "4",
                                      "--kv-heads", "4", "--layers", "2"],
                             "lr": 2e-3, "split": "validation", "head_dim": 32,
                             "fmt": {"bits": 6, "ramp_mult": 20, "jump_mult": 6}},
    "moe-top1-dh16-h4-l3": {"args": ["--arch", "gpt", "--experts", "8", "--top-k", "1",
                                     "--d", "64", "--layers", "3", "--heads", "4"],
                            "lr": 4e-3, "split": "validation", "head_dim": 16,
                            "fmt": {"bits": 10, "ramp_mult": 20, "jump_mult": 10}},
}
FAULT_STEP, LATE_LR_STEP = 500, 600
SCENARIOS = {
    "healthy": ("healthy", []),
    "lr-ramp-hidden": ("lr", ["--lr-hidden", "--lr-mult", "{ramp_mult}", "--lr-ramp", "200"]),
    "lr-jump-hidden": ("lr", ["--lr-hidden", "--lr-mult", "{jump_mult}", "--lr-ramp", "1"]),
    "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
    "combined-late": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden",
                                   "--lr-mult", "{ramp_mult}", "--lr-ramp", "200",
                                   "--lr-fault-step", str(LATE_LR_STEP)]),
}
MATRIX = dict(corpus_shapes.MATRIX, shapes=SHAPES, scenarios=SCENARIOS, seeds=(11, 12),
              common=["--ctx", "32", "--batch", "16", "--warmup", "100", "--clip", "1.0",
                      "--threads", "1"],
              steps=1200, healthy_steps=3000, fault_step=FAULT_STEP, late_lr_step=LATE_LR_STEP,
              fmt={}, manifest_lr_mult=True, description="Foreshock held-out corpus (CORPUS.md)")


def plan(shapes=None, scenarios=None, seeds=None):
    return corpus_shapes.plan(shapes, scenarios, seeds, MATRIX)


if __name__ == "__main__":
    sys.exit(corpus_shapes.main(matrix=MATRIX, doc=__doc__))
