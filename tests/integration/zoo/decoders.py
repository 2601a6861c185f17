"""Decoder-only dense models: transformers' LLaMA, Mistral, Qwen2, Qwen3,
Gemma, Phi-3, GPT-2, GPT-NeoX, GPT-J, GPTBigCode, Falcon (both
architectures), BLOOM, OPT; AllenAI's OLMo; Meta's LLaMA reference;
nanoGPT; minGPT. Written here after the public code's names and forward
structure, tiny and random."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Attn, Truth, heads_contiguous, heads_grouped, heads_separate, member
from .parts import (D, DH, H, HKV, L, T, VOCAB, Decoder, RMSNorm, RotaryEmbedding,
                    apply_rotary_pos_emb, attend, config, repeat_kv, rotate_half, tokens)


def llama_config(**kw):
    c = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=3 * D, num_hidden_layers=L,
             num_attention_heads=H, num_key_value_heads=HKV, rms_norm_eps=1e-6,
             hidden_act="silu")
    c.update(kw)
    return config(**c)


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    """q/k/v/o_proj; head_dim from config (or hidden / heads);
    num_key_value_groups; rotary (rotate_half); repeat_kv; SDPA or eager.
    qk_norm: Qwen3's per-head q_norm/k_norm before rotary. sliding_window:
    Mistral's banded mask (eager path)."""

    def __init__(self, cfg, layer_idx, bias=False, qk_norm=False, sdpa=True):
        super().__init__()
        self.config = cfg
        self.layer_idx = layer_idx
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // \
            cfg.num_attention_heads
        self.num_key_value_groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.sdpa = sdpa
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
        self.q_proj = nn.Linear(d, h * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(h * self.head_dim, d, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim)
            self.k_norm = RMSNorm(self.head_dim)

    def forward(self, x, rope):
        b, t, _ = x.shape
        shape = (b, t, -1, self.head_dim)
        q = self.q_proj(x).view(shape)
        k = self.k_proj(x).view(shape)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        mask = None
        window = getattr(self.config, "sliding_window", None)
        if window:
            i = torch.arange(t)
            mask = torch.zeros(t, t).masked_fill((i[None, :] <= i[:, None] - window), float("-inf"))
        out = attend(q, k, v, causal=True, mask=mask, sdpa=self.sdpa, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class LlamaDecoderLayer(nn.Module):
    attention_kw = {}

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, **self.attention_kw)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


def separate_truth(prefix, n_layers, h, kv, dh, attn="self_attn", q="q_proj", k="k_proj",
                   not_reported=()):
    att = []
    for i in range(n_layers):
        m = f"{prefix}.{i}.{attn}"
        qs, ks = heads_separate(f"{m}.{q}.weight", f"{m}.{k}.weight", h, kv, dh)
        att.append(Attn(i, h, kv, dh, qs, ks, m))
    return Truth(att, not_reported=list(not_reported))


def mlp_gates(prefix, n_layers, name="mlp.gate_proj"):
    return [f"{prefix}.{i}.{name}.weight" for i in range(n_layers)]


@member("llama")
def llama():
    model = Decoder(llama_config(), LlamaDecoderLayer, rotary_dim=DH)
    return model, tokens(), separate_truth("model.layers", L, H, HKV, DH,
                                           not_reported=mlp_gates("model.layers", L))


class MistralDecoderLayer(LlamaDecoderLayer):
    attention_kw = dict(sdpa=False)


@member("mistral")
def mistral():
    model = Decoder(llama_config(sliding_window=4), MistralDecoderLayer, rotary_dim=DH)
    return model, tokens(), separate_truth("model.layers", L, H, HKV, DH,
                                           not_reported=mlp_gates("model.layers", L))


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_kw = dict(bias=True, sdpa=False)


@member("qwen2")
def qwen2():
    cfg = llama_config(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3)
    model = Decoder(cfg, Qwen2DecoderLayer, rotary_dim=D // 8)
    return model, tokens(), separate_truth("model.layers", 3, 8, 2, D // 8,
                                           not_reported=mlp_gates("model.layers", 3))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_kw = dict(qk_norm=True)


@member("qwen3-qknorm")
def qwen3():
    # head_dim set apart from hidden / heads, as Qwen3's config does
    cfg = llama_config(head_dim=16, num_attention_heads=4, num_key_value_heads=2)
    model = Decoder(cfg, Qwen3DecoderLayer, rotary_dim=16)
    return model, tokens(), separate_truth("model.layers", L, 4, 2, 16,
                                           not_reported=mlp_gates("model.layers", L))


# ---- Gemma: MQA, head_dim from config, scaled embeddings, GeGLU --------------------------------

class GemmaRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        n = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (n * (1.0 + self.weight.float())).type_as(x)


class GemmaMLP(LlamaMLP):
    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, sdpa=False)
        self.mlp = GemmaMLP(cfg)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class GemmaForCausalLM(Decoder):
    def forward(self, input_ids):
        x = self.model.embed_tokens(input_ids) * math.sqrt(self.config.hidden_size)
        rope = self.model.rotary_emb(x, input_ids.shape[1])
        for layer in self.model.layers:
            x = layer(x, rope)
        return self.lm_head(self.model.norm(x))


@member("gemma-mqa")
def gemma():
    cfg = llama_config(num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    model = GemmaForCausalLM(cfg, GemmaDecoderLayer, rotary_dim=16, norm=GemmaRMSNorm)
    return model, tokens(), separate_truth("model.layers", L, 4, 1, 16,
                                           not_reported=mlp_gates("model.layers", L))


# ---- Phi-3: fused qkv_proj with GQA, fused gate_up_proj ---------------------------------------

class Phi3Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.config = cfg
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads
        self.num_key_value_heads = cfg.num_key_value_heads
        op = (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, op, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, rope):
        b, t, _ = x.shape
        qkv = self.qkv_proj(x)
        qp = self.num_heads * self.head_dim
        kp = self.num_key_value_heads * self.head_dim
        q = qkv[..., :qp].view(b, t, -1, self.head_dim).transpose(1, 2)
        k = qkv[..., qp:qp + kp].view(b, t, -1, self.head_dim).transpose(1, 2)
        v = qkv[..., qp + kp:].view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        rep = self.num_heads // self.num_key_value_heads
        out = attend(q, repeat_kv(k, rep), repeat_kv(v, rep), sdpa=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Phi3MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


class Phi3DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.self_attn = Phi3Attention(cfg, layer_idx)
        self.mlp = Phi3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


@member("phi3")
def phi3():
    model = Decoder(llama_config(), Phi3DecoderLayer, rotary_dim=DH)
    att = []
    for i in range(L):
        m = f"model.layers.{i}.self_attn"
        qs, ks = heads_contiguous(f"{m}.qkv_proj.weight", H, HKV, DH)
        att.append(Attn(i, H, HKV, DH, qs, ks, m))
    return model, tokens(), Truth(att, not_reported=mlp_gates("model.layers", L,
                                                              "mlp.gate_up_proj"))


# ---- GPT-2: Conv1D c_attn stored [in, out] --------------------------------------------------

class Conv1D(nn.Module):
    """transformers' Conv1D: weight [nx, nf], y = x @ W + b."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(
            x.shape[:-1] + (self.nf,))


class GPT2Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.embed_dim = cfg.n_embd
        self.num_heads = cfg.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.register_buffer("bias", torch.tril(torch.ones(cfg.n_positions, cfg.n_positions,
                                                           dtype=torch.bool)).view(
            1, 1, cfg.n_positions, cfg.n_positions), persistent=False)

    def _split_heads(self, x):
        return x.view(x.shape[:-1] + (self.num_heads, self.head_dim)).permute(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        w = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], v.size(-1) ** 0.5)
        t = q.size(-2)
        w = torch.where(self.bias[:, :, :t, :t], w, torch.finfo(w.dtype).min)
        w = nn.functional.softmax(w, dim=-1)
        out = torch.matmul(w, v).permute(0, 2, 1, 3).contiguous()
        return self.c_proj(out.view(out.shape[:-2] + (self.embed_dim,)))


class GPT2MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = Conv1D(4 * cfg.n_embd, cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, 4 * cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = GPT2Attention(cfg, i)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg, block=GPT2Block):
        super().__init__()
        self.config = cfg
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.transformer.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.transformer.h = nn.ModuleList(block(cfg, i) for i in range(cfg.n_layer))
        self.transformer.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        pos = torch.arange(input_ids.shape[1])
        x = self.transformer.wte(input_ids) + self.transformer.wpe(pos)
        for blk in self.transformer.h:
            x = blk(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpt2_config(**kw):
    c = dict(vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=L, n_head=H)
    c.update(kw)
    return config(**c)


@member("gpt2")
def gpt2():
    model = GPT2LMHeadModel(gpt2_config())
    att = []
    for i in range(L):
        m = f"transformer.h.{i}.attn"
        qs, ks = heads_contiguous(f"{m}.c_attn.weight", H, H, DH, t=True)
        att.append(Attn(i, H, H, DH, qs, ks, m))
    return model, tokens(), Truth(att)


# ---- GPTBigCode: multi-query, c_attn Linear(d, d + 2 dh) ----------------------------------------

class GPTBigCodeAttention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.multi_query = cfg.multi_query
        self.embed_dim = cfg.n_embd
        self.num_heads = cfg.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.kv_heads = 1 if self.multi_query else self.num_heads
        self.kv_dim = self.kv_heads * self.head_dim
        self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, kv = self.c_attn(x).split((self.embed_dim, 2 * self.kv_dim), dim=2)
        # MQA: queries folded into the sequence dim, one shared key
        q = q.reshape(b, t * self.num_heads, self.head_dim)
        k, v = kv.split(self.head_dim, dim=-1)
        w = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(self.head_dim)
        w = w.view(b, t, self.num_heads, t)
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, :, None, :]
        w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
        w = F.softmax(w, dim=-1).view(b, t * self.num_heads, t)
        out = torch.bmm(w, v).view(b, t, self.embed_dim)
        return self.c_proj(out)


class GPTBigCodeMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPTBigCodeBlock(GPT2Block):
    def __init__(self, cfg, i):
        nn.Module.__init__(self)
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = GPTBigCodeAttention(cfg, i)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = GPTBigCodeMLP(cfg)


@member("gpt-bigcode-mqa")
def gpt_bigcode():
    model = GPT2LMHeadModel(gpt2_config(multi_query=True), GPTBigCodeBlock)
    att = []
    for i in range(L):
        m = f"transformer.h.{i}.attn"
        qs, ks = heads_contiguous(f"{m}.c_attn.weight", H, 1, DH)
        att.append(Attn(i, H, 1, DH, qs, ks, m))
    return model, tokens(), Truth(att)


# ---- GPT-NeoX: query_key_value viewed [B, T, H, 3 dh], partial rotary ---------------------------

class GPTNeoXAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_attention_heads = cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.head_size = self.hidden_size // self.num_attention_heads
        self.rotary_ndims = int(self.head_size * cfg.rotary_pct)
        self.rotary_emb = RotaryEmbedding(self.rotary_ndims)
        self.query_key_value = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.query_key_value(x)
        qkv = qkv.view(b, t, self.num_attention_heads, 3 * self.head_size).permute(0, 2, 1, 3)
        q = qkv[..., :self.head_size]
        k = qkv[..., self.head_size:2 * self.head_size]
        v = qkv[..., 2 * self.head_size:]
        r = self.rotary_ndims
        cos, sin = self.rotary_emb(x, t)
        qr, kr = apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin)
        q = torch.cat((qr, q[..., r:]), dim=-1)
        k = torch.cat((kr, k[..., r:]), dim=-1)
        out = attend(q, k, v)
        return self.dense(out.permute(0, 2, 1, 3).reshape(b, t, self.hidden_size))


class GPTNeoXLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.attention = GPTNeoXAttention(cfg)
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.mlp.dense_4h_to_h = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):  # parallel residual
        a = self.attention(self.input_layernorm(x))
        m = self.mlp.dense_4h_to_h(F.gelu(self.mlp.dense_h_to_4h(self.post_attention_layernorm(x))))
        return x + a + m


class GPTNeoXForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.gpt_neox = nn.Module()
        self.gpt_neox.embed_in = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.gpt_neox.layers = nn.ModuleList(GPTNeoXLayer(cfg, i)
                                             for i in range(cfg.num_hidden_layers))
        self.gpt_neox.final_layer_norm = nn.LayerNorm(cfg.hidden_size)
        self.embed_out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.gpt_neox.embed_in(input_ids)
        for layer in self.gpt_neox.layers:
            x = layer(x)
        return self.embed_out(self.gpt_neox.final_layer_norm(x))


@member("gpt-neox")
def gpt_neox():
    cfg = config(vocab_size=VOCAB, hidden_size=D, num_attention_heads=H, num_hidden_layers=L,
                 rotary_pct=0.5)
    model = GPTNeoXForCausalLM(cfg)
    att = []
    for i in range(L):
        m = f"gpt_neox.layers.{i}.attention"
        qs, ks = heads_grouped(f"{m}.query_key_value.weight", H, H, DH)
        att.append(Attn(i, H, H, DH, qs, ks, m))
    return model, tokens(), Truth(att)


# ---- GPT-J: separate q/k/v_proj, interleaved rotary on rotary_dim --------------------------------

def rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class GPTJAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_dim = cfg.n_embd
        self.num_attention_heads = cfg.n_head
        self.head_dim = self.embed_dim // self.num_attention_heads
        self.rotary_dim = cfg.rotary_dim
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)

    def _split_heads(self, x):
        return x.view(x.shape[:-1] + (self.num_attention_heads, self.head_dim))

    def forward(self, x):
        b, t, _ = x.shape
        q, k = self._split_heads(self.q_proj(x)), self._split_heads(self.k_proj(x))
        v = self._split_heads(self.v_proj(x)).permute(0, 2, 1, 3)
        pos = torch.arange(t, dtype=torch.float32)
        inv = 1.0 / (10000 ** (torch.arange(0, self.rotary_dim, 2).float() / self.rotary_dim))
        ang = torch.einsum("i,j->ij", pos, inv)
        sin = ang.sin().repeat_interleave(2, dim=-1)[None, :, None, :]
        cos = ang.cos().repeat_interleave(2, dim=-1)[None, :, None, :]
        r = self.rotary_dim
        kr = k[..., :r] * cos + rotate_every_two(k[..., :r]) * sin
        qr = q[..., :r] * cos + rotate_every_two(q[..., :r]) * sin
        k = torch.cat([kr, k[..., r:]], dim=-1).permute(0, 2, 1, 3)
        q = torch.cat([qr, q[..., r:]], dim=-1).permute(0, 2, 1, 3)
        w = torch.matmul(q.float(), k.float().transpose(-1, -2))
        w = w.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), torch.finfo(w.dtype).min)
        w = F.softmax(w / math.sqrt(self.head_dim), dim=-1)
        out = torch.matmul(w, v).permute(0, 2, 1, 3).reshape(b, t, self.embed_dim)
        return self.out_proj(out)


class GPTJBlock(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = GPTJAttention(cfg)
        self.mlp = nn.Module()
        self.mlp.fc_in = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.mlp.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        h = self.ln_1(x)
        return x + self.attn(h) + self.mlp.fc_out(F.gelu(self.mlp.fc_in(h)))


class GPTJForCausalLM(GPT2LMHeadModel):
    def forward(self, input_ids):
        x = self.transformer.wte(input_ids)
        for blk in self.transformer.h:
            x = blk(x)
        return self.lm_head(self.transformer.ln_f(x))


@member("gptj")
def gptj():
    model = GPTJForCausalLM(gpt2_config(rotary_dim=4), GPTJBlock)
    return model, tokens(), separate_truth("transformer.h", L, H, H, DH, attn="attn")


# ---- Falcon: query_key_value, both architectures -------------------------------------------------

class FalconAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.new_decoder_architecture = cfg.new_decoder_architecture
        self.multi_query = cfg.multi_query
        if cfg.new_decoder_architecture:
            qkv_out = (cfg.num_kv_heads * 2 + cfg.num_attention_heads) * self.head_dim
        elif cfg.multi_query:
            qkv_out = self.hidden_size + 2 * self.head_dim
        else:
            qkv_out = 3 * self.hidden_size
        self.query_key_value = nn.Linear(self.hidden_size, qkv_out, bias=cfg.bias)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size, bias=cfg.bias)
        self.num_kv_heads = cfg.num_kv_heads if (
            self.new_decoder_architecture or not self.multi_query) else 1
        self.rotary_emb = RotaryEmbedding(self.head_dim)

    def _split_heads(self, fused):
        b, t, _ = fused.shape
        if self.new_decoder_architecture:
            qkv = fused.view(b, t, -1, self.num_heads // self.num_kv_heads + 2, self.head_dim)
            q = qkv[:, :, :, :-2]
            k = qkv[:, :, :, [-2]].expand(q.shape)
            v = qkv[:, :, :, [-1]].expand(q.shape)
            return (q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3))
        if not self.multi_query:
            fused = fused.view(b, t, self.num_heads, 3, self.head_dim)
            return fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
        fused = fused.view(b, t, self.num_heads + 2, self.head_dim)
        return fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self._split_heads(self.query_key_value(x))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *self.rotary_emb(x, t))
        if k.shape[1] != q.shape[1]:
            k, v = k.expand(q.shape), v.expand(q.shape)
        out = attend(q, k, v)
        return self.dense(out.transpose(1, 2).reshape(b, t, self.hidden_size))


class FalconDecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attention = FalconAttention(cfg)
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size, bias=False)
        self.mlp.dense_4h_to_h = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size, bias=False)
        if cfg.new_decoder_architecture:
            self.ln_attn = nn.LayerNorm(cfg.hidden_size)
            self.ln_mlp = nn.LayerNorm(cfg.hidden_size)
        else:
            self.input_layernorm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, x):
        if hasattr(self, "ln_attn"):
            a_in, m_in = self.ln_attn(x), self.ln_mlp(x)
        else:
            a_in = m_in = self.input_layernorm(x)
        m = self.mlp.dense_4h_to_h(F.gelu(self.mlp.dense_h_to_4h(m_in)))
        return x + self.self_attention(a_in) + m


class FalconForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = nn.Module()
        self.transformer.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.transformer.h = nn.ModuleList(FalconDecoderLayer(cfg, i)
                                           for i in range(cfg.num_hidden_layers))
        self.transformer.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.transformer.word_embeddings(input_ids)
        for blk in self.transformer.h:
            x = blk(x)
        return self.lm_head(self.transformer.ln_f(x))


def falcon_config(**kw):
    c = dict(vocab_size=VOCAB, hidden_size=D, num_attention_heads=H, num_hidden_layers=L,
             num_kv_heads=HKV, new_decoder_architecture=False, multi_query=True, bias=False)
    c.update(kw)
    return config(**c)


@member("falcon-gqa")
def falcon_gqa():
    model = FalconForCausalLM(falcon_config(new_decoder_architecture=True, num_kv_heads=HKV))
    att = []
    for i in range(L):
        m = f"transformer.h.{i}.self_attention"
        qs, ks = heads_grouped(f"{m}.query_key_value.weight", H, HKV, DH)
        att.append(Attn(i, H, HKV, DH, qs, ks, m))
    return model, tokens(), Truth(att)


@member("falcon-mqa")
def falcon_mqa():
    model = FalconForCausalLM(falcon_config(multi_query=True))
    att = []
    for i in range(L):
        m = f"transformer.h.{i}.self_attention"
        qs, ks = heads_contiguous(f"{m}.query_key_value.weight", H, 1, DH)
        att.append(Attn(i, H, 1, DH, qs, ks, m))
    return model, tokens(), Truth(att)


# ---- BLOOM: query_key_value viewed [B, T, H, 3, dh], ALiBi, baddbmm --------------------------

class BloomAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.n_head
        self.head_dim = self.hidden_size // self.num_heads
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=True)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size)

    def forward(self, x, alibi):
        b, t, _ = x.shape
        fused = self.query_key_value(x).view(b, t, self.num_heads, 3, self.head_dim)
        q = fused[..., 0, :].transpose(1, 2).reshape(b * self.num_heads, t, self.head_dim)
        k = fused[..., 1, :].permute(0, 2, 3, 1).reshape(b * self.num_heads, self.head_dim, t)
        v = fused[..., 2, :].transpose(1, 2).reshape(b * self.num_heads, t, self.head_dim)
        scores = alibi.baddbmm(batch1=q, batch2=k, beta=1.0, alpha=self.inv_norm_factor)
        scores = scores.view(b, self.num_heads, t, t) + \
            torch.full((t, t), torch.finfo(scores.dtype).min).triu(1)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).view(b * self.num_heads, t, t)
        out = torch.bmm(probs, v).view(b, self.num_heads, t, self.head_dim)
        return self.dense(out.permute(0, 2, 1, 3).reshape(b, t, self.hidden_size))


def build_alibi(b, n_heads, t):
    slopes = torch.tensor([2 ** (-8.0 * (i + 1) / n_heads) for i in range(n_heads)])
    pos = torch.arange(t, dtype=torch.float32)
    return (slopes[:, None] * pos[None, :])[None].expand(b, n_heads, t).reshape(
        b * n_heads, 1, t)


class BloomBlock(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.self_attention = BloomAttention(cfg)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.mlp.dense_4h_to_h = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)

    def forward(self, x, alibi):
        x = x + self.self_attention(self.input_layernorm(x), alibi)
        h = self.post_attention_layernorm(x)
        return x + self.mlp.dense_4h_to_h(F.gelu(self.mlp.dense_h_to_4h(h)))


class BloomForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = nn.Module()
        self.transformer.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.transformer.word_embeddings_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.transformer.h = nn.ModuleList(BloomBlock(cfg, i) for i in range(cfg.n_layer))
        self.transformer.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.transformer.word_embeddings_layernorm(self.transformer.word_embeddings(input_ids))
        alibi = build_alibi(input_ids.shape[0], self.config.n_head, input_ids.shape[1])
        for blk in self.transformer.h:
            x = blk(x, alibi)
        return self.lm_head(self.transformer.ln_f(x))


@member("bloom")
def bloom():
    model = BloomForCausalLM(config(vocab_size=VOCAB, hidden_size=D, n_head=H, n_layer=L))
    att = []
    for i in range(L):
        m = f"transformer.h.{i}.self_attention"
        qs, ks = heads_grouped(f"{m}.query_key_value.weight", H, H, DH)
        att.append(Attn(i, H, H, DH, qs, ks, m))
    return model, tokens(), Truth(att)


# ---- OPT: model.decoder.layers, q scaled before the product, bmm over B*H -----------------------

class OPTAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _shape(self, x, t, b):
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x) * self.scaling
        k = self._shape(self.k_proj(x), -1, b)
        v = self._shape(self.v_proj(x), -1, b)
        shape = (b * self.num_heads, -1, self.head_dim)
        q = self._shape(q, t, b).view(*shape)
        k, v = k.view(*shape), v.view(*shape)
        w = torch.bmm(q, k.transpose(1, 2)).view(b, self.num_heads, t, t)
        w = w + torch.full((t, t), torch.finfo(w.dtype).min).triu(1)
        w = F.softmax(w.view(b * self.num_heads, t, t), dim=-1)
        out = torch.bmm(w, v).view(b, self.num_heads, t, self.head_dim).transpose(1, 2)
        return self.out_proj(out.reshape(b, t, self.embed_dim))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attn = OPTAttention(cfg.hidden_size, cfg.num_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.hidden_size)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, x):
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))


class OPTForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.decoder = nn.Module()
        dec = self.model.decoder
        dec.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        dec.embed_positions = nn.Embedding(cfg.max_position_embeddings + 2, cfg.hidden_size)
        dec.layers = nn.ModuleList(OPTDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        dec.final_layer_norm = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        dec = self.model.decoder
        x = dec.embed_tokens(input_ids) + dec.embed_positions(torch.arange(input_ids.shape[1]) + 2)
        for layer in dec.layers:
            x = layer(x)
        return self.lm_head(dec.final_layer_norm(x))


@member("opt")
def opt():
    cfg = config(vocab_size=VOCAB, hidden_size=D, num_attention_heads=H, num_hidden_layers=L,
                 ffn_dim=4 * D, max_position_embeddings=16)
    return OPTForCausalLM(cfg), tokens(), separate_truth("model.decoder.layers", L, H, H, DH)


# ---- OLMo (AllenAI's repository): block-level att_proj, config.n_heads -------------------------

class OLMoSequentialBlock(nn.Module):
    def __init__(self, layer_id, cfg):
        super().__init__()
        self.layer_id = layer_id
        self.config = cfg
        self.fused_dims = (cfg.d_model, cfg.d_model, cfg.d_model)
        self.att_proj = nn.Linear(cfg.d_model, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ff_proj = nn.Linear(cfg.d_model, 2 * cfg.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(cfg.mlp_hidden_size, cfg.d_model, bias=False)
        self.attn_norm = nn.LayerNorm(cfg.d_model, elementwise_affine=False)
        self.ff_norm = nn.LayerNorm(cfg.d_model, elementwise_affine=False)
        self.rotary_emb = RotaryEmbedding(cfg.d_model // cfg.n_heads)

    def attention(self, q, k, v):
        b, t, c = q.shape
        nh = self.config.n_heads
        q = q.view(b, t, nh, c // nh).transpose(1, 2)
        k = k.view(b, t, nh, c // nh).transpose(1, 2)
        v = v.view(b, t, nh, c // nh).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *self.rotary_emb(q, t))
        out = attend(q, k, v)
        return self.attn_out(out.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x):
        q, k, v = self.att_proj(self.attn_norm(x)).split(self.fused_dims, dim=-1)
        x = x + self.attention(q, k, v)
        h, gate = self.ff_proj(self.ff_norm(x)).chunk(2, dim=-1)
        return x + self.ff_out(F.silu(gate) * h)


class OLMo(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.d_model),
            blocks=nn.ModuleList(OLMoSequentialBlock(i, cfg) for i in range(cfg.n_layers)),
            ln_f=nn.LayerNorm(cfg.d_model, elementwise_affine=False)))
        self.transformer["ff_out"] = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.transformer.wte(input_ids)
        for blk in self.transformer.blocks:
            x = blk(x)
        return self.transformer.ff_out(self.transformer.ln_f(x))


@member("olmo")
def olmo():
    model = OLMo(config(vocab_size=VOCAB, d_model=D, n_heads=H, n_layers=L, mlp_hidden_size=2 * D))
    att = []
    for i in range(L):
        m = f"transformer.blocks.{i}"
        qs, ks = heads_contiguous(f"{m}.att_proj.weight", H, H, DH)
        att.append(Attn(i, H, H, DH, qs, ks, m))
    return model, tokens(), Truth(att, not_reported=[f"transformer.blocks.{i}.ff_proj.weight"
                                                     for i in range(L)])


# ---- Meta's LLaMA reference: wq/wk/wv/wo, n_local_heads, complex rotary -------------------------

def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return (torch.view_as_real(xq_ * fc).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * fc).flatten(3).type_as(xk))


class MetaAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.n_local_heads = args.n_heads
        self.n_local_kv_heads = self.n_kv_heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x, freqs_cis, mask):
        b, t, _ = x.shape
        xq = self.wq(x).view(b, t, self.n_local_heads, self.head_dim)
        xk = self.wk(x).view(b, t, self.n_local_kv_heads, self.head_dim)
        xv = self.wv(x).view(b, t, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys = xk[:, :, :, None, :].expand(b, t, self.n_local_kv_heads, self.n_rep,
                                           self.head_dim).reshape(b, t, -1, self.head_dim)
        values = xv[:, :, :, None, :].expand(b, t, self.n_local_kv_heads, self.n_rep,
                                             self.head_dim).reshape(b, t, -1, self.head_dim)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = F.softmax((scores + mask).float(), dim=-1).type_as(xq)
        out = torch.matmul(scores, values).transpose(1, 2).contiguous().view(b, t, -1)
        return self.wo(out)


class MetaFeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MetaTransformerBlock(nn.Module):
    def __init__(self, layer_id, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.head_dim = args.dim // args.n_heads
        self.attention = MetaAttention(args)
        self.feed_forward = MetaFeedForward(args.dim, 3 * args.dim)
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim)
        self.ffn_norm = RMSNorm(args.dim)

    def forward(self, x, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class MetaTransformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList(MetaTransformerBlock(i, params)
                                    for i in range(params.n_layers))
        self.norm = RMSNorm(params.dim)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(params.dim // params.n_heads, 2 * params.max_seq_len)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        mask = torch.full((t, t), float("-inf")).triu(1)
        for layer in self.layers:
            h = layer(h, self.freqs_cis[:t], mask)
        return self.output(self.norm(h)).float()


@member("meta-llama")
def meta_llama():
    args = config(dim=D, n_layers=L, n_heads=H, n_kv_heads=HKV, vocab_size=VOCAB, max_seq_len=T)
    return (MetaTransformer(args), tokens(),
            separate_truth("layers", L, H, HKV, DH, attn="attention", q="wq", k="wk",
                           not_reported=mlp_gates("layers", L, "feed_forward.w1")))


# ---- nanoGPT and minGPT ------------------------------------------------------------------------

class NanoCausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.dropout = cfg.dropout
        self.flash = hasattr(torch.nn.functional, "scaled_dot_product_attention")
        if not self.flash:
            self.register_buffer("bias", torch.tril(torch.ones(cfg.block_size, cfg.block_size))
                                 .view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        if self.flash:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                                                 dropout_p=0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = self.attn_dropout(att) @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = NanoCausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = NanoMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([NanoBlock(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd)))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


@member("nanogpt")
def nanogpt():
    cfg = config(block_size=16, vocab_size=VOCAB, n_layer=3, n_head=H, n_embd=D, dropout=0.0,
                 bias=True)
    att = []
    for i in range(3):
        m = f"transformer.h.{i}.attn"
        qs, ks = heads_contiguous(f"{m}.c_attn.weight", H, H, DH)
        att.append(Attn(i, H, H, DH, qs, ks, m))
    return NanoGPT(cfg), tokens(), Truth(att)


class MinGPTSelfAttention(nn.Module):
    """minGPT: c_attn, c_proj, a `bias` mask buffer, explicit softmax."""

    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(cfg.block_size, cfg.block_size))
                             .view(1, 1, cfg.block_size, cfg.block_size))
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MinGPTBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = MinGPTSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
                                      c_proj=nn.Linear(4 * cfg.n_embd, cfg.n_embd),
                                      act=nn.GELU()))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        m = self.mlp
        return x + m.c_proj(m.act(m.c_fc(self.ln_2(x))))


class MinGPT(NanoGPT):
    def __init__(self, cfg):
        nn.Module.__init__(self)
        self.block_size = cfg.block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([MinGPTBlock(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd)))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)


@member("mingpt")
def mingpt():
    # minGPT keeps its config out of the model: no attribute tells the heads
    # but the attention module's own n_head
    cfg = config(block_size=16, vocab_size=VOCAB, n_layer=L, n_head=2, n_embd=D)
    att = []
    for i in range(L):
        m = f"transformer.h.{i}.attn"
        qs, ks = heads_contiguous(f"{m}.c_attn.weight", 2, 2, D // 2)
        att.append(Attn(i, 2, 2, D // 2, qs, ks, m))
    return MinGPT(cfg), tokens(), Truth(att)


# ---- ChatGLM2/3: query_key_value = [q (np hn); k (g hn); v (g hn)], sequence-first -------------

class ChatGLMSelfAttention(nn.Module):
    def __init__(self, cfg, layer_number):
        super().__init__()
        self.layer_number = max(1, layer_number)
        self.projection_size = cfg.kv_channels * cfg.num_attention_heads
        self.hidden_size_per_attention_head = self.projection_size // cfg.num_attention_heads
        self.num_attention_heads_per_partition = cfg.num_attention_heads
        self.multi_query_attention = cfg.multi_query_attention
        self.num_multi_query_groups_per_partition = cfg.multi_query_group_num
        self.qkv_hidden_size = (self.projection_size + 2 * self.hidden_size_per_attention_head *
                                cfg.multi_query_group_num)
        self.query_key_value = nn.Linear(cfg.hidden_size, self.qkv_hidden_size, bias=True)
        self.dense = nn.Linear(self.projection_size, cfg.hidden_size, bias=False)

    def forward(self, x, rotary_pos_emb):
        s, b, _ = x.shape
        np_, hn = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        g = self.num_multi_query_groups_per_partition
        mixed = self.query_key_value(x)
        q, k, v = mixed.split([np_ * hn, g * hn, g * hn], dim=-1)
        q = q.view(s, b, np_, hn)
        k = k.view(s, b, g, hn)
        v = v.view(s, b, g, hn)
        # rotary on the first half of each head, interleaved pairs
        rot = hn // 2
        cos, sin = rotary_pos_emb
        def rope(t):
            tr, tp = t[..., :rot], t[..., rot:]
            tr = tr * cos[:, None, None, :] + rotate_every_two(tr) * sin[:, None, None, :]
            return torch.cat([tr, tp], dim=-1)
        q, k = rope(q), rope(k)
        k = k.unsqueeze(-2).expand(s, b, g, np_ // g, hn).reshape(s, b, np_, hn)
        v = v.unsqueeze(-2).expand(s, b, g, np_ // g, hn).reshape(s, b, np_, hn)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = attend(q, k, v)
        return self.dense(out.permute(2, 0, 1, 3).reshape(s, b, self.projection_size))


class GLMBlock(nn.Module):
    def __init__(self, cfg, layer_number):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attention = ChatGLMSelfAttention(cfg, layer_number)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size * 2, bias=False)
        self.mlp.dense_4h_to_h = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x, rope):
        x = x + self.self_attention(self.input_layernorm(x), rope)
        a, b = self.mlp.dense_h_to_4h(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.mlp.dense_4h_to_h(F.silu(a) * b)


class ChatGLMForConditionalGeneration(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = nn.Module()
        self.transformer.embedding = nn.Module()
        self.transformer.embedding.word_embeddings = nn.Embedding(cfg.padded_vocab_size,
                                                                  cfg.hidden_size)
        self.transformer.encoder = nn.Module()
        self.transformer.encoder.layers = nn.ModuleList(GLMBlock(cfg, i + 1)
                                                        for i in range(cfg.num_layers))
        self.transformer.encoder.final_layernorm = RMSNorm(cfg.hidden_size)
        self.transformer.output_layer = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size,
                                                  bias=False)

    def forward(self, input_ids):
        tr = self.transformer
        x = tr.embedding.word_embeddings(input_ids).transpose(0, 1)  # [s, b, h]
        s = x.shape[0]
        rot = self.config.kv_channels // 2
        inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
        ang = torch.outer(torch.arange(s).float(), inv)
        rope = (ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1))
        for layer in tr.encoder.layers:
            x = layer(x, rope)
        return tr.output_layer(tr.encoder.final_layernorm(x)).transpose(0, 1)


@member("chatglm2")
def chatglm2():
    cfg = config(padded_vocab_size=VOCAB, hidden_size=D, num_layers=2, num_attention_heads=H,
                 kv_channels=DH, multi_query_attention=True, multi_query_group_num=HKV,
                 ffn_hidden_size=48)
    att = []
    for i in range(2):
        m = f"transformer.encoder.layers.{i}.self_attention"
        att.append(Attn(i, H, HKV, DH, *heads_contiguous(f"{m}.query_key_value.weight", H, HKV,
                                                         DH), m))
    return ChatGLMForConditionalGeneration(cfg), tokens(), Truth(att)


# ---- InternLM2: wqkv viewed [b, t, Hkv, 2 + H/Hkv, dh] ----------------------------------------

class InternLM2Attention(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = cfg.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.wqkv = nn.Linear(self.hidden_size,
                              (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim,
                              bias=cfg.bias)
        self.wo = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=cfg.bias)

    def forward(self, x, rope):
        b, t, _ = x.shape
        qkv = self.wqkv(x).view(b, t, -1, 2 + self.num_key_value_groups, self.head_dim)
        q = qkv[..., :self.num_key_value_groups, :].reshape(b, t, -1, self.head_dim)
        k, v = qkv[..., -2, :], qkv[..., -1, :]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        out = attend(q, k, v, sdpa=False)
        return self.wo(out.transpose(1, 2).reshape(b, t, self.hidden_size))


class InternLM2DecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.attention = InternLM2Attention(cfg, i)
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.feed_forward.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.feed_forward.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.attention_norm = RMSNorm(cfg.hidden_size)
        self.ffn_norm = RMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        x = x + self.attention(self.attention_norm(x), rope)
        f, h = self.feed_forward, self.ffn_norm(x)
        return x + f.w2(F.silu(f.w1(h)) * f.w3(h))


@member("internlm2")
def internlm2():
    cfg = llama_config(num_attention_heads=8, num_key_value_heads=2, bias=False)
    model = Decoder(cfg, InternLM2DecoderLayer, rotary_dim=D // 8)
    att = []
    for i in range(L):
        m = f"model.layers.{i}.attention"
        att.append(Attn(i, 8, 2, D // 8, *heads_grouped(f"{m}.wqkv.weight", 8, 2, D // 8), m))
    return model, tokens(), Truth(att)


# ---- Baichuan: W_pack unflattened into (3, d) -----------------------------------------------

class BaichuanAttention(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.W_pack = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

    def forward(self, x, rope):
        b, t, _ = x.shape
        proj = self.W_pack(x)
        proj = proj.unflatten(-1, (3, self.hidden_size)).unsqueeze(0).transpose(0, -2) \
            .squeeze(-2)
        q, k, v = (p.view(b, t, self.num_heads, self.head_dim).transpose(1, 2) for p in proj)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.hidden_size))


class BaichuanLayer(LlamaDecoderLayer):
    def __init__(self, cfg, i):
        nn.Module.__init__(self)
        self.self_attn = BaichuanAttention(cfg, i)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)


@member("baichuan")
def baichuan():
    model = Decoder(llama_config(num_key_value_heads=H), BaichuanLayer, rotary_dim=DH)
    att = []
    for i in range(L):
        m = f"model.layers.{i}.self_attn"
        att.append(Attn(i, H, H, DH, *heads_contiguous(f"{m}.W_pack.weight", H, H, DH), m))
    return model, tokens(), Truth(att, not_reported=mlp_gates("model.layers", L))


# ---- Gemma 2: query_pre_attn_scalar, attention logit soft-capping, alternating sliding window --

class Gemma2Attention(LlamaAttention):
    def __init__(self, cfg, layer_idx):
        super().__init__(cfg, layer_idx, sdpa=False)
        self.scaling = cfg.query_pre_attn_scalar ** -0.5
        self.sliding_window = cfg.sliding_window if not bool(layer_idx % 2) else None
        self.attn_logit_softcapping = cfg.attn_logit_softcapping

    def forward(self, x, rope):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        k = repeat_kv(k, self.num_key_value_groups)
        v = repeat_kv(v, self.num_key_value_groups)
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        cap = self.attn_logit_softcapping
        w = torch.tanh(w / cap) * cap
        i = torch.arange(t)
        masked = i[None, :] > i[:, None]
        if self.sliding_window:
            masked = masked | (i[None, :] <= i[:, None] - self.sliding_window)
        w = w.masked_fill(masked, float("-inf"))
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(b, t, -1))


class Gemma2DecoderLayer(GemmaDecoderLayer):
    def __init__(self, cfg, layer_idx):
        nn.Module.__init__(self)
        self.self_attn = Gemma2Attention(cfg, layer_idx)
        self.mlp = GemmaMLP(cfg)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


@member("gemma2-softcap")
def gemma2():
    cfg = llama_config(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       query_pre_attn_scalar=16, attn_logit_softcapping=50.0, sliding_window=4)
    model = GemmaForCausalLM(cfg, Gemma2DecoderLayer, rotary_dim=16, norm=GemmaRMSNorm)
    return model, tokens(), separate_truth("model.layers", L, 4, 2, 16,
                                           not_reported=mlp_gates("model.layers", L))


# ---- cross-layer attention (CLA): odd layers reuse the keys and values of the layer below -----

class CLAAttention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_key_value_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.produces_kv = layer_idx % cfg.cla_share_factor == 0
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, d, bias=False)
        if self.produces_kv:
            self.k_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=False)
            self.v_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, rope, shared_kv):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q = q * cos + rotate_half(q) * sin
        if self.produces_kv:
            k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            k = k * cos + rotate_half(k) * sin
            v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            shared_kv = (k, v)
        k, v = shared_kv
        rep = self.num_heads // self.num_key_value_heads
        out = attend(q, repeat_kv(k, rep), repeat_kv(v, rep))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), shared_kv


class CLADecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attn = CLAAttention(cfg, i)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, rope, shared_kv):
        a, shared_kv = self.self_attn(self.input_layernorm(x), rope, shared_kv)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), shared_kv


class CLAForCausalLM(Decoder):
    def forward(self, input_ids):
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(x, input_ids.shape[1])
        kv = None
        for layer in self.model.layers:
            x, kv = layer(x, rope, kv)
        return self.lm_head(self.model.norm(x))


@member("cla-shared-kv")
def cla_shared_kv():
    cfg = llama_config(num_hidden_layers=4, cla_share_factor=2)
    att = []
    for i in range(4):
        m = f"model.layers.{i}.self_attn"
        src = f"model.layers.{i - i % 2}.self_attn"
        att.append(Attn(i, H, HKV, DH, *heads_separate(f"{m}.q_proj.weight",
                                                       f"{src}.k_proj.weight", H, HKV, DH), m))
    return CLAForCausalLM(cfg, CLADecoderLayer, rotary_dim=DH), tokens(), Truth(
        att, not_reported=mlp_gates("model.layers", 4),
        note="layers 1 and 3 read the keys of layers 0 and 2")
