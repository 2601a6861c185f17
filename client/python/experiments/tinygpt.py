"""A tiny GPT (and an MoE variant) whose attention backward can carry the
biased low-precision flash-attention fault.

The attention is an autograd.Function written the way flash attention's
backward is: it recomputes nothing clever, but it forms
    D = rowsum(O * dO)
and uses dS = P * (dP - D). Flash attention computes D from the BF16 copies
of O and dO. The fault truncates (rounds toward zero) the low `bits` bits of
the BF16 bit pattern of O and/or dO before that row sum: a biased rounding,
the same sign every step, so the error in dS does not average out. Exact
arithmetic gives D = rowsum(P * dP); with the fault the softmax gradient rows
no longer sum to zero and Q/K receive a systematic push along the
attention-weighted mean key/query directions (a few directions, every step).

The model follows nanoGPT's layout (a fused `c_attn` projection [q; k; v],
`n_head` on the attention module), so foreshock.Monitor finds its Q/K
weights without help; the MoE variant has a router `gate` (Linear d -> E)
beside an `experts` ModuleList, the layout of Mixtral/Qwen-MoE.
"""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class Fault:
    """Mutable switch shared by every attention layer of a model: the
    trainer flips it at the fault step. bits: low bits of the BF16 pattern
    to truncate (0 = healthy, at most 7, the whole mantissa); on: which of
    'o', 'do' or 'both'; layers: None for all layers, else a set of indices."""

    def __init__(self):
        self.bits = 0
        self.on = "both"
        self.layers = None

    def active(self, layer):
        return self.bits > 0 and (self.layers is None or layer in self.layers)


def truncate_bf16(x, bits):
    """x rounded to BF16, then the low `bits` bits of its 16-bit pattern
    cleared (round toward zero), back in x's dtype."""
    if bits <= 0:
        return x
    b = x.to(torch.bfloat16).view(torch.int16)
    mask = ~((1 << bits) - 1)
    return (b & mask).view(torch.bfloat16).to(x.dtype)


class FlashLikeAttention(torch.autograd.Function):
    """Causal softmax attention over [B, H, T, dh] with a flash-style
    backward. fault_bits/fault_on: see Fault."""

    @staticmethod
    def forward(ctx, q, k, v, fault_bits, fault_on):
        if torch.is_autocast_cpu_enabled():
            # Under CPU autocast (train.py --autocast bf16) the kernel takes
            # one dtype, as flash attention does: LLaMA's rotated q/k come
            # in float32 beside a bfloat16 v, and the backward's matmuls
            # need their operands alike.
            lo = torch.get_autocast_cpu_dtype()
            q, k, v = q.to(lo), k.to(lo), v.to(lo)
        scale = 1.0 / math.sqrt(q.shape[-1])
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        t = q.shape[-2]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.matmul(p, v)
        ctx.save_for_backward(q, k, v, p, o)
        ctx.scale = scale
        ctx.fault_bits = int(fault_bits)
        ctx.fault_on = fault_on
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, p, o = ctx.saved_tensors
        scale = ctx.scale
        dv = torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, v.transpose(-1, -2))
        o_d, do_d = o, do
        if ctx.fault_bits > 0:
            if ctx.fault_on in ("o", "both"):
                o_d = truncate_bf16(o, ctx.fault_bits)
            if ctx.fault_on in ("do", "both"):
                do_d = truncate_bf16(do, ctx.fault_bits)
        # D = rowsum(O * dO) = rowsum(P * dP) in exact arithmetic.
        d = (o_d * do_d).sum(dim=-1, keepdim=True)
        ds = p * (dp - d)
        dq = torch.matmul(ds, k) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q) * scale
        return dq, dk, dv, None, None


class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_head, layer, fault):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.c_proj.residual_out = True
        self.n_head = n_head
        self.layer = layer
        self.fault = fault

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        h = self.n_head
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        bits = self.fault.bits if self.fault.active(self.layer) else 0
        y = FlashLikeAttention.apply(q, k, v, bits, self.fault.on)
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.c_fc = nn.Linear(d, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, d, bias=False)
        self.c_proj.residual_out = True

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class MoE(nn.Module):
    """Top-k routed experts: `gate` (Linear d -> E) beside `experts`, as in
    Mixtral's block_sparse_moe. Every expert runs on every token and the
    top-k mask selects (tiny E: simpler than dispatch, same maths). Adds the
    Switch load-balancing loss to `self.aux` on each forward. shared=True
    adds one always-on expert (`shared_expert`, DeepSeekMoE's shared
    expert) whose output is added to the routed mixture."""

    def __init__(self, d, hidden, n_experts, top_k, shared=False):
        super().__init__()
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(d, hidden) for _ in range(n_experts))
        self.shared_expert = MLP(d, hidden) if shared else None
        self.num_experts = n_experts
        self.top_k = top_k
        self.aux = None

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        logits = self.gate(flat)
        probs = torch.softmax(logits, dim=-1)
        topv, topi = probs.topk(self.top_k, dim=-1)
        topv = topv / topv.sum(dim=-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(1, topi, topv)
        out = torch.stack([e(flat) for e in self.experts], dim=1)  # [N, E, d]
        y = (weights.unsqueeze(-1) * out).sum(dim=1)
        shared = getattr(self, "shared_expert", None)  # subclasses may not set it
        if shared is not None:
            y = y + shared(flat)
        frac = torch.zeros_like(probs).scatter(1, topi, 1.0).mean(0) / self.top_k
        self.aux = self.num_experts * (frac * probs.mean(0)).sum()
        return y.view(b, t, d)


class Block(nn.Module):
    def __init__(self, d, n_head, layer, fault, moe):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head, layer, fault)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MoE(d, d, moe[0], moe[1], *moe[2:]) if moe else MLP(d, 4 * d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """n_layer blocks of width d, n_head heads, context t. moe=(E, top_k)
    makes every block's MLP a routed MoE; moe=(E, top_k, True) adds a
    shared expert to each."""

    def __init__(self, vocab, d=64, n_layer=4, n_head=4, t=64, moe=None):
        super().__init__()
        self.fault = Fault()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(t, d)
        self.h = nn.ModuleList(Block(d, n_head, i, self.fault, moe) for i in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    def _init(self, m):
        # Fan-in scaling (std 1/sqrt(d_in)) keeps the random bulk of the
        # small weights comparable to what training adds; nanoGPT's fixed
        # 0.02 is that scale only for d ~ 2500, and at d = 64 it lets the
        # first learned directions dominate Wq/Wk (their Delta2 spectra then
        # look collapsed even when healthy). Residual-branch outputs get
        # GPT-2's extra 1/sqrt(2 n_layer).
        if isinstance(m, nn.Linear) and m is not self.lm_head:  # lm_head: tied to wte
            std = m.in_features ** -0.5
            if getattr(m, "residual_out", False):
                std /= math.sqrt(2 * len(self.h))
            nn.init.normal_(m.weight, mean=0.0, std=std)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        aux = [blk.mlp.aux for blk in self.h if isinstance(blk.mlp, MoE)]
        return loss, (sum(aux) / len(aux) if aux else None)


def load_corpus(path=None, max_bytes=4 << 20):
    """Character-level text: the file at `path`, or else Python's own
    standard library sources (always on a Debian python3 install), read in
    sorted order so every machine with the same Python gets the same text."""
    if path:
        with open(path, "rb") as f:
            raw = f.read(max_bytes)
    else:
        import sysconfig
        lib = sysconfig.get_paths()["stdlib"]
        raw, names = b"", sorted(n for n in os.listdir(lib) if n.endswith(".py"))
        for n in names:
            with open(os.path.join(lib, n), "rb") as f:
                raw += f.read()
            if len(raw) >= max_bytes:
                break
        raw = raw[:max_bytes]
    text = raw.decode("ascii", errors="ignore")
    chars = sorted(set(text))
    table = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([table[c] for c in text], dtype=torch.long)
    return data, len(chars)


class Batches:
    """Deterministic batches: batch i of a seed is the same for every run
    with that seed (healthy and faulty runs of a pair see the same data)."""

    def __init__(self, data, batch, t, seed):
        self.data, self.batch, self.t, self.seed = data, batch, t, seed

    def get(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ix = torch.randint(len(self.data) - self.t - 1, (self.batch,), generator=g)
        x = torch.stack([self.data[j:j + self.t] for j in ix.tolist()])
        y = torch.stack([self.data[j + 1:j + 1 + self.t] for j in ix.tolist()])
        return x, y
