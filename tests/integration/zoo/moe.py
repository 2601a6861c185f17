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
        experts = [lambda y, e=e: self.experts.mlp(y, e) for e in range(self.experts.moe_num_experts)]
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
