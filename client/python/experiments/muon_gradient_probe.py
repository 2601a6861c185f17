"""Probe: is the attention fault visible in the gradient's first-order QK
term when the optimizer orthogonalizes its update (Muon)?

The daemon's Δ2 is the first-order term of the QK bilinear *update* over a
window, ΔWqᵀ Wk + Wqᵀ ΔWk (docs/monitors.md section 1). Muon steps every
matrix by its momentum orthogonalized, so the update of a head is full-rank
whatever the gradient does, and the seventeenth held-out look saw no Δ2
collapse under the attention fault (docs/detection.md). This probe asks
whether the same term built from the *gradient*, Gqᵀ Wk + Wqᵀ Gk, still
collapses: the question a gradient-side monitor would rest on.

It runs train.py (GPT layout: tinygpt's fused `c_attn`) with the given
arguments and, from an optimizer step pre-hook (torch 2.x), reads each
layer's Wq, Wk and their gradients before every optimizer step. At every
10th step it writes, per layer, the smallest effective rank (erank_2,
docs/monitors.md 1.3) over the layer's heads of three matrices:

    g1  the term from this step's gradient
    gw  the term from the gradients summed over the last 10 steps
    up  the update's Δ2 over the last 10 steps (what the daemon sees)

and at the end the median over sketches and layers of each, for the 100
steps before --fault-step and the 100 after it. A scratch measurement, not
a monitor: nothing is sent to a daemon.

    build-venv/bin/python client/python/experiments/muon_gradient_probe.py OUT.tsv \\
        --arch gpt --experts 0 --d 64 --heads 4 --layers 4 --optimizer muon \\
        --weight-decay 0.01 --lr 8e-3 --warmup 50 --schedule wsd --ctx 32 --batch 16 \\
        --min-lr-frac 0 --clip 1.0 --threads 1 --seed 171 --steps 1100 --fault-step 1000 \\
        --scenario attention-numerics --bits 12 --fault-on both
"""
import os
import statistics
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tinygpt  # noqa: E402
import train  # noqa: E402

WINDOW = 10  # steps per sketch, as a default Monitor
SPAN = 100   # steps each side of the fault the summary covers


def erank_min(dq, dk, wq, wk, heads):
    """Smallest erank_2 over heads of dqᵀ wk + wqᵀ dk (rows: heads x dh)."""
    dh = wq.shape[0] // heads
    best = float("inf")
    for h in range(heads):
        rows = slice(h * dh, (h + 1) * dh)
        m = dq[rows].T.double() @ wk[rows].double() + wq[rows].T.double() @ dk[rows].double()
        s2 = torch.linalg.svdvals(m) ** 2
        s2 = s2[s2 > s2.max() * 1e-12]
        if s2.numel() == 0:
            continue
        p = s2 / s2.sum()
        best = min(best, float(torch.exp(-(p * p.log()).sum())))
    return best


class Probe:
    def __init__(self, out):
        self.out, self.layers, self.n = out, [], 0
        self.acc, self.w0 = None, None
        self.rows = []  # (step, kind, layer-min eranks)

    def watch(self, module):
        self.layers.append(module)

    def qk(self, t, d):
        return t[:d].detach().clone(), t[d:2 * d].detach().clone()

    def before_step(self, opt, args, kwargs):
        self.n += 1
        d = self.layers[0].c_attn.weight.shape[1]
        w = [self.qk(m.c_attn.weight, d) for m in self.layers]
        g = [self.qk(m.c_attn.weight.grad, d) for m in self.layers]
        if (self.n - 1) % WINDOW == 0:
            self.acc, self.w0 = g, w
        else:
            self.acc = [(a + c, b + e) for (a, b), (c, e) in zip(self.acc, g)]
        if self.n % WINDOW:
            return
        kinds = {
            "g1": [erank_min(gq, gk, wq, wk, m.n_head)
                   for (gq, gk), (wq, wk), m in zip(g, w, self.layers)],
            "gw": [erank_min(gq, gk, wq, wk, m.n_head)
                   for (gq, gk), (wq, wk), m in zip(self.acc, w, self.layers)],
            "up": [erank_min(wq - q0, wk - k0, q0, k0, m.n_head)
                   for (wq, wk), (q0, k0), m in zip(w, self.w0, self.layers)],
        }
        for kind, v in kinds.items():
            self.rows.append((self.n, kind, v))
            self.out.write("%d\t%s\t%s\n" % (self.n, kind, "\t".join("%.3f" % x for x in v)))
        self.out.flush()

    def summary(self, fault):
        for kind in ("g1", "gw", "up"):
            before = [x for s, k, v in self.rows if k == kind and fault - SPAN <= s < fault
                      for x in v]
            after = [x for s, k, v in self.rows if k == kind and fault < s <= fault + SPAN
                     for x in v]
            if before and after:
                print("%s erank_2 layer-min median: %.2f before the fault, %.2f after"
                      % (kind, statistics.median(before), statistics.median(after)))


def main(argv):
    if len(argv) < 2:
        print(__doc__.split("\n\n")[-1], file=sys.stderr)
        return 2
    with open(argv[0], "w") as out:
        probe = Probe(out)
        init = tinygpt.CausalSelfAttention.__init__

        def watched_init(self, *a, **k):
            init(self, *a, **k)
            probe.watch(self)

        tinygpt.CausalSelfAttention.__init__ = watched_init
        handle = register_optimizer_step_pre_hook(probe.before_step)
        try:
            rc = train.main(argv[1:])
        finally:
            handle.remove()
            tinygpt.CausalSelfAttention.__init__ = init
        fault = int(argv[argv.index("--fault-step") + 1]) if "--fault-step" in argv else 200
        probe.summary(fault)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
