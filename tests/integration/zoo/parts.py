"""Pieces several replicas share: norms, rotary embeddings, the attention
product (SDPA where torch has it, the softmax written out otherwise), a
config object. Sizes every member uses unless it says otherwise."""
import math
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

D, H, DH, HKV, L, VOCAB, T, B = 32, 4, 8, 2, 2, 64, 8, 2

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


def config(**kw):
    """A config object like a transformers PretrainedConfig (attributes)."""
    return types.SimpleNamespace(**kw)


def tokens(vocab=VOCAB, b=B, t=T):
    return (torch.randint(0, vocab, (b, t)),)


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: weight, variance_epsilon."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon)).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """inv_freq buffer; forward gives (cos, sin) [T, dim] for rotate_half."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)),
                             persistent=False)

    def forward(self, x, seq_len):
        t = torch.arange(seq_len, dtype=self.inv_freq.dtype, device=x.device)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x, n_rep):
    """[B, Hkv, T, dh] -> [B, Hkv * n_rep, T, dh] (expand + reshape)."""
    b, kv, t, dh = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, kv, n_rep, t, dh).reshape(b, kv * n_rep, t, dh)


def causal_mask(t, device=None):
    """[t, t] additive mask, -inf above the diagonal."""
    return torch.full((t, t), float("-inf"), device=device).triu(1)


def attend(q, k, v, causal=True, mask=None, sdpa=True, scale=None):
    """softmax(q k^T * scale + mask) v on [B, H, T, dh]: SDPA when asked and
    torch has it (no custom scale on torch < 2.1: then the softmax)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if sdpa and HAS_SDPA and abs(scale - 1.0 / math.sqrt(q.shape[-1])) < 1e-12:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              is_causal=causal and mask is None)
    w = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        w = w + causal_mask(q.shape[-2], q.device)[-q.shape[-2]:, -k.shape[-2]:]
    if mask is not None:
        w = w + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)


class Decoder(nn.Module):
    """model.embed_tokens -> model.layers -> model.norm -> lm_head, the
    transformers *ForCausalLM shape; blocks take (x, cos, sin) or (x,)."""

    def __init__(self, cfg, layer_cls, rotary_dim=None, norm=RMSNorm):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(layer_cls(cfg, i)
                                          for i in range(cfg.num_hidden_layers))
        self.model.norm = norm(cfg.hidden_size)
        self.model.rotary_emb = RotaryEmbedding(rotary_dim) if rotary_dim else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.model.embed_tokens(input_ids)
        rope = (self.model.rotary_emb(x, input_ids.shape[1])
                if self.model.rotary_emb is not None else None)
        for layer in self.model.layers:
            x = layer(x, rope)
        return self.lm_head(self.model.norm(x))


class PreNormBlock(nn.Module):
    """x + attn(ln1(x)), then x + mlp(ln2(x)) (a GELU MLP of width 4d):
    the block research code wraps around an attention it writes itself.
    The attention sits under `attn_name` (its module path is the member's
    truth)."""

    def __init__(self, attn, attn_name="attn", d=D):
        super().__init__()
        self.attn_name = attn_name
        self.ln1 = nn.LayerNorm(d)
        setattr(self, attn_name, attn)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + getattr(self, self.attn_name)(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PreNormLM(nn.Module):
    """embed -> blocks (PreNormBlock around make_attn(), `layers` of them)
    -> head, token ids in."""

    def __init__(self, make_attn, attn_name="attn", layers=L, d=D, vocab=VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(PreNormBlock(make_attn(), attn_name, d)
                                    for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class LayersLM(nn.Module):
    """model.embed_tokens -> model.layers (each layer(x, rope)) ->
    model.norm -> lm_head, the transformers *ForCausalLM module paths, from
    built layers (Decoder builds them from a config)."""

    def __init__(self, layers, rope=None, norm=RMSNorm, d=D, vocab=VOCAB):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = norm(d)
        self.model.rotary_emb = rope
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids):
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(x, input_ids.shape[1]) if self.model.rotary_emb else None
        for layer in self.model.layers:
            x = layer(x, rope)
        return self.lm_head(self.model.norm(x))
