"""Records the fourteenth held-out corpus (CORPUS.md, "Fourteenth held-out
look"): the end of a schedule that decays to exactly zero, with faults late
in the decay where the rate is small; a fine-tuning-like low rate; tight
gradient clipping that clips every step. No earlier look had these: the
earlier decay-to-zero looks put their faults near the middle of the run,
every earlier AdamW peak was 1e-3 or more, and every earlier clip norm was
1.0 or a change of it (0.25 at the tightest).

Three shapes no earlier look had, AdamW, seed 141, sketches every 10 steps
over windows 10 and 50 (the Monitor's defaults):

- gpt-dense-dh32-h6-l3 (GPT, dense, d 192, 6 heads of 32, 3 layers):
  beta2 0.95, weight decay 0.1, peak 2e-3, a 100-step warm-up, then cosine
  or linear decay to zero at the last step (--min-lr-frac 0). Runs of
  3,000 steps, faults at 2,400 (80%: the rate is 10% of its peak under
  cosine, 21% under linear), combined-late's hidden ramp from 2,500. Two
  healthy runs (cosine and linear).
- qwen3moe4-top2-dh16-h4-kv2-l3 (Qwen3-MoE layout with qk-norm, d 64, 4
  query heads of 16 over 2 KV heads, 3 layers, 4 experts top-2): a
  fine-tuning-like rate, peak 2e-4, beta2 0.999, weight decay 0.01, a
  30-step warm-up, then constant or cosine decay to zero. Runs of 2,000
  steps, faults at 1,500 (75%), combined's ramp from 1,600; healthy runs
  of 3,000 (constant, and last in the order cosine).
- llama-mqa-dh24-h3-kv1-l3 (LLaMA, d 72, 3 query heads of 24 sharing one
  KV head, 3 layers): gradients clipped at norm 0.05 (--clip 0.05; the
  gradient's norm stays above 1.7 from step 300, so every step is
  clipped), peak 1e-3, beta2 0.95, weight decay 0.1, a 100-step warm-up,
  then cosine decay to zero or WSD to zero. Runs of 2,000 steps, faults
  at 1,500 (75%), combined's ramp from 1,600; healthy 3,000 (cosine).

Faults, the LR faults hidden from the logged rate: a 5x jump, a 20x ramp
over 200 steps, the attention fault (bits 12, both O and dO) and
combined-late (that attention fault, then a hidden 20x ramp over 200 steps
from 100 steps later). Not calibrated: a fault that does not diverge within
its run is counted apart by the scorecard. Every run is in the validation
split: the corpus only reports.

Appended after those seventeen were scored (the first seventeen's
arguments are unchanged, so the recorder, run again, records only these):
the MoE's healthy run (constant) at ten times its rate, 2e-3
(healthy-lr10x), and with seeds 142, 143 and 144, because its healthy
runs at 2e-4 alerted.

Recorded in the order PRIORITY gives (the healthy runs, the 5x jumps, the
attention faults, the 20x ramps, combined-late, the MoE's second healthy
run, then the appended runs); no trainer starts after --start-until minutes (default 20),
so a corpus cut short holds the first cells and the recorder resumes the
rest if run again.

    FORESHOCK_LIB=$PWD/build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout14.py /work/holdout14-out --jobs 2

The matrix is corpus_shapes.py's planner with one table per shape, and
corpus_shapes' manifest. Recorded as a default Monitor sends (windows 10
and 50, a sketch every 10 steps, the per-step update ratio every step).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

TAIL, FT, CLIP = "gpt-dense-dh32-h6-l3", "qwen3moe4-top2-dh16-h4-kv2-l3", "llama-mqa-dh24-h3-kv1-l3"
SEED = 141
START_UNTIL_MIN = 20  # no trainer starts later than this (the recording's budget is 25)


def scenarios(late_lr):
    """One shape's table: the same faults on every shape."""
    return {
        "healthy": ("healthy", []),
        "healthy-2": ("healthy", []),
        "lr-jump5-hidden": ("lr", ["--lr-hidden", "--lr-mult", "5", "--lr-ramp", "1"]),
        "lr-ramp20-hidden": ("lr", ["--lr-hidden", "--lr-mult", "20", "--lr-ramp", "200"]),
        "attn-strong": ("attention-numerics", ["--bits", "{bits}", "--fault-on", "both"]),
        "combined-late": ("combined", ["--bits", "{bits}", "--fault-on", "both", "--lr-hidden",
                                       "--lr-mult", "20", "--lr-ramp", "200",
                                       "--lr-fault-step", str(late_lr)]),
        # Appended after the first seventeen were scored (the others'
        # arguments stay put): the shape's healthy run at ten times its
        # rate (the later --lr wins), to tell the low rate from the shape.
        "healthy-lr10x": ("healthy", ["--lr", "{lr10}"]),
    }


def schedules(healthy_steps, a, b):
    """Each scenario's schedule, set rather than alternated: the two
    healthy runs take one schedule each, the faults alternate."""
    o = {"healthy": {"schedule": a, "steps": healthy_steps},
         "healthy-2": {"schedule": b, "steps": healthy_steps, "fault_step": None},
         "healthy-lr10x": {"schedule": a, "steps": healthy_steps, "fault_step": None}}
    for i, sc in enumerate(("lr-jump5-hidden", "lr-ramp20-hidden", "attn-strong",
                            "combined-late")):
        o[sc] = {"schedule": (a, b)[i % 2]}
    return o


ADAMW = ["--optimizer", "adamw", "--threads", "1"]
MATRICES = {
    TAIL: dict(corpus_shapes.MATRIX, shapes={TAIL: {
        "args": ["--arch", "gpt", "--experts", "0", "--d", "192", "--heads", "6",
                 "--layers", "3", "--beta2", "0.95", "--weight-decay", "0.1"],
        "lr": 2e-3, "split": "validation", "head_dim": 32}},
        scenarios=scenarios(2500), seeds=(SEED,), schedules=("cosine", "linear"),
        overrides=schedules(3000, "cosine", "linear"),
        common=["--ctx", "32", "--batch", "16", "--warmup", "100", "--min-lr-frac", "0",
                "--clip", "1.0"] + ADAMW,
        steps=3000, healthy_steps=3000, fault_step=2400, late_lr_step=2500, fmt={"bits": 12},
        manifest_lr_mult=True),
    FT: dict(corpus_shapes.MATRIX, shapes={FT: {
        "args": ["--arch", "qwen3moe", "--experts", "4", "--top-k", "2", "--d", "64",
                 "--heads", "4", "--kv-heads", "2", "--layers", "3", "--beta2", "0.999",
                 "--weight-decay", "0.01"],
        "lr": 2e-4, "split": "validation", "head_dim": 16}},
        scenarios=scenarios(1600), seeds=(SEED,), schedules=("constant", "cosine"),
        overrides=schedules(3000, "constant", "cosine"),
        common=["--ctx", "32", "--batch", "16", "--warmup", "30", "--min-lr-frac", "0",
                "--clip", "1.0"] + ADAMW,
        steps=2000, healthy_steps=3000, fault_step=1500, late_lr_step=1600,
        fmt={"bits": 12, "lr10": "2e-3"}, manifest_lr_mult=True),
    CLIP: dict(corpus_shapes.MATRIX, shapes={CLIP: {
        "args": ["--arch", "llama", "--experts", "0", "--d", "72", "--heads", "3",
                 "--kv-heads", "1", "--layers", "3", "--beta2", "0.95",
                 "--weight-decay", "0.1"],
        "lr": 1e-3, "split": "validation", "head_dim": 24}},
        scenarios=scenarios(1600), seeds=(SEED,), schedules=("cosine", "wsd"),
        overrides=schedules(3000, "cosine", "wsd"),
        common=["--ctx", "32", "--batch", "16", "--warmup", "100", "--min-lr-frac", "0",
                "--clip", "0.05"] + ADAMW,
        steps=2000, healthy_steps=3000, fault_step=1500, late_lr_step=1600, fmt={"bits": 12},
        manifest_lr_mult=True),
}
ALL = (TAIL, FT, CLIP)
# Which scenario on which shape, in recording order.
PRIORITY = [
    ("healthy", ALL), ("healthy-2", (TAIL,)),
    ("lr-jump5-hidden", ALL), ("attn-strong", ALL), ("lr-ramp20-hidden", ALL),
    ("combined-late", ALL),
    ("healthy-2", (FT,)),
    # Appended after the first seventeen were scored: the fine-tuning-like
    # shape's healthy run (constant) with another seed, and at ten times
    # its rate.
    ("healthy", (FT,), (142,)), ("healthy-lr10x", (FT,)),
    # And, after those two were scored, two more seeds of it.
    ("healthy", (FT,), (143,)), ("healthy", (FT,), (144,)),
]
MATRIX = {"description": "Foreshock fourteenth held-out corpus (CORPUS.md)"}


plan, main = corpus_shapes.recorder(PRIORITY, MATRICES, MATRIX, __doc__, START_UNTIL_MIN)


if __name__ == "__main__":
    sys.exit(main())
