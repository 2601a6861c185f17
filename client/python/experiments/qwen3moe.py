"""Two tiny layouts that neither tinygpt nor llama has, for the third
held-out corpus (CORPUS.md, "Third held-out look"); both carry the same
biased attention-backward fault (tinygpt.FlashLikeAttention, the model's
shared tinygpt.Fault).

--arch qwen3moe: a Qwen3-MoE / OLMoE-style decoder. llama.py's layout
(model.embed_tokens, model.layers.N.{input_layernorm, self_attn,
post_attention_layernorm, mlp}, model.norm, untied lm_head, RoPE, GQA, no
biases) with two changes:
  self_attn.q_norm / k_norm  RMSNorm over head_dim, one per head, applied
                             to q and k before the rotary embedding
                             (Hugging Face's Qwen3MoeAttention)
  mlp                        a sparse MoE block: `gate` (Linear d -> E)
                             beside `experts` (E SwiGLU MLPs of
                             gate_proj/up_proj/down_proj); softmax over
                             the E logits, top-k, the k weights
                             renormalised to sum to 1 (norm_topk_prob)

--arch parallel: a GPT-J / Cohere-style parallel block. One LayerNorm
(input_layernorm) feeds attention and the MLP side by side:
    x + self_attn(ln(x)) + mlp(ln(x))
with the same q_norm / k_norm (here LayerNorm over head_dim, Cohere's
use_qk_norm), RoPE, GQA and a dense SwiGLU MLP.

Both return (loss, aux) like tinygpt.TinyGPT: aux is the MoE blocks'
mean Switch load-balancing loss, None for a dense model.
"""
import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from llama import (LlamaAttention, LlamaMLP, LlamaRMSNorm, TinyLlama, apply_rotary_pos_emb,
                   repeat_kv)
from tinygpt import FlashLikeAttention, Fault, MoE


class QkNormAttention(LlamaAttention):
    """llama.LlamaAttention with a norm over each head's q and k (norm:
    a class taking (head_dim, eps))."""

    def __init__(self, config, layer_idx, fault, norm):
        super().__init__(config, layer_idx, fault)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = norm(self.head_dim, config.rms_norm_eps)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_key_value_heads,
                                            self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(t)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        bits = self.fault.bits if self.fault.active(self.layer_idx) else 0
        y = FlashLikeAttention.apply(q, k, v, bits, self.fault.on)
        y = y.transpose(1, 2).contiguous().view(b, t, self.num_heads * self.head_dim)
        return self.o_proj(y)


class SparseMoeBlock(MoE):
    """Top-k routed SwiGLU experts. Every expert runs on every token and
    the top-k weights select (tiny E: simpler than dispatch, same maths).
    Sets self.aux to the Switch load-balancing loss on each forward:
    tinygpt.MoE's forward, with SwiGLU experts."""

    def __init__(self, config):
        nn.Module.__init__(self)  # not MoE's: its own experts
        d = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(d, self.num_experts, bias=False)
        expert = SimpleNamespace(hidden_size=d, intermediate_size=config.moe_intermediate_size)
        self.experts = nn.ModuleList(LlamaMLP(expert) for _ in range(self.num_experts))
        self.aux = None


class SequentialLayer(nn.Module):
    """Qwen3-MoE's decoder layer: pre-norm attention, then pre-norm MoE."""

    def __init__(self, config, layer_idx, fault):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = QkNormAttention(config, layer_idx, fault, LlamaRMSNorm)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoeBlock(config)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def _layer_norm(d, eps):
    return nn.LayerNorm(d, eps=eps)


class ParallelLayer(nn.Module):
    """GPT-J / Cohere's parallel layer: one norm, attention and MLP read it."""

    def __init__(self, config, layer_idx, fault):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = QkNormAttention(config, layer_idx, fault, _layer_norm)
        self.mlp = LlamaMLP(config)

    def forward(self, x):
        h = self.input_layernorm(x)
        return x + self.self_attn(h) + self.mlp(h)


class TinyQkModel(nn.Module):
    """forward(idx, targets) -> (loss, aux), the interface of
    tinygpt.TinyGPT; `fault` is the shared tinygpt.Fault. parallel: the
    GPT-J/Cohere layer (dense), else Qwen3-MoE's (experts, top_k)."""

    def __init__(self, vocab, d=64, n_layer=4, n_head=4, n_kv_head=2, t=64,
                 parallel=False, experts=8, top_k=2, expert_ffn=None):
        super().__init__()
        if n_head % n_kv_head or d % n_head:
            raise ValueError("need d % n_head == 0 and n_head % n_kv_head == 0")
        self.config = SimpleNamespace(
            vocab_size=vocab, hidden_size=d, intermediate_size=16 * math.ceil(8 * d / 3 / 16),
            num_hidden_layers=n_layer, num_attention_heads=n_head,
            num_key_value_heads=n_kv_head, max_position_embeddings=t, rms_norm_eps=1e-6,
            num_experts=experts, num_experts_per_tok=top_k,
            moe_intermediate_size=expert_ffn or d)
        self.fault = Fault()
        layer = ParallelLayer if parallel else SequentialLayer
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(layer(self.config, i, self.fault)
                                          for i in range(n_layer))
        self.model.norm = (nn.LayerNorm(d, eps=1e-6) if parallel else LlamaRMSNorm(d, 1e-6))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.apply(self._init)

    _init = TinyLlama._init  # fan-in scaling, residual outputs by 1/sqrt(2 n_layer)

    def forward(self, idx, targets):
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x)
        logits = self.lm_head(self.model.norm(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        aux = [lay.mlp.aux for lay in self.model.layers if isinstance(lay.mlp, SparseMoeBlock)]
        return loss, (sum(aux) / len(aux) if aux else None)
