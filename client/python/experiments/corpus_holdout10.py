"""Records the tenth held-out corpus (CORPUS.md, "Tenth held-out look"): a
small matrix recorded blind, with the defaults as they stood after nine
held-out looks, with what production training has and none of the earlier
corpora holds.

Monitoring attached to a model that is already trained, on every run:
steps 1-1,000 train healthy with no Monitor (train.py --attach-at 1000),
then the Monitor is created and the run goes on; the steps it reports
continue from 1,001. Two ways: a resumed job (the optimizer's state kept,
the schedule continues) and a fine-tune of the trained model (the
optimizer's state dropped at 1,001 and the rate warmed up again over 100
steps, the logged rate too: --opt-reset 1001 --rewarmup 1001:100), in
different runs (the scenario names say which: "-ft" and healthy-finetune
are fine-tunes).

Shapes: a 6-layer LLaMA with head_dim 64 (d 256, 4 query heads sharing 2
KV heads, peak 1e-3) and a fine-grained GPT MoE, 16 experts top-4 plus a
shared expert (d 96, 4 heads of 24, 4 layers, peak 2e-3). Both AdamW
0.9/0.95, weight decay 0.1, a 200-step warm-up from step 1, then cosine or
WSD (decaying to 10% at the last step), alternating; sequences of 16
tokens, batches of 8 (CPU time).

Hard negatives, healthy by family (any alert is false): healthy-finetune
(the fine-tune attach, nothing else); healthy-skips, skipped optimizer
steps as dynamic loss scaling makes on fp16 overflow (train.py
--skip-steps: gradients zeroed, weights and optimizer state unchanged,
the loss logged; 180, 420, 240, 230 and 210 monitored steps apart, with a
burst of 3 consecutive skips at 1,420-1,422) with no grad_norm reported at
a skipped step (--skip-grad-norm none, as Megatron-LM logs a skipped
iteration); healthy-skips-inf, the MoE only, the same skips with grad_norm
inf (what clip_grad_norm_ returns on overflowed gradients in the PyTorch
AMP recipe). Healthy runs of 2,200 steps (1,200 monitored), and one of
4,000 on the MoE (healthy-long: 3,000 monitored).

Faults at step 1,500 of 2,100 (500 monitored steps after the attach), the
LR faults hidden from the logged rate: on a resumed job a 3x jump, a 10x
jump and the attention fault (bits 10 on the LLaMA, 12 on the MoE); on a
fine-tune a 10x jump, a 20x ramp over 200 steps and combined-late
(attention at 1,500, the hidden 10x jump at 1,550). Seed 101. Every run
is in the validation split: the corpus only reports. Not calibrated: a
fault that does not diverge stays in as recorded.

    FORESHOCK_LIB=$PWD/build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout10.py /work/holdout10-out --jobs 2

The matrix is corpus_shapes.py's planner and runner with this file's table,
as corpus_holdout9.py does. Recorded as a default Monitor sends (windows 10
and 50, a sketch every 10 steps), from the attach on.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

LLAMA, MOE = "llama-dh64-h4-kv2-l6", "moe16-top4-shared-dh24-h4-l4"
SHAPES = {
    LLAMA: {"args": ["--arch", "llama", "--d", "256", "--heads", "4", "--kv-heads", "2",
                     "--layers", "6"],
            "lr": 1e-3, "split": "validation", "head_dim": 64, "fmt": {"bits": 10}},
    MOE: {"args": ["--arch", "gpt", "--experts", "16", "--top-k", "4", "--shared-expert",
                   "--d", "96", "--heads", "4", "--layers", "4"],
          "lr": 2e-3, "split": "validation", "head_dim": 24, "fmt": {"bits": 12}},
}
ATTACH = 1000  # the Monitor is created after this step
FAULT_STEP, LATE_LR_STEP = 1500, 1550
FINETUNE = ["--opt-reset", str(ATTACH + 1), "--rewarmup", f"{ATTACH + 1}:100"]
SKIPS = ",".join(str(s) for s in (1180, 1420, 1421, 1422, 1660, 1890, 2100))
SCENARIOS = {
    "healthy": ("healthy", []),
    # Hard negatives: train.py's healthy scenario, any alert is false.
    "healthy-finetune": ("healthy", FINETUNE),
    "healthy-skips": ("healthy", ["--skip-steps", SKIPS, "--skip-grad-norm", "none"]),
    "healthy-skips-inf": ("healthy", ["--skip-steps", SKIPS, "--skip-grad-norm", "inf"]),
    "healthy-long": ("healthy", []),
    # Faults on a resumed job (optimizer state kept).
    "lr-jump3-hidden": ("lr", ["--lr-hidden", "--lr-mult", "3", "--lr-ramp", "1"]),
    "lr-jump10-hidden": ("lr", ["--lr-hidden", "--lr-mult", "10", "--lr-ramp", "1"]),
    "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
    # Faults on a fine-tune (fresh optimizer state, a re-warm-up).
    "lr-jump10-hidden-ft": ("lr", ["--lr-hidden", "--lr-mult", "10", "--lr-ramp", "1"]
                            + FINETUNE),
    "lr-ramp20-hidden-ft": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]
                            + FINETUNE),
    "combined-late-ft": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden",
                                      "--lr-mult", "10", "--lr-ramp", "1",
                                      "--lr-fault-step", str(LATE_LR_STEP)] + FINETUNE),
}
# The inf variant and the 4,000-step healthy run on the MoE only (CPU time).
ONLY = {"healthy-skips-inf": [MOE], "healthy-long": [MOE]}
# The hard negatives run as long as the healthy runs, have no fault step and
# train on to their end even if their loss meets the divergence criterion.
HARD = ("healthy-finetune", "healthy-skips", "healthy-skips-inf")
OVERRIDES = {sc: {"steps": 2200, "fault_step": None, "post_diverge": -1} for sc in HARD}
OVERRIDES["healthy-long"] = {"steps": ATTACH + 3000, "fault_step": None, "post_diverge": -1}
MATRIX = dict(corpus_shapes.MATRIX, shapes=SHAPES, scenarios=SCENARIOS, seeds=(101,),
              schedules=("cosine", "wsd"), overrides=OVERRIDES, only=ONLY,
              common=["--ctx", "16", "--batch", "8", "--clip", "1.0", "--threads", "1",
                      "--warmup", "200", "--attach-at", str(ATTACH)],
              steps=2100, healthy_steps=2200, fault_step=FAULT_STEP,
              late_lr_step=LATE_LR_STEP, fmt={}, manifest_lr_mult=True,
              description="Foreshock tenth held-out corpus (CORPUS.md)")


def plan(shapes=None, scenarios=None, seeds=None):
    return corpus_shapes.plan(shapes, scenarios, seeds, MATRIX)


if __name__ == "__main__":
    sys.exit(corpus_shapes.main(matrix=MATRIX, doc=__doc__))
