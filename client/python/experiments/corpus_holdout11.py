"""Records the eleventh held-out corpus (CORPUS.md, "Eleventh held-out
look"): the step-size faults and step-size hard negatives of earlier looks
recorded again with the current client, which sends every step's
step_update_ratio (|W(t) - W(t-1)| / |W(t-1)| over the monitored weights),
so that the step-size family's per-step rule can be judged on them. No
earlier recording carries that value.

Three shapes, each exactly as its look defined it, with that look's
optimizer, rate, schedules, run lengths and fault step:

- qwen3moe16-top2-dh32-h2-kv2-l3 (eighth look: Qwen3-MoE, 16 experts
  top-2, head_dim 32; AdamW 0.85/0.97, eps 1e-10, weight decay 0.02, peak
  3e-3, 300-step warm-up, WSD or cosine), faults at 1,200 of 1,800,
  healthy 2,000. Its hidden 10x jump diverged 9 steps after the fault.
- qwen3moe-dh64-h2-kv1-l3 (the third look's late variant: Qwen3-MoE, 8
  experts top-2, head_dim 64; AdamW 0.9/0.95, weight decay 0.1, peak 3e-3,
  WSD after a 300-step warm-up or constant with none), faults at 1,000 of
  1,700, healthy 3,000. Its hidden 10x jump diverged within a sketch (at
  1,009, WSD).
- moe32-top4-shared-sgd-dh16-h4-l2 (fifth look: GPT MoE, 32 experts top-4
  plus a shared expert; SGD, momentum 0.9, no weight decay, peak 0.3,
  30-step warm-up, cosine or constant decaying to zero), faults at 1,000
  of 1,600, healthy 3,000. The faster of the fifth look's two shapes.

Faults at each shape's fault step, the LR faults hidden from the logged
rate: a 10x, a 5x and a 3x jump, a 20x ramp over 200 steps, the attention
fault as the shape's look set it (bits 10, 6, 10) and combined-late as
that look set it (eighth: the hidden 10x jump 50 steps after the
attention fault; third late and fifth: a hidden 20x ramp over 200 steps
100 steps after it).

Hard negatives, healthy by family (any alert is false), each at the
shape's fault step, each on one shape (CPU time): the optimizer's state
dropped (--opt-reset), the first half of the layers frozen until then
(--freeze-until), the weight decay 0.02 to 0.2 (--wd-change), all three on
the eighth look's MoE as that look had them; a logged 100-step re-warm-up
(--rewarmup) and skipped optimizer steps (--skip-steps: single skips at
the fault step, 180 and 430 steps later and a burst of 3 at 300-302 steps
later, no grad_norm reported at a skipped step) on the third look's
shape; the batch halved (--batch-change), a logged 10x step decay
(--schedule step, constant before) and cosine with warm restarts every 500
steps (as the fifth look) on the SGD shape. They train on past a
divergence by the loss criterion. Seed 111. Every run is in the validation
split: the corpus only reports. Not calibrated.

Recorded in the order PRIORITY gives (healthy runs, the 10x jumps, the
hard negatives most likely to move the per-step ratio, the other LR
faults, the other hard negatives, combined-late, the attention faults):
a corpus cut short holds the first cells. As recorded, the trainers the
recorder started after 25 minutes (the three attention faults) were
stopped, so they are not in tests/data/corpus-holdout11; the recorder
resumes them if run again.

    FORESHOCK_LIB=$PWD/build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout11.py /work/holdout11-out --jobs 2

The matrix is corpus_shapes.py's planner with one table per shape (their
fault steps, lengths and schedules differ), and corpus_shapes' manifest.
Recorded as a default Monitor sends (windows 10 and 50, a sketch every 10
steps, the per-step update ratio every step).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

Q8, Q3, SGD = ("qwen3moe16-top2-dh32-h2-kv2-l3", "qwen3moe-dh64-h2-kv1-l3",
               "moe32-top4-shared-sgd-dh16-h4-l2")
SEED = 111
HARD_NAMES = ("healthy-optreset", "healthy-unfreeze", "healthy-wdchange", "healthy-rewarmup",
              "healthy-skips", "healthy-batchchange", "healthy-stepdecay", "healthy-restarts")


def scenarios(fault, late_lr, combined_lr):
    """One shape's table: the same scenarios in the same order on every
    shape (corpus_shapes.plan alternates schedules by the order)."""
    return {
        "healthy": ("healthy", []),
        "lr-jump10-hidden": ("lr", ["--lr-hidden", "--lr-mult", "10", "--lr-ramp", "1"]),
        "lr-jump5-hidden": ("lr", ["--lr-hidden", "--lr-mult", "5", "--lr-ramp", "1"]),
        "lr-jump3-hidden": ("lr", ["--lr-hidden", "--lr-mult", "3", "--lr-ramp", "1"]),
        "lr-ramp20-hidden": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]),
        "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
        "combined-late": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden"]
                          + combined_lr + ["--lr-fault-step", str(late_lr)]),
        # Hard negatives: train.py's healthy scenario, any alert is false.
        "healthy-optreset": ("healthy", ["--opt-reset", str(fault)]),
        "healthy-unfreeze": ("healthy", ["--freeze-until", str(fault)]),
        "healthy-wdchange": ("healthy", ["--wd-change", f"{fault}:{{wd_to}}"]),
        "healthy-rewarmup": ("healthy", ["--rewarmup", f"{fault}:100"]),
        "healthy-skips": ("healthy", ["--skip-steps",
                                      ",".join(str(fault + d) for d in (0, 180, 300, 301, 302,
                                                                        430)),
                                      "--skip-grad-norm", "none"]),
        "healthy-batchchange": ("healthy", ["--batch-change", f"{fault}:8"]),
        "healthy-stepdecay": ("healthy", ["--step-decay", f"{fault}:0.1"]),
        "healthy-restarts": ("healthy", ["--restart-period", "500"]),
    }


def overrides(hard_steps):
    o = {sc: {"steps": hard_steps, "post_diverge": -1} for sc in HARD_NAMES}
    o["healthy-stepdecay"]["schedule"] = "step"
    o["healthy-restarts"].update(schedule="cosine-restarts", fault_step=None)
    return o


JUMP10 = ["--lr-mult", "10", "--lr-ramp", "1"]
RAMP20 = ["--lr-mult", "20", "--lr-ramp", "200"]
# Each shape's look, as corpus_holdout8.py, corpus_holdout3_late.py (over
# corpus_holdout3.py) and corpus_holdout5.py define it; the schedules are
# ordered so that the 10x jump runs under the schedule it diverged under
# there (WSD on both Qwen3 shapes).
MATRICES = {
    Q8: dict(corpus_shapes.MATRIX, shapes={Q8: {
        "args": ["--arch", "qwen3moe", "--experts", "16", "--top-k", "2", "--d", "64",
                 "--heads", "2", "--kv-heads", "2", "--layers", "3", "--beta1", "0.85",
                 "--beta2", "0.97", "--eps", "1e-10", "--weight-decay", "0.02",
                 "--warmup", "300"],
        "lr": 3e-3, "split": "validation", "head_dim": 32,
        "fmt": {"bits": 10, "wd_to": "0.2"}}},
        scenarios=scenarios(1200, 1250, JUMP10), seeds=(SEED,),
        schedules=("wsd", "cosine"), overrides=overrides(1800),
        common=["--ctx", "32", "--batch", "16", "--clip", "1.0", "--threads", "1"],
        steps=1800, healthy_steps=2000, fault_step=1200, late_lr_step=1250, fmt={},
        manifest_lr_mult=True),
    Q3: dict(corpus_shapes.MATRIX, shapes={Q3: {
        "args": ["--arch", "qwen3moe", "--experts", "8", "--top-k", "2", "--d", "128",
                 "--heads", "2", "--kv-heads", "1", "--layers", "3"],
        "split": "validation", "head_dim": 64, "fmt": {"bits": 6, "wd_to": "0"}}},
        scenarios=scenarios(1000, 1100, RAMP20), seeds=(SEED,),
        schedules=("wsd", "constant"), warmup_of={"wsd": 300, "constant": 1},
        overrides=overrides(1700), lr=3e-3,
        common=["--ctx", "32", "--batch", "16", "--warmup", "50", "--clip", "1.0",
                "--threads", "1"],
        steps=1700, healthy_steps=3000, fault_step=1000, late_lr_step=1100, fmt={},
        manifest_lr_mult=True),
    SGD: dict(corpus_shapes.MATRIX, shapes={SGD: {
        "args": ["--arch", "gpt", "--experts", "32", "--top-k", "4", "--shared-expert",
                 "--d", "64", "--heads", "4", "--layers", "2", "--optimizer", "sgd",
                 "--momentum", "0.9", "--weight-decay", "0", "--warmup", "30"],
        "lr": 0.3, "split": "validation", "head_dim": 16,
        "fmt": {"bits": 10, "wd_to": "1e-4"}}},
        scenarios=scenarios(1000, 1100, RAMP20), seeds=(SEED,),
        schedules=("cosine", "constant"), overrides=overrides(2000),
        common=["--ctx", "32", "--batch", "16", "--min-lr-frac", "0", "--clip", "1.0",
                "--threads", "1"],
        steps=1600, healthy_steps=3000, fault_step=1000, late_lr_step=1100, fmt={},
        manifest_lr_mult=True),
}
# Which scenario on which shape, in recording order.
ALL = (Q8, Q3, SGD)
PRIORITY = [
    ("healthy", ALL),
    ("lr-jump10-hidden", ALL),
    ("healthy-optreset", (Q8,)), ("healthy-unfreeze", (Q8,)), ("healthy-rewarmup", (Q3,)),
    ("healthy-restarts", (SGD,)),
    ("lr-jump5-hidden", ALL), ("lr-jump3-hidden", ALL), ("lr-ramp20-hidden", ALL),
    ("healthy-batchchange", (SGD,)), ("healthy-skips", (Q3,)), ("healthy-wdchange", (Q8,)),
    ("healthy-stepdecay", (SGD,)),
    ("combined-late", ALL), ("attn-strong", ALL),
]
MATRIX = {"description": "Foreshock eleventh held-out corpus (CORPUS.md)"}


def plan(shapes=None, scenarios=None, seeds=None):
    return corpus_shapes.plan_priority(PRIORITY, MATRICES, shapes, scenarios, seeds)


def main(argv=None):
    return corpus_shapes.record_planned(plan(), MATRIX, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
