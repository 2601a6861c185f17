"""Discovery by observation (client/python/foreshock/observe.py): small
layouts written here whose attention and routers names cannot find or get
wrong, each run through foreshock.discover(model) with no other argument
(a probe batch) and through Monitor (no daemon: a RecordingTransport).

For every member the test asserts exactly
  - the attention specs: (layer, H, Hkv, dh, head_offset), and each query
    head's and key head's rows as get() returns them, against the rows the
    test slices by hand from the weights (einsum parameters, fused
    in_proj, grouped layouts included);
  - the routers: (layer, E, top_k) and that get() is the weight;
  - what the summary says (observed, skipped with the fix, not routers)
    and its level: WARNING exactly when a site is not monitored.
Then: the pass leaves no trace (RNG states, BatchNorm statistics, train
mode, hooks, tensor attributes), Monitor(example_input=) observes at
construction, a model no probe batch fits is observed at the first step()
on the user's batch (also against the real daemon, which then takes every
report), and a sketch step runs on what was found.
"""
import logging
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fstest  # noqa: E402
from fstest import check  # noqa: E402


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def zoo(torch, nn, F):
    """[(name, build() -> model, expectations)]. model.expect_() gives
    [(layer, H, Hkv, dh, head_offset, [q rows per head], [k rows per head])]
    and model.routers_() [(layer, E, top_k, weight)]."""
    import numpy as np
    members = []

    def member(name, **exp):
        def deco(build):
            members.append((name, build, exp))
            return build
        return deco

    def split_rows(w, n, dh, start=0):
        return [w[start + i * dh:start + (i + 1) * dh] for i in range(n)]

    def rot_half(t):
        a, b = t.chunk(2, -1)
        return torch.cat([-b, a], -1)

    def rope(t, pos_dim=-2):
        n, dh = t.shape[pos_dim], t.shape[-1]
        ang = torch.arange(n, dtype=t.dtype)[:, None] * torch.arange(1, dh + 1,
                                                                     dtype=t.dtype)[None]
        return t * ang.cos() + rot_half(t) * ang.sin()

    def causal_softmax(s):
        t = s.shape[-1]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        return s.masked_fill(mask, float("-inf")).softmax(dim=-1)

    class Embed(nn.Module):
        """Token embedding, blocks, final norm: a decoder-only LM."""

        def __init__(self, blocks, d=32, vocab=40):
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(blocks)
            self.norm = nn.LayerNorm(d)

        def forward(self, ids):
            x = self.wte(ids)
            for b in self.blocks:
                x = b(x)
            return self.norm(x)

    # 1. Unknown names: to_queries / to_keys / to_values, head count in self.h,
    # GQA by repeat_interleave, q/k LayerNorm over head_dim, rotary.
    class ToQueries(nn.Module):
        def __init__(self, d, h, kv):
            super().__init__()
            self.h, self.g, self.dh = h, kv, d // h
            self.to_queries = nn.Linear(d, h * self.dh, bias=False)
            self.to_keys = nn.Linear(d, kv * self.dh, bias=False)
            self.to_values = nn.Linear(d, kv * self.dh, bias=False)
            self.qn, self.kn = nn.LayerNorm(self.dh), nn.LayerNorm(self.dh)
            self.out = nn.Linear(d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q = self.qn(self.to_queries(x).view(b, t, self.h, self.dh)).transpose(1, 2)
            k = self.kn(self.to_keys(x).view(b, t, self.g, self.dh)).transpose(1, 2)
            v = self.to_values(x).view(b, t, self.g, self.dh).transpose(1, 2)
            q, k = rope(q), rope(k)
            k = k.repeat_interleave(self.h // self.g, dim=1)
            v = v.repeat_interleave(self.h // self.g, dim=1)
            a = causal_softmax(q @ k.transpose(-2, -1) / math.sqrt(self.dh))
            return x + self.out((a @ v).transpose(1, 2).reshape(b, t, -1))

    @member("unknown names to_queries/to_keys, self.h, GQA, qk-norm, rotary",
            says=["observed (matmul)"], not_says=["SKIPPED"], level=logging.INFO)
    def to_queries():
        m = Embed([ToQueries(32, 8, 2) for _ in range(2)])
        m.expect_ = lambda: [(i, 8, 2, 4, 0, split_rows(b.to_queries.weight, 8, 4),
                              split_rows(b.to_keys.weight, 2, 4))
                             for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: []
        return m

    # 2. Block-level fused projection `att_proj` (OLMo-style), attention in the
    # block itself, MQA: one key head broadcast by matmul.
    class AttProjBlock(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.n, self.dh = h, d // h
            self.att_proj = nn.Linear(d, d + 2 * self.dh)
            self.attn_out = nn.Linear(d, d)
            self.ff_proj = nn.Linear(d, 2 * d)
            self.ff_out = nn.Linear(d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.att_proj(x).split([d, self.dh, self.dh], dim=-1)
            q = q.view(b, t, self.n, self.dh).permute(0, 2, 1, 3)
            k = k.view(b, t, 1, self.dh).permute(0, 2, 1, 3)
            v = v.view(b, t, 1, self.dh).permute(0, 2, 1, 3)
            a = causal_softmax(torch.matmul(q, k.transpose(2, 3)) * self.dh ** -0.5)
            x = x + self.attn_out(torch.matmul(a, v).permute(0, 2, 1, 3).reshape(b, t, d))
            g, u = self.ff_proj(x).chunk(2, -1)
            return x + self.ff_out(F.silu(g) * u)

    @member("block-level att_proj, MQA broadcast", says=["observed (matmul)"],
            not_says=["SKIPPED"], level=logging.INFO)
    def att_proj():
        m = Embed([AttProjBlock(32, 4) for _ in range(3)])
        m.expect_ = lambda: [(i, 4, 1, 8, 0, split_rows(b.att_proj.weight, 4, 8),
                              split_rows(b.att_proj.weight, 1, 8, 32))
                             for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: []
        return m

    # 3. Raw Parameters through einsum: Wq, Wk [d, H, dh], score by einsum.
    class EinsumAttn(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.dh = d // h
            self.wq = nn.Parameter(torch.randn(d, h, self.dh) / d ** 0.5)
            self.wk = nn.Parameter(torch.randn(d, h, self.dh) / d ** 0.5)
            self.wv = nn.Parameter(torch.randn(d, h, self.dh) / d ** 0.5)
            self.wo = nn.Parameter(torch.randn(h, self.dh, d) / d ** 0.5)

        def forward(self, x):
            q = torch.einsum("btd,dhk->bhtk", x, self.wq)
            k = torch.einsum("btd,dhk->bhtk", x, self.wk)
            v = torch.einsum("btd,dhk->bthk", x, self.wv)
            s = torch.einsum("bhqk,bhsk->bhqs", q, k) / math.sqrt(self.dh)
            a = causal_softmax(s)
            return x + torch.einsum("bhqs,bshk,hkd->bqd", a, v, self.wo)

    def einsum_rows(p, h):
        return p[:, h, :].t()

    @member("raw Parameters through einsum", says=["observed (einsum)"],
            not_says=["SKIPPED"], level=logging.INFO)
    def einsum_params():
        m = Embed([EinsumAttn(32, 4) for _ in range(2)])
        m.expect_ = lambda: [(i, 4, 4, 8, 0, [einsum_rows(b.wq, h) for h in range(4)],
                              [einsum_rows(b.wk, h) for h in range(4)])
                             for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: []
        return m

    # 4. in_proj_weight on a module that is not nn.MultiheadAttention
    # (xformers-style), sliced per projection; and an nn.MultiheadAttention.
    class InProj(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.nh, self.d = h, d
            self.in_proj_weight = nn.Parameter(torch.randn(3 * d, d) / d ** 0.5)
            self.in_proj_bias = nn.Parameter(torch.zeros(3 * d))
            self.mha = nn.MultiheadAttention(d, h, batch_first=True)

        def forward(self, x):
            b, t, d = x.shape
            w, bias = self.in_proj_weight, self.in_proj_bias
            q = F.linear(x, w[:d], bias[:d]).reshape(b, t, self.nh, -1).transpose(1, 2)
            k = F.linear(x, w[d:2 * d], bias[d:2 * d]).reshape(b, t, self.nh, -1).transpose(1, 2)
            v = F.linear(x, w[2 * d:], bias[2 * d:]).reshape(b, t, self.nh, -1).transpose(1, 2)
            a = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / 8 ** 0.5, dim=-1)
            x = x + torch.matmul(a, v).transpose(1, 2).reshape(b, t, d)
            return x + self.mha(x, x, x, need_weights=False)[0]

    @member("in_proj_weight on a non-MHA module, then nn.MultiheadAttention in one block",
            says=["observed (matmul)", "nn.MultiheadAttention.num_heads; confirmed by the "
                  "observed pass"], not_says=["SKIPPED"], level=logging.INFO)
    def in_proj():
        m = Embed([InProj(32, 4) for _ in range(2)])
        m.expect_ = lambda: [e for i, b in enumerate(m.blocks) for e in (
            (2 * i, 4, 4, 8, 0, split_rows(b.in_proj_weight, 4, 8),
             split_rows(b.in_proj_weight, 4, 8, 32)),
            (2 * i + 1, 4, 4, 8, 0, split_rows(b.mha.in_proj_weight, 4, 8),
             split_rows(b.mha.in_proj_weight, 4, 8, 32)))]
        m.routers_ = lambda: []
        return m

    # 5. nanoGPT with the head count in `self.h` (names find c_attn but not H).
    class NanoAttn(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.c_attn(x).split(d, dim=2)
            q = q.view(b, t, self.h, d // self.h).transpose(1, 2)
            k = k.view(b, t, self.h, d // self.h).transpose(1, 2)
            v = v.view(b, t, self.h, d // self.h).transpose(1, 2)
            if hasattr(F, "scaled_dot_product_attention"):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                y = causal_softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.h)) @ v
            return x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))

    @member("nanoGPT, head count in self.h, SDPA on torch 2 (matmul on 1.13)",
            says=["observed"], not_says=["SKIPPED"], level=logging.INFO)
    def nano_h():
        m = Embed([NanoAttn(32, 4) for _ in range(2)])
        m.expect_ = lambda: [(i, 4, 4, 8, 0, split_rows(b.c_attn.weight, 4, 8),
                              split_rows(b.c_attn.weight, 4, 8, 32))
                             for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: []
        return m

    # 6. Interleaved rotary through complex numbers (Meta LLaMA), GQA by
    # expand + reshape, names wq/wk with a stale n_heads attribute: names give
    # the wrong count, observation corrects it.
    class MetaAttn(nn.Module):
        def __init__(self, d, h, kv):
            super().__init__()
            self.n_heads = 4  # stale: forward uses self.heads_used
            self.heads_used, self.kv, self.dh = h, kv, d // h
            self.wq = nn.Linear(d, h * self.dh, bias=False)
            self.wk = nn.Linear(d, kv * self.dh, bias=False)
            self.wv = nn.Linear(d, kv * self.dh, bias=False)
            self.wo = nn.Linear(h * self.dh, d, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            h, kv, dh = self.heads_used, self.kv, self.dh
            q = self.wq(x).view(b, t, h, dh)
            k = self.wk(x).view(b, t, kv, dh)
            v = self.wv(x).view(b, t, kv, dh)
            ang = torch.arange(t)[:, None].float() * torch.arange(dh // 2)[None].float()
            fr = torch.polar(torch.ones_like(ang), ang)[None, :, None, :]
            q = torch.view_as_real(torch.view_as_complex(q.float().reshape(b, t, h, -1, 2))
                                   * fr).flatten(3)
            k = torch.view_as_real(torch.view_as_complex(k.float().reshape(b, t, kv, -1, 2))
                                   * fr).flatten(3)
            rep = h // kv
            k = k[:, :, :, None, :].expand(b, t, kv, rep, dh).reshape(b, t, h, dh)
            v = v[:, :, :, None, :].expand(b, t, kv, rep, dh).reshape(b, t, h, dh)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(dh)
            a = F.softmax(s.float(), dim=-1).type_as(q)
            return x + self.wo(torch.matmul(a, v).transpose(1, 2).reshape(b, t, -1))

    @member("Meta LLaMA complex rotary, expand GQA, stale n_heads",
            says=["corrected by observation", "names gave H=4 Hkv=1 dh=8", "gives H=8 Hkv=2 dh=4"],
            not_says=["SKIPPED"], level=logging.INFO)
    def meta():
        m = Embed([MetaAttn(32, 8, 2) for _ in range(2)])
        m.expect_ = lambda: [(i, 8, 2, 4, 0, split_rows(b.wq.weight, 8, 4),
                              split_rows(b.wk.weight, 2, 4)) for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: []
        return m

    # 7. Routers named `selector`: top-1 by argmax, top-2 by topk(2), topk(self.k)
    # with k = 3, and a sigmoid router (DeepSeek-V3 style scores + bias).
    class SelMoE(nn.Module):
        def __init__(self, d, e, k, how):
            super().__init__()
            self.selector = nn.Linear(d, e, bias=False)
            self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(e)])
            self.kk, self.how = k, how
            self.register_buffer("bias_e", torch.zeros(e))

        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            logits = self.selector(x)
            if self.how == "argmax":
                probs = logits.softmax(-1)
                idx = probs.argmax(dim=-1, keepdim=True)
                self.picked = torch.argmax(probs, dim=-1)  # again, for statistics
            elif self.how == "gshard":  # top-2 as two argmaxes, the first masked
                first = torch.argmax(logits, dim=1)
                mask = F.one_hot(first, num_classes=logits.shape[-1]).bool()
                second = torch.argmax(logits.masked_fill(mask, float("-inf")), dim=1)
                idx = torch.stack([first, second], dim=-1)
            elif self.how == "sigmoid":
                idx = (torch.sigmoid(logits) + self.bias_e).topk(self.kk, dim=-1).indices
            elif self.how.startswith("kth"):  # a mask at the k-th largest: >= or > (reversed)
                e_n = logits.shape[-1]
                probs = logits.softmax(-1)
                if self.how == "kth-ge":
                    chosen = probs >= probs.kthvalue(e_n - self.kk + 1, dim=-1, keepdim=True).values
                else:
                    chosen = logits.kthvalue(e_n - self.kk, dim=-1).values.unsqueeze(-1) < logits
            else:
                _, idx = torch.topk(F.softmax(logits, dim=1), self.kk, dim=-1)
            out = torch.zeros_like(x)
            for e, ex in enumerate(self.experts):
                if self.how.startswith("kth"):  # weighted by the mask, no indexing
                    out = out + ex(x) * chosen.select(-1, e).unsqueeze(-1)
                    continue
                rows = (idx == e).any(dim=-1)
                out[rows] += ex(x[rows])
            return out.reshape(shape)

    class Block(nn.Module):
        def __init__(self, attn, ff):
            super().__init__()
            self.attn, self.ff = attn, ff

        def forward(self, x):
            return x + self.ff(self.attn(x))

    @member("routers named selector: argmax top-1, topk(2), topk(3), sigmoid top-2, "
            "GShard top-2 by two argmaxes, top-2 / top-3 as masks at a kthvalue (>=, reversed >)",
            says=["observed: softmax then argmax over its 4 outputs",
                  "observed: sigmoid then topk over its 6 outputs"], not_says=["SKIPPED",
                                                                              "assumed"],
            level=logging.INFO)
    def selector():
        hows = [(4, 1, "argmax"), (4, 2, "topk"), (8, 3, "topk"), (6, 2, "sigmoid"),
                (4, 2, "gshard"), (8, 2, "kth-ge"), (6, 3, "kth-lt")]
        m = Embed([Block(ToQueries(32, 4, 4), SelMoE(32, e, k, how)) for e, k, how in hows])
        m.expect_ = lambda: [(i, 4, 4, 8, 0, split_rows(b.attn.to_queries.weight, 4, 8),
                              split_rows(b.attn.to_keys.weight, 4, 8))
                             for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: [(i, e, k, b.ff.selector.weight)
                              for i, ((e, k, _), b) in enumerate(zip(hows, m.blocks))]
        return m

    # 8. A dense model with a per-head output gate `gate = Linear(d, H)` and
    # sigmoid: names take it for a router, the pass sees no topk.
    class GatedAttn(ToQueries):
        def __init__(self, d, h):
            super().__init__(d, h, h)
            self.gate = nn.Linear(d, h)

        def forward(self, x):
            b, t, _ = x.shape
            q = self.to_queries(x).view(b, t, self.h, self.dh).transpose(1, 2)
            k = self.to_keys(x).view(b, t, self.h, self.dh).transpose(1, 2)
            v = self.to_values(x).view(b, t, self.h, self.dh).transpose(1, 2)
            y = causal_softmax(q @ k.transpose(-2, -1)) @ v
            y = y * torch.sigmoid(self.gate(x)).transpose(1, 2)[..., None]
            return x + self.out(y.transpose(1, 2).reshape(b, t, -1))

    @member("per-head gate Linear(d, H) with no topk is not a router",
            says=["not routers", "gate: observed: its outputs reach no topk"],
            not_says=["MoE router", "SKIPPED"], level=logging.INFO)
    def head_gate():
        m = Embed([GatedAttn(32, 4) for _ in range(2)])
        for b in m.blocks:  # where names look for a router: beside experts-less MLP
            b.gate = b.gate
        m.expect_ = lambda: [(i, 4, 4, 8, 0, split_rows(b.to_queries.weight, 4, 8),
                              split_rows(b.to_keys.weight, 4, 8))
                             for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: []
        return m

    # 9. Encoder-decoder (T5/Switch shape): encoder blocks self-attention +
    # MoE router, decoder blocks self-attention, cross-attention, router.
    class Enc(nn.Module):
        def __init__(self, d, h, e, k):
            super().__init__()
            self.sa = ToQueries(d, h, h)
            self.moe = SelMoE(d, e, k, "topk")

        def forward(self, x):
            return x + self.moe(self.sa(x))

    class Cross(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h, self.dh = h, d // h
            self.q = nn.Linear(d, d, bias=False)
            self.k = nn.Linear(d, d, bias=False)
            self.v = nn.Linear(d, d, bias=False)
            self.o = nn.Linear(d, d, bias=False)

        def forward(self, x, mem):
            b, t, d = x.shape
            s = mem.shape[1]
            q = self.q(x).view(b, t, self.h, self.dh).transpose(1, 2)
            k = self.k(mem).view(b, s, self.h, self.dh).transpose(1, 2)
            v = self.v(mem).view(b, s, self.h, self.dh).transpose(1, 2)
            a = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
            return x + self.o((a @ v).transpose(1, 2).reshape(b, t, d))

    class Dec(nn.Module):
        def __init__(self, d, h, e, k):
            super().__init__()
            self.sa = ToQueries(d, h, h)
            self.ca = Cross(d, h)
            self.moe = SelMoE(d, e, k, "argmax")

        def forward(self, x, mem):
            return x + self.moe(self.ca(self.sa(x), mem))

    class EncDec(nn.Module):
        def __init__(self, d=32, h=4):
            super().__init__()
            self.shared = nn.Embedding(40, d)
            self.encoder = nn.ModuleList([Enc(d, h, 4, 2) for _ in range(2)])
            self.decoder = nn.ModuleList([Dec(d, h, 4, 1) for _ in range(2)])

        def forward(self, input_ids, decoder_input_ids):
            x = self.shared(input_ids)
            for b in self.encoder:
                x = b(x)
            y = self.shared(decoder_input_ids)
            for b in self.decoder:
                y = b(y, x)
            return y

    @member("encoder-decoder: block indices, cross-attention the next layer",
            says=["observed"], not_says=["SKIPPED"], level=logging.INFO)
    def enc_dec():
        m = EncDec()
        exp = []
        for i, b in enumerate(m.encoder):
            exp.append((i, 4, 4, 8, 0, split_rows(b.sa.to_queries.weight, 4, 8),
                        split_rows(b.sa.to_keys.weight, 4, 8)))
        for i, b in enumerate(m.decoder):
            exp.append((2 + 2 * i, 4, 4, 8, 0, split_rows(b.sa.to_queries.weight, 4, 8),
                        split_rows(b.sa.to_keys.weight, 4, 8)))
            exp.append((3 + 2 * i, 4, 4, 8, 0, split_rows(b.ca.q.weight, 4, 8),
                        split_rows(b.ca.k.weight, 4, 8)))
        m.expect_ = lambda: exp
        m.routers_ = lambda: ([(i, 4, 2, b.moe.selector.weight) for i, b in enumerate(m.encoder)]
                              + [(2 + 2 * i, 4, 1, b.moe.selector.weight)
                                 for i, b in enumerate(m.decoder)])
        return m

    # 10. DeepSeek MLA: q_a/q_b low rank, kv_a_proj_with_mqa split into the
    # latent and a shared rope key, kv_b: its own message, not monitored.
    class MLA(nn.Module):
        def __init__(self, d, h, q_rank=16, kv_rank=16, nope=8, rope_d=4, vd=8):
            super().__init__()
            self.h, self.nope, self.rope_d, self.vd, self.kv_rank = h, nope, rope_d, vd, kv_rank
            self.q_a_proj = nn.Linear(d, q_rank, bias=False)
            self.q_a_layernorm = nn.LayerNorm(q_rank)
            self.q_b_proj = nn.Linear(q_rank, h * (nope + rope_d), bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(d, kv_rank + rope_d, bias=False)
            self.kv_a_layernorm = nn.LayerNorm(kv_rank)
            self.kv_b_proj = nn.Linear(kv_rank, h * (nope + vd), bias=False)
            self.o_proj = nn.Linear(h * vd, d, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            q = q.view(b, t, self.h, -1).transpose(1, 2)
            q_nope, q_pe = torch.split(q, [self.nope, self.rope_d], dim=-1)
            ckv = self.kv_a_proj_with_mqa(x)
            ckv, k_pe = torch.split(ckv, [self.kv_rank, self.rope_d], dim=-1)
            k_pe = k_pe.view(b, t, 1, self.rope_d).transpose(1, 2)
            kv = self.kv_b_proj(self.kv_a_layernorm(ckv)).view(b, t, self.h, -1).transpose(1, 2)
            k_nope, v = torch.split(kv, [self.nope, self.vd], dim=-1)
            q_pe, k_pe = rope(q_pe), rope(k_pe)
            qs = torch.cat([q_nope, q_pe], dim=-1)
            ks = torch.cat([k_nope, k_pe.expand(b, self.h, t, self.rope_d)], dim=-1)
            a = causal_softmax(torch.matmul(qs, ks.transpose(2, 3)))
            return x + self.o_proj(torch.matmul(a, v).transpose(1, 2).reshape(b, t, -1))

    @member("DeepSeek MLA: its own message", says=["SKIPPED attention", "MLA-style",
                                                   "q_b_proj", "kv_a_proj_with_mqa",
                                                   "not approximated", "fix: attention="],
            level=logging.WARNING)
    def mla():
        m = Embed([MLA(32, 4) for _ in range(2)])
        m.expect_ = lambda: []
        m.routers_ = lambda: []
        return m

    # 11. nn.MultiheadAttention with kdim = vdim != embed_dim: names find it,
    # the pass confirms it; q and k read different widths, which the sketch
    # takes (attention_grams reduces each side over its own width): monitored.
    class KdimModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(32, 4, kdim=16, vdim=16, batch_first=True)
            self.mem = nn.Linear(32, 16)

        def forward(self, x):
            m = self.mem(x)
            return self.mha(x, m, m)[0]

    @member("nn.MultiheadAttention(kdim=vdim=16): monitored",
            says=["confirmed by the observed pass"], not_says=["SKIPPED"], level=logging.INFO)
    def kdim():
        m = KdimModel()
        m.expect_ = lambda: [(0, 4, 4, 8, 0, split_rows(m.mha.q_proj_weight, 4, 8),
                              split_rows(m.mha.k_proj_weight, 4, 8))]
        m.routers_ = lambda: []
        return m

    # 12. timm ViT: fused qkv reshaped [B, N, 3, H, dh], permuted, indexed qkv[0],
    # q/k norm, scaled q; GPT-J interleaved rotary (stack + flatten) with a
    # where-mask; Megatron-core [s, b, h] grouped linear_qkv, baddbmm.
    class TimmAttn(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.num_heads_used, self.hd_used = h, d // h
            self.qkv = nn.Linear(d, 3 * d)
            self.q_norm, self.k_norm = nn.LayerNorm(d // h), nn.LayerNorm(d // h)
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            b, n, c = x.shape
            qkv = self.qkv(x).reshape(b, n, 3, self.num_heads_used, self.hd_used)
            qkv = qkv.permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]  # integer indexing: unseen by the mode on 1.13
            q, k = self.q_norm(q) * self.hd_used ** -0.5, self.k_norm(k)
            a = (q @ k.transpose(-2, -1)).softmax(dim=-1)
            return x + self.proj((a @ v).transpose(1, 2).reshape(b, n, c))

    class GPTJAttn(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h, self.dh = h, d // h
            self.qp, self.kp, self.vp = (nn.Linear(d, d, bias=False) for _ in range(3))
            self.op = nn.Linear(d, d, bias=False)

        def forward(self, x):
            b, t, d = x.shape
            q, k = self.qp(x).view(b, t, self.h, self.dh), self.kp(x).view(b, t, self.h, self.dh)
            v = self.vp(x).view(b, t, self.h, self.dh).permute(0, 2, 1, 3)
            ang = torch.arange(t, dtype=x.dtype)[:, None, None] * torch.ones(1, 1, self.dh)

            def every_two(z):
                return torch.stack((-z[..., 1::2], z[..., ::2]), dim=-1).flatten(-2)
            q = q * ang.cos() + every_two(q) * ang.sin()
            k = k * ang.cos() + every_two(k) * ang.sin()
            w = torch.matmul(q.permute(0, 2, 1, 3).float(), k.permute(0, 2, 1, 3).float()
                             .transpose(-1, -2))
            w = torch.where(torch.ones(t, t, dtype=torch.bool).tril(), w, torch.tensor(-1e9))
            a = F.softmax(w / math.sqrt(self.dh), dim=-1)
            return x + self.op(torch.matmul(a, v).permute(0, 2, 1, 3).reshape(b, t, d))

    class MegatronAttn(nn.Module):
        def __init__(self, d, np_, ng):
            super().__init__()
            self.np, self.ng, self.hn = np_, ng, d // np_
            self.linear_qkv_x = nn.Linear(d, (np_ + 2 * ng) * self.hn)
            self.linear_proj_x = nn.Linear(d, d)

        def forward(self, x):
            h = x.transpose(0, 1)  # [s, b, d]
            sq, b, _ = h.shape
            mixed = self.linear_qkv_x(h).view(sq, b, self.ng, (self.np // self.ng + 2) * self.hn)
            q, k, v = torch.split(mixed, [self.np // self.ng * self.hn, self.hn, self.hn], dim=3)
            q = q.reshape(sq, b, self.np, self.hn)
            k = k.repeat_interleave(self.np // self.ng, dim=2)
            v = v.repeat_interleave(self.np // self.ng, dim=2)
            qq = q.reshape(sq, b * self.np, self.hn).transpose(0, 1)
            kk = k.reshape(sq, b * self.np, self.hn).transpose(0, 1)
            buf = torch.empty(b * self.np, sq, sq)
            # keyword form, as BLOOM calls it: alibi.baddbmm(batch1=, batch2=)
            s = buf.baddbmm(batch1=qq, batch2=kk.transpose(1, 2), beta=0.0, alpha=self.hn ** -0.5)
            a = nn.Softmax(dim=-1)(s.view(b, self.np, sq, sq))
            ctx = torch.bmm(a.view(b * self.np, sq, sq), v.reshape(sq, b * self.np, self.hn)
                            .transpose(0, 1))
            ctx = ctx.view(b, self.np, sq, self.hn).permute(2, 0, 1, 3).reshape(sq, b, -1)
            return x + self.linear_proj_x(ctx).transpose(0, 1)

    def grouped_rows(w, np_, ng, hn):
        per = np_ // ng
        g = w.view(ng, (per + 2) * hn, w.shape[1])
        return ([g[j // per, (j % per) * hn:(j % per + 1) * hn] for j in range(np_)],
                [g[i, per * hn:(per + 1) * hn] for i in range(ng)])

    @member("timm qkv permute/unbind + qk-norm; GPT-J interleaved rotary; Megatron "
            "[s, b, h] grouped linear_qkv with baddbmm", says=["observed (matmul)",
                                                             "observed (baddbmm)"],
            not_says=["SKIPPED"], level=logging.INFO)
    def mixed_layouts():
        m = Embed([TimmAttn(32, 4), GPTJAttn(32, 4), MegatronAttn(32, 4, 2)])
        t, j, g = m.blocks
        m.expect_ = lambda: [
            (0, 4, 4, 8, 0, split_rows(t.qkv.weight, 4, 8), split_rows(t.qkv.weight, 4, 8, 32)),
            (1, 4, 4, 8, 0, split_rows(j.qp.weight, 4, 8), split_rows(j.kp.weight, 4, 8)),
            (2, 4, 2, 8, 0) + tuple(grouped_rows(g.linear_qkv_x.weight, 4, 2, 8))]
        m.routers_ = lambda: []
        return m

    # TimeSformer's / old timm's q, k, v = qkv[0], qkv[1], qkv[2] of the permuted
    # fused projection, q and k straight into q @ k.transpose(-2, -1): on torch
    # 1.13 the mode sees neither index; q's labels come from the projection's
    # output, though k.transpose (seen, labelled later) covers only k's part.
    class IndexedQKV(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x):
            b, n, c = x.shape
            qkv = self.qkv(x).reshape(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            a = (q @ k.transpose(-2, -1)).softmax(dim=-1)
            return x + self.proj((a @ v).transpose(1, 2).reshape(b, n, c))

    @member("q, k = qkv[0], qkv[1] of a permuted fused projection straight into q @ k^T",
            says=["observed (matmul)"], not_says=["SKIPPED"], level=logging.INFO)
    def indexed_qkv():
        m = Embed([IndexedQKV(32, 4) for _ in range(2)])
        m.expect_ = lambda: [(i, 4, 4, 8, 0, split_rows(b.qkv.weight, 4, 8),
                              split_rows(b.qkv.weight, 4, 8, 32)) for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: []
        return m

    # 13. One score per head: Karpathy's "Let's build GPT" (heads =
    # ModuleList([Head(head_size)]), each with its own query/key Linear) and a
    # loop over one projection's head slices: the heads of one attention.
    class KHead(nn.Module):
        def __init__(self, d, hs):
            super().__init__()
            self.key = nn.Linear(d, hs, bias=False)
            self.query = nn.Linear(d, hs, bias=False)
            self.value = nn.Linear(d, hs, bias=False)

        def forward(self, x):
            k, q = self.key(x), self.query(x)
            wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
            t = x.shape[1]
            wei = wei.masked_fill(torch.ones(t, t).tril() == 0, float("-inf"))
            return F.softmax(wei, dim=-1) @ self.value(x)

    class KMulti(nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.heads = nn.ModuleList([KHead(d, d // n) for _ in range(n)])
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            return x + self.proj(torch.cat([h(x) for h in self.heads], dim=-1))

    class LoopHeads(nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.n, self.dh = n, d // n
            self.wqk = nn.Linear(d, 2 * d, bias=False)
            self.wv = nn.Linear(d, d, bias=False)

        def forward(self, x):
            q, k = self.wqk(x).chunk(2, dim=-1)
            v = self.wv(x)
            outs = []
            for h in range(self.n):
                sl = slice(h * self.dh, (h + 1) * self.dh)
                a = torch.softmax(q[..., sl] @ k[..., sl].transpose(1, 2), dim=-1)
                outs.append(a @ v[..., sl])
            return x + torch.cat(outs, dim=-1)

    @member("one score per head: Karpathy's ModuleList of Head modules, a loop over slices",
            says=["observed (matmul)", "blocks.0.heads"], not_says=["SKIPPED"],
            level=logging.INFO)
    def per_head():
        m = Embed([KMulti(32, 4), LoopHeads(32, 4)])
        a, b = m.blocks
        m.expect_ = lambda: [
            (0, 4, 4, 8, 0, [h.query.weight for h in a.heads], [h.key.weight for h in a.heads]),
            (1, 4, 4, 8, 0, split_rows(b.wqk.weight, 4, 8), split_rows(b.wqk.weight, 4, 8, 32))]
        m.routers_ = lambda: []
        return m

    # 14. A score whose q is partly a learned table, no projection: named
    # with the reason the pass gives (not names' "head count unknown").
    class PartQ(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.wq = nn.Linear(d, 12)
            self.wk = nn.Linear(d, 16)
            self.table = nn.Parameter(torch.randn(64, 4))

        def forward(self, x):
            b, t, _ = x.shape
            q = torch.cat([self.wq(x), self.table[:t].expand(b, t, 4)], -1)
            q = q.view(b, t, 2, 8).transpose(1, 2)
            k = self.wk(x).view(b, t, 2, 8).transpose(1, 2)
            return x + (torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ k).transpose(1, 2) \
                .reshape(b, t, 16).sum(-1, keepdim=True)

    @member("q partly from a learned table: skipped with the pass's reason",
            says=["SKIPPED attention blocks.0", "some q/k features come from no projection",
                  "found NOTHING it can monitor"], not_says=["head count unknown"],
            level=logging.WARNING)
    def part_q():
        m = Embed([PartQ(32)])
        m.expect_ = lambda: []
        m.routers_ = lambda: []
        return m

    # 15. An attention kernel reached as a torch custom op in the
    # An attention kernel the pass cannot see (old flash-attn bindings,
    # xformers C++ ops, apex): here an autograd.Function computing softmax
    # attention in numpy on detached tensors. The pass sees q and k projected
    # but no score: the names' spec (H from num_heads) must stay monitored.
    class OpaqueAttn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            qn, kn, vn = (t.detach().cpu().numpy() for t in (q, k, v))
            s = qn @ kn.swapaxes(-1, -2) / math.sqrt(qn.shape[-1])
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            return torch.from_numpy(p @ vn).to(q.dtype)

        @staticmethod
        def backward(ctx, g):
            return None, None, None

    class OpaqueBlock(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.num_heads = h
            self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
            self.v_proj, self.o_proj = nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (p(x).view(b, t, self.num_heads, -1).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            y = OpaqueAttn.apply(q, k, v)
            return x + self.o_proj(y.transpose(1, 2).reshape(b, t, d))

    @member("attention in a kernel the pass cannot see (numpy in an autograd.Function)",
            says=["attention: layer 0: H=4 Hkv=4 dh=8", "0 attention scores"],
            not_says=["not attention", "SKIPPED"], level=logging.INFO)
    def opaque():
        m = Embed([OpaqueBlock(32, 4) for _ in range(2)])
        m.expect_ = lambda: [(i, 4, 4, 8, 0, split_rows(b.q_proj.weight, 4, 8),
                              split_rows(b.k_proj.weight, 4, 8))
                             for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: []
        return m

    # A fused qkv (num_heads known) split by integer indexing, which torch
    # 1.13's mode does not see, q and k into a kernel the pass cannot see (a
    # C++ extension, stood in for by popping the mode), v also into a seen op
    # (a gate): v's use is not q's and k's, so names' spec stays monitored (the pass
    # drops names' q/k only when every value of them went to ops it sees).
    def unseen_kernel(q, k, v):
        from torch.overrides import _pop_mode_temporarily
        if not torch._C._len_torch_function_stack():  # training: no mode to pop
            return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v
        with _pop_mode_temporarily():
            return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v

    class SplitOpaque(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.num_heads = h
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x):
            b, t, d = x.shape
            qkv = self.qkv(x).view(b, t, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            y = unseen_kernel(q, k, v) * v.sigmoid()  # a value gate: a seen op on v
            return x + self.proj(y.transpose(1, 2).reshape(b, t, d))

    @member("fused qkv split by indexing, q and k into an unseen kernel, v seen: monitored",
            says=["attention: layer 0: H=4 Hkv=4 dh=8", "0 attention scores"],
            not_says=["not attention", "SKIPPED"], level=logging.INFO)
    def split_opaque():
        m = Embed([SplitOpaque(32, 4) for _ in range(2)])
        m.expect_ = lambda: [(i, 4, 4, 8, 0, split_rows(b.qkv.weight, 4, 8),
                              split_rows(b.qkv.weight, 4, 8, 32))
                             for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: []
        return m

    # A fused qkv Linear(d, 3d) with no head attribute (names: SKIPPED, head
    # count unknown) whose attention runs in that opaque kernel: q, k, v
    # leave the ops the pass sees, so the warning must stay.
    class OpaqueFused(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (y.view(b, t, 4, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
            return x + self.proj(OpaqueAttn.apply(q, k, v).transpose(1, 2).reshape(b, t, d))

    @member("fused qkv, head count unknown, attention in an opaque kernel: still warned",
            says=["SKIPPED attention blocks.0, blocks.1: fused qkv", "head count unknown"],
            not_says=["not attention"], level=logging.WARNING)
    def opaque_fused():
        m = Embed([OpaqueFused(32) for _ in range(2)])
        m.expect_ = lambda: []
        m.routers_ = lambda: []
        return m

    # The same fused Linear(d, 3d) feeding a short convolution and gated FFT
    # long convolutions (Hyena): every output seen, no two meet in a product.
    class LongConv(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.d = d
            self.in_proj = nn.Linear(d, 3 * d)
            self.short = nn.Conv1d(3 * d, 3 * d, 3, padding=2, groups=3 * d)
            self.filt = nn.Parameter(torch.randn(d, 16) * 0.1)
            self.out_proj = nn.Linear(d, d)

        def forward(self, x):
            t = x.shape[1]
            u = self.short(self.in_proj(x).transpose(1, 2))[..., :t]
            x0, x1, v = u.split(self.d, dim=1)
            y = torch.fft.irfft(torch.fft.rfft(v * x1, n=2 * t) *
                                torch.fft.rfft(self.filt[:, :t], n=2 * t), n=2 * t)[..., :t]
            return x + self.out_proj((y * x0).transpose(1, 2))

    @member("fused in_proj into long convolutions (Hyena): not attention, no warning",
            says=["not attention: blocks.0, blocks.1: observed: its outputs only reach"],
            not_says=["SKIPPED"], level=logging.WARNING)
    def long_conv():
        m = Embed([LongConv(32) for _ in range(2)])
        m.expect_ = lambda: []
        m.routers_ = lambda: []
        return m

    # Retention (RetNet) / linear attention: q.k^T times a decay mask, then
    # @ v, no softmax: not an attention score by the client's definition.
    # Names find q_proj/k_proj (num_heads); the pass saw them meet in a
    # product that weights v with no softmax, so they are dropped, said once.
    class Retention(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.num_heads = h
            self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
            self.v_proj, self.o_proj = nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (p(x).view(b, t, self.num_heads, -1).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            i = torch.arange(t, dtype=x.dtype)
            decay = (0.9 ** (i[:, None] - i[None, :])).tril()
            y = ((q @ k.transpose(-1, -2)) * decay) @ v
            return x + self.o_proj(y.transpose(1, 2).reshape(b, t, d))

    @member("retention: q.k product times a decay, no softmax: no attention",
            says=["not attention: blocks.0.q_proj/k_proj, blocks.1.q_proj/k_proj: q.k product "
                  "without softmax", "0 attention scores"],
            not_says=["SKIPPED"], level=logging.WARNING)
    def retention():
        m = Embed([Retention(32, 4) for _ in range(2)])
        m.expect_ = lambda: []
        m.routers_ = lambda: []
        return m

    # The softmax over the key axis wherever the product put it: Transformer-XL's
    # time-first einsum("ibhd,jbhd->ijbh") scores, the first key sliced away
    # ([:, 1:], a memory slot dropped), softmax'd over dim 1; a
    # batch-first "bihd,bjhd->bijh" score moved by transpose(0, 1) to
    # [i, b, j, h] and softmax'd over dim 2 (the keys, found through the move).
    class AxisSoftmax(ToQueries):
        def __init__(self, d, h, time_first):
            super().__init__(d, h, h)
            self.time_first = time_first

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (p(x).view(b, t, self.h, self.dh)
                       for p in (self.to_queries, self.to_keys, self.to_values))
            if self.time_first:
                q, k, v = (y.transpose(0, 1) for y in (q, k, v))  # [t, b, h, dh]
                a = torch.einsum("ibhd,jbhd->ijbh", q, k)[:, 1:].float().softmax(dim=1)
                y = torch.einsum("ijbh,jbhd->ibhd", a, v[1:]).transpose(0, 1)
            else:
                s = torch.einsum("bihd,bjhd->bijh", q, k).transpose(0, 1)  # [i, b, j, h]
                a = s.softmax(dim=2).transpose(0, 1)
                y = torch.einsum("bijh,bjhd->bihd", a, v)
            return x + self.out(y.reshape(b, t, -1))

    @member("softmax over the key axis where it sits: [i, j, b, h] dim 1, [i, b, j, h] dim 2",
            says=["observed (einsum)"],
            not_says=["SKIPPED", "without softmax"], level=logging.INFO)
    def axis_softmax():
        m = Embed([AxisSoftmax(32, 4, tf) for tf in (True, False)])
        m.expect_ = lambda: [(i, 4, 4, 8, 0, split_rows(b.to_queries.weight, 4, 8),
                              split_rows(b.to_keys.weight, 4, 8)) for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: []
        return m

    # A softmax over the heads of [b, i, j, h] scores (the product's heads
    # axis, one of its last two, not its query or key axis) normalizes no
    # attention over tokens: no score.
    class HeadSoftmax(ToQueries):
        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (p(x).view(b, t, self.h, self.dh)
                       for p in (self.to_queries, self.to_keys, self.to_values))
            a = torch.einsum("bihd,bjhd->bijh", q, k).softmax(dim=-1)
            y = torch.einsum("bijh,bjhd->bihd", a, v)
            return x + self.out(y.reshape(b, t, -1))

    @member("a softmax over the heads axis of [b, i, j, h] scores: no attention",
            says=["found NOTHING to monitor", "0 attention scores"],
            not_says=["SKIPPED"], level=logging.WARNING)
    def head_softmax():
        m = Embed([HeadSoftmax(32, 4, 4) for _ in range(2)])
        m.expect_ = lambda: []
        m.routers_ = lambda: []
        return m

    # A score written elementwise: q[:, :, None] * k[:, None] broadcast over
    # (query, key), summed over head_dim, heads moved before the softmax.
    class PairScore(ToQueries):
        def forward(self, x):
            b, t, _ = x.shape
            q = self.to_queries(x).view(b, t, self.h, self.dh)
            k = self.to_keys(x).view(b, t, self.h, self.dh)
            v = self.to_values(x).view(b, t, self.h, self.dh).transpose(1, 2)
            s = (q[:, :, None] * k[:, None]).sum(-1) / math.sqrt(self.dh)  # [b, t, t, h]
            a = causal_softmax(s.permute(0, 3, 1, 2))
            return x + self.out((a @ v).transpose(1, 2).reshape(b, t, -1))

    @member("a score as (q[:, :, None] * k[:, None]).sum(-1): broadcast pairs of tokens",
            says=["observed (mul-sum)"], not_says=["SKIPPED"], level=logging.INFO)
    def pair_score():
        m = Embed([PairScore(32, 4, 4) for _ in range(2)])
        m.expect_ = lambda: [(i, 4, 4, 8, 0, split_rows(b.to_queries.weight, 4, 8),
                              split_rows(b.to_keys.weight, 4, 8)) for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: []
        return m

    # A graph's per-edge score: tokens are nodes, each attends to itself and
    # the earlier ones (edges dst <- src), einsum("ehc,ehc->eh", q[dst], k[src]),
    # a softmax by hand over each node's edges (exp, index_add).
    class EdgeAttn(ToQueries):
        def forward(self, x):
            b, t, d = x.shape
            n = b * t
            ii, jj = torch.tril_indices(t, t)
            off = (torch.arange(b) * t)[:, None]
            dst, src = (ii[None] + off).reshape(-1), (jj[None] + off).reshape(-1)
            xf = x.reshape(n, d)
            q, k, v = (p(xf).view(n, self.h, self.dh)
                       for p in (self.to_queries, self.to_keys, self.to_values))
            s = torch.einsum("ehc,ehc->eh", q[dst], k[src]) / math.sqrt(self.dh)
            w = (s - s.max().detach()).exp()
            w = w / torch.zeros(n, self.h).index_add(0, dst, w)[dst]
            y = torch.zeros(n, self.h, self.dh).index_add(0, dst, v[src] * w[..., None])
            return x + self.out(y.reshape(b, t, d))

    @member("a graph's per-edge einsum(q[dst], k[src]) score, exp and index_add softmax",
            says=["observed (einsum)"], not_says=["SKIPPED"], level=logging.INFO)
    def edge_score():
        m = Embed([EdgeAttn(32, 4, 4) for _ in range(2)])
        m.expect_ = lambda: [(i, 4, 4, 8, 0, split_rows(b.to_queries.weight, 4, 8),
                              split_rows(b.to_keys.weight, 4, 8)) for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: []
        return m

    # Not a score: a per-token bilinear form (left(x) * right(x)).sum(-1), its
    # softmax over the tokens a pooling weight; each token meets only itself.
    class BilinearPool(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.left, self.right = nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x):
            w = (self.left(x) * self.right(x)).sum(-1).softmax(-1)  # [b, t]
            return x + (w[..., None] * x).sum(1, keepdim=True)

    @member("a per-token (left(x) * right(x)).sum(-1) then softmax over tokens: no score",
            says=["1 attention score"], not_says=["SKIPPED", "mul-sum"], level=logging.INFO)
    def bilinear_pool():
        m = Embed([Block(ToQueries(32, 4, 4), BilinearPool(32))])
        m.expect_ = lambda: [(0, 4, 4, 8, 0, split_rows(m.blocks[0].attn.to_queries.weight, 4, 8),
                              split_rows(m.blocks[0].attn.to_keys.weight, 4, 8))]
        m.routers_ = lambda: []
        return m

    # A low-rank router: router(reduce(x)), E logits of a rank-8 reduction:
    # the router's map from the block's input is router.weight @ reduce.weight.
    class LowRankMoE(nn.Module):
        def __init__(self, d, e, r=8):
            super().__init__()
            self.reduce = nn.Linear(d, r, bias=False)
            self.router = nn.Linear(r, e, bias=False)
            self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(e)])

        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            idx = self.router(self.reduce(x)).softmax(-1).topk(2, dim=-1).indices
            out = torch.zeros_like(x)
            for e, ex in enumerate(self.experts):
                rows = (idx == e).any(dim=-1)
                out[rows] += ex(x[rows])
            return out.reshape(shape)

    @member("a low-rank router router(reduce(x)): its weight composed, router @ reduce",
            says=["times blocks.0.ff.reduce.weight", "2 routing top-ks"],
            not_says=["SKIPPED"], level=logging.INFO)
    def low_rank_router():
        m = Embed([Block(ToQueries(32, 4, 4), LowRankMoE(32, 4)) for _ in range(2)])
        m.expect_ = lambda: [(i, 4, 4, 8, 0, split_rows(b.attn.to_queries.weight, 4, 8),
                              split_rows(b.attn.to_keys.weight, 4, 8))
                             for i, b in enumerate(m.blocks)]
        m.routers_ = lambda: [(i, 4, 2, b.ff.router.weight.matmul(b.ff.reduce.weight))
                              for i, b in enumerate(m.blocks)]
        return m

    # flash-attn layout [B, T, H, D] (torch 2.4+ only: torch.library.custom_op).
    if hasattr(torch, "library") and hasattr(torch.library, "custom_op"):
        @torch.library.custom_op("foreshock_test::flash_attn_func", mutates_args=())
        def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qq, kk, vv = (t.transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(1, 2)

        class FlashBlock(nn.Module):
            def __init__(self, d, h, kv):
                super().__init__()
                self.h, self.kv, self.dh = h, kv, d // h
                self.wqkv_x = nn.Linear(d, (h + 2 * kv) * self.dh)
                self.proj_x = nn.Linear(d, d)

            def forward(self, x):
                b, t, d = x.shape
                q, k, v = self.wqkv_x(x).split([d, self.kv * self.dh, self.kv * self.dh], -1)
                q = q.view(b, t, self.h, self.dh)
                k = k.view(b, t, self.kv, self.dh).repeat_interleave(self.h // self.kv, 2)
                v = v.view(b, t, self.kv, self.dh).repeat_interleave(self.h // self.kv, 2)
                y = torch.ops.foreshock_test.flash_attn_func(q, k, v)
                return x + self.proj_x(y.reshape(b, t, d))

        @member("attention kernel as a torch custom op, [B, T, H, D], GQA",
                says=["observed (flash_attn_func)"], not_says=["SKIPPED"], level=logging.INFO)
        def flash_op():
            m = Embed([FlashBlock(32, 4, 2) for _ in range(2)])
            m.expect_ = lambda: [(i, 4, 2, 8, 0, split_rows(b.wqkv_x.weight, 4, 8),
                                  split_rows(b.wqkv_x.weight, 2, 8, 32))
                                 for i, b in enumerate(m.blocks)]
            m.routers_ = lambda: []
            return m

        # TransformerEngine-like: the layer norm and the qkv GEMM in one
        # operator (the pass sees x, the norm's weight and the [3d, d]
        # weight go in, [B, T, 3d] come out), then flash-attn's packed
        # [B, T, 3, H, D] into another operator.
        @torch.library.custom_op("foreshock_test::ln_gemm", mutates_args=())
        def ln_gemm(x: torch.Tensor, ln_w: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return F.linear(F.layer_norm(x, (x.shape[-1],), ln_w), w)

        @torch.library.custom_op("foreshock_test::flash_attn_qkvpacked_func", mutates_args=())
        def flash_attn_qkvpacked_func(qkv: torch.Tensor) -> torch.Tensor:
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

        class PackedBlock(nn.Module):
            def __init__(self, d, h):
                super().__init__()
                self.h, self.dh = h, d // h
                self.ln_w = nn.Parameter(torch.ones(d))
                self.w_in = nn.Parameter(torch.randn(3 * d, d) * d ** -0.5)
                self.proj_x = nn.Linear(d, d)

            def forward(self, x):
                b, t, d = x.shape
                qkv = torch.ops.foreshock_test.ln_gemm(x, self.ln_w, self.w_in)
                y = torch.ops.foreshock_test.flash_attn_qkvpacked_func(
                    qkv.view(b, t, 3, self.h, self.dh))
                return x + self.proj_x(y.reshape(b, t, d))

        @member("a fused norm + GEMM operator, then q/k/v packed [B, T, 3, H, D] into one",
                says=["observed (flash_attn_qkvpacked_func)"], not_says=["SKIPPED"],
                level=logging.INFO)
        def packed_op():
            m = Embed([PackedBlock(32, 4) for _ in range(2)])
            m.expect_ = lambda: [(i, 4, 4, 8, 0, split_rows(b.w_in, 4, 8),
                                  split_rows(b.w_in, 4, 8, 32))
                                 for i, b in enumerate(m.blocks)]
            m.routers_ = lambda: []
            return m

    return members


def check_member(torch, foreshock, cap, name, build, exp):
    from foreshock.testing import RecordingTransport
    torch.manual_seed(len(name))
    model = build()
    found = foreshock.discover(model)
    text = found.summary()
    check(found.observation is not None and found.observation.error is None,
          f"{name}: the observed pass did not run: {text}")
    check(found.level == exp["level"], f"{name}: summary at level {found.level}:\n{text}")
    for s in exp.get("says", []):
        check(s in text, f"{name}: summary does not say {s!r}:\n{text}")
    for s in exp.get("not_says", []):
        check(s not in text, f"{name}: summary says {s!r}:\n{text}")
    want = model.expect_()
    got = [(a.layer, a.n_heads, a.n_kv_heads, a.head_dim, a.head_offset) for a in found.attention]
    check(got == [w[:5] for w in want], f"{name}: attention {got} "
          f"({[a.name for a in found.attention]}), expected {[w[:5] for w in want]}:\n{text}")
    for a, w in zip(found.attention, want):
        wq, wk = a.get()
        dh = a.head_dim
        for h, rows in enumerate(w[5]):
            check(torch.equal(wq[h * dh:(h + 1) * dh], rows),
                  f"{name}: {a.name}: query head {h} rows are not the layout's")
        for g, rows in enumerate(w[6]):
            check(torch.equal(wk[g * dh:(g + 1) * dh], rows),
                  f"{name}: {a.name}: key head {g} rows are not the layout's")
    want_r = model.routers_()
    got_r = [(r.layer, r.n_experts, r.top_k) for r in found.routers]
    check(got_r == [w[:3] for w in want_r], f"{name}: routers {got_r} "
          f"({[r.name for r in found.routers]}), expected {[w[:3] for w in want_r]}:\n{text}")
    for r, w in zip(found.routers, want_r):
        check(torch.equal(r.get(), w[3]), f"{name}: {r.name}: get() is not the router weight")

    # The Monitor finds the same and logs it once; a sketch step runs on it.
    n = len(cap.records)
    mon = foreshock.Monitor(model, run="observe", windows=(1,), every=1,
                            transport=RecordingTransport())
    recs = [r for r in cap.records[n:] if r.getMessage().startswith("foreshock: ")]
    check(len(recs) == 1 and recs[0].levelno == exp["level"],
          f"{name}: Monitor logged {[(r.levelname, r.getMessage()) for r in recs]}")
    check([(a.layer, a.n_heads, a.n_kv_heads, a.head_dim, a.head_offset)
           for a in mon.attention] == got, f"{name}: Monitor found other attention")
    check([(r.layer, r.n_experts, r.top_k) for r in mon.routers] == got_r,
          f"{name}: Monitor found other routers")
    ids = (torch.randint(0, 40, (2, 6)),)
    for step in (1, 2):
        with torch.no_grad():
            if isinstance(model, type(model)) and hasattr(model, "encoder"):
                model(ids[0], ids[0])
            elif hasattr(model, "wte"):
                model(ids[0])
        mon.step(step, loss=1.0)
    mon.close(10)
    rep = mon.transport.by_step()[2]
    heads = sorted({(g.layer, g.head) for g in rep.attention})
    want_heads = sorted({(w[0], w[4] + h) for w in want for h in range(w[1])})
    check(heads == want_heads, f"{name}: sketched heads {heads}, want {want_heads}")
    print(f"  {name:78s} {len(got)} attention, {len(got_r)} routers; "
          f"{logging.getLevelName(found.level)}", flush=True)
    return text


def check_compiled(torch, foreshock, members):
    """A torch.compile'd model (torch 2) is observed through its eager module."""
    if not hasattr(torch, "compile"):
        print("  torch.compile: not in this torch, skipped", flush=True)
        return
    name, build, _ = members[0]
    torch.manual_seed(0)
    model = build()
    plain = foreshock.discover(model)
    compiled = torch.compile(model, backend="eager")
    found = foreshock.discover(compiled)
    want = [(a.layer, a.n_heads, a.n_kv_heads, a.head_dim) for a in plain.attention]
    got = [(a.layer, a.n_heads, a.n_kv_heads, a.head_dim) for a in found.attention]
    check(got == want and all(torch.equal(x, y) for a, b in zip(found.attention, plain.attention)
                              for x, y in zip(a.get(), b.get())),
          f"torch.compile'd {name}: {got} vs {want}:\n{found.summary()}")
    print(f"  torch.compile'd {name}: the same {len(got)} attention specs and rows", flush=True)


def check_no_side_effects(torch, nn, foreshock):
    """The pass restores RNG, BatchNorm statistics and leaves no hook,
    no mode and no attribute behind; train mode stays."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(16, 32)
            self.bn = nn.BatchNorm1d(8)
            self.drop = nn.Dropout(0.5)
            self.to_queries = nn.Linear(32, 32)
            self.to_keys = nn.Linear(32, 32)

        def forward(self, x):
            x = self.drop(self.bn(self.inp(x)))
            q = self.to_queries(x).view(x.shape[0], x.shape[1], 4, 8).transpose(1, 2)
            k = self.to_keys(x).view(x.shape[0], x.shape[1], 4, 8).transpose(1, 2)
            noise = torch.randn(())  # consumes the RNG
            return torch.softmax(q @ k.transpose(-1, -2) + noise, dim=-1)

    m = Net().train()
    m.bn.running_mean.fill_(0.25)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    vmaps = [(mod, mod.vmap) for mod in (torch, getattr(torch, "func", None))
             if mod is not None and hasattr(mod, "vmap")]
    x = torch.randn(2, 8, 16)
    rng = torch.get_rng_state()
    hooks = [len(mod._forward_hooks) + len(mod._forward_pre_hooks) for mod in m.modules()]
    found = foreshock.discover(m, example_input=x)
    check(found.observation.error is None, f"side effects: pass failed: {found.summary()}")
    check([(a.n_heads, a.head_dim) for a in found.attention] == [(4, 8)],
          f"side effects model: attention {found.summary()}")
    check(torch.equal(torch.get_rng_state(), rng), "the observed pass moved the RNG")
    after = m.state_dict()
    for k, v in before.items():
        check(torch.equal(after[k], v), f"the observed pass changed {k}")
    check(m.training and m.bn.training, "the observed pass changed train mode")
    check(hooks == [len(mod._forward_hooks) + len(mod._forward_pre_hooks)
                    for mod in m.modules()], "the observed pass left hooks")
    check(not any(hasattr(p, "_foreshock_obs") for p in m.parameters()),
          "the observed pass left attributes on parameters")
    check(all(mod.vmap is v for mod, v in vmaps), "the observed pass left vmap replaced")
    from torch.overrides import has_torch_function
    check(not has_torch_function((torch.zeros(1),)), "a torch function mode is still active")
    print("  side effects: RNG, BatchNorm running stats, train mode, hooks, modes and vmap "
          "unchanged "
          f"({len(before)} state entries compared)", flush=True)


def check_monitor_inputs(torch, nn, foreshock, cap):
    """example_input at construction; a model no probe fits is observed at
    the first step() on the batch it was trained with."""
    from foreshock.testing import RecordingTransport

    class DictModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.blk = nn.Module()
            self.blk.to_queries = nn.Linear(12, 12)
            self.blk.to_keys = nn.Linear(12, 12)
            self.head = nn.Linear(12, 3)

        def forward(self, batch):
            x = batch["x"]
            q = self.blk.to_queries(x).view(*x.shape[:2], 3, 4).transpose(1, 2)
            k = self.blk.to_keys(x).view(*x.shape[:2], 3, 4).transpose(1, 2)
            a = (q @ k.transpose(-1, -2)).softmax(-1)
            return self.head((a @ q).transpose(1, 2).reshape(x.shape))

    m = DictModel()
    batch = {"x": torch.randn(2, 5, 12)}
    mon = foreshock.Monitor(m, run="ex", transport=RecordingTransport(),
                            example_input=(batch,))
    check([(a.n_heads, a.head_dim) for a in mon.attention] == [(3, 4)],
          f"example_input: {mon.discovery.summary()}")
    check("observed: one forward pass (example_input)" in mon.discovery.summary(),
          mon.discovery.summary())
    mon.close(5)
    # a parameter replaced after discovery (a wrapper, a checkpoint load) is followed
    spec = mon.attention[0]
    old_q = m.blk.to_queries.weight
    m.blk.to_queries.weight = nn.Parameter(torch.randn(12, 12))
    check(torch.equal(spec.get()[0], m.blk.to_queries.weight), "get() kept a replaced weight")
    m.blk.to_queries.weight = old_q

    n = len(cap.records)
    mon = foreshock.Monitor(m, run="later", windows=(1,), every=1,
                            transport=RecordingTransport())
    check(mon.attention == [], "no probe fits a dict batch: nothing before the first batch")
    first = [r.getMessage() for r in cap.records[n:]]
    check(any("waits for the first batch" in t for t in first), f"construction said {first}")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in (1, 2, 3):
        loss = m(batch).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step(step, loss=loss)
    mon.close(5)
    check([(a.layer, a.n_heads, a.head_dim) for a in mon.attention] == [(0, 3, 4)],
          f"first batch: {mon.discovery.summary()}")
    wq, wk = mon.attention[0].get()
    check(torch.equal(wq, m.blk.to_queries.weight) and torch.equal(wk, m.blk.to_keys.weight),
          "first batch: rows")
    rep = mon.transport.by_step()[2]
    check(sorted({g.head for g in rep.attention}) == [0, 1, 2], "first batch: no sketches")
    print("  Monitor(example_input=) observes at construction; a dict-batch model is "
          "observed at the first step() and sketched from the second", flush=True)
    return DictModel, batch


def check_cast_indices(torch, nn, foreshock):
    """Top-k indices cast before they dispatch: a seen use after the cast
    gives the router (and the k of a slice after it), and a cast copy no
    seen op takes went to a kernel the pass cannot see (MegaBlocks' CUDA
    sort): still a router. The kernel is stood in for by running it with
    the pass's torch function mode popped, as a C++ extension runs."""
    from torch.overrides import _pop_mode_temporarily

    class Routed(nn.Module):
        def __init__(self, route):
            super().__init__()
            self.scorer = nn.Linear(16, 4, bias=False)
            self.route = route

        def forward(self, x):
            # per token: the mask weights the token (a dispatch); a comparison only
            # reduced to one number (a top-k accuracy) would dispatch nothing
            return x * self.route(self.scorer(x).softmax(-1)).sum(-1, keepdim=True)

    def opaque(p):
        top = torch.topk(p, 2, dim=-1)[1].flatten().int()
        with _pop_mode_temporarily():
            return torch.bincount(top.long(), minlength=4)

    routes = {
        "topk(3), .int(), [..., :2]": (lambda p: (torch.topk(p, 3, dim=-1)[1].int()[..., :2]
                                                   == 1).float(), 2),
        "argsort, .to(int32), [..., :2]": (lambda p: (torch.argsort(p, dim=-1, descending=True)
                                                       .to(torch.int32)[..., :2] == 1).float(), 2),
        "topk(2), .int() into an unseen kernel": (opaque, 2),
    }
    for what, (route, k) in routes.items():
        found = foreshock.discover(Routed(route), example_input=torch.randn(1, 8, 16))
        got = [(r.n_experts, r.top_k) for r in found.routers]
        check(got == [(4, k)], f"{what}: routers {got}, want [(4, {k})]: {found.summary()}")
    print("  top-k indices are followed through casts, to a slice or an unseen kernel",
          flush=True)


def check_computed_fresh(torch, nn, foreshock):
    """A computed weight's get() is the weight the next forward multiplies
    by, recomputed from the parameters after an optimizer step (not the
    copy an old-style weight_norm hook cached at the last forward), and a
    read runs no spectral_norm power iteration (its u, v buffers stay)."""
    from torch.nn.utils import parametrize

    class Rows(nn.Module):
        def forward(self, w):
            return w / w.norm(dim=-1, keepdim=True)

    class Att(nn.Module):
        def __init__(self, wrap_q, wrap_k):
            super().__init__()
            self.aa, self.bb = wrap_q(nn.Linear(16, 16, bias=False)), \
                wrap_k(nn.Linear(16, 16, bias=False))

        def forward(self, x):
            q = self.aa(x).view(1, 8, 2, 8).transpose(1, 2)
            k = self.bb(x).view(1, 8, 2, 8).transpose(1, 2)
            return (q @ k.transpose(-1, -2)).softmax(-1) @ k

    def reparam(lin):
        parametrize.register_parametrization(lin, "weight", Rows())
        return lin

    def eff(lin):  # the weight a forward in eval mode multiplies by
        was = lin.training
        lin.eval()
        with torch.no_grad():
            if lin._forward_pre_hooks:  # old-style: the hook recomputes it on a call
                lin(torch.zeros(1, 16))
            w = lin.weight.detach().clone()
        lin.train(was)
        return w

    wraps = {"old weight_norm / parametrization": (torch.nn.utils.weight_norm, reparam),
             "old spectral_norm / parametrized spectral_norm": (
                 torch.nn.utils.spectral_norm, torch.nn.utils.parametrizations.spectral_norm)}
    for what, (wq, wk) in wraps.items():
        m = Att(wq, wk)
        x = torch.randn(1, 8, 16)
        found = foreshock.discover(m, example_input=x)
        check([(a.n_heads, a.head_dim) for a in found.attention] == [(2, 8)],
              f"{what}: {found.summary()}")
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        m(x).pow(2).sum().backward()
        opt.step()
        bufs = {n: b.clone() for n, b in m.named_buffers()}
        got_q, got_k = found.attention[0].get()
        check(all(torch.equal(b, bufs[n]) for n, b in m.named_buffers()),
              f"{what}: get() changed buffers")
        check(torch.allclose(got_q, eff(m.aa)) and torch.allclose(got_k, eff(m.bb)),
              f"{what}: get() is not the effective weight after the step")

    # A weight the forward computes from a parameter (F.normalize(wq) @ x):
    # get() recomputes it from the parameter now, also one replaced since.
    class CosQ(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq = nn.Parameter(torch.randn(16, 16))
            self.bb = nn.Linear(16, 16, bias=False)

        def forward(self, x):
            q = (x @ torch.nn.functional.normalize(self.wq, dim=1).t()).view(1, 8, 2, 8)
            k = self.bb(x).view(1, 8, 2, 8).transpose(1, 2)
            return (q.transpose(1, 2) @ k.transpose(-1, -2)).softmax(-1) @ k

    m = CosQ()
    x = torch.randn(1, 8, 16)
    found = foreshock.discover(m, example_input=x)
    check([(a.n_heads, a.head_dim) for a in found.attention] == [(2, 8)],
          f"weight computed from a parameter: {found.summary()}")
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m(x).pow(2).sum().backward()
    opt.step()
    norm = torch.nn.functional.normalize
    check(torch.equal(found.attention[0].get()[0], norm(m.wq.detach(), dim=1)),
          "weight computed from a parameter: get() is not it after the step")
    m.wq = nn.Parameter(torch.randn(16, 16))
    check(torch.equal(found.attention[0].get()[0], norm(m.wq.detach(), dim=1)),
          "weight computed from a parameter: get() did not follow the replaced parameter")
    print("  computed weights: get() is the effective weight after a step, buffers untouched; "
          "a weight computed in the forward is recomputed", flush=True)


def check_keyword_first_batch(torch, nn, foreshock, cap):
    """A keyword-only forward no probe fits is observed on its first batch,
    keyword arguments included (on torch 1.x too, whose pre-hooks see only
    positional inputs); a first batch that cannot be replayed gets one
    WARNING naming example_input=, and nothing raises."""
    from foreshock.testing import RecordingTransport

    class KwModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.blk = nn.Module()
            self.blk.to_queries = nn.Linear(12, 12)
            self.blk.to_keys = nn.Linear(12, 12)
            self.calls = 0

        def forward(self, *, feats, lengths, once=None):
            if not isinstance(lengths, list):
                raise TypeError("lengths must be a list of ints")
            if once is not None:  # a batch that cannot be run twice
                once.append(1)
                if len(once) > 1:
                    raise RuntimeError("this batch was already consumed")
            x = feats[:, :lengths[0]]
            q = self.blk.to_queries(x).view(*x.shape[:2], 3, 4).transpose(1, 2)
            k = self.blk.to_keys(x).view(*x.shape[:2], 3, 4).transpose(1, 2)
            return ((q @ k.transpose(-1, -2)).softmax(-1) @ q).pow(2).mean()

    for replayable in (True, False):
        m = KwModel()
        n = len(cap.records)
        mon = foreshock.Monitor(m, run="kw", windows=(1,), every=1,
                                transport=RecordingTransport())
        check(mon.attention == [], "keyword-only: a probe ran")
        for step in (1, 2):
            loss = m(feats=torch.randn(2, 5, 12), lengths=[5],
                     once=None if replayable else [])
            loss.backward()
            mon.step(step, loss=loss.detach())
        mon.close(5)
        said = [r for r in cap.records[n:] if r.levelno >= logging.WARNING
                and "example_input=" in r.getMessage()]
        if replayable:
            check([(a.n_heads, a.head_dim) for a in mon.attention] == [(3, 4)],
                  f"keyword-only first batch: {mon.discovery.summary()}")
            check(not said, f"keyword-only first batch warned: {[r.getMessage() for r in said]}")
        else:
            check(mon.attention == [], "an unreplayable batch was observed")
            check(len(said) == 1 and "could not replay the first batch" in said[0].getMessage(),
                  f"unreplayable first batch: {[r.getMessage() for r in cap.records[n:]]}")
    print("  a keyword-only forward is observed on its first batch; one that cannot be "
          "replayed gets one WARNING naming example_input=", flush=True)


def check_deferred_daemon(torch, foreshock, args, workdir, DictModel, batch):
    """The observed pass at the first step() with the real client: the
    connection opens then (its Hello carries what the pass found) and the
    daemon takes every report."""
    os.environ["FORESHOCK_LIB"] = os.path.join(os.path.abspath(args.build_dir),
                                               "libforeshock.so")
    daemon = fstest.Daemon(args.build_dir, workdir)
    try:
        m = DictModel()
        mon = foreshock.Monitor(m, endpoint=daemon.endpoint, run="deferred", windows=(1,),
                                every=1)
        check(mon.stats().get("submitted", 0) == 0, "deferred: connected before the first step")
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(1, 5):
            loss = m(batch).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step(step, loss=loss.detach())
        st = mon.close(60)
    finally:
        daemon.stop()
    check([(a.n_heads, a.head_dim) for a in mon.attention] == [(3, 4)],
          f"deferred with the daemon: {mon.discovery.summary()}")
    check(st.get("acked") == 4 and not st.get("dropped"), f"deferred: daemon stats {st}")
    print(f"  first-step observation with the real client: {st.get('acked')} of 4 reports "
          "acknowledged", flush=True)


def main(args, workdir):
    sys.path.insert(0, os.path.join(args.source_dir, "client", "python"))
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import foreshock
    torch.set_num_threads(1)
    print(f"  torch {torch.__version__}", flush=True)
    cap = Capture()
    logger = logging.getLogger("foreshock")
    logger.addHandler(cap)
    logger.setLevel(logging.DEBUG)
    members = zoo(torch, nn, F)
    check(len(members) >= 10, "zoo too small")
    shown = {}
    for name, build, exp in members:
        shown[name] = check_member(torch, foreshock, cap, name, build, exp)
    check_compiled(torch, foreshock, members)
    check_no_side_effects(torch, nn, foreshock)
    DictModel, batch = check_monitor_inputs(torch, nn, foreshock, cap)
    check_keyword_first_batch(torch, nn, foreshock, cap)
    check_cast_indices(torch, nn, foreshock)
    check_computed_fresh(torch, nn, foreshock)
    check_deferred_daemon(torch, foreshock, args, workdir, DictModel, batch)
    for n in shown:
        if n.startswith(("DeepSeek", "per-head", "Meta")):
            print(f"\n  summary for {n}:\n    " + shown[n].replace("\n", "\n    "), flush=True)


if __name__ == "__main__":
    fstest.run_main(main)
