"""One training run of a tiny model (--arch gpt: tinygpt's nanoGPT layout,
MoE unless --experts 0; --arch llama: llama.py's LLaMA layout with GQA;
--arch qwen3moe / parallel: qwen3moe.py's Qwen3-MoE layout with per-head
qk-norm and --experts/--top-k SwiGLU experts, or its GPT-J/Cohere parallel
block with qk-norm),
with foreshock.Monitor wired in (the two lines marked MONITOR), and
optionally a fault.

Learning rate (--schedule): linear warm-up over --warmup steps, then
constant, cosine decay to 10% of --lr at the last step (--steps), wsd
(warmup-stable-decay: constant, then linear decay to 10% over the last 20%
of the steps), cosine-restarts (SGDR: cosine decay to 10% over each
--restart-period steps after the warm-up, then back to --lr), linear
(linear decay to --min-lr-frac at the last step), invsqrt (the rate times
sqrt(--warmup / step) after the warm-up) or step (the rate times FACTOR
from STEP on, --step-decay STEP:FACTOR; default 10x down at half the
steps).

Scenarios (the fault starts at --fault-step; before it every scenario of a
seed trains identically: same initial weights, same batches):
  healthy             no fault
  attention-numerics  the attention backward truncates the low --bits bits
                      of the BF16 pattern of O and dO before D = rowsum(O*dO)
                      (tinygpt.FlashLikeAttention), in every layer
  lr                  too large a learning rate: from the fault step the
                      rate ramps linearly to --lr-mult times its value over
                      --lr-ramp steps (a peak learning rate mistyped by 100x),
                      then stays there (a multiplier on the scheduled rate)
  combined            both; the learning-rate ramp starts at --lr-fault-step
                      (default: --fault-step, both faults at once)

--lr-hidden: the learning-rate fault is invisible to the monitor: the
optimizer steps with the faulted rate, the monitor is told the scheduled one
(a gradient-accumulation or loss-scale bug, a second optimizer group). With
--peak-mult M the whole schedule runs at M x --lr from step 1 (a peak rate
too large from the start) and the monitor is told the schedule of --lr.
Two more hidden learning-rate faults (scenario lr with --lr-mult 1, so
only these change the rate): --lr-restart S, the optimizer's schedule
starts over at step S (a resume that forgot the scheduler's state: warm-up
again, then the peak) while the logged rate continues; --skip-warmup, the
optimizer steps at the post-warm-up rate from step 1 while the logged rate
warms up.
Router-only faults (MoE layouts): --router-lr-mult M puts the routers'
weights (each MoE block's `gate`) in their own optimizer group whose rate
ramps to M times the scheduled one from the fault step over --lr-ramp
steps (scenario lr with --lr-mult 1: the rest of the model and the logged
rate are unchanged); --aux-off S drops the load-balancing loss from step S.
Hard negatives: --corrupt S:N replaces the batches of steps S..S+N-1 with
uniformly random tokens (a few corrupted batches); --clip-change S:C clips
at C from step S; --ctx-change S:T trains on sequences of T tokens from
step S; --accum-change S:K accumulates K micro-batches a step from step S.
--fault-layers restricts the attention fault to some layers.
More hard negatives, each a change at one step (all healthy): --opt-reset S
drops the optimizer's state at step S (moments and step counts zeroed, as a
resume that loads the weights without the optimizer state; the rate is
unchanged); --freeze-until S trains only the second half of the layers
(the transformer blocks; embeddings and head always train) until step S,
the first half with requires_grad False, then all of them; --wd-change S:W
sets the weight decay to W from step S; --rewarmup S:N warms the rate up
again from step S over N steps (a resume with a re-warm-up: the logged rate
shows it).
Mixed precision and regularisers: --autocast bf16 runs the forward and the
loss under torch.autocast('cpu', bfloat16) (weights, gradients and the
optimizer's state stay float32); --dropout P drops each block's attention
and MLP output (residual dropout, forward hooks: the model files have none).
Hard negatives of those (all healthy): --dropout-change S:P sets the
dropout to P from step S; --smoothing-change S:E label-smooths the loss by
E from step S (the logged loss too); --data-hard S switches to harder data
at step S (each sequence alternates the characters of two places in the
text, see Interleaved).
Monitoring attached late (--attach-at P): steps 1..P train without a
Monitor, which is created after step P (a job resumed from a checkpoint,
or Foreshock added to a running job); the steps it reports continue from
P+1. With --opt-reset P+1 --rewarmup P+1:N it is a fine-tune of a trained
model (fresh optimizer state, a re-warm-up); without, a resumed job.
Skipped optimizer steps (--skip-steps S1,S2,...; all healthy), as dynamic
loss scaling skips a step whose fp16 gradients overflowed: the loss is
computed and logged, the gradients are zeroed, the weights and the
optimizer's state stay as they were, and the monitor is told grad_norm
inf (what clip_grad_norm_ returns on overflowed gradients in the PyTorch
AMP recipe; --skip-grad-norm none: no grad_norm that step).
--arch qwen3moe with --experts 0: the Qwen3 dense layout (per-head qk-norm,
a dense SwiGLU MLP in every layer).

Optimizer (--optimizer): AdamW, our Lion, SGD, RMSprop, or our Muon (one
optimizer, class name "Muon": orthogonalized Nesterov momentum for every
2-D matrix inside the transformer blocks, MLP experts and routers too,
AdamW for embeddings, head, norms and biases; see the Muon class). Every
parameter group steps at the rate lr_at() gives, so a rate fault scales
all of them (the routers' group by --router-lr-mult besides).

Writes one JSON line per step to --out (step, loss, grad_norm, lr,
train_s: forward+backward+optimizer, monitor_s: monitor.step()) and a last
line {"summary": ...} with the client's counters.

    /usr/bin/python3 client/python/experiments/train.py --endpoint 127.0.0.1:7781 \
        --run demo-attn --scenario attention-numerics --seed 1 --out /tmp/demo.jsonl
"""
import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import foreshock  # noqa: E402
import llama  # noqa: E402
import qwen3moe  # noqa: E402
import tinygpt  # noqa: E402

SCENARIOS = ("healthy", "attention-numerics", "lr", "combined")
DIVERGE_WINDOW, DIVERGE_RATIO = 25, 1.2  # as run_experiment.divergence_step


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", help="daemon ingest HOST:PORT (omit: no monitor, unless --record)")
    p.add_argument("--record", default=None,
                   help="also record the report stream to this file (Monitor(record=...)); "
                        "without --endpoint the run is only recorded")
    p.add_argument("--run", default=None, help="run id (default: SCENARIO-sSEED)")
    p.add_argument("--scenario", choices=SCENARIOS, default="healthy")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--fault-step", type=int, default=200)
    p.add_argument("--bits", type=int, default=5, help="BF16 low bits truncated (1..16)")
    p.add_argument("--fault-on", choices=("o", "do", "both"), default="both")
    p.add_argument("--fault-layers", default=None,
                   help="attention fault in these layers only (comma separated; default: all)")
    p.add_argument("--arch", choices=("gpt", "llama", "qwen3moe", "parallel"),
                   default="gpt")
    p.add_argument("--schedule", choices=("constant", "cosine", "wsd", "cosine-restarts",
                                          "linear", "invsqrt", "step"),
                   default="constant",
                   help="after warm-up: constant, or cosine decay to 10%% at --steps")
    p.add_argument("--step-decay", default=None,
                   help="step: STEP:FACTOR, the rate times FACTOR from STEP on (default: "
                        "10x down at half of --steps)")
    p.add_argument("--restart-period", type=int, default=500,
                   help="cosine-restarts: steps from one restart to the next")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--lr-mult", type=float, default=100.0)
    p.add_argument("--lr-ramp", type=int, default=200)
    p.add_argument("--lr-fault-step", type=int, default=None,
                   help="combined: step the learning-rate ramp starts (default: --fault-step)")
    p.add_argument("--lr-hidden", action="store_true",
                   help="the monitor is told the scheduled rate, not the faulted one")
    p.add_argument("--peak-mult", type=float, default=1.0,
                   help="the optimizer runs the whole schedule at this multiple of --lr; "
                        "the monitor is told the schedule of --lr")
    p.add_argument("--lr-restart", type=int, default=None,
                   help="lr: from this step the optimizer's schedule starts over (warm-up, "
                        "then the peak; a resume that forgot the scheduler state)")
    p.add_argument("--skip-warmup", action="store_true",
                   help="lr: the optimizer skips the warm-up (the logged rate warms up "
                        "under --lr-hidden)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm (0: off)")
    p.add_argument("--clip-change", default=None,
                   help="STEP:C: from this step clip at C (0: off)")
    p.add_argument("--router-lr-mult", type=float, default=1.0,
                   help="lr: the MoE routers' own group ramps to this multiple of the rate "
                        "from the fault step over --lr-ramp steps (default 1: one group)")
    p.add_argument("--aux-off", type=int, default=None,
                   help="from this step the load-balancing loss is dropped")
    p.add_argument("--corrupt", default=None,
                   help="STEP:N: batches of steps STEP..STEP+N-1 are random tokens")
    p.add_argument("--optimizer", choices=("adamw", "lion", "sgd", "rmsprop", "muon"),
                   default="adamw",
                   help="adamw (betas 0.9/--beta2), lion (Chen et al. 2023: the sign of an "
                        "interpolated momentum, betas 0.9/0.99, decoupled weight decay) or "
                        "sgd (heavy-ball --momentum, L2 weight decay) or rmsprop "
                        "(squared-gradient average --alpha, no momentum, L2 weight decay) or "
                        "muon (orthogonalized Nesterov momentum 0.95 for the blocks' 2-D "
                        "matrices, AdamW betas 0.9/--beta2 for the rest, one optimizer; "
                        "decoupled weight decay on both)")
    p.add_argument("--alpha", type=float, default=0.99, help="rmsprop: squared-gradient decay")
    p.add_argument("--beta1", type=float, default=0.9, help="adamw: first-moment decay")
    p.add_argument("--beta2", type=float, default=0.95, help="adamw: second-moment decay")
    p.add_argument("--eps", type=float, default=1e-8, help="adamw: denominator epsilon")
    p.add_argument("--momentum", type=float, default=0.9, help="sgd: momentum")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--wd-change", default=None,
                   help="STEP:W: from this step the weight decay is W")
    p.add_argument("--opt-reset", type=int, default=None,
                   help="at this step the optimizer's state is dropped (a resume without "
                        "the optimizer state; the rate is unchanged)")
    p.add_argument("--freeze-until", type=int, default=None,
                   help="the first half of the layers is frozen (requires_grad False) until "
                        "this step, then trains")
    p.add_argument("--rewarmup", default=None,
                   help="STEP:N: from this step the rate warms up again over N steps (the "
                        "logged rate too)")
    p.add_argument("--autocast", choices=("off", "bf16"), default="off",
                   help="bf16: forward and loss under torch.autocast('cpu', bfloat16) (mixed "
                        "precision; weights, gradients and optimizer state stay float32)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="residual dropout on each block's attention and MLP outputs")
    p.add_argument("--dropout-change", default=None,
                   help="STEP:P: from this step the residual dropout is P")
    p.add_argument("--smoothing-change", default=None,
                   help="STEP:E: from this step the loss is label-smoothed by E (the logged "
                        "loss too, as a trainer logs its training loss)")
    p.add_argument("--data-hard", type=int, default=None,
                   help="from this step each sequence alternates the characters of two "
                        "places in the text (harder data: each character follows the one two "
                        "back; same characters, same batch and length)")
    p.add_argument("--attach-at", type=int, default=None,
                   help="P: no Monitor until step P; it is created after step P and reports "
                        "steps P+1.. (a resumed job, or monitoring added to a running one)")
    p.add_argument("--skip-steps", default=None,
                   help="S1,S2,...: at these steps the optimizer step is skipped (as dynamic "
                        "loss scaling does on overflow): gradients zeroed, weights and "
                        "optimizer state unchanged, the loss still logged")
    p.add_argument("--skip-grad-norm", choices=("inf", "none"), default="inf",
                   help="the grad_norm the monitor is told at a skipped step: inf (overflowed "
                        "fp16 gradients) or none (not reported)")
    p.add_argument("--accum", type=int, default=1,
                   help="gradient accumulation: micro-batches of --batch per optimizer step "
                        "(the logged loss is their mean)")
    p.add_argument("--accum-change", default=None,
                   help="STEP:K: from this step K micro-batches a step (the effective batch "
                        "changes mid-run; the rate is unchanged)")
    p.add_argument("--min-lr-frac", type=float, default=0.1,
                   help="cosine and wsd decay to this fraction of --lr (0: to zero)")
    p.add_argument("--data-shift", type=int, default=None,
                   help="batches before this step come from the first 3/4 of the text, "
                        "from it on from the last 1/4 (a data-mix change; default: "
                        "the whole text throughout)")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="llama: key/value heads (GQA)")
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--ctx-change", default=None,
                   help="STEP:T: from this step sequences of T tokens (a sequence-length "
                        "change mid-run; the model is built for the longer of --ctx and T)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batch-change", default=None,
                   help="STEP:N: from this step batches of N sequences (a batch-size change "
                        "mid-run; the rate is unchanged)")
    p.add_argument("--experts", type=int, default=4, help="0: dense MLP")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--shared-expert", action="store_true",
                   help="gpt MoE: one always-on expert beside the routed ones")
    p.add_argument("--aux", type=float, default=0.01, help="load-balancing loss weight")
    # One 5-step window sketched every 5 steps, so the detectors' 3-sample
    # persistence spans 3 disjoint windows. Longer windows sketched every 5
    # steps overlap: 3 samples of a 25-step window cover 35 steps, and a
    # healthy run's transient low-rank phase (seed 2, layer 1, steps
    # 1020-1045) fired qk.d2.entropy/erank there; client/python/README.md, "Windows".
    p.add_argument("--windows", default="5", help="sketch windows, comma separated")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--detect-from", type=int, default=100,
                   help="Hello.detect_from_step: earlier steps only build baselines")
    p.add_argument("--corpus", default=None, help="text file (default: Python's stdlib)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--out", default=None, help="per-step JSON lines")
    p.add_argument("--stop-after-diverge", type=int, default=-1,
                   help="stop this many steps after the loss diverged by "
                        "run_experiment.divergence_step's criterion (-1: never)")
    p.add_argument("--stop-after-alert", default=None,
                   help="HOST:PORT of the daemon's HTTP API: stop once an alert labelled "
                        "attention-numerics has fired for this run (CI smoke)")
    return p.parse_args(argv)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
    Algorithms"): the update is lr * sign(b1 * m + (1 - b1) * g), then
    m = b2 * m + (1 - b2) * g; weight decay is decoupled (p *= 1 - lr * wd)."""

    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1.0 - lr * wd)
                p.add_(torch.sign(m * b1 + p.grad * (1.0 - b1)), alpha=-lr)
                m.mul_(b2).add_(p.grad, alpha=1.0 - b2)


def newton_schulz5(g, steps=5, eps=1e-7):
    """The nearest semi-orthogonal matrix to g, approximately: the quintic
    Newton-Schulz iteration X <- a X + (b A + c A^2) X with A = X X^T and
    (a, b, c) = (3.4445, -4.7750, 2.0315), on g normalised by its Frobenius
    norm (every singular value then at most 1), in float32. A wide X (rows
    <= cols) keeps A small; a tall one is transposed first and back after.
    These coefficients drive every singular value into roughly [0.7, 1.2]
    in 5 steps rather than exactly to 1: near-orthogonal is enough. g may
    be a stack of matrices of one shape (..., rows, cols), each normalised
    and iterated on its own (one batched matmul for all: the MoE's experts)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.transpose(-2, -1)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        s = x @ x.transpose(-2, -1)
        x = a * x + (b * s + c * (s @ s)) @ x
    return x.transpose(-2, -1) if tall else x


class Muon(torch.optim.Optimizer):
    """Muon for the transformer blocks' 2-D weight matrices, AdamW for every
    other parameter, in one optimizer (as Moonlight's and Kimi's
    implementations step both; the Monitor's Hello then names "Muon").

    A group with use_muon True: the momentum buffer m = beta m + (1 - beta) g
    (beta 0.95), the Nesterov update u = beta m + (1 - beta) g, orthogonalized
    by newton_schulz5, scaled by 0.2 sqrt(max(rows, cols)) so that its RMS is
    about 0.2 (an AdamW update's at the same rate), then p -= lr * that.
    Other groups: AdamW (betas, eps, bias-corrected moments). Weight decay is
    decoupled on both (p *= 1 - lr * wd). Every group steps at its own "lr",
    which the trainer sets each step, so a rate fault scales both parts."""

    def __init__(self, muon_params, adamw_params, lr, momentum=0.95, ns_steps=5,
                 betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, extra=None):
        extra = extra or {}
        groups = [dict(extra, params=list(muon_params), use_muon=True),
                  dict(extra, params=list(adamw_params), use_muon=False)]
        groups = [g for g in groups if g["params"]]
        super().__init__(groups, {"lr": lr, "momentum": momentum, "ns_steps": ns_steps,
                                  "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            ps = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                beta = group["momentum"]
                by_shape = {}
                for p in ps:
                    m = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    m.mul_(beta).add_(p.grad, alpha=1.0 - beta)
                    by_shape.setdefault(tuple(p.shape), []).append(p)
                # The Nesterov updates of one shape orthogonalized together
                # (the same arithmetic as one by one, fewer calls).
                for shape, same in by_shape.items():
                    u = torch.stack([self.state[p]["momentum_buffer"] * beta
                                     + p.grad * (1.0 - beta) for p in same])
                    o = newton_schulz5(u, group["ns_steps"])
                    for p, op in zip(same, o):
                        p.mul_(1.0 - lr * wd)
                        p.add_(op.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(shape)))
                continue
            b1, b2 = group["betas"]
            for p in ps:
                g, st = p.grad, self.state[p]
                n = st["step"] = st.get("step", 0) + 1
                m = st.setdefault("exp_avg", torch.zeros_like(p))
                v = st.setdefault("exp_avg_sq", torch.zeros_like(p))
                p.mul_(1.0 - lr * wd)
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                denom = (v / (1.0 - b2 ** n)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-lr / (1.0 - b1 ** n))


def muon_split(model, arch, params):
    """Muon's two parameter sets, for each group of params (a list of
    parameters, or of groups as --router-lr-mult makes): the 2-D matrices
    inside the transformer blocks (attention, MLP, experts, routers) and
    everything else (embeddings, the output head, norms, biases). Returns
    (muon params, adamw params, the group's other keys) per group."""
    blocks = model.h if arch == "gpt" else model.model.layers
    hidden = {id(w) for b in blocks for w in b.parameters() if w.dim() == 2}
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    out = []
    for g in groups:
        ws = list(g["params"])
        out.append(([w for w in ws if id(w) in hidden], [w for w in ws if id(w) not in hidden],
                    {k: v for k, v in g.items() if k != "params"}))
    return out


WSD_DECAY = 0.2  # wsd: share of the steps spent decaying, at the end


def scheduled_lr(a, step, warm=True):
    """The schedule of --lr, without any fault: what a trainer logs
    (warm=False: without the warm-up)."""
    base = a.lr * min(1.0, (step + 1) / a.warmup) if warm else a.lr
    if a.schedule == "cosine-restarts" and step > a.warmup:
        frac = ((step - a.warmup) % a.restart_period) / a.restart_period
        base *= a.min_lr_frac + (1.0 - a.min_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * frac))
    if a.schedule == "cosine" and step > a.warmup:
        frac = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
        base *= a.min_lr_frac + (1.0 - a.min_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * frac))
    if a.schedule == "linear" and step > a.warmup:
        frac = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
        base *= 1.0 - (1.0 - a.min_lr_frac) * frac
    if a.schedule == "invsqrt" and step > a.warmup:
        base *= math.sqrt(a.warmup / step)
    if a.schedule == "step":
        at, factor = (a.step_decay or f"{a.steps // 2}:0.1").split(":")
        base *= float(factor) if step >= int(at) else 1.0
    if a.schedule == "wsd":
        start = a.steps * (1.0 - WSD_DECAY)
        if step > start:
            base *= 1.0 - (1.0 - a.min_lr_frac) * min(1.0, (step - start)
                                                      / max(1.0, a.steps - start))
    if a.rewarmup is not None:
        at, n = (int(x) for x in a.rewarmup.split(":"))
        base *= min(1.0, (step - at + 1) / n) if step >= at else 1.0
    return base


def lr_at(a, step):
    """The rate the optimizer steps with (faults included)."""
    lr_fault = a.fault_step if a.lr_fault_step is None else a.lr_fault_step
    faulted = a.scenario in ("lr", "combined")
    at = step - a.lr_restart + 1 if faulted and a.lr_restart and step >= a.lr_restart else step
    base = scheduled_lr(a, at, not (faulted and a.skip_warmup)) * a.peak_mult
    if a.scenario in ("lr", "combined") and step >= lr_fault:
        ramp = min(1.0, (step - lr_fault + 1) / a.lr_ramp)
        base *= 1.0 + (a.lr_mult - 1.0) * ramp
    return base


def router_mult(a, step):
    """The routers' group's multiple of the rate (--router-lr-mult)."""
    if a.scenario not in ("lr", "combined") or step < a.fault_step:
        return 1.0
    return 1.0 + (a.router_lr_mult - 1.0) * min(1.0, (step - a.fault_step + 1) / a.lr_ramp)


class Interleaved:
    """--data-hard's batches: sequence j of batch i alternates the characters
    of two random places in the text, so a character's predecessor in its own
    stream is two tokens back. Deterministic per (seed, i), like
    tinygpt.Batches."""

    def __init__(self, data, batch, t, seed):
        self.data, self.batch, self.t, self.seed = data, batch, t, seed

    def get(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i + 500_009)
        n = self.t // 2 + 1
        ix = torch.randint(len(self.data) - n - 1, (2, self.batch), generator=g)
        seqs = [torch.stack([self.data[u:u + n], self.data[v:v + n]], dim=1).reshape(-1)
                [:self.t + 1] for u, v in zip(*ix.tolist())]
        s = torch.stack(seqs)
        return s[:, :-1].contiguous(), s[:, 1:].contiguous()


def add_dropout(model, arch, state):
    """Residual dropout (--dropout): a forward hook on each block's attention
    and MLP module drops their output with probability state['p'] (the model
    files have no dropout of their own)."""
    blocks = model.h if arch == "gpt" else model.model.layers
    for b in blocks:
        for m in (getattr(b, "attn", None) or b.self_attn, b.mlp):
            m.register_forward_hook(
                lambda mod, inp, out: torch.nn.functional.dropout(out, state["p"], True))


def main(argv=None):
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(a.threads)
    run = a.run or f"{a.scenario}-s{a.seed}"
    torch.manual_seed(a.seed)
    data, vocab = tinygpt.load_corpus(a.corpus)
    ctx_at, ctx_to = None, None
    if a.ctx_change is not None:
        ctx_at, ctx_to = (int(x) for x in a.ctx_change.split(":"))
    t = max(a.ctx, ctx_to) if ctx_to else a.ctx
    if a.arch == "llama":
        model = llama.TinyLlama(vocab, d=a.d, n_layer=a.layers, n_head=a.heads,
                                n_kv_head=a.kv_heads, t=t)
    elif a.arch == "qwen3moe" and a.experts == 0:
        # Qwen3 dense: the MoE layout built with one expert, each layer's
        # block then replaced by a dense SwiGLU MLP of the model's width.
        model = qwen3moe.TinyQkModel(vocab, d=a.d, n_layer=a.layers, n_head=a.heads,
                                     n_kv_head=a.kv_heads, t=t, experts=1, top_k=1)
        for lay in model.model.layers:
            lay.mlp = llama.LlamaMLP(model.config)
            lay.mlp.apply(model._init)
    elif a.arch in ("qwen3moe", "parallel"):
        model = qwen3moe.TinyQkModel(vocab, d=a.d, n_layer=a.layers, n_head=a.heads,
                                     n_kv_head=a.kv_heads, t=t,
                                     parallel=a.arch == "parallel", experts=a.experts,
                                     top_k=a.top_k)
    else:
        moe = (a.experts, a.top_k) + ((True,) if a.shared_expert else ()) if a.experts else None
        model = tinygpt.TinyGPT(vocab, d=a.d, n_layer=a.layers, n_head=a.heads, t=t, moe=moe)
    params = model.parameters()
    if a.router_lr_mult != 1.0:
        routers = [m.gate.weight for m in model.modules() if isinstance(m, tinygpt.MoE)]
        if not routers:
            sys.exit("train.py: --router-lr-mult needs an MoE layout (no router found)")
        ids = {id(w) for w in routers}
        params = [{"params": [w for w in model.parameters() if id(w) not in ids]},
                  {"params": routers, "router": True}]
    if a.optimizer == "muon":
        # One Muon per group (--router-lr-mult makes two); the first takes
        # the others' param groups, Muon's part and AdamW's each.
        opts = [Muon(hid, rest, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
                     weight_decay=a.weight_decay, extra=extra)
                for hid, rest, extra in muon_split(model, a.arch, list(params))]
        opt = opts[0]
        for other in opts[1:]:
            for g in other.param_groups:
                opt.add_param_group(g)
    elif a.optimizer == "lion":
        opt = Lion(params, lr=a.lr, weight_decay=a.weight_decay)
    elif a.optimizer == "rmsprop":
        opt = torch.optim.RMSprop(params, lr=a.lr, alpha=a.alpha, weight_decay=a.weight_decay)
    elif a.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=a.lr, momentum=a.momentum,
                              weight_decay=a.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
                                weight_decay=a.weight_decay)
    frozen = []
    if a.freeze_until is not None:
        blocks = model.h if a.arch == "gpt" else model.model.layers
        frozen = [w for b in list(blocks)[:len(blocks) // 2] for w in b.parameters()]
        for w in frozen:
            w.requires_grad_(False)
    drop = {"p": a.dropout}
    drop_at, drop_to = None, None
    if a.dropout_change is not None:
        drop_at, drop_to = a.dropout_change.split(":")
        drop_at, drop_to = int(drop_at), float(drop_to)
    if a.dropout > 0 or drop_at is not None:
        add_dropout(model, a.arch, drop)
    smooth = {"eps": 0.0}
    smooth_at, smooth_to = None, None
    if a.smoothing_change is not None:
        smooth_at, smooth_to = a.smoothing_change.split(":")
        smooth_at, smooth_to = int(smooth_at), float(smooth_to)
        # The model files call F.cross_entropy without smoothing: the trainer
        # wraps it (this process only) to pass the current epsilon.
        plain_ce = torch.nn.functional.cross_entropy

        def smoothed_ce(*args, **kw):
            kw.setdefault("label_smoothing", smooth["eps"])
            return plain_ce(*args, **kw)

        torch.nn.functional.cross_entropy = smoothed_ce

    def amp():
        if a.autocast == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    wd_at, wd_to = None, None
    if a.wd_change is not None:
        wd_at, wd_to = a.wd_change.split(":")
        wd_at, wd_to = int(wd_at), float(wd_to)
    batches = tinygpt.Batches(data, a.batch, a.ctx, a.seed)
    shifted = None
    if a.data_shift is not None:
        cut = len(data) * 3 // 4
        batches = tinygpt.Batches(data[:cut], a.batch, a.ctx, a.seed)
        shifted = tinygpt.Batches(data[cut:], a.batch, a.ctx, a.seed)
    resized, resize_at = None, None
    if a.batch_change is not None:
        resize_at, n = (int(x) for x in a.batch_change.split(":"))
        resized = tinygpt.Batches(data, n, a.ctx, a.seed)
    if ctx_at is not None:
        resize_at, resized = ctx_at, tinygpt.Batches(data, a.batch, ctx_to, a.seed)
    if a.data_hard is not None:
        resize_at, resized = a.data_hard, Interleaved(data, a.batch, a.ctx, a.seed)
    accum_at, accum_to = None, None
    if a.accum_change is not None:
        accum_at, accum_to = (int(x) for x in a.accum_change.split(":"))

    clip_at, clip_to = None, None
    if a.clip_change is not None:
        clip_at, clip_to = a.clip_change.split(":")
        clip_at, clip_to = int(clip_at), float(clip_to)
    corrupt = None
    if a.corrupt is not None:
        c0, cn = (int(x) for x in a.corrupt.split(":"))
        corrupt = range(c0, c0 + cn)

    def get(src, step, i):
        x, y = src.get(i)
        if corrupt is not None and step in corrupt:
            g = torch.Generator().manual_seed(a.seed * 1_000_003 + i + 7)
            x = torch.randint(vocab, x.shape, generator=g)
            y = torch.randint(vocab, y.shape, generator=g)
        return x, y

    def monitor():  # MONITOR (1 of 2)
        # optimizer=: its class name goes to Hello (how the daemon reads
        # the step); the rate still comes from step(lr=), the logged one.
        return foreshock.Monitor(model, endpoint=a.endpoint, run=run,
                                 windows=[int(w) for w in a.windows.split(",")], every=a.every,
                                 detect_from_step=a.detect_from, record=a.record, optimizer=opt)

    mon = None
    if (a.endpoint or a.record) and a.attach_at is None:
        mon = monitor()
    skips = {int(x) for x in a.skip_steps.split(",")} if a.skip_steps else set()
    watcher = None
    if a.stop_after_alert:
        from fsapi import Api
        watcher = Api(a.stop_after_alert)

    out = open(a.out, "w") if a.out else None
    t_run = time.perf_counter()
    stopped_at = None
    diverged, tail, best = None, [], math.inf  # run_experiment.divergence_step, online
    for step in range(1, a.steps + 1):
        if a.scenario in ("attention-numerics", "combined") and step == a.fault_step:
            model.fault.bits, model.fault.on = a.bits, a.fault_on
            if a.fault_layers is not None:
                model.fault.layers = {int(x) for x in a.fault_layers.split(",")}
        if frozen and step == a.freeze_until:
            for w in frozen:
                w.requires_grad_(True)
        if a.opt_reset is not None and step == a.opt_reset:
            opt.state.clear()
        if drop_at is not None and step == drop_at:
            drop["p"] = drop_to
        if smooth_at is not None and step == smooth_at:
            smooth["eps"] = smooth_to
        if wd_at is not None and step == wd_at:
            for g in opt.param_groups:
                g["weight_decay"] = wd_to
        lr = lr_at(a, step)
        logged = scheduled_lr(a, step) if a.lr_hidden or a.peak_mult != 1.0 else lr
        for g in opt.param_groups:
            g["lr"] = lr * router_mult(a, step) if g.get("router") else lr
        t0 = time.perf_counter()
        src = shifted if shifted is not None and step >= a.data_shift else batches
        if resized is not None and step >= resize_at:
            src = resized
        accum = accum_to if accum_at is not None and step >= accum_at else a.accum
        if accum == 1:
            x, y = get(src, step, step)
            with amp():
                loss, aux = model(x, y)
            w = 0.0 if a.aux_off is not None and step >= a.aux_off else a.aux
            total = loss + w * aux if aux is not None else loss
            opt.zero_grad(set_to_none=True)
            total.backward()
        else:
            opt.zero_grad(set_to_none=True)
            losses = []
            for k in range(accum):
                x, y = get(src, step, step * accum + k)
                with amp():
                    micro, aux = model(x, y)
                w = 0.0 if a.aux_off is not None and step >= a.aux_off else a.aux
                total = micro + w * aux if aux is not None else micro
                (total / accum).backward()
                losses.append(micro.detach())
            loss = torch.stack(losses).mean()
        clip = clip_to if clip_at is not None and step >= clip_at else a.clip
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                            clip if clip > 0 else float("inf"))
        told = gn
        if step in skips:
            # An overflowed step under dynamic loss scaling: no update at all.
            for w in model.parameters():
                if w.grad is not None:
                    w.grad.zero_()
            told = math.inf if a.skip_grad_norm == "inf" else None
        else:
            opt.step()
        t1 = time.perf_counter()
        if mon is not None:  # MONITOR (2 of 2)
            mon.step(step, loss=loss, grad_norm=told, lr=logged)
        t2 = time.perf_counter()
        rec = {"step": step, "loss": loss.item(), "grad_norm": gn.item(), "lr": lr,
               "lr_logged": logged,
               "train_s": t1 - t0, "monitor_s": t2 - t1}
        if out:
            if step in skips:
                rec["skipped"] = True
            out.write(json.dumps(rec) + "\n")
        if watcher is not None and step % 25 == 0:
            # Fired, not merely pending: the alert list also holds pending ones.
            if any(f["attribution"] == "attention-numerics" for f in watcher.firings(run)):
                stopped_at = step
                break
        if (a.endpoint or a.record) and a.attach_at is not None and step == a.attach_at:
            mon = monitor()  # attached late: the next step it sees is P+1
        if not math.isfinite(rec["loss"]):
            logging.warning("loss is not finite at step %d; stopping", step)
            diverged = diverged or step
            break
        if diverged is None:
            tail = (tail + [rec["loss"]])[-DIVERGE_WINDOW:]
            if len(tail) == DIVERGE_WINDOW:
                best = min(best, sum(tail) / DIVERGE_WINDOW)
                if sum(tail) / DIVERGE_WINDOW >= DIVERGE_RATIO * best:
                    diverged = step
        if diverged is not None and 0 <= a.stop_after_diverge <= step - diverged:
            logging.info("loss diverged at step %d; stopping at %d", diverged, step)
            break
    wall = time.perf_counter() - t_run
    summary = {"run": run, "arch": a.arch, "schedule": a.schedule,
               "scenario": a.scenario, "seed": a.seed, "steps": step,
               "fault_step": a.fault_step if a.scenario != "healthy" else None,
               "wall_s": wall, "stopped_after_alert": stopped_at, "diverged": diverged}
    if mon is not None:
        st = mon.close(120)
        summary["client"] = {k: v for k, v in st.items() if k != "last_error"}
    if out:
        out.write(json.dumps({"summary": summary}) + "\n")
        out.close()
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
