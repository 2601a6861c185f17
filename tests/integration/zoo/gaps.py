"""Layouts discovery used to miss, one or two members per gap, each written
after the public code it is named for:

  top-k indices cast before dispatch   MegaBlocks' dMoE (indices_and_bins
                                       casts top_expert to int32 before its
                                       sort and histogram); a router whose
                                       ranking is cast before its [.., :k]
  weights computed from parameters     torch.nn.utils.parametrize (a row
                                       normalisation, weight_norm), old-style
                                       weight_norm (weight_g / weight_v)
  1x1 convolutions as projections      denoising-diffusion-pytorch's
                                       Attention (to_qkv = Conv2d(dim, 3 *
                                       hidden, 1)), a Conv1d q/k pair over a
                                       sequence
  LoRA                                 PEFT's LoraLayer Linear (base_layer,
                                       lora_A / lora_B ModuleDicts, scaling),
                                       loralib's Linear (lora_A / lora_B
                                       Parameters)
  keyword-only and dict-batch forwards forward(*, input_ids, attention_mask)
                                       and forward(batch) with
                                       batch["input_ids"]

Judgement calls (each Truth.note says so): a computed weight is monitored as
the weight the forward multiplies by -- the parametrization's value, g v/|v|,
LoRA's W + scale * B @ A -- recomputed from the parameters at each get();
its Rows name that effective weight (Rows.eff), and verify_truth scales it
through the parameter whose rows it is made of (and lora_B's rows: W + s B A
scales row by row).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Attn, Router, Rows, Truth, heads_separate, member
from .decoders import (LlamaAttention, LlamaDecoderLayer, llama_config, mlp_gates,
                       separate_truth)
from .parts import D, DH, H, HKV, L, VOCAB, Decoder, RMSNorm, attend, config, tokens

E, K, F_ = 4, 2, 16


# ---- MegaBlocks dMoE: LearnedRouter `layer`, indices cast to int32 before sort/histogram -------

class LearnedRouter(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.layer = nn.Linear(args.hidden_size, args.moe_num_experts, bias=False)

    def _top_k(self, scores):
        if self.args.moe_top_k == 1:
            return scores.max(dim=-1, keepdim=True)
        return torch.topk(scores, self.args.moe_top_k, dim=-1)

    def forward(self, x):
        scores = self.layer(x.view(-1, x.shape[-1])).softmax(dim=-1)
        expert_weights, expert_indices = self._top_k(scores)
        return scores, expert_weights, expert_indices


class ExpertMLP(nn.Module):
    """Stacked expert weights w1 [E*ffn, d], w2 [E*ffn, d] (MegaBlocks' MLP)."""

    def __init__(self, args):
        super().__init__()
        self.ffn = args.ffn_hidden_size
        self.w1 = nn.Parameter(torch.randn(args.moe_num_experts * self.ffn, args.hidden_size) * .1)
        self.w2 = nn.Parameter(torch.randn(args.moe_num_experts * self.ffn, args.hidden_size) * .1)

    def forward(self, x, e):
        w1 = self.w1[e * self.ffn:(e + 1) * self.ffn]
        w2 = self.w2[e * self.ffn:(e + 1) * self.ffn]
        return F.gelu(x @ w1.t()) @ w2


class dMoE(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.num_experts = args.moe_num_experts
        self.top_k = args.moe_top_k
        self.router = LearnedRouter(args)
        self.experts = ExpertMLP(args)

    def indices_and_bins(self, top_expert):
        top_expert = top_expert.int()
        bin_ids, indices = torch.sort(top_expert)  # MegaBlocks: ops.sort (CUB radix sort)
        tokens_per_expert = torch.bincount(top_expert, minlength=self.num_experts)  # histogram
        bins = torch.cumsum(tokens_per_expert, 0)
        return indices, bin_ids, bins, tokens_per_expert

    def forward(self, x):
        in_shape = x.shape
        _, expert_weights, top_experts = self.router(x)
        x = x.view(-1, x.shape[-1])
        expert_weights, top_experts = expert_weights.flatten(), top_experts.flatten()
        indices, bin_ids, bins, _ = self.indices_and_bins(top_experts)
        out = torch.zeros_like(x)
        start = 0
        for e in range(self.num_experts):
            end = int(bins[e])
            if end > start:
                slots = indices[start:end].long()
                tok = slots // self.top_k
                y = self.experts(x[tok], e) * expert_weights[slots, None]
                out = out.index_add(0, tok, y.to(x.dtype))
            start = end
        return out.view(in_shape)


class DmoeBlock(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, i)
        self.moe = dMoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.moe(self.post_attention_layernorm(x))


@member("megablocks-dmoe-int")
def megablocks_dmoe_int():
    cfg = llama_config(moe_num_experts=E, moe_top_k=K, ffn_hidden_size=F_)
    model = Decoder(cfg, DmoeBlock, rotary_dim=DH)
    truth = separate_truth("model.layers", L, H, HKV, DH)
    truth.routers = [Router(i, E, K, Rows(f"model.layers.{i}.moe.router.layer.weight", range(E)),
                            f"model.layers.{i}.moe.router.layer") for i in range(L)]
    truth.note = "top-k indices cast to int32 (.int()) before they dispatch: still a router"
    return model, tokens(), truth


# ---- a ranked router: sort, cast, then the first k (names say nothing) --------------------------

class RankedMoE(nn.Module):
    def __init__(self, d, e, k):
        super().__init__()
        self.k = k
        self.scorer = nn.Linear(d, e, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(e))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = self.scorer(flat).softmax(-1)
        order = torch.argsort(probs, dim=-1, descending=True).to(torch.int32)
        chosen = order[:, :self.k].long()
        w = probs.gather(1, chosen)
        out = torch.zeros_like(flat)
        for e, ex in enumerate(self.experts):
            hit = (chosen == e)
            rows = hit.any(-1).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, ex(flat[rows]) * (w * hit).sum(-1)[rows, None])
        return out.view(x.shape)


class RankedBlock(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, i)
        self.ffn = RankedMoE(cfg.hidden_size, E, K)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.ffn(self.post_attention_layernorm(x))


@member("argsort-cast-router")
def argsort_cast_router():
    model = Decoder(llama_config(), RankedBlock, rotary_dim=DH)
    truth = separate_truth("model.layers", L, H, HKV, DH)
    truth.routers = [Router(i, E, K, Rows(f"model.layers.{i}.ffn.scorer.weight", range(E)),
                            f"model.layers.{i}.ffn.scorer") for i in range(L)]
    truth.note = ("argsort over the router's E probabilities, cast to int32 and back, first "
                  "k taken: top-k is the slice's k")
    return model, tokens(), truth


# ---- parametrized q/k projections --------------------------------------------------------------

class UnitRows(nn.Module):
    """A parametrization: every row of the weight on the unit sphere."""

    def forward(self, w):
        return F.normalize(w, dim=-1)


def _weight_norm(linear):
    """parametrizations.weight_norm where torch has it (2.1+), else the
    old-style hook (weight_g / weight_v)."""
    pz = getattr(torch.nn.utils, "parametrizations", None)
    if pz is not None and hasattr(pz, "weight_norm"):
        return pz.weight_norm(linear)
    return torch.nn.utils.weight_norm(linear)


def _effective(params, prefix):
    """The weight module `prefix` multiplies by, from the named parameters."""
    if f"{prefix}.parametrizations.weight.original" in params:        # UnitRows
        return F.normalize(params[f"{prefix}.parametrizations.weight.original"], dim=-1)
    if f"{prefix}.parametrizations.weight.original0" in params:       # weight_norm (new)
        return torch._weight_norm(params[f"{prefix}.parametrizations.weight.original1"],
                                  params[f"{prefix}.parametrizations.weight.original0"], 0)
    return torch._weight_norm(params[f"{prefix}.weight_v"], params[f"{prefix}.weight_g"], 0)


def _raw(params_names, prefix):
    """The parameter whose rows the effective weight's rows are made of."""
    for n in ("parametrizations.weight.original", "parametrizations.weight.original1",
              "weight_v"):
        if f"{prefix}.{n}" in params_names:
            return f"{prefix}.{n}"
    raise KeyError(prefix)


def _eff_rows(model, prefix, n, dh):
    names = {k for k, _ in model.named_parameters()}
    raw = _raw(names, prefix)
    return [Rows(raw, range(i * dh, (i + 1) * dh),
                 eff=lambda params, p=prefix: _effective(params, p)) for i in range(n)]


class ParamLayer(LlamaDecoderLayer):
    def __init__(self, cfg, i):
        super().__init__(cfg, i)
        from torch.nn.utils import parametrize
        parametrize.register_parametrization(self.self_attn.q_proj, "weight", UnitRows())
        self.self_attn.k_proj = _weight_norm(self.self_attn.k_proj)


_COMPUTED_NOTE = ("computed weights are monitored as the weight the forward multiplies by, "
                  "recomputed from the parameters at each get()")


@member("parametrized-qk")
def parametrized_qk():
    model = Decoder(llama_config(), ParamLayer, rotary_dim=DH)
    att = []
    for i in range(L):
        m = f"model.layers.{i}.self_attn"
        att.append(Attn(i, H, HKV, DH, _eff_rows(model, f"{m}.q_proj", H, DH),
                        _eff_rows(model, f"{m}.k_proj", HKV, DH), m))
    return model, tokens(), Truth(att, not_reported=mlp_gates("model.layers", L),
                                  note=_COMPUTED_NOTE)


class WNAttention(nn.Module):
    """lucidrains' Attention (perceiver-pytorch): to_q, to_kv fused [k; v],
    'b n (h d) -> (b h) n d', sim = einsum('b i d, b j d -> b i j'),
    softmax; here with weight-normed projections: to_q by the old-style hook
    (weight_g, weight_v), to_kv by a parametrization (UnitRows)."""

    def __init__(self, query_dim, heads=H, dim_head=DH, normed=True):
        super().__init__()
        from torch.nn.utils import parametrize
        inner = dim_head * heads
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_kv = nn.Linear(query_dim, inner * 2, bias=False)
        if normed:
            self.to_q = torch.nn.utils.weight_norm(self.to_q)
            parametrize.register_parametrization(self.to_kv, "weight", UnitRows())
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, x, context=None):
        h = self.heads
        context = x if context is None else context
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        b, n, _ = q.shape
        q, k, v = (t.reshape(t.shape[0], t.shape[1], h, -1).permute(0, 2, 1, 3)
                   .reshape(t.shape[0] * h, t.shape[1], -1) for t in (q, k, v))
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b i j, b j d -> b i d", attn, v)
        out = out.reshape(b, h, n, -1).permute(0, 2, 1, 3).reshape(b, n, -1)
        return self.to_out(out)


class WNEncoder(nn.Module):
    def __init__(self, d=D, normed=True):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(nn.ModuleList([nn.LayerNorm(d), WNAttention(d, normed=normed)])
                                    for _ in range(L))

    def forward(self, x):
        x = self.token_emb(x)
        for norm, attn in self.layers:
            x = x + attn(norm(x))
        return x


@member("weightnorm-to-q-kv")
def weightnorm_to_q_kv():
    model = WNEncoder()
    att = []
    for i in range(L):
        m = f"layers.{i}.1"
        q, kv = f"{m}.to_q", f"{m}.to_kv"
        qs = [Rows(f"{q}.weight_v", range(j * DH, (j + 1) * DH),
                   eff=lambda params, p=q: _effective(params, p)) for j in range(H)]
        ks = [Rows(f"{kv}.parametrizations.weight.original", range(j * DH, (j + 1) * DH),
                   eff=lambda params, p=kv: _effective(params, p)) for j in range(H)]
        att.append(Attn(i, H, H, DH, qs, ks, m))
    return model, tokens(), Truth(att, note=_COMPUTED_NOTE + " (old-style weight_norm: "
                                  "g v / |v| per row; a parametrization: its value)")


# ---- 1x1 convolutions as projections ------------------------------------------------------------

class ConvAttention(nn.Module):
    """denoising-diffusion-pytorch's Attention: to_qkv = Conv2d(dim, 3 *
    heads * dim_head, 1, bias=False), rearranged 'b (h c) x y -> b h c (x y)',
    sim = einsum('b h d i, b h d j -> b h i j'), softmax, to_out Conv2d 1x1."""

    def __init__(self, dim, heads=H, dim_head=DH):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        hidden = dim_head * heads
        self.norm = nn.GroupNorm(1, dim)
        self.to_qkv = nn.Conv2d(dim, hidden * 3, 1, bias=False)
        self.to_out = nn.Conv2d(hidden, dim, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        x = self.norm(x)
        qkv = self.to_qkv(x).chunk(3, dim=1)
        q, k, v = (t.reshape(b, self.heads, -1, h * w) for t in qkv)
        q = q * self.scale
        sim = torch.einsum("b h d i, b h d j -> b h i j", q, k)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b h d j -> b h i d", attn, v)
        out = out.permute(0, 1, 3, 2).reshape(b, -1, h, w)
        return self.to_out(out)


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) + x


class TinyUnetMid(nn.Module):
    """init_conv (7x7), then the mid blocks' attention twice, final 1x1."""

    def __init__(self, channels=3, dim=D):
        super().__init__()
        self.init_conv = nn.Conv2d(channels, dim, 7, padding=3)
        self.mid = nn.ModuleList(Residual(ConvAttention(dim)) for _ in range(L))
        self.final_conv = nn.Conv2d(dim, channels, 1)

    def forward(self, x):
        x = self.init_conv(x)
        for blk in self.mid:
            x = blk(x)
        return self.final_conv(x)


def _conv_heads(w, n, first, dh=DH):
    return [Rows(w, range((first + i) * dh, (first + i + 1) * dh), conv=True) for i in range(n)]


@member("ddpm-conv2d-qkv")
def ddpm_conv2d_qkv():
    model = TinyUnetMid()
    att = []
    for i in range(L):
        w = f"mid.{i}.fn.to_qkv.weight"
        att.append(Attn(i, H, H, DH, _conv_heads(w, H, 0), _conv_heads(w, H, H),
                        f"mid.{i}.fn"))
    return model, (torch.randn(2, 3, 4, 4),), Truth(
        att, note="1x1 Conv2d to_qkv [3 * H * dh, dim, 1, 1]: its output-channel rows")


class Conv1dAttention(nn.Module):
    """q/k/v as Conv1d(d, inner, 1) over [B, d, T] (audio / sequence models)."""

    def __init__(self, d, heads=H, dim_head=DH):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_q = nn.Conv1d(d, inner, 1)
        self.to_k = nn.Conv1d(d, inner, 1)
        self.to_v = nn.Conv1d(d, inner, 1)
        self.to_out = nn.Conv1d(inner, d, 1)

    def forward(self, x):
        b, d, t = x.shape
        q, k, v = (f(x).view(b, self.heads, -1, t).transpose(-1, -2)
                   for f in (self.to_q, self.to_k, self.to_v))
        out = attend(q, k, v, causal=False)
        return self.to_out(out.transpose(-1, -2).reshape(b, -1, t))


class Conv1dEncoder(nn.Module):
    def __init__(self, n_mels=12, d=D):
        super().__init__()
        self.proj_in = nn.Linear(n_mels, d)
        self.layers = nn.ModuleList(Conv1dAttention(d) for _ in range(L))

    def forward(self, feats):
        x = self.proj_in(feats).transpose(1, 2)
        for layer in self.layers:
            x = x + layer(x)
        return x.transpose(1, 2)


@member("conv1d-qk-audio")
def conv1d_qk_audio():
    model = Conv1dEncoder()
    att = [Attn(i, H, H, DH, _conv_heads(f"layers.{i}.to_q.weight", H, 0),
                _conv_heads(f"layers.{i}.to_k.weight", H, 0), f"layers.{i}") for i in range(L)]
    return model, (torch.randn(2, 8, 12),), Truth(
        att, note="1x1 Conv1d q/k [H * dh, d, 1]: their output-channel rows")


# ---- LoRA ---------------------------------------------------------------------------------------

class LoraLinear(nn.Module):
    """PEFT's lora.Linear: base_layer, lora_A / lora_B / lora_dropout
    ModuleDicts and scaling per adapter; forward base_layer(x) + lora_B(
    lora_A(dropout(x))) * scaling for each active adapter."""

    def __init__(self, base, r=4, lora_alpha=8, adapter="default"):
        super().__init__()
        self.base_layer = base
        self.r, self.lora_alpha, self.scaling = {adapter: r}, {adapter: lora_alpha}, \
            {adapter: lora_alpha / r}
        self.lora_dropout = nn.ModuleDict({adapter: nn.Dropout(0.0)})
        self.lora_A = nn.ModuleDict({adapter: nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({adapter: nn.Linear(r, base.out_features, bias=False)})
        nn.init.normal_(self.lora_B[adapter].weight, std=0.1)  # trained: B is no longer 0
        self.use_dora = {adapter: False}
        self.fan_in_fan_out = False
        self.merged_adapters = []
        self._active_adapter = [adapter]
        self._disable_adapters = False
        base.weight.requires_grad_(False)

    @property
    def merged(self):
        return bool(self.merged_adapters)

    @property
    def disable_adapters(self):
        return self._disable_adapters

    @property
    def active_adapters(self):
        return self._active_adapter

    @property
    def weight(self):
        return self.base_layer.weight

    def forward(self, x):
        result = self.base_layer(x)
        dtype = result.dtype
        for name in self.active_adapters:
            lora_A, lora_B = self.lora_A[name], self.lora_B[name]
            x = x.to(lora_A.weight.dtype)
            result = result + lora_B(lora_A(self.lora_dropout[name](x))) * self.scaling[name]
        return result.to(dtype)


class PeftLlamaLayer(LlamaDecoderLayer):
    def __init__(self, cfg, i):
        super().__init__(cfg, i)
        a = self.self_attn
        a.q_proj, a.v_proj = LoraLinear(a.q_proj), LoraLinear(a.v_proj)  # PEFT's llama default


def _lora_eff(base, a, b, scale):
    # the sum foreshock's effective.lora_delta forms: W + (B @ A) * scale
    return lambda params: params[base] + (params[b] @ params[a]) * scale


@member("peft-lora-llama")
def peft_lora_llama():
    model = Decoder(llama_config(), PeftLlamaLayer, rotary_dim=DH)
    att, nr = [], []
    for i in range(L):
        m = f"model.layers.{i}.self_attn"
        q = f"{m}.q_proj"
        base, a, b = f"{q}.base_layer.weight", f"{q}.lora_A.default.weight", \
            f"{q}.lora_B.default.weight"
        eff = _lora_eff(base, a, b, 8 / 4)
        qs = [Rows(base, range(h * DH, (h + 1) * DH), eff=eff, also=(b,)) for h in range(H)]
        _, ks = heads_separate(f"{q}.weight", f"{m}.k_proj.weight", H, HKV, DH)
        att.append(Attn(i, H, HKV, DH, qs, ks, m))
        nr += [a, b, f"{m}.v_proj.lora_A.default.weight"]
    return model, tokens(), Truth(att, not_reported=nr + mlp_gates("model.layers", L), note=(
        "LoRA: Wq is the effective W + scale * B @ A (what q = base(x) + scale B(A(x)) "
        "multiplies by), recomputed at each get(); lora_A / lora_B are no sites"))


class LoraBertLinear(nn.Linear):
    """loralib's Linear: an nn.Linear with lora_A [r, in] and lora_B [out, r]
    Parameters, scaling = lora_alpha / r, merged."""

    def __init__(self, d_in, d_out, r=2, lora_alpha=4):
        super().__init__(d_in, d_out)
        self.r, self.lora_alpha, self.scaling = r, lora_alpha, lora_alpha / r
        self.lora_A = nn.Parameter(torch.randn(r, d_in) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(d_out, r) * 0.1)
        self.lora_dropout = nn.Identity()
        self.merged = False
        self.fan_in_fan_out = False

    def forward(self, x):
        result = F.linear(x, self.weight, bias=self.bias)
        result += (self.lora_dropout(x) @ self.lora_A.transpose(0, 1)
                   @ self.lora_B.transpose(0, 1)) * self.scaling
        return result


class BertSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_attention_heads = cfg.num_attention_heads
        self.attention_head_size = cfg.hidden_size // cfg.num_attention_heads
        self.query = LoraBertLinear(cfg.hidden_size, cfg.hidden_size)
        self.key = LoraBertLinear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):
        b, t, _ = x.shape

        def heads(y):
            return y.view(b, t, self.num_attention_heads, -1).permute(0, 2, 1, 3)
        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.attention_head_size ** 0.5
        probs = scores.softmax(-1)
        return torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(b, t, -1)


class BertLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = BertSelfAttention(cfg)
        self.attention.output = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.ln = nn.LayerNorm(cfg.hidden_size)

    def forward(self, x):
        return self.ln(x + self.attention.output(self.attention.self(x)))


class LoraBert(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(cfg) for _ in range(L))

    def forward(self, input_ids):
        x = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            x = layer(x)
        return x


@member("loralib-bert")
def loralib_bert():
    cfg = config(vocab_size=VOCAB, hidden_size=D, num_attention_heads=H)
    model = LoraBert(cfg)
    att, nr = [], []
    for i in range(L):
        m = f"encoder.layer.{i}.attention.self"

        def rows(proj):
            w, a, b = f"{m}.{proj}.weight", f"{m}.{proj}.lora_A", f"{m}.{proj}.lora_B"
            eff = _lora_eff(w, a, b, 4 / 2)
            return [Rows(w, range(h * DH, (h + 1) * DH), eff=eff, also=(b,)) for h in range(H)]
        att.append(Attn(i, H, H, DH, rows("query"), rows("key"), m))
        nr += [f"{m}.query.lora_A", f"{m}.key.lora_B"]
    return model, tokens(), Truth(att, not_reported=nr, note=(
        "loralib LoRA: Wq, Wk are W + scale * B @ A, recomputed at each get()"))


# ---- keyword-only and dict-batch forwards --------------------------------------------------------
# Attention that names do not find (to_q / to_kv: perceiver-pytorch's), so that the observed pass,
# which must run the forward, is what finds it.

class KwargsEncoder(WNEncoder):
    """forward(*, input_ids, attention_mask=None): keyword arguments only."""

    def forward(self, *, input_ids, attention_mask=None):
        return super().forward(input_ids)


def _to_q_kv_truth():
    att = []
    for i in range(L):
        m = f"layers.{i}.1"
        qs, ks = heads_separate(f"{m}.to_q.weight", f"{m}.to_kv.weight", H, H, DH)
        att.append(Attn(i, H, H, DH, qs, ks, m))
    return Truth(att)


@member("kwargs-only-encoder")
def kwargs_only_encoder():
    return KwargsEncoder(normed=False), {"input_ids": tokens()[0]}, _to_q_kv_truth()


class BatchDictEncoder(WNEncoder):
    """forward(batch) with batch["input_ids"] (a data loader's dict, passed whole)."""

    def forward(self, batch):
        return super().forward(batch["input_ids"])


@member("dict-batch-encoder")
def dict_batch_encoder():
    return BatchDictEncoder(normed=False), ({"input_ids": tokens()[0]},), _to_q_kv_truth()
