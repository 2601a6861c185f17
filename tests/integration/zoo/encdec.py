"""Encoder-decoder and torch.nn models: transformers' T5, BART (different
head counts in encoder and decoder), Whisper (conv front end, k_proj without
bias); torch.nn.TransformerEncoder, nn.Transformer, nn.MultiheadAttention
with kdim/vdim (a resampler whose latents read a narrower context); the
Annotated Transformer (harvardnlp: heads in `self.h`, four cloned
`linears`). Written here after the public code's names and forward
structure, tiny and random."""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Attn, Truth, heads_contiguous, heads_separate, member
from .moe import SwitchAttention
from .parts import D, DH, H, VOCAB, RMSNorm, attend, config

TS, TT = 8, 6  # source and target lengths


def ids(t):
    return torch.randint(0, VOCAB, (2, t))


# ---- T5 -------------------------------------------------------------------------------------

class T5LayerSelfAttention(nn.Module):
    def __init__(self, cfg, has_bias):
        super().__init__()
        self.SelfAttention = SwitchAttention(cfg, has_bias)
        self.layer_norm = RMSNorm(cfg.d_model)


class T5LayerCrossAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.EncDecAttention = SwitchAttention(cfg, False, True)
        self.layer_norm = RMSNorm(cfg.d_model)


class T5DenseGatedActDense(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        return self.wo(F.gelu(self.wi_0(x)) * self.wi_1(x))


class T5LayerFF(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.DenseReluDense = T5DenseGatedActDense(cfg)
        self.layer_norm = RMSNorm(cfg.d_model)

    def forward(self, x):
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nn.Module):
    def __init__(self, cfg, has_bias, is_decoder):
        super().__init__()
        self.is_decoder = is_decoder
        self.layer = nn.ModuleList([T5LayerSelfAttention(cfg, has_bias)])
        if is_decoder:
            self.layer.append(T5LayerCrossAttention(cfg))
        self.layer.append(T5LayerFF(cfg))

    def forward(self, x, bias, enc=None, cross_bias=None):
        sa = self.layer[0]
        y, bias = sa.SelfAttention(sa.layer_norm(x), position_bias=bias, causal=self.is_decoder)
        x = x + y
        if self.is_decoder:
            ca = self.layer[1]
            y, cross_bias = ca.EncDecAttention(ca.layer_norm(x), kv=enc, position_bias=cross_bias)
            x = x + y
        return self.layer[-1](x), bias, cross_bias


class T5Stack(nn.Module):
    def __init__(self, cfg, embed, is_decoder):
        super().__init__()
        self.embed_tokens = embed
        self.is_decoder = is_decoder
        n = cfg.num_decoder_layers if is_decoder else cfg.num_layers
        self.block = nn.ModuleList(T5Block(cfg, i == 0, is_decoder) for i in range(n))
        self.final_layer_norm = RMSNorm(cfg.d_model)

    def forward(self, input_ids, enc=None):
        x = self.embed_tokens(input_ids)
        bias = cross = None
        for blk in self.block:
            x, bias, cross = blk(x, bias, enc, cross)
        return self.final_layer_norm(x)


class T5ForConditionalGeneration(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = T5Stack(cfg, self.shared, False)
        self.decoder = T5Stack(cfg, self.shared, True)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, input_ids, decoder_input_ids):
        return self.lm_head(self.decoder(decoder_input_ids, self.encoder(input_ids)))


@member("t5")
def t5():
    # d_kv * num_heads != d_model, as in t5-v1_1 / flan-t5
    cfg = config(vocab_size=VOCAB, d_model=D, d_kv=12, d_ff=48, num_heads=H, num_layers=2,
                 num_decoder_layers=3, relative_attention_num_buckets=8)
    att = []
    for stack, n in (("encoder", 2), ("decoder", 3)):
        for i in range(n):
            m = f"{stack}.block.{i}.layer.0.SelfAttention"
            att.append(Attn((stack, i), H, H, 12,
                            *heads_separate(f"{m}.q.weight", f"{m}.k.weight", H, H, 12), m))
            if stack == "decoder":
                m = f"{stack}.block.{i}.layer.1.EncDecAttention"
                att.append(Attn((stack, i), H, H, 12,
                                *heads_separate(f"{m}.q.weight", f"{m}.k.weight", H, H, 12), m,
                                kind="cross"))
    nr = [f"encoder.block.{i}.layer.1.DenseReluDense.wi_0.weight" for i in range(2)]
    return T5ForConditionalGeneration(cfg), (ids(TS), ids(TT)), Truth(att, not_reported=nr,
                                                                      stacks=True)


# ---- BART and Whisper --------------------------------------------------------------------------

class BartAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, is_decoder=False, bias=True, is_causal=False,
                 k_bias=None):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.is_decoder = is_decoder
        self.is_causal = is_causal
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias if k_bias is None else k_bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, x, kv=None):
        b, t, _ = x.shape
        src = x if kv is None else kv
        shape = (b, -1, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(src).view(shape).transpose(1, 2)
        v = self.v_proj(src).view(shape).transpose(1, 2)
        out = attend(q, k, v, causal=self.is_causal and kv is None)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, self.embed_dim))


class BartEncoderLayer(nn.Module):
    def __init__(self, cfg, k_bias=None):
        super().__init__()
        self.embed_dim = cfg.d_model
        self.self_attn = BartAttention(cfg.d_model, cfg.encoder_attention_heads, k_bias=k_bias)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x):
        x = self.self_attn_layer_norm(x + self.self_attn(x))
        return self.final_layer_norm(x + self.fc2(F.gelu(self.fc1(x))))


class BartDecoderLayer(nn.Module):
    def __init__(self, cfg, k_bias=None):
        super().__init__()
        self.self_attn = BartAttention(cfg.d_model, cfg.decoder_attention_heads, True,
                                       is_causal=True, k_bias=k_bias)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.encoder_attn = BartAttention(cfg.d_model, cfg.decoder_attention_heads, True,
                                          k_bias=k_bias)
        self.encoder_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.decoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.decoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x, enc):
        x = self.self_attn_layer_norm(x + self.self_attn(x))
        x = self.encoder_attn_layer_norm(x + self.encoder_attn(x, enc))
        return self.final_layer_norm(x + self.fc2(F.gelu(self.fc1(x))))


class BartForConditionalGeneration(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.model.encoder = nn.Module()
        self.model.encoder.embed_positions = nn.Embedding(16, cfg.d_model)
        self.model.encoder.layers = nn.ModuleList(BartEncoderLayer(cfg)
                                                  for _ in range(cfg.encoder_layers))
        self.model.decoder = nn.Module()
        self.model.decoder.embed_positions = nn.Embedding(16, cfg.d_model)
        self.model.decoder.layers = nn.ModuleList(BartDecoderLayer(cfg)
                                                  for _ in range(cfg.decoder_layers))
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, input_ids, decoder_input_ids):
        m = self.model
        x = m.shared(input_ids) + m.encoder.embed_positions(torch.arange(input_ids.shape[1]))
        for layer in m.encoder.layers:
            x = layer(x)
        y = m.shared(decoder_input_ids) + m.decoder.embed_positions(
            torch.arange(decoder_input_ids.shape[1]))
        for layer in m.decoder.layers:
            y = layer(y, x)
        return self.lm_head(y)


def encdec_truth(prefix, n_enc, n_dec, h_enc, h_dec, d, cross="encoder_attn"):
    att = []
    for stack, n, h in (("encoder", n_enc, h_enc), ("decoder", n_dec, h_dec)):
        dh = d // h
        for i in range(n):
            for kind, name in (("self", "self_attn"), ("cross", cross)):
                if kind == "cross" and stack == "encoder":
                    continue
                m = f"{prefix}{stack}.layers.{i}.{name}"
                att.append(Attn((stack, i), h, h, dh,
                                *heads_separate(f"{m}.q_proj.weight", f"{m}.k_proj.weight", h,
                                                h, dh), m, kind=kind))
    return Truth(att, stacks=True)


@member("bart")
def bart():
    cfg = config(vocab_size=VOCAB, d_model=D, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=2, encoder_ffn_dim=64,
                 decoder_ffn_dim=64)
    return (BartForConditionalGeneration(cfg), (ids(TS), ids(TT)),
            encdec_truth("model.", 2, 2, 4, 2, D))


class WhisperForConditionalGeneration(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        enc = self.model.encoder = nn.Module()
        enc.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, kernel_size=3, padding=1)
        enc.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)
        enc.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.d_model)
        enc.layers = nn.ModuleList(BartEncoderLayer(cfg, k_bias=False)
                                   for _ in range(cfg.encoder_layers))
        enc.layer_norm = nn.LayerNorm(cfg.d_model)
        dec = self.model.decoder = nn.Module()
        dec.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        dec.embed_positions = nn.Embedding(cfg.max_target_positions, cfg.d_model)
        dec.layers = nn.ModuleList(BartDecoderLayer(cfg, k_bias=False)
                                   for _ in range(cfg.decoder_layers))
        dec.layer_norm = nn.LayerNorm(cfg.d_model)
        self.proj_out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, input_features, decoder_input_ids):
        enc, dec = self.model.encoder, self.model.decoder
        x = F.gelu(enc.conv2(F.gelu(enc.conv1(input_features)))).permute(0, 2, 1)
        x = x + enc.embed_positions.weight[:x.shape[1]]
        for layer in enc.layers:
            x = layer(x)
        x = enc.layer_norm(x)
        y = dec.embed_tokens(decoder_input_ids) + dec.embed_positions(
            torch.arange(decoder_input_ids.shape[1]))
        for layer in dec.layers:
            y = layer(y, x)
        return self.proj_out(dec.layer_norm(y))


@member("whisper")
def whisper():
    cfg = config(vocab_size=VOCAB, d_model=D, num_mel_bins=8, encoder_layers=2,
                 decoder_layers=2, encoder_attention_heads=H, decoder_attention_heads=H,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
                 max_target_positions=8)
    feats = torch.randn(2, 8, 16)
    return (WhisperForConditionalGeneration(cfg), (feats, ids(TT)),
            encdec_truth("model.", 2, 2, H, H, D))


# ---- torch.nn --------------------------------------------------------------------------------

class TorchEncoderLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, nhead=H, dim_feedforward=64, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=3)
        self.decoder = nn.Linear(D, VOCAB)
        for p in self.parameters():  # TransformerEncoder deep-copies one layer
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src):
        t = src.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)
        return self.decoder(self.encoder(self.embedding(src), mask=mask))


@member("torch-encoder-layer")
def torch_encoder():
    att = []
    for i in range(3):
        m = f"encoder.layers.{i}.self_attn"
        att.append(Attn(i, H, H, DH, *heads_contiguous(f"{m}.in_proj_weight", H, H, DH), m))
    nr = [f"encoder.layers.{i}.linear1.weight" for i in range(3)]
    return TorchEncoderLM(), (ids(TS),), Truth(att, not_reported=nr)


class TorchSeq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.transformer = nn.Transformer(d_model=D, nhead=2, num_encoder_layers=2,
                                          num_decoder_layers=2, dim_feedforward=64, dropout=0.0)
        self.generator = nn.Linear(D, VOCAB)

    def forward(self, src, tgt):
        # sequence-first, as nn.Transformer's default
        s, t = self.embed(src).transpose(0, 1), self.embed(tgt).transpose(0, 1)
        mask = self.transformer.generate_square_subsequent_mask(t.shape[0])
        return self.generator(self.transformer(s, t, tgt_mask=mask))


@member("torch-transformer")
def torch_transformer():
    att = []
    for stack in ("encoder", "decoder"):
        for i in range(2):
            for kind, name in (("self", "self_attn"), ("cross", "multihead_attn")):
                if stack == "encoder" and kind == "cross":
                    continue
                m = f"transformer.{stack}.layers.{i}.{name}"
                att.append(Attn((stack, i), 2, 2, D // 2,
                                *heads_contiguous(f"{m}.in_proj_weight", 2, 2, D // 2), m,
                                kind=kind))
    return TorchSeq2Seq(), (ids(TS), ids(TT)), Truth(att, stacks=True)


class Resampler(nn.Module):
    """Latents [n, D] read a context of width 16 through
    nn.MultiheadAttention(kdim=vdim=16): q_proj_weight [D, D],
    k_proj_weight [D, 16]."""

    def __init__(self, n_latents=4, ctx_dim=16, depth=2):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(n_latents, D))
        self.layers = nn.ModuleList()
        for _ in range(depth):
            blk = nn.Module()
            blk.norm = nn.LayerNorm(D)
            blk.attn = nn.MultiheadAttention(D, H, kdim=ctx_dim, vdim=ctx_dim, batch_first=True)
            blk.ff = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 64), nn.GELU(),
                                   nn.Linear(64, D))
            self.layers.append(blk)
        self.out = nn.Linear(D, 8)

    def forward(self, context):
        x = self.latents[None].expand(context.shape[0], -1, -1)
        for blk in self.layers:
            x = x + blk.attn(blk.norm(x), context, context, need_weights=False)[0]
            x = x + blk.ff(x)
        return self.out(x)


@member("torch-mha-kdim")
def torch_mha_kdim():
    att = []
    for i in range(2):
        m = f"layers.{i}.attn"
        att.append(Attn(i, H, H, DH, *heads_separate(f"{m}.q_proj_weight", f"{m}.k_proj_weight",
                                                     H, H, DH), m, kind="cross"))
    return Resampler(), (torch.randn(2, 10, 16),), Truth(att)


# ---- The Annotated Transformer (harvardnlp) --------------------------------------------------

def clones(module, n):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(n)])


def attention(query, key, value, mask=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.0):
        super().__init__()
        self.d_k = d_model // h
        self.h = h
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)
        nbatches = query.size(0)
        query, key, value = [lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
                             for lin, x in zip(self.linears, (query, key, value))]
        x, self.attn = attention(query, key, value, mask=mask)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        del query, key, value
        return self.linears[-1](x)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.w_2(self.w_1(x).relu())


class SublayerConnection(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.norm = nn.LayerNorm(size)

    def forward(self, x, sublayer):
        return x + sublayer(self.norm(x))


class EncoderLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size), 2)
        self.size = size

    def forward(self, x, mask):
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, mask))
        return self.sublayer[1](x, self.feed_forward)


class DecoderLayer(nn.Module):
    def __init__(self, size, self_attn, src_attn, feed_forward):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size), 3)

    def forward(self, x, memory, src_mask, tgt_mask):
        m = memory
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, tgt_mask))
        x = self.sublayer[1](x, lambda x: self.src_attn(x, m, m, src_mask))
        return self.sublayer[2](x, self.feed_forward)


class Stack(nn.Module):
    def __init__(self, layer, n):
        super().__init__()
        self.layers = clones(layer, n)
        self.norm = nn.LayerNorm(layer.size)


class EncoderDecoder(nn.Module):
    def __init__(self, n=2, d_model=D, d_ff=64, h=H):
        super().__init__()
        attn, ff = MultiHeadedAttention(h, d_model), PositionwiseFeedForward(d_model, d_ff)
        c = copy.deepcopy
        self.encoder = Stack(EncoderLayer(d_model, c(attn), c(ff)), n)
        self.decoder = Stack(DecoderLayer(d_model, c(attn), c(attn), c(ff)), n)
        self.src_embed = nn.Embedding(VOCAB, d_model)
        self.tgt_embed = nn.Embedding(VOCAB, d_model)
        self.generator = nn.Linear(d_model, VOCAB)
        for p in self.parameters():  # make_model's init: deepcopy gave equal clones
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src, tgt, src_mask, tgt_mask):
        x = self.src_embed(src)
        for layer in self.encoder.layers:
            x = layer(x, src_mask)
        memory = self.encoder.norm(x)
        y = self.tgt_embed(tgt)
        for layer in self.decoder.layers:
            y = layer(y, memory, src_mask, tgt_mask)
        return self.generator(self.decoder.norm(y))


@member("annotated-transformer")
def annotated_transformer():
    att = []
    for stack in ("encoder", "decoder"):
        for i in range(2):
            for kind, name in (("self", "self_attn"), ("cross", "src_attn")):
                if stack == "encoder" and kind == "cross":
                    continue
                m = f"{stack}.layers.{i}.{name}"
                att.append(Attn((stack, i), H, H, DH,
                                *heads_separate(f"{m}.linears.0.weight", f"{m}.linears.1.weight",
                                                H, H, DH), m, kind=kind))
    src, tgt = ids(TS), ids(TT)
    src_mask = torch.ones(2, 1, TS, dtype=torch.bool)
    tgt_mask = torch.ones(1, TT, TT, dtype=torch.bool).tril()[None].expand(2, -1, -1, -1)[:, 0]
    return EncoderDecoder(), (src, tgt, src_mask, tgt_mask), Truth(att, stacks=True)



# ---- torchaudio's Conformer: nn.MultiheadAttention time-first, a conv module with BatchNorm ------

class _FeedForwardModule(nn.Module):
    def __init__(self, d, hidden, dropout=0.1):
        super().__init__()
        self.sequential = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.SiLU(),
                                        nn.Dropout(dropout), nn.Linear(hidden, d),
                                        nn.Dropout(dropout))

    def forward(self, x):
        return self.sequential(x)


class _ConvolutionModule(nn.Module):
    def __init__(self, d, num_channels, kernel, dropout=0.1):
        super().__init__()
        self.layer_norm = nn.LayerNorm(d)
        self.sequential = nn.Sequential(
            nn.Conv1d(d, 2 * num_channels, 1), nn.GLU(dim=1),
            nn.Conv1d(num_channels, num_channels, kernel, padding=(kernel - 1) // 2,
                      groups=num_channels),
            nn.BatchNorm1d(num_channels), nn.SiLU(), nn.Conv1d(num_channels, d, 1),
            nn.Dropout(dropout))

    def forward(self, x):  # [B, T, D]
        return self.sequential(self.layer_norm(x).transpose(1, 2)).transpose(1, 2)


class ConformerLayer(nn.Module):
    def __init__(self, d, ffn_dim, num_attention_heads, kernel, dropout=0.1):
        super().__init__()
        self.ffn1 = _FeedForwardModule(d, ffn_dim, dropout)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, num_attention_heads, dropout=dropout)
        self.self_attn_dropout = nn.Dropout(dropout)
        self.conv_module = _ConvolutionModule(d, d, kernel, dropout)
        self.ffn2 = _FeedForwardModule(d, ffn_dim, dropout)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, key_padding_mask):  # x: [T, B, D]
        x = x + 0.5 * self.ffn1(x)
        h = self.self_attn_layer_norm(x)
        h, _ = self.self_attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)
        x = x + self.self_attn_dropout(h)
        x = x + self.conv_module(x.transpose(0, 1)).transpose(0, 1)
        x = x + 0.5 * self.ffn2(x)
        return self.final_layer_norm(x)


class Conformer(nn.Module):
    def __init__(self, input_dim=D, num_heads=H, ffn_dim=64, num_layers=2,
                 depthwise_conv_kernel_size=3, dropout=0.1):
        super().__init__()
        self.conformer_layers = nn.ModuleList(
            ConformerLayer(input_dim, ffn_dim, num_heads, depthwise_conv_kernel_size, dropout)
            for _ in range(num_layers))

    def forward(self, input, lengths):
        mask = torch.arange(input.shape[1])[None, :] >= lengths[:, None]
        x = input.transpose(0, 1)
        for layer in self.conformer_layers:
            x = layer(x, mask)
        return x.transpose(0, 1), lengths


@member("torchaudio-conformer")
def conformer():
    # dropout and BatchNorm on: an observing discoverer must leave the RNG
    # state and the running statistics as it found them
    att = []
    for i in range(2):
        m = f"conformer_layers.{i}.self_attn"
        att.append(Attn(i, H, H, DH, *heads_contiguous(f"{m}.in_proj_weight", H, H, DH), m))
    nr = [f"conformer_layers.{i}.conv_module.sequential.0.weight" for i in range(2)]
    return Conformer(), (torch.randn(2, 10, D), torch.tensor([10, 7])), Truth(
        att, not_reported=nr)
