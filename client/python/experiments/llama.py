"""A tiny LLaMA-style model whose attention backward can carry the biased
low-precision flash-attention fault of tinygpt.

Layout and attribute names follow Hugging Face's LlamaForCausalLM, so that
a monitor sees what it would see on the real thing:

  model.embed_tokens, model.layers.N.{input_layernorm, self_attn,
  post_attention_layernorm, mlp}, model.norm, lm_head (untied)
  self_attn: q_proj [H*dh, d], k_proj / v_proj [Hkv*dh, d], o_proj,
             num_heads, num_key_value_heads, num_key_value_groups, head_dim
  mlp:       SwiGLU, down_proj(silu(gate_proj(x)) * up_proj(x))
  RMSNorm, rotary position embeddings (rotate_half convention), no biases.

Grouped-query attention: k/v have Hkv < H heads and are expanded
(repeat_interleave, HF's repeat_kv) to the H query heads before the
attention kernel, which is tinygpt.FlashLikeAttention with the model's
shared tinygpt.Fault: the fault truncates BF16 bits of O and dO before
D = rowsum(O * dO) exactly as in the GPT models. The expanded k's gradient
sums back over each group through autograd.
"""
import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinygpt import FlashLikeAttention, Fault


class LlamaRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, head_dim, max_pos, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        t = torch.arange(max_pos).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, t):
        return self.cos_cached[:t], self.sin_cached[:t]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x, n_rep):
    """[B, Hkv, T, dh] -> [B, Hkv * n_rep, T, dh]; query head h reads KV head h // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx, fault):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = d // self.num_heads
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.o_proj.residual_out = True
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, config.max_position_embeddings)
        self.fault = fault

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(t)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        bits = self.fault.bits if self.fault.active(self.layer_idx) else 0
        y = FlashLikeAttention.apply(q, k, v, bits, self.fault.on)
        y = y.transpose(1, 2).contiguous().view(b, t, self.num_heads * self.head_dim)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.down_proj.residual_out = True

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx, fault):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, fault)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config, fault):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, fault)
                                    for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, idx):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def llama_config(vocab, d=64, n_layer=4, n_head=4, n_kv_head=2, t=64, ffn=None):
    """A dict-like config with HF LlamaConfig's field names. ffn defaults to
    LLaMA's 8/3 d rounded up to a multiple of 16."""
    if ffn is None:
        ffn = 16 * math.ceil(8 * d / 3 / 16)
    return SimpleNamespace(vocab_size=vocab, hidden_size=d, intermediate_size=ffn,
                           num_hidden_layers=n_layer, num_attention_heads=n_head,
                           num_key_value_heads=n_kv_head, max_position_embeddings=t,
                           rms_norm_eps=1e-6)


class TinyLlama(nn.Module):
    """LlamaForCausalLM in miniature: forward(idx, targets) -> (loss, None),
    the interface of tinygpt.TinyGPT; `fault` is the shared tinygpt.Fault."""

    def __init__(self, vocab, d=64, n_layer=4, n_head=4, n_kv_head=2, t=64, ffn=None):
        super().__init__()
        if n_head % n_kv_head or d % n_head:
            raise ValueError("need d % n_head == 0 and n_head % n_kv_head == 0")
        self.config = llama_config(vocab, d, n_layer, n_head, n_kv_head, t, ffn)
        self.fault = Fault()
        self.model = LlamaModel(self.config, self.fault)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.apply(self._init)

    def _init(self, m):
        # As tinygpt: fan-in scaling, the residual outputs (o_proj,
        # down_proj) further by 1/sqrt(2 n_layer).
        if isinstance(m, nn.Linear):
            std = m.in_features ** -0.5
            if getattr(m, "residual_out", False):
                std /= math.sqrt(2 * self.config.num_hidden_layers)
            nn.init.normal_(m.weight, mean=0.0, std=std)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        logits = self.lm_head(self.model(idx))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return loss, None
