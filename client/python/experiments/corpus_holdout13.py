"""Records the thirteenth held-out corpus (CORPUS.md, "Thirteenth held-out
look"): batch-size ramps under AdamW, a hard negative no earlier look had
(earlier looks halved the batch under SGD and doubled it under Lion).
Large-batch pretraining often grows the batch during training; under Adam
the update's size depends on how much of the gradient is noise, so a larger
batch could move the update-to-weight ratio.

Two shapes, AdamW with a 100-step warm-up, batches of 8 sequences of 32
tokens, 1,500 steps, seed 131: `gpt-moe4-dh16-h4-l4` (GPT MoE, d 64, 4
layers, 4 experts top-2, beta2 0.95, peak 3e-3) and `llama-dh16-h4-kv2-l4`
(LLaMA, d 64, 4 layers, 4 heads over 2 KV heads, beta2 0.999, peak 2e-3);
schedules alternate (cosine, constant, WSD). Per shape: a healthy run,
the batch 4x (8 to 32) and 2x (8 to 16) at step 700 (healthy by family:
any alert is false), and, added after those were scored, a hidden 3x
jump and the attention fault (bits 10) at step 700. Every run is in the
validation split.

    FORESHOCK_LIB=$PWD/build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout13.py /work/holdout13-out --jobs 2

The matrix is corpus_shapes.py's planner and runner with this file's
table. Recorded as a default Monitor sends (windows 10 and 50, a sketch
every 10 steps, the per-step update ratio every step).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

SCENARIOS = {
    "healthy": ("healthy", []),
    "healthy-batchup4": ("healthy", ["--batch-change", "700:32"]),
    "healthy-batchup2": ("healthy", ["--batch-change", "700:16"]),
    "lr-jump3-hidden": ("lr", ["--lr-hidden", "--lr-mult", "3", "--lr-ramp", "1"]),
    "attn-strong": ("attention-numerics", ["--bits", "10", "--fault-on", "both"]),
}
SHAPES = {
    "gpt-moe4-dh16-h4-l4": {
        "args": ["--arch", "gpt", "--experts", "4", "--top-k", "2", "--d", "64", "--heads", "4",
                 "--layers", "4", "--beta2", "0.95"],
        "lr": 3e-3, "split": "validation", "head_dim": 16},
    "llama-dh16-h4-kv2-l4": {
        "args": ["--arch", "llama", "--experts", "0", "--d", "64", "--heads", "4",
                 "--kv-heads", "2", "--layers", "4", "--beta2", "0.999"],
        "lr": 2e-3, "split": "validation", "head_dim": 16},
}
MATRIX = dict(corpus_shapes.MATRIX, shapes=SHAPES, scenarios=SCENARIOS, seeds=(131,),
              schedules=("cosine", "constant", "wsd"),
              common=["--ctx", "32", "--batch", "8", "--warmup", "100", "--clip", "1.0",
                      "--threads", "1"],
              steps=1500, healthy_steps=1500, fault_step=700, manifest_lr_mult=True,
              overrides={s: {"post_diverge": -1} for s in SCENARIOS if s.startswith("healthy")},
              description="Foreshock thirteenth held-out corpus (CORPUS.md)")


if __name__ == "__main__":
    sys.exit(corpus_shapes.main(matrix=MATRIX, doc=__doc__))
