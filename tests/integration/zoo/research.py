"""Framework and research layouts: Megatron-core's GPT (grouped linear_qkv,
sequence-first), timm's ViT (qkv, SDPA, images), xformers'
MultiHeadDispatch (in_proj_container), an attention with a raw
in_proj_weight Parameter that is not nn.MultiheadAttention (open_clip /
xformers style), x-transformers (to_q/to_k/to_v, kv_heads, interleaved
attention and feed-forward layers), lucidrains-style einsum over raw
Parameters, a GPT keeping its head count in `self.h`, and two models that
tempt a router finder: a per-head output gate Linear(d, H) and a classifier
whose logits an argmax turns into an accuracy metric; a Mamba-only model
with no attention. Written here after the public code's names and forward
structure, tiny and random."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Attn, Truth, heads_contiguous, heads_grouped, heads_separate, member
from .parts import D, DH, H, HKV, VOCAB, RMSNorm, RotaryEmbedding, apply_rotary_pos_emb, \
    attend, config, rotate_half, tokens


# ---- Megatron-core GPT: linear_qkv grouped by query group, [s, b, h] -------------------------

class MegatronSelfAttention(nn.Module):
    def __init__(self, cfg, layer_number):
        super().__init__()
        self.config = cfg
        self.layer_number = layer_number
        self.hidden_size_per_attention_head = cfg.kv_channels
        self.num_attention_heads_per_partition = cfg.num_attention_heads
        self.num_query_groups_per_partition = cfg.num_query_groups
        self.query_projection_size = cfg.kv_channels * cfg.num_attention_heads
        self.kv_projection_size = cfg.kv_channels * cfg.num_query_groups
        self.linear_qkv = nn.Linear(cfg.hidden_size,
                                    self.query_projection_size + 2 * self.kv_projection_size,
                                    bias=cfg.add_qkv_bias)
        self.linear_proj = nn.Linear(self.query_projection_size, cfg.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.kv_channels)

    def get_query_key_value_tensors(self, hidden_states):
        mixed_qkv = self.linear_qkv(hidden_states)
        per = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        hn = self.hidden_size_per_attention_head
        new_shape = mixed_qkv.size()[:-1] + (self.num_query_groups_per_partition, (per + 2) * hn)
        mixed_qkv = mixed_qkv.view(*new_shape)
        query, key, value = torch.split(mixed_qkv, [per * hn, hn, hn], dim=3)
        query = query.reshape(query.size(0), query.size(1), -1, hn)
        return query, key, value

    def forward(self, hidden_states):
        s, b, _ = hidden_states.shape
        q, k, v = self.get_query_key_value_tensors(hidden_states)
        # [s, b, n, hn] -> [b, n, s, hn]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        q, k = apply_rotary_pos_emb(q, k, *self.rotary(q, s))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = attend(q, k, v)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class MegatronMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, bias=False)
        self.linear_fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        a, b = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(a) * b)


class MegatronTransformerLayer(nn.Module):
    def __init__(self, cfg, layer_number, mlp=None):
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attention = MegatronSelfAttention(cfg, layer_number)
        self.pre_mlp_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = mlp if mlp is not None else MegatronMLP(cfg)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class MegatronGPTModel(nn.Module):
    def __init__(self, cfg, mlp_factory=None):
        super().__init__()
        self.config = cfg
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(
            MegatronTransformerLayer(cfg, i + 1, mlp_factory(cfg) if mlp_factory else None)
            for i in range(cfg.num_layers))
        self.decoder.final_layernorm = RMSNorm(cfg.hidden_size)
        self.output_layer = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.embedding.word_embeddings(input_ids).transpose(0, 1).contiguous()  # [s, b, h]
        for layer in self.decoder.layers:
            x = layer(x)
        return self.output_layer(self.decoder.final_layernorm(x)).transpose(0, 1)


def megatron_config(**kw):
    c = dict(num_layers=2, hidden_size=D, num_attention_heads=H, num_query_groups=HKV,
             kv_channels=DH, ffn_hidden_size=48, vocab_size=VOCAB, add_qkv_bias=False)
    c.update(kw)
    return config(**c)


def megatron_attention_truth(n):
    att = []
    for i in range(n):
        m = f"decoder.layers.{i}.self_attention"
        att.append(Attn(i, H, HKV, DH, *heads_grouped(f"{m}.linear_qkv.weight", H, HKV, DH), m))
    return att


@member("megatron-core-gpt")
def megatron_gpt():
    return (MegatronGPTModel(megatron_config()), tokens(),
            Truth(megatron_attention_truth(2),
                  not_reported=[f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(2)]))


# ---- timm ViT --------------------------------------------------------------------------------

class TimmAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_norm=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = hasattr(F, "scaled_dot_product_attention")
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            q = q * self.scale
            attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
            x = self.attn_drop(attn) @ v
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, n, c)))


class TimmMlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TimmBlock(nn.Module):
    def __init__(self, dim, num_heads, qk_norm):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = TimmAttention(dim, num_heads, qkv_bias=True, qk_norm=qk_norm)
        self.ls1 = nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = TimmMlp(dim, 4 * dim)
        self.ls2 = nn.Identity()

    def forward(self, x):
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class VisionTransformer(nn.Module):
    def __init__(self, img_size=16, patch_size=8, num_classes=5, embed_dim=D, depth=2,
                 num_heads=H, qk_norm=True):
        super().__init__()
        self.num_classes = num_classes
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, embed_dim, patch_size, patch_size)
        n = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, embed_dim) * 0.02)
        self.blocks = nn.Sequential(*[TimmBlock(embed_dim, num_heads, qk_norm)
                                      for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x):
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


@member("timm-vit")
def timm_vit():
    att = []
    for i in range(2):
        m = f"blocks.{i}.attn"
        att.append(Attn(i, H, H, DH, *heads_contiguous(f"{m}.qkv.weight", H, H, DH), m))
    return VisionTransformer(), (torch.randn(2, 3, 16, 16),), Truth(
        att, not_reported=["head.weight"])


# ---- xformers MultiHeadDispatch ------------------------------------------------------------

class InputProjection(nn.Module):
    def __init__(self, dim_model, dim_key, bias=True):
        super().__init__()
        self.q_proj = nn.Linear(dim_model, dim_key, bias)
        self.k_proj = nn.Linear(dim_model, dim_key, bias)
        self.v_proj = nn.Linear(dim_model, dim_key, bias)

    def forward(self, query, key, value):
        return self.q_proj(query), self.k_proj(key), self.v_proj(value)


class ScaledDotProduct(nn.Module):
    def forward(self, q, k, v, att_mask=None):
        att = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))
        if att_mask is not None:
            att = att + att_mask
        return torch.softmax(att, dim=att.ndim - 1) @ v


class MultiHeadDispatch(nn.Module):
    def __init__(self, dim_model, num_heads, attention):
        super().__init__()
        self.num_heads = num_heads
        self.dim_model = dim_model
        self.dim_key_head = dim_model // num_heads
        self.attention = attention
        self.in_proj_container = InputProjection(dim_model, dim_model)
        self.proj = nn.Linear(dim_model, dim_model)

    def _split_heads(self, t, b, s):
        # [B, S, E] -> [B * H, S, E / H]
        return t.view(b, s, self.num_heads, self.dim_key_head).transpose(1, 2).flatten(0, 1)

    def forward(self, query, key=None, value=None, att_mask=None):
        key = query if key is None else key
        value = query if value is None else value
        b, s, _ = query.shape
        q, k, v = self.in_proj_container(query, key, value)
        q, k, v = (self._split_heads(x, b, s) for x in (q, k, v))
        y = self.attention(q, k, v, att_mask=att_mask)
        y = y.view(b, self.num_heads, s, self.dim_key_head).transpose(1, 2).flatten(-2)
        return self.proj(y)


class XformersBlock(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.wrap_att = nn.Module()
        self.wrap_att.norm = nn.LayerNorm(D)
        self.wrap_att.sublayer = MultiHeadDispatch(D, H, ScaledDotProduct())
        self.wrap_ff = nn.Module()
        self.wrap_ff.norm = nn.LayerNorm(D)
        self.wrap_ff.sublayer = nn.Sequential(nn.Linear(D, 64), nn.GELU(), nn.Linear(64, D))

    def forward(self, x):
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)
        x = x + self.wrap_att.sublayer(self.wrap_att.norm(x), att_mask=mask)
        return x + self.wrap_ff.sublayer(self.wrap_ff.norm(x))


class XformerLM(nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D)
        self.encoders = nn.ModuleList(XformersBlock(i) for i in range(n))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embedding(ids)
        for blk in self.encoders:
            x = blk(x)
        return self.head(x)


@member("xformers-dispatch")
def xformers_dispatch():
    att = []
    for i in range(2):
        m = f"encoders.{i}.wrap_att.sublayer"
        c = f"{m}.in_proj_container"
        att.append(Attn(i, H, H, DH, *heads_separate(f"{c}.q_proj.weight", f"{c}.k_proj.weight",
                                                     H, H, DH), m))
    return XformerLM(), tokens(), Truth(att)


# ---- an attention holding in_proj_weight as a raw Parameter (open_clip / xformers style) --------

class InProjAttention(nn.Module):
    def __init__(self, dim, num_heads, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.in_proj_weight = nn.Parameter(torch.randn((dim * 3, dim)) * self.scale)
        self.in_proj_bias = nn.Parameter(torch.zeros(dim * 3)) if qkv_bias else None
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = torch.bmm((q * self.scale).flatten(0, 1), k.flatten(0, 1).transpose(-1, -2))
        attn = attn.softmax(dim=-1)
        x = torch.bmm(attn, v.flatten(0, 1)).view(b, self.num_heads, n, -1)
        return self.out_proj(x.transpose(1, 2).reshape(b, n, c))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = InProjAttention(d, h)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential()
        self.mlp.add_module("c_fc", nn.Linear(d, 4 * d))
        self.mlp.add_module("gelu", nn.GELU())
        self.mlp.add_module("c_proj", nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ClipTextTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, D)
        self.transformer = nn.Module()
        self.transformer.resblocks = nn.ModuleList(ResidualAttentionBlock(D, H) for _ in range(2))
        self.ln_final = nn.LayerNorm(D)
        self.text_projection = nn.Parameter(torch.randn(D, 16) * 0.1)

    def forward(self, text):
        x = self.token_embedding(text)
        for blk in self.transformer.resblocks:
            x = blk(x)
        return self.ln_final(x) @ self.text_projection


@member("in-proj-param")
def in_proj_param():
    att = []
    for i in range(2):
        m = f"transformer.resblocks.{i}.attn"
        att.append(Attn(i, H, H, DH, *heads_contiguous(f"{m}.in_proj_weight", H, H, DH), m))
    return ClipTextTransformer(), tokens(), Truth(att)


# ---- x-transformers: layers = [[norms], block, residual] alternating 'a' and 'f' ---------------

class XAttention(nn.Module):
    def __init__(self, dim, dim_head=DH, heads=H, kv_heads=None, qk_norm=False, causal=True):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.causal = causal
        kv_heads = kv_heads if kv_heads is not None else heads
        self.kv_heads = kv_heads
        q_dim = dim_head * heads
        k_dim = v_dim = dim_head * kv_heads
        self.to_q = nn.Linear(dim, q_dim, bias=False)
        self.to_k = nn.Linear(dim, k_dim, bias=False)
        self.to_v = nn.Linear(dim, v_dim, bias=False)
        self.qk_norm = qk_norm
        if qk_norm:
            self.qk_norm_q_scale = nn.Parameter(torch.ones(heads, 1, dim_head))
            self.qk_norm_k_scale = nn.Parameter(torch.ones(kv_heads, 1, dim_head))
        self.to_out = nn.Linear(q_dim, dim, bias=False)

    def forward(self, x, rotary_pos_emb=None):
        b, n, _ = x.shape
        # rearrange 'b n (h d) -> b h n d'
        q = self.to_q(x).view(b, n, self.heads, -1).permute(0, 2, 1, 3)
        k = self.to_k(x).view(b, n, self.kv_heads, -1).permute(0, 2, 1, 3)
        v = self.to_v(x).view(b, n, self.kv_heads, -1).permute(0, 2, 1, 3)
        if self.qk_norm:
            q = F.normalize(q, dim=-1) * self.qk_norm_q_scale
            k = F.normalize(k, dim=-1) * self.qk_norm_k_scale
        if rotary_pos_emb is not None:
            q, k = apply_rotary_pos_emb(q, k, *rotary_pos_emb)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)  # einops repeat 'b h n d -> b (h r) n d'
        v = v.repeat_interleave(rep, dim=1)
        sim = torch.einsum("b h i d, b h j d -> b h i j".replace(" ", ""), q, k) * self.scale
        if self.causal:
            sim = sim.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1e30)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))


class XFeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU()),
                                nn.Identity(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.ff(x)


class Residual(nn.Module):
    def forward(self, x, residual):
        return x + residual


class AttentionLayers(nn.Module):
    def __init__(self, dim, depth, heads, kv_heads, qk_norm=True):
        super().__init__()
        self.dim = dim
        self.depth = depth
        self.layer_types = ("a", "f") * depth
        self.rotary_pos_emb = RotaryEmbedding(DH)
        self.layers = nn.ModuleList([])
        for t in self.layer_types:
            block = XAttention(dim, heads=heads, kv_heads=kv_heads, qk_norm=qk_norm) \
                if t == "a" else XFeedForward(dim)
            norms = nn.ModuleList([nn.LayerNorm(dim), None, None])
            self.layers.append(nn.ModuleList([norms, block, Residual()]))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x):
        rope = self.rotary_pos_emb(x, x.shape[1])
        for t, (norms, block, residual_fn) in zip(self.layer_types, self.layers):
            h = norms[0](x)
            out = block(h, rotary_pos_emb=rope) if t == "a" else block(h)
            x = residual_fn(out, x)
        return self.final_norm(x)


class TransformerWrapper(nn.Module):
    def __init__(self, num_tokens, attn_layers):
        super().__init__()
        self.token_emb = nn.Module()
        self.token_emb.emb = nn.Embedding(num_tokens, attn_layers.dim)
        self.attn_layers = attn_layers
        self.to_logits = nn.Linear(attn_layers.dim, num_tokens, bias=False)

    def forward(self, x):
        return self.to_logits(self.attn_layers(self.token_emb.emb(x)))


@member("x-transformers")
def x_transformers():
    model = TransformerWrapper(VOCAB, AttentionLayers(D, depth=2, heads=H, kv_heads=HKV))
    att = []
    for blk, idx in enumerate((0, 2)):  # block = the i-th attention ('a' layers at 0 and 2)
        m = f"attn_layers.layers.{idx}.1"
        att.append(Attn(blk, H, HKV, DH, *heads_separate(f"{m}.to_q.weight", f"{m}.to_k.weight",
                                                         H, HKV, DH), m))
    return model, tokens(), Truth(att, note="blocks are the attention layers' order: "
                                            "x-transformers interleaves 'a' and 'f' layers")


# ---- lucidrains-style einsum over raw Parameters [d, h, e] ----------------------------------

class EinsumAttention(nn.Module):
    def __init__(self, dim, heads=H, dim_head=DH):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_q = nn.Parameter(torch.randn(dim, heads, dim_head) * dim ** -0.5)
        self.to_k = nn.Parameter(torch.randn(dim, heads, dim_head) * dim ** -0.5)
        self.to_v = nn.Parameter(torch.randn(dim, heads, dim_head) * dim ** -0.5)
        self.to_out = nn.Parameter(torch.randn(heads, dim_head, dim) * dim ** -0.5)

    def forward(self, x):
        q = torch.einsum("bnd,dhe->bhne", x, self.to_q)
        k = torch.einsum("bnd,dhe->bhne", x, self.to_k)
        v = torch.einsum("bnd,dhe->bhne", x, self.to_v)
        sim = torch.einsum("bhie,bhje->bhij", q, k) * self.scale
        n = x.shape[1]
        sim = sim.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("bhij,bhje->bhie", sim.softmax(dim=-1), v)
        return torch.einsum("bhne,hed->bnd", out, self.to_out)


class EinsumTransformer(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                nn.LayerNorm(D), EinsumAttention(D),
                nn.LayerNorm(D), nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(),
                                               nn.Linear(4 * D, D))]))
        self.to_logits = nn.Linear(D, VOCAB)

    def forward(self, x):
        x = self.token_emb(x)
        for n1, attn, n2, ff in self.layers:
            x = x + attn(n1(x))
            x = x + ff(n2(x))
        return self.to_logits(x)


@member("lucidrains-einsum")
def lucidrains_einsum():
    att = []
    for i in range(2):
        m = f"layers.{i}.1"
        att.append(Attn(i, H, H, DH, *heads_separate(f"{m}.to_q", f"{m}.to_k", H, H, DH, t=True),
                        m))
    return EinsumTransformer(), tokens(), Truth(att)


# ---- a GPT whose attention keeps its head count in `self.h` --------------------------------

class SelfHAttention(nn.Module):
    def __init__(self, d_model, h):
        super().__init__()
        self.h = h
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        return self.c_proj(attend(q, k, v).transpose(1, 2).reshape(b, t, c))


class SelfHBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SelfHAttention(d, h)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class SelfHGPT(nn.Module):
    def __init__(self, d=D, h=8, depth=2):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(16, d)
        self.blocks = nn.ModuleList(SelfHBlock(d, h) for _ in range(depth))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


@member("self-h")
def self_h():
    att = []
    for i in range(2):
        m = f"blocks.{i}.attn"
        att.append(Attn(i, 8, 8, D // 8, *heads_contiguous(f"{m}.c_attn.weight", 8, 8, D // 8),
                        m))
    return SelfHGPT(), tokens(), Truth(att)


# ---- a dense model with a per-head output gate Linear(d, H): not a router ----------------------

class GatedAttentionBlock(nn.Module):
    """Each head's output is scaled by sigmoid(gate(x))[h] before the output
    projection (gated attention). No top-k, no experts: not a router."""

    def __init__(self, d, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d // n_heads
        self.norm = RMSNorm(d)
        self.attn = nn.Module()
        self.attn.q_proj = nn.Linear(d, d, bias=False)
        self.attn.k_proj = nn.Linear(d, n_kv_heads * self.head_dim, bias=False)
        self.attn.v_proj = nn.Linear(d, n_kv_heads * self.head_dim, bias=False)
        self.gate = nn.Linear(d, n_heads)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(RMSNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))
        self.rope = RotaryEmbedding(self.head_dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm(x)
        q = self.attn.q_proj(h).view(b, t, self.n_heads, -1).transpose(1, 2)
        k = self.attn.k_proj(h).view(b, t, self.n_kv_heads, -1).transpose(1, 2)
        v = self.attn.v_proj(h).view(b, t, self.n_kv_heads, -1).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *self.rope(h, t))
        rep = self.n_heads // self.n_kv_heads
        o = attend(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        g = torch.sigmoid(self.gate(h)).transpose(1, 2)[..., None]  # [b, H, t, 1]
        x = x + self.proj((o * g).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class GatedAttentionLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = config(n_heads=H, n_kv_heads=HKV)
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(GatedAttentionBlock(D, H, HKV) for _ in range(2))
        self.out = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


@member("per-head-gate")
def per_head_gate():
    att = []
    for i in range(2):
        m = f"blocks.{i}.attn"
        att.append(Attn(i, H, HKV, DH, *heads_separate(f"{m}.q_proj.weight", f"{m}.k_proj.weight",
                                                       H, HKV, DH), m))
    return GatedAttentionLM(), tokens(), Truth(
        att, not_reported=[f"blocks.{i}.gate.weight" for i in range(2)])


# ---- BERT for sequence classification with an argmax accuracy in forward ------------------------

class BertSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_attention_heads = cfg.num_attention_heads
        self.attention_head_size = cfg.hidden_size // cfg.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(cfg.hidden_size, self.all_head_size)
        self.key = nn.Linear(cfg.hidden_size, self.all_head_size)
        self.value = nn.Linear(cfg.hidden_size, self.all_head_size)

    def transpose_for_scores(self, x):
        return x.view(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)) \
            .permute(0, 2, 1, 3)

    def forward(self, x):
        q = self.transpose_for_scores(self.query(x))
        k = self.transpose_for_scores(self.key(x))
        v = self.transpose_for_scores(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        ctx = torch.matmul(nn.functional.softmax(scores, dim=-1), v).permute(0, 2, 1, 3)
        return ctx.reshape(ctx.size()[:-2] + (self.all_head_size,))


class BertLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = BertSelfAttention(cfg)
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.attention.output.LayerNorm = nn.LayerNorm(cfg.hidden_size)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, x):
        a = self.attention
        x = a.output.LayerNorm(x + a.output.dense(a.self(x)))
        h = F.gelu(self.intermediate.dense(x))
        return self.output.LayerNorm(x + self.output.dense(h))


class BertForSequenceClassification(nn.Module):
    """forward also records the batch accuracy: argmax over the class
    logits, compared with the labels (a metric, not a dispatch)."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.num_labels = cfg.num_labels
        self.bert = nn.Module()
        self.bert.embeddings = nn.Module()
        self.bert.embeddings.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.bert.embeddings.position_embeddings = nn.Embedding(16, cfg.hidden_size)
        self.bert.encoder = nn.Module()
        self.bert.encoder.layer = nn.ModuleList(BertLayer(cfg)
                                                for _ in range(cfg.num_hidden_layers))
        self.bert.pooler = nn.Module()
        self.bert.pooler.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)
        self.last_accuracy = None

    def forward(self, input_ids, labels):
        e = self.bert.embeddings
        x = e.word_embeddings(input_ids) + e.position_embeddings(
            torch.arange(input_ids.shape[1]))
        for layer in self.bert.encoder.layer:
            x = layer(x)
        pooled = torch.tanh(self.bert.pooler.dense(x[:, 0]))
        logits = self.classifier(pooled)
        self.last_accuracy = (logits.argmax(dim=-1) == labels).float().mean().detach()
        return F.cross_entropy(logits, labels), logits


@member("bert-argmax-metric")
def bert_argmax():
    cfg = config(vocab_size=VOCAB, hidden_size=D, num_attention_heads=H, num_hidden_layers=2,
                 intermediate_size=64, num_labels=4)
    att = []
    for i in range(2):
        m = f"bert.encoder.layer.{i}.attention.self"
        att.append(Attn(i, H, H, DH, *heads_separate(f"{m}.query.weight", f"{m}.key.weight",
                                                     H, H, DH), m))
    ids = torch.randint(0, VOCAB, (4, 8))
    return BertForSequenceClassification(cfg), (ids, torch.randint(0, 4, (4,))), Truth(
        att, not_reported=["classifier.weight"])


# ---- a Mamba-only language model: nothing to monitor ---------------------------------------

@member("mamba-only")
def mamba_only():
    from .moe import JambaMambaMixer

    class MambaBlock(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.norm = RMSNorm(cfg.hidden_size)
            self.mixer = JambaMambaMixer(cfg)

        def forward(self, x):
            return x + self.mixer(self.norm(x))

    class MambaLMHeadModel(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.backbone = nn.Module()
            self.backbone.embeddings = nn.Embedding(VOCAB, cfg.hidden_size)
            self.backbone.layers = nn.ModuleList(MambaBlock(cfg) for _ in range(2))
            self.backbone.norm_f = RMSNorm(cfg.hidden_size)
            self.lm_head = nn.Linear(cfg.hidden_size, VOCAB, bias=False)

        def forward(self, ids):
            x = self.backbone.embeddings(ids)
            for layer in self.backbone.layers:
                x = layer(x)
            return self.lm_head(self.backbone.norm_f(x))

    cfg = config(hidden_size=D, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)
    nr = [f"backbone.layers.{i}.mixer.{n}.weight" for i in range(2)
          for n in ("in_proj", "x_proj", "out_proj")]
    return MambaLMHeadModel(cfg), tokens(), Truth([], not_reported=nr)


# ---- two top-k sites that are not MoE routers --------------------------------------------------

class MoDBlock(nn.Module):
    """Mixture-of-depths: a Linear(d, 1) router scores tokens, the block
    processes only the top `capacity` tokens of each sequence (top-k over
    the sequence, one output: not an MoE router)."""

    def __init__(self, capacity=4):
        super().__init__()
        self.capacity = capacity
        self.router = nn.Linear(D, 1, bias=False)
        self.block = SelfHBlock(D, H)
        self.block.attn.num_heads = H

    def forward(self, x):
        b, t, d = x.shape
        w = self.router(x).squeeze(-1)  # [b, t]
        top_w, idx = torch.topk(w, self.capacity, dim=1, sorted=False)
        idx, order = idx.sort(dim=1)
        top_w = top_w.gather(1, order)
        sel = x.gather(1, idx[..., None].expand(b, self.capacity, d))
        out = self.block(sel) - sel
        return x.scatter_add(1, idx[..., None].expand(b, self.capacity, d),
                             out * torch.sigmoid(top_w)[..., None])


@member("mixture-of-depths")
def mixture_of_depths():
    att = []
    for i in range(2):
        m = f"blocks.{i}.block.attn"
        att.append(Attn(i, H, H, DH, *heads_contiguous(f"{m}.c_attn.weight", H, H, DH), m))
    model = SelfHGPT(h=H)
    model.blocks = nn.ModuleList(MoDBlock() for _ in range(2))
    return model, tokens(), Truth(att, not_reported=[f"blocks.{i}.router.weight"
                                                     for i in range(2)])


class TopKActivationMLP(nn.Module):
    """k-sparse activations: keep the top 8 of 64 hidden units per token
    (top-k over a projection's outputs, no dispatch: not a router)."""

    def __init__(self, d, hidden=64, k=8):
        super().__init__()
        self.k = k
        self.w_in = nn.Linear(d, hidden)
        self.w_out = nn.Linear(hidden, d)

    def forward(self, x):
        h = F.relu(self.w_in(x))
        vals, idx = h.topk(self.k, dim=-1)
        return self.w_out(torch.zeros_like(h).scatter(-1, idx, vals))


class TopKMLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = TimmAttention(D, H, qkv_bias=True)
        self.mlp = TopKActivationMLP(D)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


@member("topk-sparse-mlp")
def topk_sparse_mlp():
    from .moe import BlocksLM
    att = []
    for i in range(2):
        m = f"blocks.{i}.attn"
        att.append(Attn(i, H, H, DH, *heads_contiguous(f"{m}.qkv.weight", H, H, DH), m))
    return BlocksLM(TopKMLPBlock), tokens(), Truth(
        att, not_reported=[f"blocks.{i}.mlp.w_in.weight" for i in range(2)])


# ---- ALBERT: one layer's weights applied at every depth ----------------------------------------

class AlbertLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention = nn.Module()
        a = self.attention
        a.num_attention_heads = cfg.num_attention_heads
        a.attention_head_size = cfg.hidden_size // cfg.num_attention_heads
        a.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        a.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        a.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        a.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        a.LayerNorm = nn.LayerNorm(cfg.hidden_size)
        self.ffn = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.ffn_output = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.full_layer_layer_norm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, x):
        a = self.attention
        b, t, d = x.shape
        def heads(z):
            return z.view(b, t, a.num_attention_heads, a.attention_head_size).transpose(1, 2)
        q, k, v = heads(a.query(x)), heads(a.key(x)), heads(a.value(x))
        ctx = attend(q, k, v, causal=False).transpose(1, 2).reshape(b, t, d)
        x = a.LayerNorm(x + a.dense(ctx))
        return self.full_layer_layer_norm(x + self.ffn_output(F.gelu(self.ffn(x))))


class AlbertModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.embedding_size)
        self.embeddings.position_embeddings = nn.Embedding(16, cfg.embedding_size)
        self.encoder = nn.Module()
        self.encoder.embedding_hidden_mapping_in = nn.Linear(cfg.embedding_size, cfg.hidden_size)
        group = nn.Module()
        group.albert_layers = nn.ModuleList([AlbertLayer(cfg)])
        self.encoder.albert_layer_groups = nn.ModuleList([group])
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, input_ids):
        e = self.embeddings
        x = e.word_embeddings(input_ids) + e.position_embeddings(torch.arange(input_ids.shape[1]))
        x = self.encoder.embedding_hidden_mapping_in(x)
        layer = self.encoder.albert_layer_groups[0].albert_layers[0]
        for _ in range(self.config.num_hidden_layers):  # the same weights at every depth
            x = layer(x)
        return torch.tanh(self.pooler(x[:, 0])), x


@member("albert-shared")
def albert():
    cfg = config(vocab_size=VOCAB, embedding_size=16, hidden_size=D, num_attention_heads=H,
                 num_hidden_layers=3, intermediate_size=64)
    m = "encoder.albert_layer_groups.0.albert_layers.0.attention"
    att = [Attn(0, H, H, DH, *heads_separate(f"{m}.query.weight", f"{m}.key.weight", H, H, DH),
                m)]
    return AlbertModel(cfg), tokens(), Truth(
        att, note="one attention module applied at 3 depths: one site (one set of weights), "
                  "layer 0")


# ---- OpenAI CLIP's AttentionPool2d: F.multi_head_attention_forward with separate weights ------

class AttentionPool2d(nn.Module):
    def __init__(self, spacial_dim, embed_dim, num_heads, output_dim=None):
        super().__init__()
        self.positional_embedding = nn.Parameter(
            torch.randn(spacial_dim ** 2 + 1, embed_dim) / embed_dim ** 0.5)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.c_proj = nn.Linear(embed_dim, output_dim or embed_dim)
        self.num_heads = num_heads

    def forward(self, x):
        x = x.flatten(start_dim=2).permute(2, 0, 1)  # NCHW -> (HW)NC
        x = torch.cat([x.mean(dim=0, keepdim=True), x], dim=0)
        x = x + self.positional_embedding[:, None, :].to(x.dtype)
        x, _ = F.multi_head_attention_forward(
            query=x[:1], key=x, value=x, embed_dim_to_check=x.shape[-1],
            num_heads=self.num_heads, q_proj_weight=self.q_proj.weight,
            k_proj_weight=self.k_proj.weight, v_proj_weight=self.v_proj.weight,
            in_proj_weight=None,
            in_proj_bias=torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]),
            bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
            out_proj_weight=self.c_proj.weight, out_proj_bias=self.c_proj.bias,
            use_separate_proj_weight=True, training=self.training, need_weights=False)
        return x.squeeze(0)


class ClipResNetStem(nn.Module):
    """A two-stage conv trunk (BatchNorm) ending in the attention pool."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, D, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(D)
        self.conv2 = nn.Conv2d(D, D, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(D)
        self.attnpool = AttentionPool2d(4, D, H, 16)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.attnpool(x)


@member("clip-attnpool")
def clip_attnpool():
    m = "attnpool"
    att = [Attn(0, H, H, DH, *heads_separate(f"{m}.q_proj.weight", f"{m}.k_proj.weight", H, H,
                                             DH), m)]
    return ClipResNetStem(), (torch.randn(2, 3, 16, 16),), Truth(
        att, note="one attention site outside any numbered block: layer 0")


# ---- PaLM (lucidrains): one fused projection for q, the single key head, v and the FF --------

class PaLMParallelTransformerBlock(nn.Module):
    def __init__(self, dim, dim_head=DH, heads=H, ff_mult=2):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        attn_inner_dim = dim_head * heads
        ff_inner_dim = dim * ff_mult
        self.fused_dims = (attn_inner_dim, dim_head, dim_head, ff_inner_dim * 2)
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.rotary_emb = RotaryEmbedding(dim_head)
        self.fused_attn_ff_proj = nn.Linear(dim, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(attn_inner_dim, dim, bias=False)
        self.ff_out = nn.Linear(ff_inner_dim, dim, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        x = self.norm(x)
        q, k, v, ff = self.fused_attn_ff_proj(x).split(self.fused_dims, dim=-1)
        q = q.view(b, n, self.heads, -1).transpose(1, 2)  # b h n d
        cos, sin = self.rotary_emb(x, n)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin  # b n d: one key head for all
        sim = torch.einsum("bhid,bjd->bhij", q * self.scale, k)
        sim = sim.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1e30)
        out = torch.einsum("bhij,bjd->bhid", sim.softmax(dim=-1), v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        a, gate = ff.chunk(2, dim=-1)
        return self.attn_out(out) + self.ff_out(F.silu(gate) * a)


class PaLM(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(PaLMParallelTransformerBlock(D) for _ in range(depth))
        self.norm = nn.LayerNorm(D)
        self.to_logits = nn.Linear(D, VOCAB, bias=False)

    def forward(self, x):
        x = self.token_emb(x)
        for blk in self.layers:
            x = x + blk(x)
        return self.to_logits(self.norm(x))


@member("palm-parallel")
def palm_parallel():
    att = []
    for i in range(2):
        m = f"layers.{i}"
        att.append(Attn(i, H, 1, DH, *heads_contiguous(f"{m}.fused_attn_ff_proj.weight", H, 1,
                                                       DH), m))
    return PaLM(), tokens(), Truth(att)


# ---- RWKV-4: receptance/key/value and a WKV recurrence, no attention scores --------------------

class RWKVTimeMix(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.time_decay = nn.Parameter(torch.randn(d) * 0.1)
        self.time_first = nn.Parameter(torch.randn(d) * 0.1)
        self.time_mix_k = nn.Parameter(torch.rand(1, 1, d))
        self.time_mix_v = nn.Parameter(torch.rand(1, 1, d))
        self.time_mix_r = nn.Parameter(torch.rand(1, 1, d))
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d, bias=False)
        self.receptance = nn.Linear(d, d, bias=False)
        self.output = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        xx = F.pad(x, (0, 0, 1, -1))  # time shift
        k = self.key(x * self.time_mix_k + xx * (1 - self.time_mix_k))
        v = self.value(x * self.time_mix_v + xx * (1 - self.time_mix_v))
        r = torch.sigmoid(self.receptance(x * self.time_mix_r + xx * (1 - self.time_mix_r)))
        w, u = -torch.exp(self.time_decay), self.time_first
        num = torch.zeros(b, d)
        den = torch.zeros(b, d)
        outs = []
        for i in range(t):
            e = torch.exp(u + k[:, i])
            outs.append((num + e * v[:, i]) / (den + e))
            num = torch.exp(w) * num + torch.exp(k[:, i]) * v[:, i]
            den = torch.exp(w) * den + torch.exp(k[:, i])
        return self.output(r * torch.stack(outs, 1))


class RWKVChannelMix(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.time_mix_k = nn.Parameter(torch.rand(1, 1, d))
        self.time_mix_r = nn.Parameter(torch.rand(1, 1, d))
        self.key = nn.Linear(d, 4 * d, bias=False)
        self.receptance = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        xx = F.pad(x, (0, 0, 1, -1))
        k = torch.square(torch.relu(self.key(x * self.time_mix_k + xx * (1 - self.time_mix_k))))
        r = torch.sigmoid(self.receptance(x * self.time_mix_r + xx * (1 - self.time_mix_r)))
        return r * self.value(k)


class RWKV(nn.Module):
    def __init__(self, n_layer=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList()
        for _ in range(n_layer):
            blk = nn.Module()
            blk.ln1, blk.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            blk.att, blk.ffn = RWKVTimeMix(D), RWKVChannelMix(D)
            self.blocks.append(blk)
        self.ln_out = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.blocks:
            x = x + blk.att(blk.ln1(x))
            x = x + blk.ffn(blk.ln2(x))
        return self.head(self.ln_out(x))


@member("rwkv4")
def rwkv4():
    nr = [f"blocks.{i}.att.{n}.weight" for i in range(2) for n in ("key", "receptance")]
    return RWKV(), tokens(), Truth([], not_reported=nr)


# ---- heads last: rearrange 'b n (d h) -> b h n d' (head h reads rows h, h + H, ...) ----------

class HeadsLastAttention(nn.Module):
    def __init__(self, dim, heads=H, dim_head=DH):
        super().__init__()
        self.heads = heads
        self.dim_head = dim_head
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_k = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_v = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, x):
        b, n, _ = x.shape
        # the head index varies fastest along the projection's outputs
        q, k, v = (f(x).view(b, n, self.dim_head, self.heads).permute(0, 3, 1, 2)
                   for f in (self.to_q, self.to_k, self.to_v))
        out = attend(q, k, v)
        return self.to_out(out.permute(0, 2, 3, 1).reshape(b, n, -1))


class HeadsLastLM(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList()
        for _ in range(depth):
            blk = nn.Module()
            blk.norm1, blk.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
            blk.attn = HeadsLastAttention(D)
            blk.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
            self.layers.append(blk)
        self.out = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.layers:
            x = x + blk.attn(blk.norm1(x))
            x = x + blk.ff(blk.norm2(x))
        return self.out(x)


@member("heads-last")
def heads_last():
    from . import Rows
    att = []
    for i in range(2):
        m = f"layers.{i}.attn"
        qs = [Rows(f"{m}.to_q.weight", range(h, H * DH, H)) for h in range(H)]
        ks = [Rows(f"{m}.to_k.weight", range(h, H * DH, H)) for h in range(H)]
        att.append(Attn(i, H, H, DH, qs, ks, m))
    return HeadsLastLM(), tokens(), Truth(att, note="head h reads rows h, h + H, h + 2H, ...")


# ---- Q/K weights in an nn.ParameterDict, applied with F.linear ----------------------------------

class DictAttention(nn.Module):
    def __init__(self, dim, n_heads=H, n_kv_heads=HKV):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        kv = n_kv_heads * self.head_dim
        self.w = nn.ParameterDict({
            "q": nn.Parameter(torch.randn(dim, dim) * dim ** -0.5),
            "k": nn.Parameter(torch.randn(kv, dim) * dim ** -0.5),
            "v": nn.Parameter(torch.randn(kv, dim) * dim ** -0.5),
            "o": nn.Parameter(torch.randn(dim, dim) * dim ** -0.5)})

    def forward(self, x):
        b, n, d = x.shape
        q = F.linear(x, self.w["q"]).view(b, n, self.n_heads, -1).transpose(1, 2)
        k = F.linear(x, self.w["k"]).view(b, n, self.n_kv_heads, -1).transpose(1, 2)
        v = F.linear(x, self.w["v"]).view(b, n, self.n_kv_heads, -1).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        out = attend(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        return F.linear(out.transpose(1, 2).reshape(b, n, d), self.w["o"])


@member("parameterdict-attn")
def parameterdict_attn():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = RMSNorm(D), RMSNorm(D)
            self.mix = DictAttention(D)
            self.ff = nn.Sequential(nn.Linear(D, 64), nn.SiLU(), nn.Linear(64, D))

        def forward(self, x):
            x = x + self.mix(self.n1(x))
            return x + self.ff(self.n2(x))

    from .moe import BlocksLM
    att = []
    for i in range(2):
        m = f"blocks.{i}.mix"
        att.append(Attn(i, H, HKV, DH, *heads_separate(f"{m}.w.q", f"{m}.w.k", H, HKV, DH), m))
    return BlocksLM(Block), tokens(), Truth(att)


# ---- Linformer (lucidrains): keys and values projected along the sequence --------------------

class LinformerSelfAttention(nn.Module):
    def __init__(self, dim, seq_len, k=4, heads=H, dim_head=DH):
        super().__init__()
        self.seq_len, self.k, self.heads, self.dim_head = seq_len, k, heads, dim_head
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_k = nn.Linear(dim, dim_head * heads, bias=False)
        self.proj_k = nn.Parameter(torch.randn(seq_len, k) / math.sqrt(k))
        self.to_v = nn.Linear(dim, dim_head * heads, bias=False)
        self.proj_v = nn.Parameter(torch.randn(seq_len, k) / math.sqrt(k))
        self.to_out = nn.Linear(dim_head * heads, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.to_q(x)
        keys = torch.einsum("bnd,nk->bkd", self.to_k(x), self.proj_k[:n])
        values = torch.einsum("bnd,nk->bkd", self.to_v(x), self.proj_v[:n])
        q = q.reshape(b, n, self.heads, -1).transpose(1, 2)
        keys = keys.reshape(b, self.k, self.heads, -1).transpose(1, 2)
        values = values.reshape(b, self.k, self.heads, -1).transpose(1, 2)
        dots = torch.einsum("bhnd,bhkd->bhnk", q, keys) * (self.dim_head ** -0.5)
        out = torch.einsum("bhnk,bhkd->bhnd", dots.softmax(dim=-1), values)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class Linformer(nn.Module):
    def __init__(self, seq_len=8, depth=2):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList()
        for _ in range(depth):
            blk = nn.Module()
            blk.attn_norm, blk.ff_norm = nn.LayerNorm(D), nn.LayerNorm(D)
            blk.attn = LinformerSelfAttention(D, seq_len)
            blk.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
            self.layers.append(blk)
        self.to_logits = nn.Linear(D, VOCAB)

    def forward(self, x):
        x = self.token_emb(x)
        for blk in self.layers:
            x = x + blk.attn(blk.attn_norm(x))
            x = x + blk.ff(blk.ff_norm(x))
        return self.to_logits(x)


@member("linformer")
def linformer():
    att = []
    for i in range(2):
        m = f"layers.{i}.attn"
        att.append(Attn(i, H, H, DH, *heads_separate(f"{m}.to_q.weight", f"{m}.to_k.weight", H,
                                                     H, DH), m))
    return Linformer(), tokens(), Truth(att, note="keys mixed along the sequence by proj_k")


# ---- SDPA with enable_gqa (torch >= 2.5): the key heads enter the product unrepeated ------------

def _sdpa_gqa():
    try:
        major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    except ValueError:
        return False
    return hasattr(F, "scaled_dot_product_attention") and (major, minor) >= (2, 5)


class GQASDPAAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_q = nn.Linear(cfg.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(cfg.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(cfg.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim)

    def forward(self, x):
        b, t, c = x.shape
        q = self.c_q(x).view(b, t, self.n_head, self.head_dim)
        k = self.c_k(x).view(b, t, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(b, t, self.n_kv_head, self.head_dim)
        if hasattr(F, "rms_norm"):  # torch >= 2.4
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *self.rotary(x, t))
        if _sdpa_gqa():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            rep = self.n_head // self.n_kv_head
            y = attend(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


@member("sdpa-enable-gqa")
def sdpa_enable_gqa():
    """A modded-nanoGPT/nanochat-style block: c_q/c_k/c_v, functional
    qk-norm (F.rms_norm where torch has it), SDPA with enable_gqa."""
    class Block(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.attn = GQASDPAAttention(cfg)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D, bias=False), nn.ReLU(),
                                     nn.Linear(4 * D, D, bias=False))

        def forward(self, x):
            x = x + self.attn(F.layer_norm(x, (D,)))
            return x + self.mlp(F.layer_norm(x, (D,)))

    class GPT(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.config = cfg
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(VOCAB, D), h=nn.ModuleList(Block(cfg) for _ in range(2))))
            self.lm_head = nn.Linear(D, VOCAB, bias=False)

        def forward(self, idx):
            x = self.transformer.wte(idx)
            for blk in self.transformer.h:
                x = blk(x)
            return self.lm_head(x)

    cfg = config(n_head=H, n_kv_head=HKV, n_embd=D)
    att = []
    for i in range(2):
        m = f"transformer.h.{i}.attn"
        att.append(Attn(i, H, HKV, DH, *heads_separate(f"{m}.c_q.weight", f"{m}.c_k.weight", H,
                                                       HKV, DH), m))
    return GPT(cfg), tokens(), Truth(att)
