"""The detection defaults, judged on the recorded corpora through
`foreshock backtest`, which runs the daemon's own detection code. The
verdict is the same on any machine: the corpora hold the monitor values,
not live training.

tests/data/corpus (one shape, three architectures, seeds 1-3 tuning and 4-5
validation), validation seeds, daemon defaults: every faulted run alerts
before its loss diverged with the right label, no healthy run raises any
alert, and the median lead is at least 40% of the time from fault to
divergence.

The same validation seeds with the `lr` rule disabled: every learning-rate
fault (the `lr` and `combined` runs) caught before divergence with the
right label by the mechanism (update ratio, router rules) alone.

tests/data/corpus-shapes (client/python/experiments/CORPUS.md, "Shapes
corpus"), its validation split: five whole shapes the defaults were not
tuned on (head_dim 8-64, 2-16 heads, 2-6 layers, three schedules). There:
no alert on any healthy run (3,000 steps each) nor in the healthy phase of
any faulted run before its fault; every faulted run that diverged caught
before divergence with the right label; every learning-rate fault that
diverged (all of them hidden from the logged rate) also with the `lr` rule
disabled; median lead at least 40%. Faulted runs that did not diverge are
printed, not asserted (tests/bench/scorecard.py prints the whole table;
docs/detection.md "Detection on training nobody tuned it to" gives the
numbers).
tests/data/corpus-holdout (CORPUS.md, "Held-out corpus"): three more shapes
(LLaMA with grouped-query attention, dense; a GPT with a top-1 MoE), warm-up
100, faults at step 500 of 1,200, every LR fault hidden, recorded by a
helper who changed no detection code. Its first look with the defaults of
that day paged 3 of its 6 healthy runs, which led to scale_rel (detect.c);
it is no longer blind. Asserted: no healthy alert, every diverged faulted
run caught before divergence, LR faults with the right label at >= 90%
(all of them since evidence opening at the same sketch reads
optimizer-hyperparameter), median lead at least 40%.
tests/data/corpus-holdout3 and corpus-holdout3-late (CORPUS.md, "Third
held-out look"): two layouts no other corpus holds (a Qwen3-MoE-like block
with per-head qk-norm and 8 experts top-2, head_dim 64; a parallel
attention+MLP block with qk-norm, 16 heads of 8 over 6 layers), WSD after a
300-step warm-up and constant with none, faults at step 700 or 1,000.
Blind, it caught 3 of 6 diverged faults of the first (every LR fault there
fell between the warm-up end and the start of detection at 3 warm-ups)
and paged one healthy run (router.maxvio); since then update_ratio detects
once its baseline is warm and router.maxvio's z scale is at least 20% of
its level. Its attention fault alone never diverged on either layout (the
qk-norm clamps the logits it inflates), so its combined runs are scored as
LR runs that may name the attention fault too (scorecard.py,
mark_inert_attention). Asserted: no alert on either corpus's healthy runs
nor in the healthy phase of a faulted run, and every diverged faulted run
caught before divergence with the right label, except a run that diverged
before the first sketch after its fault (a 10x jump on qwen3moe diverged 9
steps after it, the sketch comes every 10): that one must be paged by a
symptom rule (grad_norm, loss) before divergence.
tests/data/corpus-holdout4 (CORPUS.md, "Fourth held-out look"): Lion and
gradient accumulation, 16 experts top-1, schedules decaying to zero, data
shifted mid-run as a hard negative; recorded blind after the changes above
and right at its first look. Asserted as it scored: no healthy alert,
every diverged faulted run caught before divergence with the right label,
with and without the `lr` rule.
tests/data/corpus-holdout5 and corpus-holdout6 (CORPUS.md, "Fifth held-out
look", "Sixth held-out look"): SGD and AdamW, restarts, a halved batch,
corrupted batches, router-only rate faults. Blind, they paged 4 of 6 and 2
of 6 healthy runs; since then grad_norm's z scale is 20% of its level, a
relative floor within a series' own noise needs the full persistence, and
a loss or grad-norm page is labelled only by evidence that opened before
it. Asserted as they score now: no healthy alert (a corrupted batch may
page loss-spike), every diverged faulted run caught before divergence with
the right label, except the SGD MoE's combined-late run, asserted to read
optimizer-hyperparameter (docs/detection.md says why).
tests/data/corpus-holdout7 (CORPUS.md, "Seventh held-out look"): recorded
blind after those changes (Adam with beta2 0.99, RMSprop, linear,
inverse-sqrt and step schedules, sequence-length and accumulation changes).
Asserted as it scored: every diverged faulted run caught before divergence
with the right label, with and without the `lr` rule; every healthy run
quiet but one, asserted as the known exception: the GPT MoE's doubled
sequence length pages qk.cqk.
tests/data/corpus-holdout8 (CORPUS.md, "Eighth held-out look"): qk-norm
layouts (a 10-layer dense, a 16-expert top-2 MoE), an optimizer-state reset,
layers unfrozen, a weight-decay change and a re-warm-up as hard negatives.
Blind it paged both unfreezing runs, quiet since a still series re-warms.
Asserted: healthy quiet, every diverged faulted run caught before
divergence with the right label (with and without `lr`), except a 10x jump
that diverged 9 steps after it, before the next sketch, asserted as missed.
tests/data/corpus-holdout9 (CORPUS.md, "Ninth held-out look"): bf16
autocast, multi-query attention over 16 heads of 8, a 5-layer MoE with
dropout; dropout off, label smoothing on and harder data as hard negatives.
Asserted as it scores: every diverged faulted run caught before divergence
with the right label, with and without `lr`; healthy quiet but three runs
asserted as known: label smoothing's loss step, and harder data on both
shapes.
The tuning seeds and shape are printed too, for the record; they are not
asserted: defaults were chosen on them.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402


def describe(rows):
    return ", ".join(f"{r['run']} (first alert {r['first']} {r['label']} {r['rule']}, "
                     f"fault {r['fault']}, diverged {r['div']})" for r in rows)


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "tests", "bench"))
    import scorecard
    data = os.path.join(args.source_dir, "tests", "data")

    def scored(corpus):
        """(rows, validation summary) of corpus with the defaults, printed."""
        rows, summaries, by_shape = scorecard.run(args.build_dir, corpus)
        scorecard.print_table(rows, summaries, by_shape)
        return rows, next(s for s in summaries if s["split"] == "validation")

    def check_lead(val, what):
        check(val["median_lead"] is not None and val["median_lead"] >= scorecard.MIN_MEDIAN_LEAD,
              f"{what}median lead {val['median_lead']} below {scorecard.MIN_MEDIAN_LEAD}")

    def check_lr_without_lr_rule(corpus, families, least, what, exclude=()):
        """Every diverged validation run of `families` (but the runs named
        in exclude) right with the lr rule disabled, and at least `least`
        of them."""
        rows, _, _ = scorecard.run(args.build_dir, corpus, ["lr.enabled=false"])
        lr = [r for r in rows if r["split"] == "validation" and r["family"] in families
              and r["diverged"] and r["run"] not in exclude]
        check(len(lr) >= least, f"too few diverged LR faults {what}: {len(lr)}")
        bad = [r for r in lr if not r["ok"]]
        check(not bad, "LR faults missed without the lr rule: " + describe(bad))
        return len(lr)

    def check_quiet(rows, val, least, what):
        """At least `least` healthy runs, none alerting, and no alert in the
        healthy phase of a faulted run. Returns the diverged faulted rows."""
        check(val["healthy"] >= least and val["healthy_alerting"] == 0 and
              val["phase_alerts"] == 0,
              f"alerts on {what}'s healthy training: " + describe(
                  [r for r in rows if r["family"] == "healthy" and r["n_alerts"]
                   or r.get("phase_alerts")]))
        return [r for r in rows if r["family"] != "healthy" and r["diverged"]]

    corpus = os.path.join(data, "corpus")
    rows, val = scored(corpus)
    check(val["faulted"] > 0 and val["healthy"] > 0, f"no validation runs: {val}")
    bad = [r for r in rows if r["split"] == "validation" and not r["ok"]]
    check(not bad, "validation runs missing the criteria: " + describe(bad))
    check_lead(val, "")
    n = check_lr_without_lr_rule(corpus, ("lr", "combined"), 10, "in the validation seeds")
    print(f"first corpus, lr rule disabled: {n}/{n} diverged LR faults caught "
          "with the right label")

    shapes = os.path.join(data, "corpus-shapes")
    rows, val = scored(shapes)
    check(val["healthy"] > 0 and val["healthy_steps"] >= 3000 * val["healthy"] * 0.9,
          f"held-out healthy runs missing or short: {val}")
    check(val["healthy_alerting"] == 0 and val["phase_alerts"] == 0,
          "alerts on held-out healthy training: " + describe(
              [r for r in rows if r["split"] == "validation" and (
                  r["family"] == "healthy" and r["n_alerts"] or r.get("phase_alerts"))]))
    bad = [r for r in rows if r["split"] == "validation" and r["family"] != "healthy"
           and r["diverged"] and not r["ok"]]
    check(not bad, "held-out faulted runs missing the criteria: " + describe(bad))
    check_lead(val, "held-out ")
    n = check_lr_without_lr_rule(shapes, ("lr",), 5, "on held-out shapes")
    print(f"held-out shapes, lr rule disabled: {n}/{n} diverged LR faults caught "
          "with the right label")

    rows, val = scored(os.path.join(data, "corpus-holdout"))
    faulted = check_quiet(rows, val, 6, "the held-out corpus")
    missed = [r for r in faulted if not r["caught"]]
    check(len(faulted) >= 20 and not missed,
          f"held-out corpus: {len(faulted)} diverged faulted runs, missed: " + describe(missed))
    lr = [r for r in faulted if r["family"] == "lr"]
    right = [r for r in lr if r["ok"]]
    check(len(lr) >= 10 and len(right) >= 0.9 * len(lr),
          f"held-out corpus: LR faults right {len(right)}/{len(lr)}: " + describe(
              [r for r in lr if not r["ok"]]))
    check_lead(val, "held-out corpus ")
    print(f"held-out corpus: {len(faulted)}/{len(faulted)} diverged faulted runs caught, "
          f"LR faults right {len(right)}/{len(lr)}, healthy quiet")

    for name in ("corpus-holdout3", "corpus-holdout3-late"):
        rows, val = scored(os.path.join(data, name))
        faulted = check_quiet(rows, val, 2, name)
        fast = [r for r in faulted if r["div"] - r["fault"] < scorecard.MONITOR_EVERY]
        bad = [r for r in faulted if r not in fast and not r["ok"]]
        check(len(faulted) >= 6 and not bad, f"{name}: " + describe(bad))
        unpaged = [r for r in fast if r["any_first"] is None or r["any_first"] >= r["div"]]
        check(not unpaged, f"{name}: diverged before a sketch and not paged: " +
              describe(unpaged))
        print(f"{name}: {len(faulted) - len(fast)}/{len(faulted)} diverged faulted runs caught "
              f"with the right label, {len(fast)} diverged before the next sketch and paged by "
              "a symptom rule, healthy quiet")

    corpus4 = os.path.join(data, "corpus-holdout4")
    rows, val = scored(corpus4)
    faulted = check_quiet(rows, val, 4, "corpus-holdout4")
    bad = [r for r in faulted if not r["ok"]]
    check(len(faulted) >= 5 and not bad, "corpus-holdout4: " + describe(bad))
    n = check_lr_without_lr_rule(corpus4, ("lr",), 2, "on corpus-holdout4")
    print(f"corpus-holdout4: {len(faulted)}/{len(faulted)} diverged faulted runs caught with the "
          f"right label ({n} LR faults without the lr rule), healthy quiet")

    def check_look(name, least, healthy_known=(), label_known=(), lr_least=0, missed_known=(),
                   unseen_known=(), phase_known=(), healthy_least=6):
        """A later look as it scores: every healthy run quiet but the runs
        of healthy_known ((run, rule) of its first alert), no alert in a
        healthy phase but those of phase_known (faulted runs that page
        before their fault), every diverged faulted run caught before divergence
        with the right label but those of label_known ((run, label)),
        missed_known (runs that diverged before the first sketch after
        their fault, asserted not caught) and unseen_known (runs asserted
        not caught in time, for a documented reason), and at least
        lr_least diverged LR faults right without the lr rule. A look
        recorded with fewer healthy runs (its healthy runs are another
        look's) sets healthy_least lower."""
        corpus = os.path.join(data, name)
        rows, val = scored(corpus)
        noisy = [r for r in rows if r["family"] == "healthy" and not r["ok"]]
        check(sorted((r["run"], r["rule"] or "") for r in noisy) ==
              sorted((run, rule or "") for run, rule in healthy_known),
              f"{name}: healthy alerts changed: " + describe(noisy))
        phase = sorted(r["run"] for r in rows if r.get("phase_alerts"))
        check(val["healthy"] >= healthy_least and phase == sorted(phase_known),
              f"{name}: healthy runs or phases: {val}, phase alerts on {phase}")
        faulted = [r for r in rows if r["family"] != "healthy" and r["diverged"]]
        known = [r for r in faulted if (r["run"], r["label"]) in label_known]
        check(len(known) == len(label_known) and all(r["caught"] for r in known),
              f"{name}: known wrong labels changed: " + describe(known))
        fast = [r for r in faulted if r["run"] in missed_known]
        check(len(fast) == len(missed_known) and not any(r["caught"] for r in fast) and
              all(r["div"] - r["fault"] < scorecard.MONITOR_EVERY for r in fast),
              f"{name}: known misses changed: " + describe(fast))
        known += fast
        unseen = [r for r in faulted if r["run"] in unseen_known]
        check(len(unseen) == len(unseen_known) and not any(r["caught"] for r in unseen),
              f"{name}: known misses changed: " + describe(unseen))
        known += unseen
        bad = [r for r in faulted if not r["ok"] and r not in known]
        check(len(faulted) >= least and not bad, f"{name}: " + describe(bad))
        n = check_lr_without_lr_rule(corpus, ("lr",), lr_least, "on " + name,
                                     tuple(missed_known) + tuple(unseen_known)) if lr_least else 0
        print(f"{name}: {len(faulted) - len(fast) - len(unseen)}/{len(faulted)} diverged faulted "
              f"runs caught, "
              f"{len(faulted) - len(known)} with the right label ({n} LR faults without the "
              f"lr rule), {len(noisy)} known healthy page(s)")
        return rows

    # The fifth and sixth looks, no longer blind (detect.c: grad_norm's
    # scale, relative breaches within the noise; evaluate.c: a spike is
    # explained only by earlier evidence). Under SGD the step is the rate
    # times the gradient, so the attention fault of the SGD MoE's
    # combined-late run lifted the update ratio as a rate fault would and
    # read optimizer-hyperparameter; right since the run's optimizer is
    # known (stamped into the corpus: tests/data/stamp_optimizer.py) and
    # its gradient's rise is credited (evaluate.c: per_grad_credit). The
    # sixth look's corrupted batches page loss-spike only, which the
    # scorecard counts as right.
    check_look("corpus-holdout5", 5)
    check_look("corpus-holdout6", 3, lr_least=1)
    # The seventh look, blind on the defaults of this version. Known and
    # documented: a sequence length doubled mid-run on the GPT MoE, whose
    # learned positions 32-63 were never trained, lifts layer 0's c_qk
    # 2-3.5x for 40 steps and pages qk.cqk.
    check_look("corpus-holdout7", 5, lr_least=2, healthy_known=[
        ("moe8-top1-rmsprop-dh24-h2-l3.healthy-seqlen.s71", "qk.cqk")])
    # The eighth look, blind on the defaults of its day; since then a still
    # series (a frozen layer) re-warms, which quieted its two unfreezing
    # runs. Known: the MoE's hidden 10x jump diverged 9 steps after the
    # fault, before the next sketch, and nothing paged before that.
    check_look("corpus-holdout8", 5, lr_least=3, missed_known=[
        "qwen3moe16-top2-dh32-h2-kv2-l3.lr-jump10-hidden.s81"])
    # The ninth look (bf16 autocast), blind on the defaults of its day;
    # since then router.load_entropy's z scale is 2% of its level, which
    # quieted its plain 3,000-step healthy MoE. Known and documented
    # (docs/detection.md): label smoothing switched on steps the loss up
    # (a loss page, no mechanism alert), and a switch to harder data pages
    # the loss and then the mechanisms it rewires (qk.d2.srank on the
    # LLaMA, router.maxvio on the MoE), read as the loss jump's consequence
    # (loss-spike) since they open while the loss incident fires.
    rows = check_look("corpus-holdout9", 7, lr_least=4, healthy_known=[
        ("llama-mqa-bf16-dh8-h16-kv1-l4.healthy-smoothing.s91", None),
        ("llama-mqa-bf16-dh8-h16-kv1-l4.healthy-datahard.s91", "qk.d2.srank"),
        ("moe8-top2-bf16-drop-dh16-h4-l5.healthy-datahard.s91", "router.maxvio")])
    hard = [r for r in rows if "healthy-datahard" in r["run"]]
    check(len(hard) == 2 and all(r["label"] == "loss-spike" for r in hard),
          "corpus-holdout9: harder data's first mechanism pages: " + describe(hard))
    # The tenth look (a Monitor attached at step 1,001 to trained models),
    # blind on the defaults of its day; since then training progress counts
    # from the run's first step (every attention fault caught), qk.cqk's z
    # scale is 7% of its level and a non-finite gradient norm needs 32 in
    # a row (its healthy runs quiet). Re-recorded with the per-step update
    # ratio (the same training, every divergence step the same):
    # step_update_ratio at 2.5x catches its two hidden 3x jumps, which
    # lift the per-sketch update ratio only 2.5-2.8x.
    check_look("corpus-holdout10", 12, lr_least=8)
    # The eleventh look: the step-size faults and hard negatives of the
    # third, fifth and eighth looks recorded again with the per-step
    # update ratio (step_update_ratio; since then its baseline keeps raw
    # samples through a logged warm restart, and it fires at 2.5x).
    # Under the fifth look's momentum SGD the attention fault's larger
    # gradients are larger steps too (about 3x), so step_update_ratio
    # opened before the Delta2 collapse and both runs read
    # optimizer-hyperparameter; right since the optimizer is known and the
    # gradient's rise credited (as the fifth look's, above).
    check_look("corpus-holdout11", 13, lr_least=9)
    # The twelfth look: 500- and 600-step warm-ups with faults 350 steps
    # after them (before 3x the warm-up end, the start of detection), a
    # 12-layer LLaMA, Lion, one shape sketched every 20 steps (replayed at
    # its own cadence: scorecard.cadence); since then the rank-one floors
    # hold from the warm-up end. The Lion MoE's attention fault diverged it
    # (1,196) before Delta2 reached rank one (1,200) and long before its
    # start (1,800), and its combined-late run's hidden ramp read
    # optimizer-hyperparameter; both right since the relative floors hold
    # from the warm-up end while the gradient norm stands 2x its level
    # (early_grad_rise), while the same look's doubled sequence length on
    # the LLaMA, which takes Delta2 as low with the gradient unmoved, stays
    # quiet (a healthy run of this look: check_look asserts it).
    rows = check_look("corpus-holdout12", 6, lr_least=1)
    lion = [r for r in rows if r["run"] in ("moe8-top2-lion-dh48-h2-l3.attn-strong.s121",
                                            "moe8-top2-lion-dh48-h2-l3.combined-late.s121")]
    check(len(lion) == 2 and all(r["caught"] and r["ok"] for r in lion),
          "corpus-holdout12: the Lion MoE's early attention fault, confirmed by the gradient: "
          + describe(lion))
    # The thirteenth look: batch ramps under AdamW (no step-size change)
    # and a healthy small-batch MoE whose router.maxvio doubled (quiet
    # since its scale is 30% of its level).
    check_look("corpus-holdout13", 1)
    # The fourteenth look: faults late in a decay to zero and clipping on
    # every step, all caught. Blind, its MoE trained from scratch at 2e-4
    # paged qk.cqk on three healthy runs as its attention formed late (the
    # window-50 c_qk 1.7-2.3x for 100-300 steps); quiet since a long
    # window's z counts from 30% of its level (scale_rel_long, detect.c).
    check_look("corpus-holdout14", 4, lr_least=2)
    # The fifteenth look, blind on the defaults of this version: SGD with
    # momentum on three shapes the gradient credit was not set on (a dense
    # LLaMA, a dense GPT at momentum 0.95 with weight decay, a top-2 MoE).
    # All ten diverged faults caught with the right label: the attention
    # faults raised the step ratio 2.5-10x and no update-ratio rule paged
    # (attention-numerics), the hidden rate faults read
    # optimizer-hyperparameter; every healthy run quiet.
    check_look("corpus-holdout15", 10, lr_least=4)
    # The sixteenth look, blind on the defaults of this version: the
    # fifteenth's SGD shapes (seed 161) with a weaker attention fault (bits
    # 9) overlapping a hidden 20x LR ramp. Its healthy runs are one per
    # shape (the fifteenth has six). As it scored: the LLaMA's combined-now
    # (both faults at 1,000) diverged at 1,022 with only the qk.d2 rank
    # rules paged (attention-numerics; no update-ratio rule fired), a label
    # outside the combined family's; the MoE's constant-rate runs share one
    # healthy phase (same seed and schedule up to 1,000), in which
    # router.zloss paged at 350 blind (optimizer-hyperparameter, never
    # resolved): quiet since its z scale is 10% of the line (detect.c). Its
    # attention and combined-late runs (both diverged at 1,038, 38 steps
    # after the fault, before the ramp) had no mechanism alert before
    # divergence blind: the collapse moved between layers (layer 1 at
    # 1,010, layer 0 at 1,030) and each layer waited for its own second
    # sample (1,040). Caught at 1,030 since a breach of size is confirmed
    # by another layer's within two windows (cross_layer_windows). No 5x
    # ramp diverged, so no LR fault is counted.
    rows = check_look("corpus-holdout16", 9, healthy_least=3,
                      label_known=[("llama-sgd-dh24-h4-kv2-l3.combined-now.s161",
                                    "attention-numerics")])
    moe = [r for r in rows if r["run"] in ("moe8-top2-sgd-dh32-h2-l3.attn-weak.s161",
                                           "moe8-top2-sgd-dh32-h2-l3.combined-late-weak.s161")]
    check(len(moe) == 2 and all(r["caught"] and r["label"] == "attention-numerics"
                                for r in moe),
          "corpus-holdout16: the SGD MoE's attention faults, confirmed across layers: "
          + describe(moe))

    # The seventeenth look, blind: Muon (orthogonalized momentum for the
    # blocks' matrices, AdamW for the rest; the Hello names "Muon") on
    # three shapes. Healthy runs quiet and every hidden rate fault caught
    # by step_update_ratio. Its attention faults are not seen by the
    # mechanism: the orthogonalized update has no rank to lose, so Delta2
    # barely moves (erank 20.7 -> 14.5-17.8 on the LLaMA) and c_qk stays
    # flat; the gradient norm pages at the fault (grad_norm, read
    # loss-spike), which the scorecard does not count as a mechanism
    # alert. Known and documented (docs/detection.md): two attention runs
    # and the LLaMA's combined-late run (diverged before its ramp) missed,
    # the other combined-late runs read optimizer-hyperparameter.
    check_look("corpus-holdout17", 10, lr_least=5, label_known=[
        ("gpt-dense-muon-dh16-h4-l4.combined-late.s171", "optimizer-hyperparameter"),
        ("moe8-top2-muon-dh32-h2-l2.combined-late.s171", "optimizer-hyperparameter")],
        unseen_known=["gpt-dense-muon-dh16-h4-l4.attn-strong.s171",
                      "moe8-top2-muon-dh32-h2-l2.attn-strong.s171",
                      "llama-muon-dh32-h3-kv1-l2.combined-late.s171"])

    # The eighteenth look, blind on the defaults of this version (with the
    # relative floors from the warm-up end while the gradient doubles):
    # attention, combined-late and hidden 5x faults 150-250 steps after
    # warm-ups of 300-400 steps, before the start of detection, and
    # healthy disturbances at the same steps (a doubled context, a few
    # corrupted batches, shifted and harder data, a halved batch). Every
    # diverged fault caught with the right label, every healthy run quiet.
    # Without early_grad_rise it scores 6/7 caught, 4/7 right.
    check_look("corpus-holdout18", 7, lr_least=1, healthy_least=9)

    # The nineteenth look, blind: depth (a 16-layer LLaMA, a 24-layer GPT,
    # a 16-layer top-1 MoE), faults at 500 after 100-step warm-ups, a few
    # corrupted batches, a doubled context and shifted data. Every diverged
    # fault caught with the right label, every healthy run quiet. Blind,
    # the 24-layer GPT paged a healthy-phase gradient spike (grad_norm's
    # scale is 25% of its level since), and its hidden 5x jump read
    # combined from one layer's pending Delta2 breach (pending evidence
    # needs 1 + layers/16 layers since); that jump did not diverge, so it
    # is not asserted here (unit test: test_evaluate).
    check_look("corpus-holdout19", 6, healthy_least=6)

    # The twentieth look: three healthy runs of 10,000 steps (every earlier
    # healthy run stopped by 3,000), into the slow phase where the rate
    # decays to 10% or to zero. No alert at any step.
    check_look("corpus-holdout20", 0, healthy_least=3)

    # The twenty-first look, blind: the twentieth look's shapes faulted at
    # step 6,000 of 10,000 (its healthy runs are the twins). Every diverged
    # fault caught before divergence; the LLaMA's attention fault, at 42%
    # of the peak rate, took 130 steps to show in Delta2 (2,758 to diverge
    # alone), so in its combined-late run the hidden ramp 100 steps after
    # it paged first, optimizer-hyperparameter (documented).
    check_look("corpus-holdout21", 9, lr_least=3, healthy_least=3, label_known=[
        ("llama-dh16-h4-kv2-l4.combined-late.s201", "optimizer-hyperparameter")])


if __name__ == "__main__":
    fstest.run_main(main)
