"""Records the twelfth held-out corpus (CORPUS.md, "Twelfth held-out
look"): faults soon after a long warm-up, a deeper and narrower model than
any earlier look, Lion under an inverse-square-root schedule, and one shape
whose Monitor sends a sketch every 20 steps over windows 20 and 100 instead
of the default 10 and 10, 50. No earlier look had any of these.

Two shapes:

- llama-dh8-h8-kv2-l12 (LLaMA, d 64, 8 query heads of 8 sharing 2 KV
  heads, 12 layers, dense; the deepest earlier shape had 10 layers of d
  64 with heads of 16): AdamW 0.9/0.95, weight decay 0.1, peak 2e-3, a
  500-step linear warm-up, then linear or cosine decay to zero at the last
  step. Faults at 850 of 1,700 (350 steps after the
  warm-up ends), healthy 2,000. Sketches every 10 steps, windows 10, 50
  (the Monitor's defaults).
- moe8-top2-lion-dh48-h2-l3 (GPT MoE, d 96, 2 heads of 48, 3 layers, 8
  experts top-2): Lion (betas 0.9/0.99), weight decay 0.3, peak 4e-4, a
  600-step linear warm-up, then the rate times sqrt(600 / step) or linear
  decay to zero. Faults at 950 of 1,700 (350 steps after the warm-up),
  healthy 2,000. Sketches every 20 steps, windows 20 and 100.

Faults at each shape's fault step, the LR faults hidden from the logged
rate: a 5x jump, a 20x ramp over 200 steps, the attention fault (bits 12
on the LLaMA, 10 on the MoE, the fewest that diverged within the run in
unmonitored trials of the faulted run with seed 1: on the LLaMA bits 8
and 10 had not diverged 450 and 650 steps after the fault, 12 diverged at
1,435; bits 10 on the MoE at 1,084) and
combined-late (that attention fault, then a hidden 20x ramp over 200 steps
from 100 steps later).

Hard negatives, healthy by family (any alert is false), each at the
shape's fault step, 1,700 steps, training on past a divergence by the loss
criterion: on the LLaMA sequences of 64 tokens instead of 32
(--ctx-change; the model is built for 64 from step 1), the data mix moved
to the text's last quarter (--data-shift) and gradient clipping tightened
from 1.0 to 0.3 (--clip-change); on the MoE the batch doubled to 32
sequences (--batch-change), the optimizer's state dropped (--opt-reset: a
resume without Lion's momentum) and the weight decay 0.3 to 0.1
(--wd-change). Seed 121. Every run is in the validation split: the corpus
only reports. Not calibrated beyond the attention fault's bits.

Added after those sixteen were scored (every diverged fault had diverged
before the start of detection, 3x the warm-up end, and the MoE's healthy
run gave its rules 200 steps): attn-strong-late, the same attention fault
300 steps after the start of detection (LLaMA 1,800 of 2,400, MoE 2,100
of 2,700), and healthy-long (LLaMA 3,000 steps, linear; MoE 3,600,
invsqrt). Appended to each table, so the first sixteen's schedules and
arguments are unchanged and the recorder resumes with these four.

Recorded in the order PRIORITY gives (healthy runs, the 5x jumps, the
attention faults, the 20x ramps, the hard negatives, combined-late, then
the four added runs); no
trainer starts after --start-until minutes (default 25), so a corpus cut
short holds the first cells and the recorder resumes the rest if run
again.

    FORESHOCK_LIB=$PWD/build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout12.py /work/holdout12-out --jobs 2

The matrix is corpus_shapes.py's planner with one table per shape, and
corpus_shapes' manifest. Recorded as a Monitor with the given windows and
cadence sends (the per-step update ratio every step).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

DEEP, LION = "llama-dh8-h8-kv2-l12", "moe8-top2-lion-dh48-h2-l3"
SEED = 121
HARD_NAMES = ("healthy-seqlen", "healthy-datashift", "healthy-clipchange", "healthy-batchup",
              "healthy-optreset", "healthy-wdchange")
START_UNTIL_MIN = 25  # no trainer starts later than this (the recording's budget is 30)


def scenarios(fault, late_lr):
    """One shape's table: the same scenarios in the same order on every
    shape (corpus_shapes.plan alternates schedules by the order)."""
    return {
        "healthy": ("healthy", []),
        "lr-jump5-hidden": ("lr", ["--lr-hidden", "--lr-mult", "5", "--lr-ramp", "1"]),
        "lr-ramp20-hidden": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]),
        "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
        "combined-late": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden",
                                       "--lr-mult", "20", "--lr-ramp", "200",
                                       "--lr-fault-step", str(late_lr)]),
        # Hard negatives: train.py's healthy scenario, any alert is false.
        "healthy-seqlen": ("healthy", ["--ctx-change", f"{fault}:64"]),
        "healthy-datashift": ("healthy", ["--data-shift", str(fault)]),
        "healthy-clipchange": ("healthy", ["--clip-change", f"{fault}:0.3"]),
        "healthy-batchup": ("healthy", ["--batch-change", f"{fault}:32"]),
        "healthy-optreset": ("healthy", ["--opt-reset", str(fault)]),
        "healthy-wdchange": ("healthy", ["--wd-change", f"{fault}:0.1"]),
        # Added after the first sixteen were scored (appended: the others'
        # schedules stay put): the attention fault after the start of
        # detection (LATE), and a healthy run long enough for every rule to
        # judge 1,000 steps or more of it.
        "attn-strong-late": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
        "healthy-long": ("healthy", []),
    }


def overrides(hard_steps, long_steps, long_schedule):
    o = {sc: {"steps": hard_steps, "post_diverge": -1} for sc in HARD_NAMES}
    o["healthy-long"] = {"steps": long_steps, "fault_step": None, "schedule": long_schedule}
    return o


# attn-strong-late: (fault step, steps), 300 steps after each shape's start
# of detection (3x the warm-up end: 1,500 and 1,800), so that every rule's
# baseline is warm at the fault.
LATE = {"llama-dh8-h8-kv2-l12": (1800, 2400), "moe8-top2-lion-dh48-h2-l3": (2100, 2700)}


MATRICES = {
    DEEP: dict(corpus_shapes.MATRIX, shapes={DEEP: {
        "args": ["--arch", "llama", "--experts", "0", "--d", "64", "--heads", "8",
                 "--kv-heads", "2", "--layers", "12", "--beta2", "0.95",
                 "--weight-decay", "0.1"],
        "lr": 2e-3, "split": "validation", "head_dim": 8, "fmt": {"bits": 12}}},
        scenarios=scenarios(850, 950), seeds=(SEED,), schedules=("linear", "cosine"),
        overrides=overrides(1700, 3000, "linear"),
        common=["--ctx", "32", "--batch", "16", "--warmup", "500", "--min-lr-frac", "0",
                "--clip", "1.0", "--threads", "1"],
        steps=1700, healthy_steps=2000, fault_step=850, late_lr_step=950, fmt={},
        manifest_lr_mult=True),
    LION: dict(corpus_shapes.MATRIX, shapes={LION: {
        "args": ["--arch", "gpt", "--experts", "8", "--top-k", "2", "--d", "96",
                 "--heads", "2", "--layers", "3", "--optimizer", "lion",
                 "--weight-decay", "0.3"],
        "lr": 4e-4, "split": "validation", "head_dim": 48, "fmt": {"bits": 10}}},
        scenarios=scenarios(950, 1050), seeds=(SEED,), schedules=("invsqrt", "linear"),
        overrides=overrides(1700, 3600, "invsqrt"),
        common=["--ctx", "32", "--batch", "16", "--warmup", "600", "--min-lr-frac", "0",
                "--clip", "1.0", "--threads", "1"],
        # A user's pick of a sparser cadence: a sketch every 20 steps over
        # windows of 20 and 100 steps (the default Monitor: 10 over 10, 50).
        monitor=["--windows", "20,100", "--every", "20", "--detect-from", "0"],
        steps=1700, healthy_steps=2000, fault_step=950, late_lr_step=1050, fmt={},
        manifest_lr_mult=True),
}
# Which scenario on which shape, in recording order.
ALL = (DEEP, LION)
PRIORITY = [
    ("healthy", ALL),
    ("lr-jump5-hidden", ALL), ("attn-strong", ALL), ("lr-ramp20-hidden", ALL),
    ("healthy-seqlen", (DEEP,)), ("healthy-batchup", (LION,)),
    ("healthy-datashift", (DEEP,)), ("healthy-optreset", (LION,)),
    ("healthy-clipchange", (DEEP,)), ("healthy-wdchange", (LION,)),
    ("combined-late", ALL),
    ("attn-strong-late", ALL), ("healthy-long", ALL),
]
MATRIX = {"description": "Foreshock twelfth held-out corpus (CORPUS.md)"}


def matrix_of(sc, shape):
    """The shape's matrix; the late attention fault moves its fault step
    and length."""
    if sc != "attn-strong-late":
        return MATRICES[shape]
    fault, steps = LATE[shape]
    return dict(MATRICES[shape], fault_step=fault, steps=steps)


def plan(shapes=None, scenarios=None, seeds=None):
    return corpus_shapes.plan_priority(PRIORITY, MATRICES, shapes, scenarios, seeds, matrix_of)


def main(argv=None):
    return corpus_shapes.record_planned(plan(), MATRIX, __doc__, argv,
                                        start_until_min=START_UNTIL_MIN)


if __name__ == "__main__":
    sys.exit(main())
