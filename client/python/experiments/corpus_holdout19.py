"""Records the nineteenth held-out corpus (CORPUS.md, "Nineteenth held-out
look"): depth. Every earlier corpus had at most 12 layers; this look asks
how the defaults behave on deep, narrow models (16 to 24 layers, d 64):
whether healthy deep runs stay quiet (any alert on a healthy run is
false) and whether faults are still caught before divergence with the
right label.

Three shapes no earlier look had, linear warm-ups of 100 steps, a sketch
every 10 steps over windows 10 and 50 (the Monitor's defaults), gradients
clipped at 1.0, --ctx 32 --batch 16, --min-lr-frac 0, faults at step 500
(five warm-ups):

- llama-dh16-h4-kv2-l16: LLaMA, dense, d 64, 4 query heads of 16 over 2
  KV heads, 16 layers; AdamW 0.9/0.95, weight decay 0.1, peak 2e-3, then
  cosine or WSD.
- gpt-dense-dh16-h4-l24: GPT, dense, d 64, 4 heads of 16, 24 layers;
  AdamW 0.9/0.95, weight decay 0.1, peak 3e-3, then WSD or linear decay
  to zero.
- moe4-top1-dh16-h4-l16: GPT MoE, 4 experts top-1, d 64, 4 heads of 16,
  16 layers; AdamW 0.9/0.95, weight decay 0.1, peak 2e-3, then constant
  or linear.

Scenarios per shape, the LR faults hidden from the logged rate:

- attn-strong: the attention fault (--bits 12 --fault-on both, every
  layer) at the fault step;
- combined-late: that fault, then a hidden 20x ramp over 200 steps from
  100 steps later;
- lr-jump5-hidden: a hidden 5x jump at the fault step;
- healthy: 2,000 steps, no fault;
- one hard negative per shape at the fault step, healthy by family (any
  alert is false; for healthy-corrupt a loss-spike page is right), 1,300
  steps, training on past a divergence by the loss criterion: LLaMA
  healthy-corrupt (--corrupt 500:3, three batches of random tokens), GPT
  healthy-seqlen (--ctx-change 500:64, sequences 32 to 64 tokens), MoE
  healthy-datashift (--data-shift 500, the data mix moved to the text's
  last quarter).

Faulted runs 1,300 steps (they stop 30 steps after a divergence). Tried
before recording, unmonitored, seed 191, the attention fault alone at
500: at peak 1e-3 no shape diverged within 300 steps of it (bits 12 and
14 on the LLaMA, 12 and 15 on the GPT, 14 on the MoE; bits 12 already
clears nearly all of O and dO's pattern, so more bits add little), nor
the GPT at 2e-3; at 2e-3 bits 12 the LLaMA diverged at 627 and the MoE at
784, at 3e-3 the GPT at 689 (at 4e-3 at 547). The peaks are those. Seed
191; every run is in the validation split: the corpus only reports.

    FORESHOCK_LIB=$PWD/build/libforeshock.so \\
        /usr/bin/python3 client/python/experiments/corpus_holdout19.py /work/holdout19-out --jobs 2

No trainer starts after --start-until minutes (default 30); a corpus cut
short holds the first cells of PRIORITY and the recorder resumes the rest
if run again.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus_shapes  # noqa: E402

LL, GD, MOE = "llama-dh16-h4-kv2-l16", "gpt-dense-dh16-h4-l24", "moe4-top1-dh16-h4-l16"
SEED = 191
START_UNTIL_MIN = 30  # no trainer starts later than this
STEPS, HEALTHY_STEPS, HARD_STEPS = 1300, 2000, 1300
WARMUP, FAULT = 100, 500
BATCH = 16  # sequences a step (healthy-batchhalf: half of it)
LATE_AFTER = 100  # combined-late: the hidden ramp starts this many steps after the fault


def scenarios(fault):
    """One shape's table (its hard negative is filtered by PRIORITY)."""
    return corpus_shapes.late_look_scenarios(fault, LATE_AFTER, BATCH)


HARD = {LL: "healthy-corrupt", GD: "healthy-seqlen", MOE: "healthy-datashift"}


def overrides(a, b, hard):
    """Each scenario's schedule, set: the faults alternate the shape's two,
    the healthy run takes the first, the hard negative the second."""
    o = {"healthy": {"schedule": a, "steps": HEALTHY_STEPS, "fault_step": None}}
    for i, sc in enumerate(("attn-strong", "combined-late", "lr-jump5-hidden")):
        o[sc] = {"schedule": (a, b)[i % 2]}
    o[hard] = {"schedule": b, "steps": HARD_STEPS, "post_diverge": -1}
    return o


def matrix(shape, args, lr, bits, scheds):
    return dict(corpus_shapes.MATRIX, shapes={shape: {
        "args": args, "lr": lr, "split": "validation", "head_dim": 16}},
        scenarios=scenarios(FAULT), seeds=(SEED,), schedules=scheds,
        overrides=overrides(*scheds, HARD[shape]),
        common=["--ctx", "32", "--batch", str(BATCH), "--warmup", str(WARMUP), "--min-lr-frac", "0",
                "--clip", "1.0", "--threads", "1"],
        steps=STEPS, healthy_steps=HEALTHY_STEPS, fault_step=FAULT,
        late_lr_step=FAULT + LATE_AFTER, fmt={"bits": bits}, manifest_lr_mult=True)


ADAMW = ["--beta2", "0.95", "--weight-decay", "0.1"]
MATRICES = {
    LL: matrix(LL, ["--arch", "llama", "--experts", "0", "--d", "64", "--heads", "4",
                    "--kv-heads", "2", "--layers", "16"] + ADAMW,
               2e-3, 12, ("cosine", "wsd")),
    GD: matrix(GD, ["--arch", "gpt", "--experts", "0", "--d", "64", "--heads", "4",
                    "--layers", "24"] + ADAMW,
               3e-3, 12, ("wsd", "linear")),
    MOE: matrix(MOE, ["--arch", "gpt", "--experts", "4", "--top-k", "1", "--d", "64",
                      "--heads", "4", "--layers", "16"] + ADAMW,
                2e-3, 12, ("constant", "linear")),
}
ALL = (LL, GD, MOE)
# Recording order: the long healthy runs first, then the attention faults,
# the hard negatives, combined-late and the 5x jumps.
PRIORITY = [
    ("healthy", ALL), ("attn-strong", ALL),
    ("healthy-corrupt", (LL,)), ("healthy-seqlen", (GD,)), ("healthy-datashift", (MOE,)),
    ("combined-late", ALL),
    ("lr-jump5-hidden", ALL),
]
MATRIX = {"description": "Foreshock nineteenth held-out corpus (CORPUS.md)"}


plan, main = corpus_shapes.recorder(PRIORITY, MATRICES, MATRIX, __doc__, START_UNTIL_MIN)


if __name__ == "__main__":
    sys.exit(main())
