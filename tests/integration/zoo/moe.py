"""Mixture-of-experts models: transformers' Mixtral, Qwen2-MoE, OLMoE, DBRX,
Switch Transformers (top-1, encoder-decoder), DeepSeek-V2 and V3 (MLA
attention, softmax and sigmoid routers), Jamba (Mamba + attention hybrid);
Megatron-core's MoE GPT; DeepSpeed-MoE; fairseq's MoE (Top2Gate, Top1Gate);
research routers: noisy top-k gating on raw Parameters, expert-choice
routing, a sigmoid router named `selector`. Written here after the public
code's names and forward structure, tiny and random."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Attn, Router, Rows, Truth, heads_contiguous, heads_grouped, heads_separate, member
from .decoders import LlamaAttention, LlamaMLP, llama_config
from .parts import (D, DH, H, HKV, VOCAB, Decoder, RMSNorm, RotaryEmbedding,
                    apply_rotary_pos_emb, attend, config, tokens)

E, K, F_ = 4, 2, 16


def dispatch(x, experts, idx, weights):
    """sum_k weights[:, k] * experts[idx[:, k]](x) over the tokens of x [N, d]."""
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        hit = idx == e
        rows = hit.any(-1).nonzero().flatten()
        if rows.numel() == 0:
            continue
        w = (weights * hit).sum(-1)[rows, None]
        out.index_add_(0, rows, (w * expert(x[rows])).to(x.dtype))
    return out


def weight_rows(param, n, t=False):
    return Rows(param, range(n), t)


def moe_truth(prefix, layers, h, kv, dh, router_name, e, k, attn="self_attn", moe_layers=None,
              not_reported=(), t=False):
    att, rts = [], []
    for i in range(layers):
        m = f"{prefix}.{i}.{attn}"
        qs, ks = heads_separate(f"{m}.q_proj.weight", f"{m}.k_proj.weight", h, kv, dh)
        att.append(Attn(i, h, kv, dh, qs, ks, m))
    for i in (range(layers) if moe_layers is None else moe_layers):
        w = f"{prefix}.{i}.{router_name}"
        rts.append(Router(i, e, k, weight_rows(w, e, t), w.rsplit(".", 1)[0]))
    return Truth(att, rts, not_reported=list(not_reported))


# ---- Mixtral (transformers 4.x layout): gate Linear, experts w1/w2/w3 ---------------------------

class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hidden_dim = cfg.hidden_size
        self.num_experts = cfg.num_local_experts
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP(cfg)
                                      for _ in range(self.num_experts)])

    def forward(self, x):
        b, t, d = x.shape
        x = x.view(-1, d)
        router_logits = self.gate(x)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        out = dispatch(x, self.experts, selected_experts, routing_weights)
        return out.view(b, t, d), router_logits


class MixtralDecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, i)
        self.block_sparse_moe = MixtralSparseMoeBlock(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        x = x + self.self_attn(self.input_layernorm(x), rope)
        out, _ = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + out


@member("mixtral")
def mixtral():
    cfg = llama_config(num_local_experts=E, num_experts_per_tok=K, intermediate_size=F_,
                       sliding_window=None)
    model = Decoder(cfg, MixtralDecoderLayer, rotary_dim=DH)
    return model, tokens(), moe_truth("model.layers", 2, H, HKV, DH,
                                      "block_sparse_moe.gate.weight", E, K)


# ---- Qwen2-MoE (transformers 5 layout): router module with a weight, stacked experts,
# shared expert with a 1-output gate -------------------------------------------------------------

class Qwen2MoeTopKRouter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_experts
        self.norm_topk_prob = cfg.norm_topk_prob
        self.hidden_dim = cfg.hidden_size
        self.weight = nn.Parameter(torch.randn(self.num_experts, self.hidden_dim) * 0.1)

    def forward(self, x):
        x = x.reshape(-1, self.hidden_dim)
        router_logits = F.linear(x, self.weight)
        probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_value /= top_value.sum(dim=-1, keepdim=True)
        return router_logits, top_value.to(x.dtype), top_index


class Qwen2MoeExperts(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.hidden_dim = cfg.hidden_size
        self.intermediate_dim = cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.randn(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim) * 0.1)
        self.down_proj = nn.Parameter(
            torch.randn(self.num_experts, self.hidden_dim, self.intermediate_dim) * 0.1)

    def forward(self, x, top_index, top_weights):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            hit = top_index == e
            rows = hit.any(-1).nonzero().flatten()
            if rows.numel() == 0:
                continue
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, rows, y * (top_weights * hit).sum(-1)[rows, None])
        return out


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = Qwen2MoeTopKRouter(cfg)
        self.experts = Qwen2MoeExperts(cfg)
        self.shared_expert = LlamaMLP(config(hidden_size=cfg.hidden_size,
                                             intermediate_size=cfg.shared_expert_intermediate_size))
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        x = x.view(-1, d)
        shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
        _, w, idx = self.gate(x)
        return (self.experts(x, idx, w) + shared).view(b, t, d)


class Qwen2MoeDecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, i, bias=True)
        self.mlp = Qwen2MoeSparseMoeBlock(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


@member("qwen2-moe")
def qwen2_moe():
    cfg = llama_config(num_experts=8, num_experts_per_tok=4, norm_topk_prob=False,
                       moe_intermediate_size=8, shared_expert_intermediate_size=16)
    model = Decoder(cfg, Qwen2MoeDecoderLayer, rotary_dim=DH)
    nr = [f"model.layers.{i}.mlp.{n}.weight" for i in range(2)
          for n in ("shared_expert_gate", "shared_expert.gate_proj")]
    return model, tokens(), moe_truth("model.layers", 2, H, HKV, DH, "mlp.gate.weight", 8, 4,
                                      not_reported=nr)


# ---- OLMoE (transformers 4.x): q_norm/k_norm over the whole projection, gate Linear -----------

class OlmoeAttention(LlamaAttention):
    def __init__(self, cfg, i):
        super().__init__(cfg, i)
        self.q_norm = RMSNorm(cfg.hidden_size)
        self.k_norm = RMSNorm(cfg.hidden_size // cfg.num_attention_heads *
                              cfg.num_key_value_heads)

    def forward(self, x, rope):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x)).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class OlmoeMLP(LlamaMLP):
    pass


class OlmoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList([OlmoeMLP(cfg) for _ in range(self.num_experts)])

    def forward(self, x):
        b, t, d = x.shape
        x = x.view(-1, d)
        logits = self.gate(x)
        w = F.softmax(logits, dim=1, dtype=torch.float)
        w, idx = torch.topk(w, self.top_k, dim=-1)
        return dispatch(x, self.experts, idx, w).view(b, t, d)


class OlmoeDecoderLayer(Qwen2MoeDecoderLayer):
    def __init__(self, cfg, i):
        nn.Module.__init__(self)
        self.self_attn = OlmoeAttention(cfg, i)
        self.mlp = OlmoeSparseMoeBlock(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)


@member("olmoe")
def olmoe():
    cfg = llama_config(num_key_value_heads=H, num_experts=8, num_experts_per_tok=3,
                       norm_topk_prob=False, intermediate_size=8, num_hidden_layers=3)
    model = Decoder(cfg, OlmoeDecoderLayer, rotary_dim=DH)
    nr = [f"model.layers.{i}.mlp.experts.0.gate_proj.weight" for i in range(3)]
    return model, tokens(), moe_truth("model.layers", 3, H, H, DH, "mlp.gate.weight", 8, 3,
                                      not_reported=nr)


# ---- DBRX: Wqkv with clip_qkv, router.layer, experts as flat w1/v1/w2 Parameters ---------------

class DbrxAttention(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.config = cfg
        self.hidden_size = cfg.d_model
        self.num_heads = cfg.n_heads
        self.head_dim = self.hidden_size // self.num_heads
        attn_config = cfg.attn_config
        self.clip_qkv = attn_config.clip_qkv
        self.num_key_value_heads = attn_config.kv_n_heads
        self.Wqkv = nn.Linear(self.hidden_size,
                              self.hidden_size + 2 * self.num_key_value_heads * self.head_dim,
                              bias=False)
        self.out_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.Wqkv(x).clamp(min=-self.clip_qkv, max=self.clip_qkv)
        kvd = self.num_key_value_heads * self.head_dim
        q, k, v = qkv.split([self.hidden_size, kvd, kvd], dim=2)
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *self.rotary_emb(x, t))
        rep = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = attend(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, self.hidden_size))


class DbrxRouter(nn.Module):
    def __init__(self, ffn_config, d):
        super().__init__()
        self.hidden_size = d
        self.moe_jitter_eps = None
        self.layer = nn.Linear(d, ffn_config.moe_num_experts, bias=False)

    def forward(self, x):
        return self.layer(x.view(-1, x.shape[-1]))


class DbrxExpertGLU(nn.Module):
    def __init__(self, ffn_config, d):
        super().__init__()
        n, f = ffn_config.moe_num_experts, ffn_config.ffn_hidden_size
        self.hidden_size, self.ffn_hidden_size, self.moe_num_experts = d, f, n
        self.w1 = nn.Parameter(torch.randn(n * f, d) * 0.1)
        self.v1 = nn.Parameter(torch.randn(n * f, d) * 0.1)
        self.w2 = nn.Parameter(torch.randn(n * f, d) * 0.1)

    def forward(self, x, e):
        f = self.ffn_hidden_size
        w1, v1, w2 = (p.view(self.moe_num_experts, f, self.hidden_size)[e]
                      for p in (self.w1, self.v1, self.w2))
        return (F.silu(x @ w1.t()) * (x @ v1.t())) @ w2


class DbrxExperts(nn.Module):
    def __init__(self, ffn_config, d):
        super().__init__()
        self.moe_num_experts = ffn_config.moe_num_experts
        self.mlp = DbrxExpertGLU(ffn_config, d)


class DbrxFFN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        fc = cfg.ffn_config
        self.router = DbrxRouter(fc, cfg.d_model)
        self.experts = DbrxExperts(fc, cfg.d_model)
        self.moe_normalize_expert_weights = 1
        self.top_k = fc.moe_top_k

    def forward(self, x):
        b, t, d = x.shape
        logits = self.router(x)
        w = F.softmax(logits, dim=1, dtype=torch.float)
        w, idx = torch.topk(w, self.top_k, dim=-1)
        w = w / w.norm(p=1, dim=-1, keepdim=True)
        xs = x.view(-1, d)
        experts = [lambda y, e=e: self.experts.mlp(y, e)
                   for e in range(self.experts.moe_num_experts)]
        return dispatch(xs, experts, idx, w).view(b, t, d)


class DbrxBlock(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.norm_attn_norm = nn.Module()
        self.norm_attn_norm.norm_1 = nn.LayerNorm(cfg.d_model)
        self.norm_attn_norm.attn = DbrxAttention(cfg, i)
        self.norm_attn_norm.norm_2 = nn.LayerNorm(cfg.d_model)
        self.ffn = DbrxFFN(cfg)

    def forward(self, x):
        n = self.norm_attn_norm
        x = x + n.attn(n.norm_1(x))
        return x + self.ffn(n.norm_2(x))


class DbrxForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.transformer.blocks = nn.ModuleList(DbrxBlock(cfg, i) for i in range(cfg.n_layers))
        self.transformer.norm_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.transformer.wte(input_ids)
        for blk in self.transformer.blocks:
            x = blk(x)
        return self.lm_head(self.transformer.norm_f(x))


@member("dbrx")
def dbrx():
    cfg = config(d_model=D, n_heads=H, n_layers=2, vocab_size=VOCAB,
                 attn_config=config(kv_n_heads=HKV, clip_qkv=8.0, rope_theta=10000.0),
                 ffn_config=config(moe_num_experts=8, moe_top_k=4, ffn_hidden_size=8))
    att, rts = [], []
    for i in range(2):
        m = f"transformer.blocks.{i}.norm_attn_norm.attn"
        qs, ks = heads_contiguous(f"{m}.Wqkv.weight", H, HKV, DH)
        att.append(Attn(i, H, HKV, DH, qs, ks, m))
        w = f"transformer.blocks.{i}.ffn.router.layer.weight"
        rts.append(Router(i, 8, 4, weight_rows(w, 8), f"transformer.blocks.{i}.ffn.router"))
    return DbrxForCausalLM(cfg), tokens(), Truth(att, rts)


# ---- Switch Transformers: T5 encoder-decoder, top-1 router.classifier every other block --------

class SwitchAttention(nn.Module):
    """T5Attention: q/k/v/o, n_heads, key_value_proj_dim, inner_dim, no
    1/sqrt(d) scaling, relative position bias in the first layer."""

    def __init__(self, cfg, has_relative_attention_bias=False, is_decoder=False):
        super().__init__()
        self.is_decoder = is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
        self.relative_attention_num_buckets = cfg.relative_attention_num_buckets
        self.d_model = cfg.d_model
        self.key_value_proj_dim = cfg.d_kv
        self.n_heads = cfg.num_heads
        self.inner_dim = self.n_heads * self.key_value_proj_dim
        self.q = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, self.d_model, bias=False)
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.relative_attention_num_buckets,
                                                        self.n_heads)

    def compute_bias(self, tq, tk):
        ctx = torch.arange(tq)[:, None]
        mem = torch.arange(tk)[None, :]
        rel = (mem - ctx).clamp(-(self.relative_attention_num_buckets // 2) + 1,
                                self.relative_attention_num_buckets // 2 - 1)
        rel = rel + self.relative_attention_num_buckets // 2
        return self.relative_attention_bias(rel).permute(2, 0, 1)[None]

    def forward(self, x, kv=None, position_bias=None, causal=False):
        b, t, _ = x.shape
        src = x if kv is None else kv

        def shape(s):
            return s.view(b, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)
        q, k, v = shape(self.q(x)), shape(self.k(src)), shape(self.v(src))
        scores = torch.matmul(q, k.transpose(3, 2))
        if position_bias is None:
            if self.has_relative_attention_bias:
                position_bias = self.compute_bias(t, k.shape[2])
            else:
                position_bias = torch.zeros(1, self.n_heads, t, k.shape[2])
            if causal:
                position_bias = position_bias + torch.full((t, t), -1e9).triu(1)
        w = F.softmax((scores + position_bias).float(), dim=-1).type_as(scores)
        out = torch.matmul(w, v).transpose(1, 2).contiguous().view(b, -1, self.inner_dim)
        return self.o(out), position_bias


class SwitchTransformersTop1Router(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.expert_capacity = cfg.expert_capacity
        self.classifier = nn.Linear(cfg.hidden_size, self.num_experts, bias=cfg.router_bias)
        self.jitter_noise = cfg.router_jitter_noise

    def forward(self, x):
        logits = self.classifier(x)
        probs = F.softmax(logits, dim=-1)
        expert_index = torch.argmax(probs, dim=-1)
        expert_index = F.one_hot(expert_index, num_classes=self.num_experts)
        token_priority = torch.cumsum(expert_index, dim=-2)
        expert_index = expert_index * (token_priority <= self.expert_capacity)
        return expert_index, probs.max(dim=-1).values.unsqueeze(-1), logits


class SwitchTransformersDenseActDense(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wi = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        return self.wo(F.relu(self.wi(x)))


class SwitchTransformersSparseMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.router = SwitchTransformersTop1Router(cfg)
        self.experts = nn.ModuleDict({f"expert_{i}": SwitchTransformersDenseActDense(cfg)
                                      for i in range(cfg.num_experts)})

    def forward(self, x):
        mask, probs, _ = self.router(x)
        out = x.clone()
        for i, expert in enumerate(self.experts.values()):
            sel = mask[..., i].bool()
            if sel.any():
                out[sel] = expert(x[sel]).to(out.dtype)
        return probs * out


class SwitchLayerFF(nn.Module):
    def __init__(self, cfg, is_sparse):
        super().__init__()
        self.is_sparse = is_sparse
        self.mlp = SwitchTransformersSparseMLP(cfg) if is_sparse else \
            SwitchTransformersDenseActDense(cfg)
        self.layer_norm = RMSNorm(cfg.d_model)

    def forward(self, x):
        return x + self.mlp(self.layer_norm(x))


class SwitchLayerSelfAttention(nn.Module):
    def __init__(self, cfg, has_bias, is_decoder):
        super().__init__()
        self.SelfAttention = SwitchAttention(cfg, has_bias, is_decoder)
        self.layer_norm = RMSNorm(cfg.d_model)


class SwitchLayerCrossAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.EncDecAttention = SwitchAttention(cfg, False, True)
        self.layer_norm = RMSNorm(cfg.d_model)


class SwitchBlock(nn.Module):
    def __init__(self, cfg, has_bias, is_sparse, is_decoder):
        super().__init__()
        self.is_decoder = is_decoder
        self.layer = nn.ModuleList([SwitchLayerSelfAttention(cfg, has_bias, is_decoder)])
        if is_decoder:
            self.layer.append(SwitchLayerCrossAttention(cfg))
        self.layer.append(SwitchLayerFF(cfg, is_sparse))

    def forward(self, x, bias, enc=None, cross_bias=None):
        sa = self.layer[0]
        y, bias = sa.SelfAttention(sa.layer_norm(x), position_bias=bias, causal=self.is_decoder)
        x = x + y
        if self.is_decoder:
            ca = self.layer[1]
            y, cross_bias = ca.EncDecAttention(ca.layer_norm(x), kv=enc, position_bias=cross_bias)
            x = x + y
        return self.layer[-1](x), bias, cross_bias


class SwitchStack(nn.Module):
    def __init__(self, cfg, embed, is_decoder):
        super().__init__()
        self.embed_tokens = embed
        self.is_decoder = is_decoder
        n = cfg.num_decoder_layers if is_decoder else cfg.num_layers
        step = cfg.decoder_sparse_step if is_decoder else cfg.encoder_sparse_step
        self.block = nn.ModuleList(SwitchBlock(cfg, i == 0, i % step == 1, is_decoder)
                                   for i in range(n))
        self.final_layer_norm = RMSNorm(cfg.d_model)

    def forward(self, ids, enc=None):
        x = self.embed_tokens(ids)
        bias = cross = None
        for blk in self.block:
            x, bias, cross = blk(x, bias, enc, cross)
        return self.final_layer_norm(x)


class SwitchTransformersForConditionalGeneration(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = SwitchStack(cfg, self.shared, False)
        self.decoder = SwitchStack(cfg, self.shared, True)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, input_ids, decoder_input_ids):
        enc = self.encoder(input_ids)
        return self.lm_head(self.decoder(decoder_input_ids, enc))


@member("switch-top1")
def switch():
    cfg = config(vocab_size=VOCAB, d_model=D, hidden_size=D, d_kv=8, d_ff=16, num_heads=H,
                 num_layers=2, num_decoder_layers=2, num_experts=E, expert_capacity=64,
                 router_bias=False, router_jitter_noise=0.0, relative_attention_num_buckets=8,
                 encoder_sparse_step=2, decoder_sparse_step=2)
    model = SwitchTransformersForConditionalGeneration(cfg)
    att, rts = [], []
    for stack in ("encoder", "decoder"):
        for i in range(2):
            blk = f"{stack}.block.{i}"
            m = f"{blk}.layer.0.SelfAttention"
            qs, ks = heads_separate(f"{m}.q.weight", f"{m}.k.weight", H, H, 8)
            att.append(Attn((stack, i), H, H, 8, qs, ks, m))
            if stack == "decoder":
                m = f"{blk}.layer.1.EncDecAttention"
                qs, ks = heads_separate(f"{m}.q.weight", f"{m}.k.weight", H, H, 8)
                att.append(Attn((stack, i), H, H, 8, qs, ks, m, kind="cross"))
            if i % 2 == 1:
                ff = f"{blk}.layer.{2 if stack == 'decoder' else 1}.mlp.router"
                rts.append(Router((stack, i), E, 1, weight_rows(f"{ff}.classifier.weight", E),
                                  ff))
    ids = torch.randint(0, VOCAB, (2, 8))
    return model, (ids, torch.randint(0, VOCAB, (2, 6))), Truth(att, rts, stacks=True)


# ---- DeepSeek-V2 / V3: MLA attention, MoEGate with weight Parameter ------------------------------

class DeepseekAttention(nn.Module):
    """Multi-head latent attention: q_proj (V2-Lite) or q_a_proj ->
    q_a_layernorm -> q_b_proj (V3); kv_a_proj_with_mqa -> kv_a_layernorm ->
    kv_b_proj; the rope part of the key is one shared head."""

    def __init__(self, cfg, i):
        super().__init__()
        self.config = cfg
        self.num_heads = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.v_head_dim = cfg.v_head_dim
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.q_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        d = cfg.hidden_size
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d, self.num_heads * self.q_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * self.q_head_dim,
                                      bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                            bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank,
                                   self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, d, bias=False)
        self.rotary_emb = RotaryEmbedding(self.qk_rope_head_dim)
        self.softmax_scale = self.q_head_dim ** -0.5

    def forward(self, x, rope=None):
        b, t, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else \
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, self.num_heads, self.q_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        ckv = self.kv_a_proj_with_mqa(x)
        ckv, k_pe = torch.split(ckv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.view(b, t, 1, self.qk_rope_head_dim).transpose(1, 2)
        kv = self.kv_b_proj(self.kv_a_layernorm(ckv)).view(
            b, t, self.num_heads, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        cos, sin = self.rotary_emb(x, t)
        q_pe, k_pe = apply_rotary_pos_emb(q_pe, k_pe, cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, self.num_heads, t, self.qk_rope_head_dim)], dim=-1)
        w = torch.matmul(q, k.transpose(2, 3)) * self.softmax_scale
        w = w + torch.full((t, t), float("-inf")).triu(1)
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class DeepseekMoEGate(nn.Module):
    """V2: softmax scores, plain top-k. V3: sigmoid scores plus
    e_score_correction_bias, group-limited top-k, normalised weights."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.top_k = cfg.num_experts_per_tok
        self.n_routed_experts = cfg.n_routed_experts
        self.scoring_func = cfg.scoring_func
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.gating_dim = cfg.hidden_size
        self.weight = nn.Parameter(torch.randn(self.n_routed_experts, self.gating_dim) * 0.1)
        if self.scoring_func == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts))

    def forward(self, x):
        x = x.view(-1, x.shape[-1])
        logits = F.linear(x.float(), self.weight.float())
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
            w, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
            return idx, w
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias[None]
        group_scores = choice.view(x.shape[0], self.n_group, -1).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask[:, :, None].expand(x.shape[0], self.n_group,
                                                   self.n_routed_experts // self.n_group)
        choice = choice.masked_fill(~score_mask.reshape(x.shape[0], -1).bool(), float("-inf"))
        idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        return idx, w / (w.sum(-1, keepdim=True) + 1e-20)


class DeepseekMLP(LlamaMLP):
    def __init__(self, cfg, intermediate_size=None):
        super().__init__(config(hidden_size=cfg.hidden_size,
                                intermediate_size=intermediate_size or cfg.intermediate_size))


class DeepseekMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.num_experts_per_tok = cfg.num_experts_per_tok
        self.experts = nn.ModuleList([DeepseekMLP(cfg, cfg.moe_intermediate_size)
                                      for _ in range(cfg.n_routed_experts)])
        self.gate = DeepseekMoEGate(cfg)
        self.shared_experts = DeepseekMLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x):
        b, t, d = x.shape
        idx, w = self.gate(x)
        y = dispatch(x.view(-1, d), self.experts, idx, w).view(b, t, d)
        return y + self.shared_experts(x)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attn = DeepseekAttention(cfg, i)
        self.mlp = DeepseekMoE(cfg) if i >= cfg.first_k_dense_replace else DeepseekMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def deepseek_config(**kw):
    c = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=H, num_key_value_heads=H, q_lora_rank=None, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
             num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=8,
             first_k_dense_replace=1, scoring_func="softmax", n_group=1, topk_group=1)
    c.update(kw)
    return config(**c)


def deepseek_truth(cfg):
    att, rts = [], []
    dh = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    for i in range(cfg.num_hidden_layers):
        m = f"model.layers.{i}.self_attn"
        att.append(Attn(i, cfg.num_attention_heads, cfg.num_attention_heads, dh, [], [], m,
                        mla=True))
        if i >= cfg.first_k_dense_replace:
            g = f"model.layers.{i}.mlp.gate"
            rts.append(Router(i, cfg.n_routed_experts, cfg.num_experts_per_tok,
                              weight_rows(f"{g}.weight", cfg.n_routed_experts), g))
    nr = [f"model.layers.0.mlp.gate_proj.weight"]
    return Truth(att, rts, not_reported=nr)


@member("deepseek-v2-mla")
def deepseek_v2():
    cfg = deepseek_config()
    return Decoder(cfg, DeepseekDecoderLayer), tokens(), deepseek_truth(cfg)


@member("deepseek-v3-mla-sigmoid")
def deepseek_v3():
    cfg = deepseek_config(q_lora_rank=16, scoring_func="sigmoid", n_group=2, topk_group=1,
                          num_experts_per_tok=3)
    return Decoder(cfg, DeepseekDecoderLayer), tokens(), deepseek_truth(cfg)


# ---- Jamba: Mamba mixers and attention in alternate layers, MoE in others ----------------------

class JambaMambaMixer(nn.Module):
    """in_proj -> causal conv1d -> x_proj -> dt_proj, selective scan with
    A_log and D, out_proj (a sequential scan: tiny T)."""

    def __init__(self, cfg):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.ssm_state_size = cfg.mamba_d_state
        self.conv_kernel_size = cfg.mamba_d_conv
        self.intermediate_size = cfg.mamba_expand * cfg.hidden_size
        self.time_step_rank = cfg.mamba_dt_rank
        self.conv1d = nn.Conv1d(self.intermediate_size, self.intermediate_size,
                                self.conv_kernel_size, groups=self.intermediate_size,
                                padding=self.conv_kernel_size - 1)
        self.in_proj = nn.Linear(self.hidden_size, self.intermediate_size * 2, bias=False)
        self.x_proj = nn.Linear(self.intermediate_size,
                                self.time_step_rank + self.ssm_state_size * 2, bias=False)
        self.dt_proj = nn.Linear(self.time_step_rank, self.intermediate_size, bias=True)
        a = torch.arange(1, self.ssm_state_size + 1, dtype=torch.float32)[None, :]
        self.A_log = nn.Parameter(torch.log(a.expand(self.intermediate_size, -1).contiguous()))
        self.D = nn.Parameter(torch.ones(self.intermediate_size))
        self.out_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        hs, gate = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)
        hs = F.silu(self.conv1d(hs)[..., :t])
        ssm = self.x_proj(hs.transpose(1, 2))
        dt, bm, cm = torch.split(ssm, [self.time_step_rank, self.ssm_state_size,
                                       self.ssm_state_size], dim=-1)
        dt = F.softplus(self.dt_proj(dt)).transpose(1, 2)  # [b, i, t]
        a = -torch.exp(self.A_log.float())
        da = torch.exp(a[None, :, None, :] * dt[:, :, :, None])
        dbu = dt[:, :, :, None] * bm[:, None, :, :] * hs[:, :, :, None]
        state = torch.zeros(b, self.intermediate_size, self.ssm_state_size)
        ys = []
        for i in range(t):
            state = da[:, :, i] * state + dbu[:, :, i]
            ys.append((state * cm[:, None, i, :]).sum(-1))
        y = torch.stack(ys, dim=-1) + hs * self.D[None, :, None]
        return self.out_proj((y * F.silu(gate)).transpose(1, 2))


class JambaSparseMoeBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hidden_dim = cfg.hidden_size
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        self.experts = nn.ModuleList([LlamaMLP(cfg) for _ in range(self.num_experts)])

    def forward(self, x):
        b, t, d = x.shape
        logits = self.router(x.view(-1, d))
        w = F.softmax(logits, dim=1, dtype=torch.float)
        w, idx = torch.topk(w, self.top_k, dim=-1)
        return dispatch(x.view(-1, d), self.experts, idx, w).view(b, t, d)


class JambaLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        if i % cfg.attn_layer_period == cfg.attn_layer_offset:
            self.self_attn = LlamaAttention(cfg, i)
        else:
            self.mamba = JambaMambaMixer(cfg)
        is_moe = i % cfg.expert_layer_period == cfg.expert_layer_offset
        self.feed_forward = JambaSparseMoeBlock(cfg) if is_moe else LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, rope) if hasattr(self, "self_attn") else self.mamba(h))
        return x + self.feed_forward(self.pre_ff_layernorm(x))


@member("jamba-hybrid")
def jamba():
    cfg = llama_config(num_hidden_layers=4, num_experts=E, num_experts_per_tok=K,
                       intermediate_size=16, attn_layer_period=2, attn_layer_offset=1,
                       expert_layer_period=2, expert_layer_offset=0, mamba_d_state=4,
                       mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)
    model = Decoder(cfg, JambaLayer, rotary_dim=DH)
    att, rts = [], []
    for i in (1, 3):
        m = f"model.layers.{i}.self_attn"
        qs, ks = heads_separate(f"{m}.q_proj.weight", f"{m}.k_proj.weight", H, HKV, DH)
        att.append(Attn(i, H, HKV, DH, qs, ks, m))
    for i in (0, 2):
        w = f"model.layers.{i}.feed_forward.router.weight"
        rts.append(Router(i, E, K, weight_rows(w, E), w.rsplit(".", 1)[0]))
    nr = [f"model.layers.{i}.mamba.{n}.weight" for i in (0, 2) for n in ("in_proj", "x_proj")]
    return model, tokens(), Truth(att, rts, not_reported=nr)


# ---- Megatron-core MoE GPT: mlp.router.weight [E, d], GroupedMLP weight1/weight2 ---------------

class MegatronTopKRouter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.topk = cfg.moe_router_topk
        self.num_experts = cfg.num_moe_experts
        self.weight = nn.Parameter(torch.randn(cfg.num_moe_experts, cfg.hidden_size) * 0.1)

    def forward(self, x):
        logits = F.linear(x.view(-1, x.shape[-1]), self.weight)
        top_logits, indices = torch.topk(logits, k=self.topk, dim=1)
        return torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits), indices


class MegatronGroupedMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_local_experts = cfg.num_moe_experts
        f = cfg.moe_ffn_hidden_size
        self.weight1 = nn.Parameter(torch.randn(cfg.hidden_size, self.num_local_experts * f) * .1)
        self.weight2 = nn.Parameter(torch.randn(self.num_local_experts * f, cfg.hidden_size) * .1)

    def forward(self, x, probs, indices):
        w1 = self.weight1.view(x.shape[-1], self.num_local_experts, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, x.shape[-1])
        experts = [lambda y, e=e: F.gelu(y @ w1[:, e]) @ w2[e]
                   for e in range(self.num_local_experts)]
        return dispatch(x, experts, indices, probs)


class MegatronMoELayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.router = MegatronTopKRouter(cfg)
        self.experts = MegatronGroupedMLP(cfg)

    def forward(self, x):
        shape = x.shape
        probs, indices = self.router(x)
        return self.experts(x.reshape(-1, shape[-1]), probs, indices).view(shape)


@member("megatron-core-moe")
def megatron_moe():
    from .research import MegatronGPTModel, megatron_attention_truth, megatron_config
    cfg = megatron_config(num_layers=3, num_moe_experts=8, moe_router_topk=3,
                          moe_ffn_hidden_size=8)
    rts = [Router(i, 8, 3, weight_rows(f"decoder.layers.{i}.mlp.router.weight", 8),
                  f"decoder.layers.{i}.mlp.router") for i in range(3)]
    return (MegatronGPTModel(cfg, MegatronMoELayer), tokens(),
            Truth(megatron_attention_truth(3), rts))


# ---- Megatron-DeepSpeed GPT with deepspeed.moe: gate.wg, top-1 gating with capacity -----------

class ParallelAttention(nn.Module):
    """Megatron-LM legacy: query_key_value viewed [s, b, np, 3 hn]."""

    def __init__(self, cfg, layer_number):
        super().__init__()
        self.layer_number = layer_number
        self.hidden_size_per_attention_head = cfg.kv_channels
        self.num_attention_heads_per_partition = cfg.num_attention_heads
        proj = cfg.kv_channels * cfg.num_attention_heads
        self.query_key_value = nn.Linear(cfg.hidden_size, 3 * proj)
        self.dense = nn.Linear(proj, cfg.hidden_size)

    def forward(self, x):
        s, b, _ = x.shape
        np_, hn = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        mixed = self.query_key_value(x).view(s, b, np_, 3 * hn)
        q, k, v = torch.split(mixed, hn, dim=3)
        # [s, b, np, hn] -> [b * np, s, hn], baddbmm as Megatron does
        q = q.reshape(s, b * np_, hn).transpose(0, 1)
        k = k.reshape(s, b * np_, hn).transpose(0, 1)
        v = v.reshape(s, b * np_, hn).transpose(0, 1)
        scores = torch.baddbmm(torch.zeros(b * np_, s, s), q, k.transpose(1, 2),
                               beta=0.0, alpha=1.0 / math.sqrt(hn))
        scores = scores + torch.full((s, s), -10000.0).triu(1)
        ctx = torch.bmm(F.softmax(scores, dim=-1), v)  # [b*np, s, hn]
        ctx = ctx.transpose(0, 1).reshape(s, b, np_ * hn)
        return self.dense(ctx)


class TopKGate(nn.Module):
    def __init__(self, model_dim, num_experts, k=1, capacity_factor=2.0):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.capacity_factor = capacity_factor

    def forward(self, x):
        logits = self.wg(x.float())
        gates = F.softmax(logits, dim=1)
        n, e = gates.shape
        capacity = max(int(math.ceil(n / e * self.capacity_factor)), 4)
        indices1_s = torch.argmax(gates, dim=1)
        mask1 = F.one_hot(indices1_s, num_classes=e)
        locations1 = torch.cumsum(mask1, dim=0) - 1
        mask1 = mask1 * torch.lt(locations1, capacity)
        gates1_s = (gates * mask1).sum(dim=1)
        return indices1_s[:, None], gates1_s[:, None] * mask1.any(1, keepdim=True)


class Experts(nn.Module):
    def __init__(self, expert, num_local_experts):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([expert() for _ in range(num_local_experts)])


class MOELayer(nn.Module):
    def __init__(self, gate, experts, num_local_experts):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_local_experts = num_local_experts

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.gate(flat)
        return dispatch(flat, self.experts.deepspeed_experts, idx, w.to(x.dtype)).view(shape)


class DeepSpeedMoE(nn.Module):
    """deepspeed.moe.layer.MoE: forward returns (output, l_aux, exp_counts)."""

    def __init__(self, hidden_size, expert, num_experts=1, k=1):
        super().__init__()
        self.num_experts = num_experts
        self.deepspeed_moe = MOELayer(TopKGate(hidden_size, num_experts, k),
                                      Experts(expert, num_experts), num_experts)

    def forward(self, x):
        return self.deepspeed_moe(x), torch.zeros(()), None


class ParallelTransformerLayer(nn.Module):
    def __init__(self, cfg, layer_number):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.self_attention = ParallelAttention(cfg, layer_number)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size)
        d = cfg.hidden_size
        self.mlp = DeepSpeedMoE(d, lambda: nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(),
                                                         nn.Linear(4 * d, d)),
                                num_experts=cfg.num_experts, k=cfg.topk)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        out, _, _ = self.mlp(self.post_attention_layernorm(x))
        return x + out


class MegatronDeepSpeedGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.language_model = nn.Module()
        self.language_model.embedding = nn.Module()
        self.language_model.embedding.word_embeddings = nn.Embedding(VOCAB, cfg.hidden_size)
        self.language_model.embedding.position_embeddings = nn.Embedding(16, cfg.hidden_size)
        self.language_model.encoder = nn.Module()
        self.language_model.encoder.layers = nn.ModuleList(
            ParallelTransformerLayer(cfg, i + 1) for i in range(cfg.num_layers))
        self.language_model.encoder.final_layernorm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, ids):
        e = self.language_model.embedding
        x = (e.word_embeddings(ids) + e.position_embeddings(torch.arange(ids.shape[1])))
        x = x.transpose(0, 1).contiguous()
        for layer in self.language_model.encoder.layers:
            x = layer(x)
        x = self.language_model.encoder.final_layernorm(x)
        return F.linear(x, e.word_embeddings.weight).transpose(0, 1)


@member("deepspeed-moe-top1")
def deepspeed_moe():
    cfg = config(num_layers=2, hidden_size=D, num_attention_heads=H, kv_channels=DH,
                 num_experts=E, topk=1)
    att, rts = [], []
    for i in range(2):
        m = f"language_model.encoder.layers.{i}.self_attention"
        att.append(Attn(i, H, H, DH, *heads_grouped(f"{m}.query_key_value.weight", H, H, DH), m))
        g = f"language_model.encoder.layers.{i}.mlp.deepspeed_moe.gate"
        rts.append(Router(i, E, 1, weight_rows(f"{g}.wg.weight", E), g))
    return MegatronDeepSpeedGPT(cfg), tokens(), Truth(att, rts)


# ---- fairseq MoE: time-first MultiheadAttention, Top2Gate / Top1Gate with wg, every other layer --

class FairseqMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, self_attention=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.self_attention = self_attention
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(key), self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask[None]
        attn_probs = F.softmax(attn_weights.float(), dim=-1).type_as(attn_weights)
        attn = torch.bmm(attn_probs, v).transpose(0, 1).contiguous()
        return self.out_proj(attn.view(tgt_len, bsz, embed_dim)), None


class Top2Gate(nn.Module):
    """Second expert: the argmax of the logits with the first masked out."""

    def __init__(self, model_dim, num_experts):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)

    def forward(self, x):
        logits = self.wg(x)
        gates = F.softmax(logits, dim=1)
        e = gates.shape[1]
        indices1_s = torch.argmax(gates, dim=1)
        mask1 = F.one_hot(indices1_s, num_classes=e)
        logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
        indices2_s = torch.argmax(logits_except1, dim=1)
        mask2 = F.one_hot(indices2_s, num_classes=e)
        g1, g2 = (gates * mask1).sum(1), (gates * mask2).sum(1)
        denom = (g1 + g2).clamp(min=torch.finfo(g1.dtype).eps)
        return torch.stack([indices1_s, indices2_s], 1), torch.stack([g1 / denom, g2 / denom], 1)


class Top1Gate(nn.Module):
    def __init__(self, model_dim, num_experts):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)

    def forward(self, x):
        gates = F.softmax(self.wg(x), dim=1)
        indices1_s = torch.argmax(gates, dim=1)
        return indices1_s[:, None], gates.gather(1, indices1_s[:, None])


class FeedForwardNetwork(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.fc1 = nn.Linear(d, f)
        self.fc2 = nn.Linear(f, d)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class FairseqMOELayer(nn.Module):
    def __init__(self, gate, experts):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_local_experts = len(experts)

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.gate(flat)
        return dispatch(flat, self.experts, idx, w).view(shape), torch.zeros(())


class FairseqDecoderLayer(nn.Module):
    def __init__(self, args, is_moe_layer):
        super().__init__()
        d = args.decoder_embed_dim
        self.is_moe_layer = is_moe_layer
        self.self_attn = FairseqMultiheadAttention(d, args.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        if is_moe_layer:
            gate = (Top1Gate if args.moe_top1_expert else Top2Gate)(d, args.moe_expert_count)
            experts = nn.ModuleList(FeedForwardNetwork(d, args.decoder_ffn_embed_dim)
                                    for _ in range(args.moe_expert_count))
            self.moe_layer = FairseqMOELayer(gate, experts)
        else:
            self.fc1 = nn.Linear(d, args.decoder_ffn_embed_dim)
            self.fc2 = nn.Linear(args.decoder_ffn_embed_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, mask):
        h = self.self_attn_layer_norm(x)
        x = x + self.self_attn(h, h, h, attn_mask=mask)[0]
        h = self.final_layer_norm(x)
        if self.is_moe_layer:
            out, _ = self.moe_layer(h)
        else:
            out = self.fc2(F.relu(self.fc1(h)))
        return x + out


class FairseqTransformerLM(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.decoder = nn.Module()
        self.decoder.embed_tokens = nn.Embedding(VOCAB, args.decoder_embed_dim)
        self.decoder.layers = nn.ModuleList(
            FairseqDecoderLayer(args, args.moe_freq > 0 and (i + 1) % args.moe_freq == 0)
            for i in range(args.decoder_layers))
        self.decoder.layer_norm = nn.LayerNorm(args.decoder_embed_dim)
        self.decoder.output_projection = nn.Linear(args.decoder_embed_dim, VOCAB, bias=False)

    def forward(self, src_tokens):
        x = self.decoder.embed_tokens(src_tokens).transpose(0, 1)  # T x B x C
        t = x.shape[0]
        mask = torch.full((t, t), float("-inf")).triu(1)
        for layer in self.decoder.layers:
            x = layer(x, mask)
        return self.decoder.output_projection(self.decoder.layer_norm(x)).transpose(0, 1)


def fairseq_member(top1):
    args = config(decoder_embed_dim=D, decoder_attention_heads=H, decoder_ffn_embed_dim=48,
                  decoder_layers=4, moe_freq=2, moe_expert_count=E, moe_top1_expert=top1)
    truth = moe_truth("decoder.layers", 4, H, H, DH, "moe_layer.gate.wg.weight", E,
                      1 if top1 else 2, moe_layers=(1, 3))
    for r in truth.routers:
        r.module = r.module.rsplit(".", 1)[0]
    return FairseqTransformerLM(args), tokens(), truth


@member("fairseq-moe-top2")
def fairseq_top2():
    return fairseq_member(False)


@member("fairseq-moe-top1")
def fairseq_top1():
    return fairseq_member(True)


# ---- research routers ------------------------------------------------------------------------

class NoisyTopkMoE(nn.Module):
    """Noisily gated top-k (Shazeer et al. 2017): raw Parameters w_gate and
    w_noise [d, E] used as x @ W; topk(k + 1) for the load loss, the first k
    route."""

    def __init__(self, input_size, output_size, num_experts, hidden_size, k=2):
        super().__init__()
        self.num_experts = num_experts
        self.k = k
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(input_size, hidden_size),
                                                    nn.ReLU(), nn.Linear(hidden_size, output_size))
                                      for _ in range(num_experts)])
        self.w_gate = nn.Parameter(torch.randn(input_size, num_experts) * 0.1)
        self.w_noise = nn.Parameter(torch.randn(input_size, num_experts) * 0.1)
        self.softplus = nn.Softplus()
        self.softmax = nn.Softmax(1)
        self.noise_epsilon = 1e-2

    def noisy_top_k_gating(self, x, train):
        clean_logits = x @ self.w_gate
        if train:
            noise_stddev = self.softplus(x @ self.w_noise) + self.noise_epsilon
            logits = clean_logits + torch.randn_like(clean_logits) * noise_stddev
        else:
            logits = clean_logits
        logits = self.softmax(logits)
        top_logits, top_indices = logits.topk(min(self.k + 1, self.num_experts), dim=1)
        top_k_logits, top_k_indices = top_logits[:, :self.k], top_indices[:, :self.k]
        top_k_gates = top_k_logits / (top_k_logits.sum(1, keepdim=True) + 1e-6)
        return top_k_indices, top_k_gates

    def forward(self, x):
        idx, w = self.noisy_top_k_gating(x, self.training)
        return dispatch(x, self.experts, idx, w)


class NoisyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.moe = NoisyTopkMoE(D, D, 6, 16, k=2)

    def forward(self, x):
        t = x.shape[1]
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=torch.full((t, t), float("-inf")).triu(1),
                          need_weights=False)[0]
        b, t, d = x.shape
        return x + self.moe(self.ln2(x).reshape(-1, d)).view(b, t, d)


class BlocksLM(nn.Module):
    def __init__(self, block, n=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(block() for _ in range(n))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@member("noisy-topk")
def noisy_topk():
    att, rts = [], []
    for i in range(2):
        m = f"blocks.{i}.attn"
        att.append(Attn(i, H, H, DH, *heads_contiguous(f"{m}.in_proj_weight", H, H, DH), m))
        rts.append(Router(i, 6, 2, weight_rows(f"blocks.{i}.moe.w_gate", 6, t=True),
                          f"blocks.{i}.moe"))
    return BlocksLM(NoisyBlock), tokens(), Truth(
        att, rts, not_reported=[f"blocks.{i}.moe.w_noise" for i in range(2)])


class ExpertChoiceMoE(nn.Module):
    """Expert-choice routing (Zhou et al. 2022): each expert takes its top
    `capacity` tokens, capacity = tokens * capacity_factor / E, so a token
    is processed by capacity_factor experts on average: that is its top-k."""

    def __init__(self, d, num_experts, capacity_factor):
        super().__init__()
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.gate = nn.Linear(d, num_experts, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 16), nn.GELU(),
                                                    nn.Linear(16, d)) for _ in range(num_experts)])

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        n = flat.shape[0]
        scores = F.softmax(self.gate(flat), dim=-1)  # [n, E]
        capacity = max(1, int(n * self.capacity_factor / self.num_experts))
        g, idx = torch.topk(scores.t(), capacity, dim=-1)  # [E, capacity] token indices
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            out.index_add_(0, idx[e], g[e][:, None] * expert(flat[idx[e]]))
        return out.view(b, t, d)


class ExpertChoiceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(D), RMSNorm(D)
        self.attn = LlamaAttention(llama_config(), 0)
        self.moe = ExpertChoiceMoE(D, E, capacity_factor=1)
        self.rope = RotaryEmbedding(DH)

    def forward(self, x):
        x = x + self.attn(self.norm1(x), self.rope(x, x.shape[1]))
        return x + self.moe(self.norm2(x))


@member("expert-choice")
def expert_choice():
    att, rts = [], []
    for i in range(2):
        m = f"blocks.{i}.attn"
        att.append(Attn(i, H, HKV, DH, *heads_separate(f"{m}.q_proj.weight", f"{m}.k_proj.weight",
                                                       H, HKV, DH), m))
        rts.append(Router(i, E, 1, weight_rows(f"blocks.{i}.moe.gate.weight", E),
                          f"blocks.{i}.moe.gate"))
    return BlocksLM(ExpertChoiceBlock), tokens(), Truth(
        att, rts, note="expert choice, capacity_factor 1: one expert per token on average")


class SigmoidSelectorMoE(nn.Module):
    """Sigmoid scores, top n_active, weights normalised over the chosen;
    the router is `selector`, the experts `ffns`."""

    def __init__(self, d, n_ffns, n_active):
        super().__init__()
        self.n_active = n_active
        self.selector = nn.Linear(d, n_ffns)
        self.ffns = nn.ModuleList([nn.Sequential(nn.Linear(d, 16), nn.SiLU(), nn.Linear(16, d))
                                   for _ in range(n_ffns)])

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        probs = torch.sigmoid(self.selector(flat))
        vals, idx = probs.topk(self.n_active, dim=-1)
        return dispatch(flat, self.ffns, idx, vals / vals.sum(-1, keepdim=True)).view(b, t, d)


class SelectorBlock(nn.Module):
    def __init__(self):
        super().__init__()
        from .research import SelfHAttention
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attention = SelfHAttention(D, H)
        self.attention.n_head = H  # this one says its head count in a known name
        self.mixture = SigmoidSelectorMoE(D, 6, 3)

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.mixture(self.ln2(x))


@member("sigmoid-selector")
def sigmoid_selector():
    att, rts = [], []
    for i in range(2):
        m = f"blocks.{i}.attention"
        att.append(Attn(i, H, H, DH, *heads_contiguous(f"{m}.c_attn.weight", H, H, DH), m))
        rts.append(Router(i, 6, 3, weight_rows(f"blocks.{i}.mixture.selector.weight", 6),
                          f"blocks.{i}.mixture.selector"))
    return BlocksLM(SelectorBlock), tokens(), Truth(att, rts)


# ---- gpt-oss: attention sinks, a router with a bias, top-k before the softmax ------------------

class GptOssAttention(LlamaAttention):
    """q/k/v/o_proj with biases, GQA, one learned sink logit per head joins
    each softmax row (dropped after it), a sliding window every other layer."""

    def __init__(self, cfg, layer_idx):
        super().__init__(cfg, layer_idx, bias=True, sdpa=False)
        self.sliding_window = cfg.sliding_window if layer_idx % 2 == 0 else None
        self.sinks = nn.Parameter(torch.randn(cfg.num_attention_heads) * 0.1)

    def forward(self, x, rope):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        k = torch.repeat_interleave(k, self.num_key_value_groups, dim=1)
        v = torch.repeat_interleave(v, self.num_key_value_groups, dim=1)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        i = torch.arange(t)
        masked = i[None, :] > i[:, None]
        if self.sliding_window:
            masked = masked | (i[None, :] <= i[:, None] - self.sliding_window)
        w = w.masked_fill(masked, float("-inf"))
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, t, -1)
        combined = torch.cat([w, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        return self.o_proj(torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1))


class GptOssTopKRouter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_local_experts
        self.hidden_dim = cfg.hidden_size
        self.weight = nn.Parameter(torch.randn(self.num_experts, self.hidden_dim) * 0.1)
        self.bias = nn.Parameter(torch.randn(self.num_experts) * 0.1)

    def forward(self, x):
        x = x.reshape(-1, self.hidden_dim)
        logits = F.linear(x, self.weight, self.bias)
        top_value, top_index = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top_value, dim=1, dtype=top_value.dtype), top_index


class GptOssExperts(nn.Module):
    """gate_up_proj [E, d, 2f] with gate and up interleaved, clamped swiglu."""

    def __init__(self, cfg):
        super().__init__()
        e, d, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.num_experts, self.alpha, self.limit = e, 1.702, 7.0
        self.gate_up_proj = nn.Parameter(torch.randn(e, d, 2 * f) * 0.1)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * f))
        self.down_proj = nn.Parameter(torch.randn(e, f, d) * 0.1)
        self.down_proj_bias = nn.Parameter(torch.zeros(e, d))

    def expert(self, e):
        def run(x):
            gu = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate, up = gu[..., ::2].clamp(max=self.limit), gu[..., 1::2].clamp(-self.limit,
                                                                               self.limit)
            glu = gate * torch.sigmoid(gate * self.alpha)
            return ((up + 1) * glu) @ self.down_proj[e] + self.down_proj_bias[e]
        return run


class GptOssMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.router = GptOssTopKRouter(cfg)
        self.experts = GptOssExperts(cfg)

    def forward(self, x):
        b, t, d = x.shape
        w, idx = self.router(x)
        experts = [self.experts.expert(e) for e in range(self.experts.num_experts)]
        return dispatch(x.reshape(-1, d), experts, idx, w).view(b, t, d)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attn = GptOssAttention(cfg, i)
        self.mlp = GptOssMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


@member("gpt-oss-sinks")
def gpt_oss():
    cfg = llama_config(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_local_experts=8, num_experts_per_tok=2, intermediate_size=8,
                       sliding_window=4)
    model = Decoder(cfg, GptOssDecoderLayer, rotary_dim=16)
    return model, tokens(), moe_truth("model.layers", 2, 4, 2, 16, "mlp.router.weight", 8, 2)
