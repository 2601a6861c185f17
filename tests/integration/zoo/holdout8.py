"""Held-out layouts, eighth blind round: hand-written research and training
code (what a team writes itself rather than a library's classes), written
without reading the discoverer (client/python/foreshock observe.py,
layouts.py, effective.py, monitor.py's discovery):

  split-gqa-baddbmm          one Linear for q/k/v split by torch.split with
                             uneven sizes (GQA 4/2), heads in self.nh and
                             self.nkv, scores by torch.baddbmm over a causal
                             mask, keys by repeat_interleave
  rawparam-xw-temperature    a raw nn.Parameter W [d, 3d] used as x @ W, the
                             head count in a config dict, q.k scaled by a
                             learned per-head temperature
  complex-rope-sdpa-global   wq/wk/wv, the head counts in module-level
                             constants, rotary by view_as_complex, SDPA with
                             is_causal and GQA by repeat_interleave
  alibi-window-shape-heads   no head count stored: heads = width // head_dim
                             read off the projection's output shape in
                             forward, ALiBi slopes computed there, a
                             sliding-window causal mask
  interleaved-hd3-heads      qkv Linear laid out "(h d three)" (an einops
                             rearrange written as view/permute), heads in
                             self.heads
  hand-moe-capacity-bincount a router as raw w_gate [d, E] used as
                             x @ self.w_gate, softmax, top-2, a capacity
                             factor, token dropping, torch.bincount load
  argsort-dispatch-moe       router Linear, top-2, tokens sorted by expert
                             with argsort, per-expert chunks by bincount
                             counts and split, index_add back
  top1-jitter-drop           Switch-style top-1 with multiplicative input
                             jitter in training, capacity and dropping
  fp32-router-bf16           a bf16 model whose router logits are computed in
                             float32 (F.linear(x.float(), w.float())), top-2
  gated-cnn-none             a gated convolutional LM (causal conv1d + GLU):
                             nothing
  relu-rownorm-attn-none     q.k^T through ReLU and a row normalization, no
                             softmax: nothing (as retnet-no-softmax)

Round 8b, written after seeing round 8's results:

  kv-first-uneven-split      in_proj output ordered [k; v; q] and split
                             unevenly (GQA 4/2), counts in a config dict,
                             keys permuted straight to [b, g, dh, t]
  inline-block-attention     nanoGPT-like, the attention written inline in
                             the block's forward (no attention module)
  layer-stacked-param        every layer's qkv in one Parameter [L, 3d, d],
                             F.linear(x, self.w_qkv[i]) in a loop, no
                             nn.Embedding (the pass waits for the first batch)
  einsum-argmax-top1         a raw [E, d] router applied by einsum on float32
                             copies, top-1 by argmax
  router-expert-major-logits w_gate @ x.T ([E, N]), softmax and top-k over
                             dim 0
  layer-stacked-router       every layer's router in one Parameter
                             [L, E, d], F.linear(x, self.w_router[i])
  kq-transposed-scores       scores as k @ q^T ([key, query]), the softmax
                             over dim -2, transposed before @ v
  kq-transposed-gqa          the same with GQA 4/2 (keys by repeat_interleave)

Score, blind (round 8, 11 members): 10 of 11 right on torch 1.13 and 2.15
(hand-moe-capacity-bincount wrong). Round 8b (8 members): 5 of 8 on both
torches (layer-stacked-param, kq-transposed-scores, kq-transposed-gqa
wrong). The four were in test_python_zoo.py's EXPECTED_FAILING with why;
discovery has since been fixed for all four (all 19 right on both torches).
Judgement calls: a raw
[d, E] router used as x @ w_gate is reported as its [E, d] transpose (as a
raw [d, 3d] attention weight is, t=True); slices of one stacked Parameter
are separate sites, one per layer, named by the parameter; in
kq-transposed-scores the query is the side the softmax does not normalize
over.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Attn, Router, Rows, Truth, heads_contiguous, heads_separate, member
from .parts import D, VOCAB, tokens

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")
N_HEADS = 4      # complex-rope-sdpa-global: the counts live here, not on the module
N_KV_HEADS = 2


class MLP(nn.Module):
    def __init__(self, d=D, f=64):
        super().__init__()
        self.fc1 = nn.Linear(d, f)
        self.fc2 = nn.Linear(f, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, attn, ff):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = attn
        self.ln2 = nn.LayerNorm(D)
        self.ff = ff

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ff(self.ln2(x))


class LM(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def causal(t):
    return torch.full((t, t), float("-inf")).triu(1)


def softmax_attend(q, k, v, scale, mask=None):
    w = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        w = w + mask
    return torch.matmul(w.softmax(-1), v)


# ---- one Linear split unevenly, baddbmm ----------------------------------------------------------

class SplitGqaAttention(nn.Module):
    def __init__(self, d=D, nh=4, nkv=2):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, d // nh
        self.wqkv = nn.Linear(d, (nh + 2 * nkv) * self.hd, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = torch.split(self.wqkv(x), [self.nh * self.hd, self.nkv * self.hd,
                                             self.nkv * self.hd], dim=-1)
        q = q.view(b, t, self.nh, self.hd).permute(0, 2, 1, 3)
        k = k.view(b, t, self.nkv, self.hd).permute(0, 2, 1, 3)
        v = v.view(b, t, self.nkv, self.hd).permute(0, 2, 1, 3)
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        qf = q.reshape(b * self.nh, t, self.hd)
        kf = k.reshape(b * self.nh, t, self.hd)
        mask = causal(t).expand(b * self.nh, t, t)
        s = torch.baddbmm(mask, qf, kf.transpose(1, 2), beta=1.0, alpha=self.hd ** -0.5)
        p = s.softmax(-1)
        o = torch.bmm(p, v.reshape(b * self.nh, t, self.hd)).view(b, self.nh, t, self.hd)
        return self.wo(o.permute(0, 2, 1, 3).reshape(b, t, -1))


@member("split-gqa-baddbmm")
def split_gqa_baddbmm():
    """Hand-written GQA: torch.split([H*dh, Hkv*dh, Hkv*dh]) of one Linear, baddbmm."""
    model = LM([Block(SplitGqaAttention(), MLP()) for _ in range(2)])
    att = [Attn(i, 4, 2, 8, *heads_contiguous(f"blocks.{i}.attn.wqkv.weight", 4, 2, 8),
                f"blocks.{i}.attn") for i in range(2)]
    return model, tokens(), Truth(att, not_reported=["blocks.0.ff.fc1.weight"])


# ---- raw [d, 3d] parameter, config dict, learned temperature -------------------------------------

class RawParamAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d = cfg["d_model"]
        self.W = nn.Parameter(torch.randn(d, 3 * d) * d ** -0.5)
        self.Wo = nn.Parameter(torch.randn(d, d) * d ** -0.5)
        self.temperature = nn.Parameter(torch.rand(cfg["n_head"], 1, 1) + 0.5)

    def forward(self, x):
        b, t, d = x.shape
        nh = self.cfg["n_head"]
        q, k, v = (x @ self.W).chunk(3, dim=-1)
        q = q.view(b, t, nh, d // nh).transpose(1, 2)
        k = k.view(b, t, nh, d // nh).transpose(1, 2)
        v = v.view(b, t, nh, d // nh).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * self.temperature
        att = att + causal(t)
        o = att.softmax(dim=-1) @ v
        return o.transpose(1, 2).reshape(b, t, d) @ self.Wo


@member("rawparam-xw-temperature")
def rawparam_temperature():
    """x @ W with W [d, 3d] a raw Parameter, cfg['n_head'], a learned per-head temperature."""
    cfg = {"d_model": D, "n_head": 4}
    model = LM([Block(RawParamAttention(cfg), MLP()) for _ in range(2)])
    att = [Attn(i, 4, 4, 8, *heads_contiguous(f"blocks.{i}.attn.W", 4, 4, 8, t=True),
                f"blocks.{i}.attn") for i in range(2)]
    return model, tokens(), Truth(att, not_reported=["blocks.0.attn.Wo"])


# ---- complex rotary, SDPA is_causal, counts in globals -------------------------------------------

def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    f = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(f), f)


def apply_rotary(x, freqs_cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)
    return out.type_as(x)


class GlobalCountAttention(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        hd = d // N_HEADS
        self.wq = nn.Linear(d, N_HEADS * hd, bias=False)
        self.wk = nn.Linear(d, N_KV_HEADS * hd, bias=False)
        self.wv = nn.Linear(d, N_KV_HEADS * hd, bias=False)
        self.wo = nn.Linear(N_HEADS * hd, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // N_HEADS
        q = self.wq(x).view(b, t, N_HEADS, hd)
        k = self.wk(x).view(b, t, N_KV_HEADS, hd)
        v = self.wv(x).view(b, t, N_KV_HEADS, hd)
        fc = precompute_freqs_cis(hd, t)
        q, k = apply_rotary(q, fc), apply_rotary(k, fc)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k = k.repeat_interleave(N_HEADS // N_KV_HEADS, dim=1)
        v = v.repeat_interleave(N_HEADS // N_KV_HEADS, dim=1)
        if HAS_SDPA:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = softmax_attend(q, k, v, hd ** -0.5, causal(t))
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


@member("complex-rope-sdpa-global")
def complex_rope_sdpa_global():
    """Counts in module constants, view_as_complex rotary, SDPA is_causal, repeat_interleave."""
    model = LM([Block(GlobalCountAttention(), MLP()) for _ in range(2)])
    att = []
    for i in range(2):
        qs, ks = heads_separate(f"blocks.{i}.attn.wq.weight", f"blocks.{i}.attn.wk.weight",
                                4, 2, 8)
        att.append(Attn(i, 4, 2, 8, qs, ks, f"blocks.{i}.attn"))
    return model, tokens(), Truth(att)


# ---- heads from shapes, ALiBi, sliding window ----------------------------------------------------

class ShapeHeadsAlibi(nn.Module):
    def __init__(self, d=D, head_dim=8, window=4):
        super().__init__()
        self.head_dim, self.window = head_dim, window
        self.to_q = nn.Linear(d, d, bias=False)
        self.to_k = nn.Linear(d, d, bias=False)
        self.to_v = nn.Linear(d, d, bias=False)
        self.to_out = nn.Linear(d, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        h = q.shape[-1] // self.head_dim
        q, k, v = (z.view(b, t, h, -1).permute(0, 2, 1, 3) for z in (q, k, v))
        slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)])
        pos = torch.arange(t)
        rel = (pos[None, :] - pos[:, None]).float()  # key - query, <= 0 below the diagonal
        bias = slopes[:, None, None] * rel[None]
        dist = pos[:, None] - pos[None, :]
        allowed = (dist >= 0) & (dist < self.window)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + bias
        s = s.masked_fill(~allowed, float("-inf"))
        o = s.softmax(-1) @ v
        return self.to_out(o.permute(0, 2, 1, 3).reshape(b, t, -1))


@member("alibi-window-shape-heads")
def alibi_window_shape_heads():
    """No head count stored: h = q.shape[-1] // head_dim in forward; ALiBi; a window mask."""
    model = LM([Block(ShapeHeadsAlibi(), MLP()) for _ in range(2)])
    att = []
    for i in range(2):
        qs, ks = heads_separate(f"blocks.{i}.attn.to_q.weight", f"blocks.{i}.attn.to_k.weight",
                                4, 4, 8)
        att.append(Attn(i, 4, 4, 8, qs, ks, f"blocks.{i}.attn"))
    return model, tokens(), Truth(att)


# ---- "(h d three)" fused layout ------------------------------------------------------------------

class InterleavedAttention(nn.Module):
    def __init__(self, d=D, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        # rearrange(qkv, 'b n (h d three) -> three b h n d', three=3, h=self.heads)
        qkv = self.qkv(x).view(b, n, self.heads, d // self.heads, 3).permute(4, 0, 2, 1, 3)
        q, k, v = qkv[0], qkv[1], qkv[2]
        o = softmax_attend(q, k, v, (d // self.heads) ** -0.5, causal(n))
        return self.proj(o.permute(0, 2, 1, 3).reshape(b, n, d))


@member("interleaved-hd3-heads")
def interleaved_hd3():
    """qkv features laid out (h, d, three): query head h is every third row from h*dh*3."""
    model = LM([Block(InterleavedAttention(), MLP()) for _ in range(2)])
    att = []
    for i in range(2):
        w = f"blocks.{i}.attn.qkv.weight"
        qs = [Rows(w, range(h * 24, (h + 1) * 24, 3)) for h in range(4)]
        ks = [Rows(w, range(h * 24 + 1, (h + 1) * 24, 3)) for h in range(4)]
        att.append(Attn(i, 4, 4, 8, qs, ks, f"blocks.{i}.attn"))
    return model, tokens(), Truth(att)


# ---- plain attention for the MoE members ---------------------------------------------------------

class HAttention(nn.Module):
    def __init__(self, d=D, h=4):
        super().__init__()
        self.h = h
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.h, d // self.h).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        s = torch.einsum("bhid,bhjd->bhij", q, k) * (d // self.h) ** -0.5 + causal(t).to(q.dtype)
        o = torch.einsum("bhij,bhjd->bhid", s.softmax(-1), v)
        return self.o(o.transpose(1, 2).reshape(b, t, d))


def h_attn(i):
    qs, ks = heads_separate(f"blocks.{i}.attn.q.weight", f"blocks.{i}.attn.k.weight", 4, 4, 8)
    return Attn(i, 4, 4, 8, qs, ks, f"blocks.{i}.attn")


class Experts(nn.Module):
    def __init__(self, e, d=D, f=16):
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, f), nn.ReLU(), nn.Linear(f, d))
                                     for _ in range(e))


# ---- raw w_gate, capacity, dropping, bincount ----------------------------------------------------

class CapacityMoE(Experts):
    def __init__(self, e=6, k=2, capacity_factor=1.25):
        super().__init__(e)
        self.n_exp, self.top_k, self.capacity_factor = e, k, capacity_factor
        self.w_gate = nn.Parameter(torch.randn(D, e) * D ** -0.5)
        self.aux = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n = x.shape[0]
        probs = (x @ self.w_gate).softmax(dim=-1)
        topv, topi = probs.topk(self.top_k, dim=-1)
        topv = topv / topv.sum(-1, keepdim=True)
        load = torch.bincount(topi.flatten(), minlength=self.n_exp).float() / (n * self.top_k)
        self.aux = (load * probs.mean(0)).sum() * self.n_exp
        cap = int(math.ceil(self.capacity_factor * n * self.top_k / self.n_exp))
        onehot = F.one_hot(topi.t().reshape(-1), self.n_exp)  # slot-major: first choices first
        pos = (onehot.cumsum(0) - 1) * onehot
        keep = ((pos < cap) & (onehot > 0)).any(-1).view(self.top_k, n).t()
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            hit = (topi == e) & keep
            rows, slot = hit.nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, ex(x[rows]) * topv[rows, slot, None])
        return out.view(shape)


@member("hand-moe-capacity-bincount")
def hand_moe_capacity():
    """x @ self.w_gate (raw [d, E]), softmax, top-2, capacity factor 1.25, dropping, bincount."""
    model = LM([Block(HAttention(), CapacityMoE()) for _ in range(2)])
    att = [h_attn(i) for i in range(2)]
    rts = [Router(i, 6, 2, Rows(f"blocks.{i}.ff.w_gate", range(6), t=True), f"blocks.{i}.ff")
           for i in range(2)]
    return model, tokens(), Truth(att, rts, not_reported=["blocks.0.ff.experts.0.0.weight"])


# ---- argsort dispatch ----------------------------------------------------------------------------

class ArgsortMoE(Experts):
    def __init__(self, e=8, k=2):
        super().__init__(e)
        self.num_experts, self.k = e, k
        self.router = nn.Linear(D, e, bias=False)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        w, idx = torch.topk(logits, self.k, dim=-1)
        w = F.softmax(w, dim=-1)
        flat = idx.reshape(-1)
        order = torch.argsort(flat)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tok = order // self.k
        chunks = torch.split(x[tok], counts)
        ys = [self.experts[e](c) for e, c in enumerate(chunks)]
        y = torch.cat(ys, 0) * w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, tok, y).view(shape)


@member("argsort-dispatch-moe")
def argsort_dispatch():
    """Router Linear, topk then softmax over the k, argsort by expert, bincount counts, split."""
    model = LM([Block(HAttention(), ArgsortMoE()) for _ in range(2)])
    att = [h_attn(i) for i in range(2)]
    rts = [Router(i, 8, 2, Rows(f"blocks.{i}.ff.router.weight", range(8)), f"blocks.{i}.ff")
           for i in range(2)]
    return model, tokens(), Truth(att, rts)


# ---- top-1, jitter, capacity ---------------------------------------------------------------------

class JitterTop1(Experts):
    def __init__(self, e=4, jitter=0.01, capacity_factor=1.0):
        super().__init__(e)
        self.e, self.jitter, self.cf = e, jitter, capacity_factor
        self.switch = nn.Linear(D, e)

    def forward(self, x):
        b, t, d = x.shape
        x = x.reshape(-1, d)
        xr = x
        if self.training and self.jitter > 0:
            xr = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        probs = F.softmax(self.switch(xr), dim=-1)
        p, route = probs.max(dim=-1)
        cap = int(self.cf * x.shape[0] / self.e) + 1
        out = x.clone()  # dropped tokens pass through
        for e, ex in enumerate(self.experts):
            rows = torch.nonzero(route == e).flatten()[:cap]
            if rows.numel():
                out[rows] = ex(x[rows]) * p[rows, None]
        return out.view(b, t, d)


@member("top1-jitter-drop")
def top1_jitter():
    """Switch-style top-1 (max of softmax), input jitter in training, capacity, pass-through."""
    model = LM([Block(HAttention(), JitterTop1()) for _ in range(2)])
    att = [h_attn(i) for i in range(2)]
    rts = [Router(i, 4, 1, Rows(f"blocks.{i}.ff.switch.weight", range(4)), f"blocks.{i}.ff")
           for i in range(2)]
    return model, tokens(), Truth(att, rts)


# ---- float32 router logits in a bf16 model -------------------------------------------------------

class Fp32RouterMoE(Experts):
    def __init__(self, e=8, k=2):
        super().__init__(e)
        self.n_routed, self.k = e, k
        self.gate = nn.Linear(D, e, bias=False)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(-1)
        wts, ids = scores.topk(self.k, -1)
        wts = (wts / wts.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.n_routed):
            r, s = (ids == e).nonzero(as_tuple=True)
            if r.numel():
                out[r] += self.experts[e](x[r]) * wts[r, s, None]
        return out.view(shape)


@member("fp32-router-bf16")
def fp32_router_bf16():
    """The model in bfloat16; router logits F.linear(x.float(), gate.weight.float()), top-2."""
    model = LM([Block(HAttention(), Fp32RouterMoE()) for _ in range(2)]).to(torch.bfloat16)
    att = [h_attn(i) for i in range(2)]
    rts = [Router(i, 8, 2, Rows(f"blocks.{i}.ff.gate.weight", range(8)), f"blocks.{i}.ff")
           for i in range(2)]
    return model, tokens(), Truth(att, rts)


# ---- negatives -----------------------------------------------------------------------------------

class GatedConvBlock(nn.Module):
    def __init__(self, d=D, k=4):
        super().__init__()
        self.k = k
        self.conv = nn.Conv1d(d, 2 * d, k)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):  # [B, T, d]
        h = F.pad(self.norm(x).transpose(1, 2), (self.k - 1, 0))
        return x + F.glu(self.conv(h), dim=1).transpose(1, 2)


class GatedCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(GatedConvBlock() for _ in range(3))
        self.out = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


@member("gated-cnn-none")
def gated_cnn():
    """Dauphin et al.-style gated conv LM: causal conv1d + GLU. No attention, no router."""
    return GatedCNN(), tokens(), Truth([], not_reported=["layers.0.conv.weight"])


class ReluRowNorm(nn.Module):
    def __init__(self, d=D, h=4):
        super().__init__()
        self.h = h
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.h, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.relu(q @ k.transpose(-2, -1)) * torch.ones(t, t).tril()
        a = a / (a.sum(-1, keepdim=True) + 1e-6)
        return self.o((a @ v).transpose(1, 2).reshape(b, t, d))


@member("relu-rownorm-attn-none")
def relu_rownorm():
    """relu(q k^T), causal, divided by its row sum: no softmax, so no attention site."""
    model = LM([Block(ReluRowNorm(), MLP()) for _ in range(2)])
    return model, tokens(), Truth([], not_reported=["blocks.0.attn.q.weight",
                                                    "blocks.0.attn.k.weight"])


# ---- round 8b, written after seeing round 8's results --------------------------------------------

class KvFirstAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d, dh = cfg["dim"], cfg["dim"] // cfg["heads"]
        self.in_proj = nn.Linear(d, (cfg["heads"] + 2 * cfg["kv_heads"]) * dh)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        h, g = self.cfg["heads"], self.cfg["kv_heads"]
        dh = d // h
        k, v, q = self.in_proj(x).split([g * dh, g * dh, h * dh], dim=-1)
        q = q.view(b, t, h, dh).permute(0, 2, 1, 3)
        k = k.view(b, t, g, dh).permute(0, 2, 3, 1)  # [b, g, dh, t]: ready for q @ k
        v = v.view(b, t, g, dh).permute(0, 2, 1, 3)
        k = k.repeat_interleave(h // g, dim=1)
        v = v.repeat_interleave(h // g, dim=1)
        s = (q @ k) / math.sqrt(dh) + causal(t)
        o = s.softmax(-1) @ v
        return self.out_proj(o.permute(0, 2, 1, 3).reshape(b, t, d))


@member("kv-first-uneven-split")
def kv_first():
    """in_proj output ordered [k; v; q], split([Hkv*dh, Hkv*dh, H*dh]); counts in a cfg dict."""
    cfg = {"dim": D, "heads": 4, "kv_heads": 2}
    model = LM([Block(KvFirstAttention(cfg), MLP()) for _ in range(2)])
    att = []
    for i in range(2):
        w = f"blocks.{i}.attn.in_proj.weight"
        qs = [Rows(w, range(32 + h * 8, 32 + (h + 1) * 8)) for h in range(4)]
        ks = [Rows(w, range(g * 8, (g + 1) * 8)) for g in range(2)]
        att.append(Attn(i, 4, 2, 8, qs, ks, f"blocks.{i}.attn"))
    return model, tokens(), Truth(att)


class InlineBlock(nn.Module):
    """nanoGPT-like block with the attention written inline in the block's forward."""

    def __init__(self, d=D, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        if HAS_SDPA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = softmax_attend(q, k, v, (d // self.n_head) ** -0.5, causal(t))
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.c_out(F.gelu(self.c_fc(self.ln_2(x))))


@member("inline-block-attention")
def inline_block():
    """Attention inline in the block's forward (no attention module), n_head on the block."""
    model = LM([InlineBlock() for _ in range(2)])
    att = [Attn(i, 4, 4, 8, *heads_contiguous(f"blocks.{i}.c_attn.weight", 4, 4, 8),
                f"blocks.{i}") for i in range(2)]
    return model, tokens(), Truth(att, not_reported=["blocks.0.c_fc.weight"])


class StackedParamLM(nn.Module):
    """Every layer's weights in one Parameter per kind, [L, ...], indexed in a loop."""

    def __init__(self, n_layer=2, d=D):
        super().__init__()
        self.emb = nn.Parameter(torch.randn(VOCAB, d) * 0.1)
        self.w_qkv = nn.Parameter(torch.randn(n_layer, 3 * d, d) * d ** -0.5)
        self.w_o = nn.Parameter(torch.randn(n_layer, d, d) * d ** -0.5)
        self.w_up = nn.Parameter(torch.randn(n_layer, 4 * d, d) * d ** -0.5)
        self.w_down = nn.Parameter(torch.randn(n_layer, d, 4 * d) * (4 * d) ** -0.5)
        self.n_layer = n_layer

    def forward(self, idx):
        x = F.embedding(idx, self.emb)
        b, t, d = x.shape
        for i in range(self.n_layer):
            hdn = F.layer_norm(x, (d,))
            q, k, v = F.linear(hdn, self.w_qkv[i]).chunk(3, -1)
            q, k, v = (z.view(b, t, N_HEADS, -1).transpose(1, 2) for z in (q, k, v))
            o = softmax_attend(q, k, v, (d // N_HEADS) ** -0.5, causal(t))
            x = x + F.linear(o.transpose(1, 2).reshape(b, t, d), self.w_o[i])
            x = x + F.linear(F.gelu(F.linear(F.layer_norm(x, (d,)), self.w_up[i])),
                             self.w_down[i])
        return x @ self.emb.t()


@member("layer-stacked-param")
def layer_stacked():
    """One Parameter w_qkv [L, 3d, d] for all layers, F.linear(x, self.w_qkv[i]) in a loop."""
    model = StackedParamLM()
    att = []
    for i in range(2):
        base = i * 3 * D
        qs = [Rows("w_qkv", range(base + h * 8, base + (h + 1) * 8)) for h in range(4)]
        ks = [Rows("w_qkv", range(base + D + h * 8, base + D + (h + 1) * 8)) for h in range(4)]
        att.append(Attn(i, 4, 4, 8, qs, ks, "w_qkv"))
    return model, tokens(), Truth(att, not_reported=["w_up"])


class EinsumTop1(Experts):
    def __init__(self, e=4):
        super().__init__(e)
        self.router = nn.Parameter(torch.randn(e, D) * D ** -0.5)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = torch.einsum("nd,ed->ne", x.float(), self.router.float())
        gate = logits.softmax(-1)
        choice = gate.argmax(-1)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            m = choice == e
            if m.any():
                out[m] = ex(x[m]) * gate[m, e, None].to(x.dtype)
        return out.view(shape)


@member("einsum-argmax-top1")
def einsum_top1():
    """Router a raw [E, d] Parameter applied by einsum on float32 copies; top-1 by argmax."""
    model = LM([Block(HAttention(), EinsumTop1()) for _ in range(2)])
    att = [h_attn(i) for i in range(2)]
    rts = [Router(i, 4, 1, Rows(f"blocks.{i}.ff.router", range(4)), f"blocks.{i}.ff")
           for i in range(2)]
    return model, tokens(), Truth(att, rts)


class ExpertMajorRouterMoE(Experts):
    """Logits computed expert-major: w_gate [E, d] @ x^T -> [E, N], softmax and top-k over dim 0."""

    def __init__(self, e=6, k=2):
        super().__init__(e)
        self.k = k
        self.w_gate = nn.Parameter(torch.randn(e, D) * D ** -0.5)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.w_gate @ x.t()  # [E, N]
        probs = logits.softmax(dim=0)
        w, idx = probs.topk(self.k, dim=0)  # [k, N]
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            slot, rows = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, ex(x[rows]) * w[slot, rows, None])
        return out.view(shape)


@member("router-expert-major-logits")
def router_expert_major():
    """Router logits as w_gate @ x.T ([E, N]), softmax and topk over dim 0."""
    model = LM([Block(HAttention(), ExpertMajorRouterMoE()) for _ in range(2)])
    att = [h_attn(i) for i in range(2)]
    rts = [Router(i, 6, 2, Rows(f"blocks.{i}.ff.w_gate", range(6)), f"blocks.{i}.ff")
           for i in range(2)]
    return model, tokens(), Truth(att, rts)


class StackedRouterLM(nn.Module):
    """Attention weights one Parameter per layer (ParameterList); every layer's router in
    one Parameter w_router [L, E, d], indexed in the loop; experts batched [L, E, f, d]."""

    def __init__(self, n_layer=2, d=D, e=4, k=2):
        super().__init__()
        self.n_layer, self.e, self.k = n_layer, e, k
        self.emb = nn.Embedding(VOCAB, d)
        self.w_qkv = nn.ParameterList(nn.Parameter(torch.randn(3 * d, d) * d ** -0.5)
                                      for _ in range(n_layer))
        self.w_router = nn.Parameter(torch.randn(n_layer, e, d) * d ** -0.5)
        self.w1 = nn.Parameter(torch.randn(n_layer, e, 16, d) * d ** -0.5)
        self.w2 = nn.Parameter(torch.randn(n_layer, e, d, 16) * 0.25)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        b, t, d = x.shape
        for i in range(self.n_layer):
            hdn = F.layer_norm(x, (d,))
            q, k, v = F.linear(hdn, self.w_qkv[i]).chunk(3, -1)
            q, k, v = (z.view(b, t, 4, -1).transpose(1, 2) for z in (q, k, v))
            o = softmax_attend(q, k, v, 8 ** -0.5, causal(t))
            x = x + o.transpose(1, 2).reshape(b, t, d)
            hx = F.layer_norm(x, (d,)).reshape(-1, d)
            probs = F.linear(hx, self.w_router[i]).softmax(-1)
            w, ids = probs.topk(self.k, -1)
            y = torch.zeros_like(hx)
            for e in range(self.e):
                r, s = (ids == e).nonzero(as_tuple=True)
                if r.numel():
                    he = F.linear(F.silu(F.linear(hx[r], self.w1[i, e])), self.w2[i, e])
                    y = y.index_add(0, r, he * w[r, s, None])
            x = x + y.view(b, t, d)
        return self.head(x)


@member("layer-stacked-router")
def layer_stacked_router():
    """Routers of all layers in one Parameter w_router [L, E, d], F.linear(x, w_router[i])."""
    model = StackedRouterLM()
    att = []
    for i in range(2):
        p = f"w_qkv.{i}"
        att.append(Attn(i, 4, 4, 8, [Rows(p, range(h * 8, (h + 1) * 8)) for h in range(4)],
                        [Rows(p, range(D + h * 8, D + (h + 1) * 8)) for h in range(4)], p))
    rts = [Router(i, 4, 2, Rows("w_router", range(i * 4, (i + 1) * 4)), "w_router")
           for i in range(2)]
    return model, tokens(), Truth(att, rts)


class KqAttention(HAttention):
    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.h, d // self.h).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        s = (k @ q.transpose(-2, -1)) * (d // self.h) ** -0.5  # [b, h, key, query]
        s = s + causal(t).t()
        p = s.softmax(dim=-2)
        o = p.transpose(-2, -1) @ v
        return self.o(o.transpose(1, 2).reshape(b, t, d))


@member("kq-transposed-scores")
def kq_transposed():
    """Scores as k @ q^T ([key, query]), softmax over dim -2, transposed before @ v."""
    model = LM([Block(KqAttention(), MLP()) for _ in range(2)])
    return model, tokens(), Truth([h_attn(i) for i in range(2)])


class KqGqaAttention(nn.Module):
    def __init__(self, d=D, h=4, g=2):
        super().__init__()
        self.h, self.g = h, g
        self.q = nn.Linear(d, h * 8, bias=False)
        self.k = nn.Linear(d, g * 8, bias=False)
        self.v = nn.Linear(d, g * 8, bias=False)
        self.o = nn.Linear(h * 8, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.h, 8).transpose(1, 2)
        k, v = (f(x).view(b, t, self.g, 8).transpose(1, 2).repeat_interleave(self.h // self.g, 1)
                for f in (self.k, self.v))
        s = (k @ q.transpose(-2, -1)) * 8 ** -0.5 + causal(t).t()  # [b, h, key, query]
        o = s.softmax(dim=-2).transpose(-2, -1) @ v
        return self.o(o.transpose(1, 2).reshape(b, t, -1))


@member("kq-transposed-gqa")
def kq_transposed_gqa():
    """kq-transposed-scores with GQA 4/2 (keys by repeat_interleave)."""
    model = LM([Block(KqGqaAttention(), MLP()) for _ in range(2)])
    att = []
    for i in range(2):
        qs, ks = heads_separate(f"blocks.{i}.attn.q.weight", f"blocks.{i}.attn.k.weight", 4, 2, 8)
        att.append(Attn(i, 4, 2, 8, qs, ks, f"blocks.{i}.attn"))
    return model, tokens(), Truth(att)
