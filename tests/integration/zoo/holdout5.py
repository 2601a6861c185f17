"""Held-out layouts, fifth blind round: written after the public code each
member's docstring names, without reading the discoverer (client/python/
foreshock observe.py, layouts.py, effective.py, monitor.py's discovery), to
score discovery with defaults on layouts real users bring that the zoo
lacked:

  cait-talking-heads         timm CaiT: talking-heads attention (proj_l mixes
                             the heads' logits before the softmax, proj_w
                             after), then class attention (the query is the
                             CLS token alone)
  xcit-xca-classattn         timm XCiT: cross-covariance attention (a softmax
                             over channel-by-channel scores of L2-normalized
                             q^T k, a temperature per head): no token score;
                             class-attention blocks after it are sites; a
                             BatchNorm conv stem and LPI
  flash-gau-relu2-none       FLASH's gated attention unit: q and k are
                             per-dim offsets/scales of one shared projection,
                             relu(q k^T / n)^2, no softmax: nothing
  gat-additive-none          pyGAT: additive scores LeakyReLU(a^T [Wh_i, Wh_j])
                             through a softmax over neighbours, node features
                             [N, F] and an adjacency [N, N]: nothing
  pyg-transformerconv        torch_geometric TransformerConv: per-edge q.k,
                             softmax by scatter over each target node's edges
                             (edge_index [2, E]), no [T, T] matrix
  ft-transformer-tabular     rtdl FT-Transformer: numeric and categorical
                             feature tokens, CLS appended last, heads folded
                             into the batch, the last layer's query the CLS
                             token alone; (x_num, x_cat)
  patchtst-res-attention     PatchTST: RevIN, patches by unfold, channels
                             folded into the batch, keys [bs, H, dk, q_len],
                             scores plus the previous layer's scores,
                             BatchNorm; a fixed number of patches
  autoformer-autocorr-none   Autoformer: auto-correlation by FFT, top-k over
                             lags, a softmax over those top-k correlations,
                             roll-and-add: no score, no router: nothing
  detr-queries               DETR: conv backbone (frozen BatchNorm), sine
                             positions added to q and k only, time-first
                             nn.MultiheadAttention, learned object queries
  openfold-evoformer         OpenFold Evoformer: MSA row attention with pair
                             bias, column attention (transposed), triangle
                             attention starting/ending node, gating, 4-D
                             channel-last inputs (msa, pair)
  vit-small-lsa-spt          vit-pytorch ViT for small datasets: shifted
                             patch tokens (pads, no conv), locality self-
                             attention (learned temperature, the diagonal
                             masked), fused to_qkv chunked
  llama-adapter-prompt       peft adaption prompt: the top layer's attention
                             wrapped, a second softmax of the same q against
                             k_proj of a learned prompt, a zero gate, the
                             base frozen
  falcon-h1-parallel         Falcon-H1: Mamba and attention in parallel in
                             each layer, key_multiplier, muP multipliers
  phi1-mixformer-sequential  phi-1.5's MixFormerSequential: one nn.Sequential
                             of [Embedding, ParallelBlock, ..., LMHead], Wqkv
                             '(three h d)', partial rotary, einsum attention
  distilbert-required-mask   DistilBERT sequence classifier whose forward
                             requires (input_ids, attention_mask), positional
  base-layer-balanced        fairseq BASE layer: expert_centroids (a raw
                             Parameter), balanced assignment in training,
                             topk(k=1) otherwise, sigmoid(x . centroid); a
                             layer of its own between two decoder layers,
                             time-first fairseq attention
  megatron-sinkhorn-top1     Megatron-core TopKRouter with sinkhorn load
                             balancing (topk over the sinkhorn-normalized
                             logits under no_grad, sigmoid scores gathered),
                             time-first, grouped linear_qkv
  xmoe-cosine-top2           torchscale X-MoE Top2Gate: wg_reduction to 16
                             dims, against wg L2-normalized (and renormalized
                             in place in the forward), gumbel-sampled second
                             expert, capacity
  moba-topk-blocks           MoBA: top-k over key blocks by q . mean(k_block)
                             (not a router), the attention masked to them
  simclr-vit-infonce         SimCLR on a small ViT: forward(x1, x2) returns the
                             InfoNCE loss, a softmax over projection-head
                             similarities: not attention

Blind score (discover(model) with defaults plus the 5-step Monitor run of
test_python_zoo.py, before any fix), round 5: 18 of 20 right on torch 1.13,
17 of 20 on torch 2.15. Wrong were pyg-transformerconv (both torches: no
probe fits the graph inputs, and the first batch's pass saw no score in the
per-edge (q[dst] * k[src]).sum(-1) and scatter softmax, so nothing was
reported), xmoe-cosine-top2 (both: the logits meet normalize(wg), a weight
computed from the parameter; the observed pass counted no routing top-k and
no router was reported) and, on torch 2.15 only, cait-talking-heads (the
observed pass saw no score through proj_l between q.k^T and the softmax and
disproved the talking-heads blocks' qkv found by names; torch 1.13 kept them
by names). xmoe-cosine-top2 as first scored normalized the input instead of
wg (a slip of the replica, fixed after checking torchscale's _cosine again,
before reading anything of the discoverer): then it was right, 19 of 20 and
18 of 20. test_python_zoo.py's EXPECTED_FAILING and EXPECTED_FAILING_TORCH2
have each symptom.

Round 5b: 4 more, written after round 5's outputs were seen (so scored
apart), still without reading the discoverer:

  mta-score-conv             Multi-Token Attention: a grouped Conv2d over each
                             head's masked scores before the softmax, head
                             mixing after it
  graphormer-dict-graph      Graphormer: one dict argument of six graph
                             tensors, structural per-head biases, time-first
                             fairseq attention
  point-transformer-vector-none  vector attention (MLP of q_i - k_j, softmax
                             per channel over k nearest neighbours): nothing
  slot-attention-heads       multi-head Slot Attention: softmax over the slots
                             (queries), renormalized over inputs, 3 iterations
                             of one module (judgement call: a site)

Score: 1 of 4 on torch 1.13 and 2.15 (graphormer-dict-graph right). Wrong:
mta-score-conv (the observed pass saw no score through the conv between q.k^T
and the softmax and disproved wq/wk: nothing reported), point-transformer-
vector-none (a names-based SKIPPED warning for the fused to_qkv stayed
though the first batch's pass saw no score) and slot-attention-heads (the
softmax over the queries is not taken for a score: to_q/to_k disproved).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Attn, Router, Rows, Truth, heads_contiguous, heads_grouped, heads_separate, member
from .parts import D, VOCAB, B, RMSNorm, RotaryEmbedding, apply_rotary_pos_emb, attend, \
    causal_mask, config, repeat_kv, tokens
from .holdout4 import MambaMixer


def image(b=B, c=3, hw=16):
    return (torch.randn(b, c, hw, hw),)


def sep(prefix, h, kv, dh, q="q_proj", k="k_proj", block=0, kind="self", t=False):
    qs, ks = heads_separate(f"{prefix}.{q}.weight", f"{prefix}.{k}.weight", h, kv, dh, t)
    return Attn(block, h, kv, dh, qs, ks, prefix, kind)


class Mlp(nn.Module):
    """timm's Mlp: fc1, act, fc2."""

    def __init__(self, d, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


# ---- CaiT: talking-heads attention, class attention ---------------------------------------------
# huggingface/pytorch-image-models timm/models/cait.py (TalkingHeadAttn, ClassAttn)

class TalkingHeadAttn(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)
        self.proj_l = nn.Linear(num_heads, num_heads)
        self.proj_w = nn.Linear(num_heads, num_heads)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads)
        qkv = qkv.permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = q @ k.transpose(-2, -1)
        attn = self.proj_l(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        attn = attn.softmax(dim=-1)
        attn = self.proj_w(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = (attn @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(x)


class ClassAttn(nn.Module):
    def __init__(self, dim, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        h = self.num_heads
        q = self.q(x[:, 0]).unsqueeze(1).reshape(b, 1, h, c // h).permute(0, 2, 1, 3)
        k = self.k(x).reshape(b, n, h, c // h).permute(0, 2, 1, 3)
        v = self.v(x).reshape(b, n, h, c // h).permute(0, 2, 1, 3)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        x_cls = (attn @ v).transpose(1, 2).reshape(b, 1, c)
        return self.proj(x_cls)


class LayerScaleBlock(nn.Module):
    def __init__(self, dim, heads, init_values=0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = TalkingHeadAttn(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 2 * dim)
        self.gamma_1 = nn.Parameter(init_values * torch.ones(dim))
        self.gamma_2 = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        x = x + self.gamma_1 * self.attn(self.norm1(x))
        return x + self.gamma_2 * self.mlp(self.norm2(x))


class LayerScaleBlockClassAttn(nn.Module):
    def __init__(self, dim, heads, init_values=0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ClassAttn(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 2 * dim)
        self.gamma_1 = nn.Parameter(init_values * torch.ones(dim))
        self.gamma_2 = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x, x_cls):
        u = torch.cat((x_cls, x), dim=1)
        x_cls = x_cls + self.gamma_1 * self.attn(self.norm1(u))
        return x_cls + self.gamma_2 * self.mlp(self.norm2(x_cls))


class Cait(nn.Module):
    def __init__(self, dim=D, heads=4, depth=2, depth_token_only=2, patch=4, img=16, classes=10):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (img // patch) ** 2, dim) * 0.02)
        self.blocks = nn.Sequential(*[LayerScaleBlock(dim, heads) for _ in range(depth)])
        self.blocks_token_only = nn.ModuleList(LayerScaleBlockClassAttn(dim, heads)
                                               for _ in range(depth_token_only))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2) + self.pos_embed
        x = self.blocks(x)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        for blk in self.blocks_token_only:
            cls = blk(x, cls)
        x = self.norm(torch.cat((cls, x), dim=1))
        return self.head(x[:, 0])


@member("cait-talking-heads")
def cait():
    """After timm's models/cait.py (Cait, TalkingHeadAttn, ClassAttn)."""
    model = Cait()
    att = []
    for i in range(2):
        p = f"blocks.{i}.attn"
        att.append(Attn(i, 4, 4, 8, *heads_contiguous(f"{p}.qkv.weight", 4, 4, 8), p))
    for i in range(2):
        att.append(sep(f"blocks_token_only.{i}.attn", 4, 4, 8, "q", "k", block=2 + i))
    nr = ["blocks.0.attn.proj_l.weight", "blocks.0.attn.proj_w.weight", "head.weight"]
    return model, image(), Truth(att, not_reported=nr, stacks=True, note=(
        "talking heads: proj_l mixes the heads' q.k logits before the softmax; the heads are "
        "the qkv rows' (the logits before the mix); the class-attention blocks (query: the "
        "CLS token alone) are a second stack, each site its own layer"))


# ---- XCiT: cross-covariance attention (channels), class attention -------------------------------
# huggingface/pytorch-image-models timm/models/xcit.py (XCA, LPI, ClassAttentionBlock)

class ConvPatchEmbed(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Sequential(nn.Conv2d(3, dim // 2, 3, 2, 1), nn.BatchNorm2d(dim // 2),
                                  nn.GELU(), nn.Conv2d(dim // 2, dim, 3, 2, 1),
                                  nn.BatchNorm2d(dim))

    def forward(self, x):
        x = self.proj(x)
        hp, wp = x.shape[2], x.shape[3]
        return x.flatten(2).transpose(1, 2), (hp, wp)


class XCA(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1))
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads)
        qkv = qkv.permute(2, 0, 3, 4, 1)
        q, k, v = qkv.unbind(0)  # [b, h, dh, n]
        q = F.normalize(q, dim=-1)
        k = F.normalize(k, dim=-1)
        attn = (q @ k.transpose(-2, -1)) * self.temperature
        attn = attn.softmax(dim=-1)
        x = (attn @ v).permute(0, 3, 1, 2).reshape(b, n, c)
        return self.proj(x)


class LPI(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.act = nn.GELU()
        self.bn = nn.BatchNorm2d(dim)
        self.conv2 = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)

    def forward(self, x, hw):
        b, n, c = x.shape
        x = x.permute(0, 2, 1).reshape(b, c, hw[0], hw[1])
        x = self.conv2(self.bn(self.act(self.conv1(x))))
        return x.reshape(b, c, n).permute(0, 2, 1)


class XCABlock(nn.Module):
    def __init__(self, dim, heads, eta=0.5):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = XCA(dim, heads)
        self.norm3 = nn.LayerNorm(dim)
        self.local_mp = LPI(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 2 * dim)
        self.gamma1 = nn.Parameter(eta * torch.ones(dim))
        self.gamma3 = nn.Parameter(eta * torch.ones(dim))
        self.gamma2 = nn.Parameter(eta * torch.ones(dim))

    def forward(self, x, hw):
        x = x + self.gamma1 * self.attn(self.norm1(x))
        x = x + self.gamma3 * self.local_mp(self.norm3(x), hw)
        return x + self.gamma2 * self.mlp(self.norm2(x))


class ClassAttentionBlock(nn.Module):
    def __init__(self, dim, heads, eta=0.5):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ClassAttn(dim, heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 2 * dim)
        self.gamma1 = nn.Parameter(eta * torch.ones(dim))
        self.gamma2 = nn.Parameter(eta * torch.ones(dim))

    def forward(self, x):
        x_norm1 = self.norm1(x)
        x_attn = torch.cat([self.attn(x_norm1), x_norm1[:, 1:]], dim=1)
        x = x + self.gamma1 * x_attn
        x = torch.cat([self.norm2(x[:, 0:1]), x[:, 1:]], dim=1)
        x_res = x
        cls_token = self.gamma2 * self.mlp(x[:, 0:1])
        x = torch.cat([cls_token, x[:, 1:]], dim=1)
        return x_res + x


class XCiT(nn.Module):
    def __init__(self, dim=D, heads=4, depth=2, cls_depth=2, classes=10):
        super().__init__()
        self.patch_embed = ConvPatchEmbed(dim)
        self.pos_embed = nn.Linear(8, dim)  # stands in for the Fourier position encoding
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.blocks = nn.ModuleList(XCABlock(dim, heads) for _ in range(depth))
        self.cls_attn_blocks = nn.ModuleList(ClassAttentionBlock(dim, heads)
                                             for _ in range(cls_depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        b = x.shape[0]
        x, hw = self.patch_embed(x)
        ys = torch.arange(hw[0], dtype=x.dtype)[:, None].expand(hw).reshape(-1)
        xs = torch.arange(hw[1], dtype=x.dtype)[None, :].expand(hw).reshape(-1)
        freqs = torch.stack([f(c * s) for c in (ys, xs) for s in (1.0, 0.5) for f in
                             (torch.sin, torch.cos)], dim=-1)
        x = x + self.pos_embed(freqs)[None]
        for blk in self.blocks:
            x = blk(x, hw)
        x = torch.cat((self.cls_token.expand(b, -1, -1), x), dim=1)
        for blk in self.cls_attn_blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


@member("xcit-xca-classattn")
def xcit():
    """After timm's models/xcit.py (XCA, LPI, XCABlock, ClassAttentionBlock)."""
    model = XCiT()
    att = [sep(f"cls_attn_blocks.{i}.attn", 4, 4, 8, "q", "k", block=2 + i) for i in range(2)]
    nr = ["blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight", "head.weight"]
    return model, image(), Truth(att, not_reported=nr, stacks=True, note=(
        "XCA scores channels against channels (q^T k over the tokens, L2-normalized, a "
        "temperature per head): no token-by-token q.k score from rows of Wq/Wk: not a site, "
        "no warning; the class-attention blocks are sites, a second stack"))


# ---- FLASH: gated attention unit, relu^2, no softmax --------------------------------------------
# lucidrains/FLASH-pytorch flash_pytorch/flash_pytorch.py (GAU, OffsetScale)

class OffsetScale(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(heads, dim) + 0.02 * torch.randn(heads, dim))
        self.beta = nn.Parameter(torch.zeros(heads, dim))

    def forward(self, x):
        out = torch.einsum("...d,hd->...hd", x, self.gamma) + self.beta
        return out.unbind(dim=-2)


class GAU(nn.Module):
    def __init__(self, dim, query_key_dim=16, expansion_factor=2.0):
        super().__init__()
        hidden = int(expansion_factor * dim)
        self.norm = nn.LayerNorm(dim)
        self.to_hidden = nn.Sequential(nn.Linear(dim, hidden * 2), nn.SiLU())
        self.to_qk = nn.Sequential(nn.Linear(dim, query_key_dim), nn.SiLU())
        self.offsetscale = OffsetScale(query_key_dim, heads=2)
        self.to_out = nn.Linear(hidden, dim)

    def forward(self, x):
        n = x.shape[-2]
        normed = self.norm(x)
        v, gate = self.to_hidden(normed).chunk(2, dim=-1)
        qk = self.to_qk(normed)
        q, k = self.offsetscale(qk)
        sim = torch.einsum("bid,bjd->bij", q, k) / n
        attn = F.relu(sim) ** 2
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        attn = attn.masked_fill(mask, 0.0)
        out = torch.einsum("bij,bjd->bid", attn, v) * gate
        return self.to_out(out) + x


class FlashLM(nn.Module):
    def __init__(self, dim=D, depth=2):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, dim)
        self.abs_pos_emb = nn.Embedding(64, dim)
        self.layers = nn.ModuleList(GAU(dim) for _ in range(depth))
        self.to_logits = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, VOCAB))

    def forward(self, x):
        x = self.token_emb(x) + self.abs_pos_emb(torch.arange(x.shape[1]))
        for gau in self.layers:
            x = gau(x)
        return self.to_logits(x)


@member("flash-gau-relu2-none")
def flash_gau():
    """After lucidrains/FLASH-pytorch flash_pytorch/flash_pytorch.py (GAU, OffsetScale)."""
    model = FlashLM()
    nr = [f"layers.{i}.{n}.0.weight" for i in range(2) for n in ("to_qk", "to_hidden")] + \
        ["layers.0.offsetscale.gamma"]
    return model, tokens(), Truth([], not_reported=nr, note=(
        "GAU: q and k are two per-dim scalings of one shared projection; relu(q k^T / n)^2, "
        "no softmax: no attention score by the client's definition (as retnet-no-softmax): "
        "nothing reported, no warning"))


# ---- GAT: additive attention over a graph's neighbours ------------------------------------------
# Diego999/pyGAT layers.py (GraphAttentionLayer), models.py (GAT)

class GraphAttentionLayer(nn.Module):
    def __init__(self, in_features, out_features, dropout, alpha, concat=True):
        super().__init__()
        self.dropout, self.out_features, self.concat = dropout, out_features, concat
        self.W = nn.Parameter(torch.empty(in_features, out_features))
        nn.init.xavier_uniform_(self.W, gain=1.414)
        self.a = nn.Parameter(torch.empty(2 * out_features, 1))
        nn.init.xavier_uniform_(self.a, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(alpha)

    def forward(self, h, adj):
        wh = torch.mm(h, self.W)
        wh1 = torch.matmul(wh, self.a[:self.out_features, :])
        wh2 = torch.matmul(wh, self.a[self.out_features:, :])
        e = self.leakyrelu(wh1 + wh2.T)
        attention = torch.where(adj > 0, e, -9e15 * torch.ones_like(e))
        attention = F.softmax(attention, dim=1)
        attention = F.dropout(attention, self.dropout, training=self.training)
        h_prime = torch.matmul(attention, wh)
        return F.elu(h_prime) if self.concat else h_prime


class GAT(nn.Module):
    def __init__(self, nfeat, nhid, nclass, dropout, alpha, nheads):
        super().__init__()
        self.dropout = dropout
        self.attentions = [GraphAttentionLayer(nfeat, nhid, dropout, alpha) for _ in range(nheads)]
        for i, attention in enumerate(self.attentions):
            self.add_module(f"attention_{i}", attention)
        self.out_att = GraphAttentionLayer(nhid * nheads, nclass, dropout, alpha, concat=False)

    def forward(self, x, adj):
        x = F.dropout(x, self.dropout, training=self.training)
        x = torch.cat([att(x, adj) for att in self.attentions], dim=1)
        x = F.dropout(x, self.dropout, training=self.training)
        x = F.elu(self.out_att(x, adj))
        return F.log_softmax(x, dim=1)


def graph(n=10, f=12, p=0.3):
    g = torch.Generator().manual_seed(3)
    adj = (torch.rand(n, n, generator=g) < p).float()
    adj = ((adj + adj.t() + torch.eye(n)) > 0).float()
    return torch.randn(n, f, generator=g), adj


@member("gat-additive-none")
def gat():
    """After Diego999/pyGAT layers.py (GraphAttentionLayer) and models.py (GAT)."""
    model = GAT(12, 8, 3, dropout=0.6, alpha=0.2, nheads=4)
    nr = ["attention_0.W", "attention_0.a", "out_att.W"]
    return model, graph(), Truth([], not_reported=nr, note=(
        "GAT scores are additive (LeakyReLU of a^T [W h_i, W h_j]), not a product of a query "
        "and a key: nothing reported, no warning"))


# ---- PyG TransformerConv: per-edge scores, softmax by scatter ----------------------------------
# pyg-team/pytorch_geometric torch_geometric/nn/conv/transformer_conv.py, utils/softmax.py

def scatter_softmax(src, index, num_nodes):
    """torch_geometric.utils.softmax: src [E, H] grouped by index [E]."""
    idx = index[:, None].expand_as(src)
    src_max = torch.zeros(num_nodes, src.shape[1], dtype=src.dtype).scatter_reduce(
        0, idx, src.detach(), reduce="amax", include_self=False)
    out = (src - src_max.index_select(0, index)).exp()
    out_sum = torch.zeros(num_nodes, src.shape[1], dtype=src.dtype).scatter_add(0, idx, out)
    return out / (out_sum.index_select(0, index) + 1e-16)


class TransformerConv(nn.Module):
    def __init__(self, in_channels, out_channels, heads=1):
        super().__init__()
        self.heads, self.out_channels = heads, out_channels
        self.lin_key = nn.Linear(in_channels, heads * out_channels)
        self.lin_query = nn.Linear(in_channels, heads * out_channels)
        self.lin_value = nn.Linear(in_channels, heads * out_channels)
        self.lin_skip = nn.Linear(in_channels, heads * out_channels)

    def forward(self, x, edge_index):
        h, c = self.heads, self.out_channels
        query = self.lin_query(x).view(-1, h, c)
        key = self.lin_key(x).view(-1, h, c)
        value = self.lin_value(x).view(-1, h, c)
        src, dst = edge_index[0], edge_index[1]
        alpha = (query[dst] * key[src]).sum(dim=-1) / math.sqrt(c)
        alpha = scatter_softmax(alpha, dst, x.shape[0])
        msg = value[src] * alpha.view(-1, h, 1)
        out = torch.zeros(x.shape[0], h, c, dtype=x.dtype).index_add(0, dst, msg)
        return out.view(-1, h * c) + self.lin_skip(x)


class GraphTransformer(nn.Module):
    def __init__(self, f=12, hidden=8, heads=2, classes=3):
        super().__init__()
        self.convs = nn.ModuleList([TransformerConv(f, hidden, heads),
                                    TransformerConv(hidden * heads, hidden, heads)])
        self.norms = nn.ModuleList(nn.LayerNorm(hidden * heads) for _ in range(2))
        self.lin = nn.Linear(hidden * heads, classes)

    def forward(self, x, edge_index):
        for conv, norm in zip(self.convs, self.norms):
            x = F.relu(norm(conv(x, edge_index)))
        return self.lin(x)


@member("pyg-transformerconv")
def pyg_transformerconv():
    """After torch_geometric's nn/conv/transformer_conv.py and utils/softmax.py."""
    x, adj = graph()
    edge_index = adj.nonzero().t().contiguous()  # [2, E]: source, target
    model = GraphTransformer()
    att = [sep(f"convs.{i}", 2, 2, 8, "lin_query", "lin_key", block=i) for i in range(2)]
    nr = ["convs.0.lin_skip.weight", "lin.weight"]
    return model, (x, edge_index), Truth(att, not_reported=nr, note=(
        "scores per edge (q of the target . k of the source), a softmax grouped by target "
        "node through scatter: an attention site per conv, 2 heads of 8"))


# ---- FT-Transformer (rtdl) ----------------------------------------------------------------------
# yandex-research/rtdl rtdl/modules.py (FeatureTokenizer, CLSToken, MultiheadAttention,
# Transformer with last_layer_query_idx, FTTransformer)

class NumericalFeatureTokenizer(nn.Module):
    def __init__(self, n_features, d_token):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_features, d_token) / math.sqrt(d_token))
        self.bias = nn.Parameter(torch.randn(n_features, d_token) / math.sqrt(d_token))

    def forward(self, x):
        return self.weight[None] * x[..., None] + self.bias[None]


class CategoricalFeatureTokenizer(nn.Module):
    def __init__(self, cardinalities, d_token):
        super().__init__()
        offsets = torch.tensor([0] + cardinalities[:-1]).cumsum(0)
        self.register_buffer("category_offsets", offsets, persistent=False)
        self.embeddings = nn.Embedding(sum(cardinalities), d_token)
        self.bias = nn.Parameter(torch.randn(len(cardinalities), d_token) / math.sqrt(d_token))

    def forward(self, x):
        return self.embeddings(x + self.category_offsets[None]) + self.bias[None]


class FeatureTokenizer(nn.Module):
    def __init__(self, n_num, cards, d_token):
        super().__init__()
        self.num_tokenizer = NumericalFeatureTokenizer(n_num, d_token)
        self.cat_tokenizer = CategoricalFeatureTokenizer(cards, d_token)

    def forward(self, x_num, x_cat):
        return torch.cat([self.num_tokenizer(x_num), self.cat_tokenizer(x_cat)], dim=1)


class CLSToken(nn.Module):
    def __init__(self, d_token):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_token) / math.sqrt(d_token))

    def forward(self, x):
        return torch.cat([x, self.weight.view(1, 1, -1).expand(len(x), 1, -1)], dim=1)


class RtdlMultiheadAttention(nn.Module):
    def __init__(self, d_token, n_heads):
        super().__init__()
        self.W_q = nn.Linear(d_token, d_token)
        self.W_k = nn.Linear(d_token, d_token)
        self.W_v = nn.Linear(d_token, d_token)
        self.W_out = nn.Linear(d_token, d_token)
        self.n_heads = n_heads

    def _reshape(self, x):
        batch_size, n_tokens, d = x.shape
        d_head = d // self.n_heads
        return (x.reshape(batch_size, n_tokens, self.n_heads, d_head).transpose(1, 2)
                .reshape(batch_size * self.n_heads, n_tokens, d_head))

    def forward(self, x_q, x_kv):
        q, k, v = self.W_q(x_q), self.W_k(x_kv), self.W_v(x_kv)
        batch_size, n_q_tokens = len(q), q.shape[1]
        d_head_key = k.shape[-1] // self.n_heads
        d_head_value = v.shape[-1] // self.n_heads
        q, k = self._reshape(q), self._reshape(k)
        attention_logits = q @ k.transpose(1, 2) / math.sqrt(d_head_key)
        attention_probs = F.softmax(attention_logits, dim=-1)
        x = attention_probs @ self._reshape(v)
        x = (x.reshape(batch_size, self.n_heads, n_q_tokens, d_head_value).transpose(1, 2)
             .reshape(batch_size, n_q_tokens, self.n_heads * d_head_value))
        return self.W_out(x)


class ReGLUFFN(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.linear_first = nn.Linear(d, hidden * 2)
        self.linear_second = nn.Linear(hidden, d)

    def forward(self, x):
        return self.linear_second(self._reglu(self.linear_first(x)))

    @staticmethod
    def _reglu(x):
        a, b = x.chunk(2, dim=-1)
        return a * F.relu(b)


class RtdlTransformer(nn.Module):
    def __init__(self, d_token, n_blocks, n_heads, d_out, last_layer_query_idx=(-1,)):
        super().__init__()
        self.blocks = nn.ModuleList()
        for i in range(n_blocks):
            layer = nn.ModuleDict({"attention": RtdlMultiheadAttention(d_token, n_heads),
                                   "ffn": ReGLUFFN(d_token, 2 * d_token),
                                   "ffn_normalization": nn.LayerNorm(d_token),
                                   "output": nn.Identity()})
            if i:  # first_prenormalization=False: the first block has no attention norm
                layer["attention_normalization"] = nn.LayerNorm(d_token)
            self.blocks.append(layer)
        self.last_layer_query_idx = list(last_layer_query_idx)
        self.head = nn.Sequential(nn.LayerNorm(d_token), nn.ReLU(), nn.Linear(d_token, d_out))

    def forward(self, x):
        for i, layer in enumerate(self.blocks):
            query_idx = self.last_layer_query_idx if i + 1 == len(self.blocks) else None
            x_res = layer["attention_normalization"](x) if "attention_normalization" in layer \
                else x
            x_res = layer["attention"](x_res if query_idx is None else x_res[:, query_idx], x_res)
            if query_idx is not None:
                x = x[:, query_idx]
            x = x + x_res
            x_res = layer["ffn"](layer["ffn_normalization"](x))
            x = layer["output"](x + x_res)
        return self.head(x[:, -1])


class FTTransformer(nn.Module):
    def __init__(self, n_num=3, cards=(4, 5), d_token=D, n_blocks=2, n_heads=4, d_out=1):
        super().__init__()
        self.feature_tokenizer = FeatureTokenizer(n_num, list(cards), d_token)
        self.cls_token = CLSToken(d_token)
        self.transformer = RtdlTransformer(d_token, n_blocks, n_heads, d_out)

    def forward(self, x_num, x_cat):
        return self.transformer(self.cls_token(self.feature_tokenizer(x_num, x_cat)))


@member("ft-transformer-tabular")
def ft_transformer():
    """After yandex-research/rtdl rtdl/modules.py (FTTransformer, MultiheadAttention)."""
    model = FTTransformer()
    x_num = torch.randn(4, 3)
    x_cat = torch.stack([torch.randint(0, 4, (4,)), torch.randint(0, 5, (4,))], dim=1)
    att = [sep(f"transformer.blocks.{i}.attention", 4, 4, 8, "W_q", "W_k", block=i)
           for i in range(2)]
    nr = ["transformer.blocks.0.ffn.linear_first.weight", "transformer.head.2.weight"]
    return model, (x_num, x_cat), Truth(att, not_reported=nr, note=(
        "heads folded into the batch (B*H, n, dh); the last block's query is the CLS token "
        "alone (appended last)"))


# ---- PatchTST: residual attention, channel independence ----------------------------------------
# yuqinie98/PatchTST PatchTST_supervised/layers/PatchTST_backbone.py, layers/RevIN.py

class RevIN(nn.Module):
    def __init__(self, num_features, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.affine_weight = nn.Parameter(torch.ones(num_features))
        self.affine_bias = nn.Parameter(torch.zeros(num_features))

    def norm(self, x):
        self.mean = x.mean(dim=1, keepdim=True).detach()
        self.stdev = torch.sqrt(x.var(dim=1, keepdim=True, unbiased=False) + self.eps).detach()
        return (x - self.mean) / self.stdev * self.affine_weight + self.affine_bias

    def denorm(self, x):
        x = (x - self.affine_bias) / (self.affine_weight + self.eps * self.eps)
        return x * self.stdev + self.mean


class ScaledDotProductAttention(nn.Module):
    def __init__(self, d_model, n_heads, lsa=False):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor((d_model // n_heads) ** -0.5), requires_grad=lsa)

    def forward(self, q, k, v, prev=None):
        attn_scores = torch.matmul(q, k) * self.scale
        if prev is not None:
            attn_scores = attn_scores + prev
        attn_weights = F.softmax(attn_scores, dim=-1)
        return torch.matmul(attn_weights, v), attn_weights, attn_scores


class PatchTSTMultiheadAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.W_Q = nn.Linear(d_model, self.d_k * n_heads)
        self.W_K = nn.Linear(d_model, self.d_k * n_heads)
        self.W_V = nn.Linear(d_model, self.d_k * n_heads)
        self.sdp_attn = ScaledDotProductAttention(d_model, n_heads)
        self.to_out = nn.Sequential(nn.Linear(n_heads * self.d_k, d_model), nn.Dropout(0.0))

    def forward(self, Q, prev=None):
        bs = Q.size(0)
        q_s = self.W_Q(Q).view(bs, -1, self.n_heads, self.d_k).transpose(1, 2)
        k_s = self.W_K(Q).view(bs, -1, self.n_heads, self.d_k).permute(0, 2, 3, 1)
        v_s = self.W_V(Q).view(bs, -1, self.n_heads, self.d_k).transpose(1, 2)
        out, _, scores = self.sdp_attn(q_s, k_s, v_s, prev=prev)
        out = out.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * self.d_k)
        return self.to_out(out), scores


class Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2)


class TSTEncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.self_attn = PatchTSTMultiheadAttention(d_model, n_heads)
        self.dropout_attn = nn.Dropout(0.1)
        self.norm_attn = nn.Sequential(Transpose(), nn.BatchNorm1d(d_model), Transpose())
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(0.1),
                                nn.Linear(d_ff, d_model))
        self.dropout_ffn = nn.Dropout(0.1)
        self.norm_ffn = nn.Sequential(Transpose(), nn.BatchNorm1d(d_model), Transpose())

    def forward(self, src, prev=None):
        src2, scores = self.self_attn(src, prev)
        src = self.norm_attn(src + self.dropout_attn(src2))
        src = self.norm_ffn(src + self.dropout_ffn(self.ff(src)))
        return src, scores


class TSTiEncoder(nn.Module):
    def __init__(self, patch_num, patch_len, n_layers, d_model, n_heads, d_ff):
        super().__init__()
        self.W_P = nn.Linear(patch_len, d_model)
        self.W_pos = nn.Parameter(torch.empty(patch_num, d_model).uniform_(-0.02, 0.02))
        self.dropout = nn.Dropout(0.1)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(TSTEncoderLayer(d_model, n_heads, d_ff)
                                            for _ in range(n_layers))

    def forward(self, x):  # [bs, nvars, patch_len, patch_num]
        n_vars = x.shape[1]
        x = self.W_P(x.permute(0, 1, 3, 2))
        u = torch.reshape(x, (x.shape[0] * x.shape[1], x.shape[2], x.shape[3]))
        z = self.dropout(u + self.W_pos)
        scores = None
        for mod in self.encoder.layers:
            z, scores = mod(z, prev=scores)
        z = torch.reshape(z, (-1, n_vars, z.shape[-2], z.shape[-1]))
        return z.permute(0, 1, 3, 2)


class PatchTST(nn.Module):
    def __init__(self, c_in=3, context_window=16, target_window=4, patch_len=4, stride=2,
                 n_layers=2, d_model=D, n_heads=4, d_ff=64):
        super().__init__()
        self.model = nn.Module()
        m = self.model
        m.revin_layer = RevIN(c_in)
        m.patch_len, m.stride = patch_len, stride
        m.padding_patch_layer = nn.ReplicationPad1d((0, stride))
        patch_num = int((context_window - patch_len) / stride + 1) + 1
        m.backbone = TSTiEncoder(patch_num, patch_len, n_layers, d_model, n_heads, d_ff)
        m.head = nn.Sequential(nn.Flatten(start_dim=-2), nn.Linear(d_model * patch_num,
                                                                   target_window))

    def forward(self, x):  # [bs, seq_len, nvars]
        m = self.model
        z = m.revin_layer.norm(x).permute(0, 2, 1)
        z = m.padding_patch_layer(z)
        z = z.unfold(dimension=-1, size=m.patch_len, step=m.stride).permute(0, 1, 3, 2)
        z = m.head(m.backbone(z))
        return m.revin_layer.denorm(z.permute(0, 2, 1))


@member("patchtst-res-attention")
def patchtst():
    """After yuqinie98/PatchTST PatchTST_supervised/layers/PatchTST_backbone.py."""
    model = PatchTST()
    p = "model.backbone.encoder.layers"
    att = [sep(f"{p}.{i}.self_attn", 4, 4, 8, "W_Q", "W_K", block=i) for i in range(2)]
    nr = ["model.backbone.W_P.weight", "model.head.1.weight"]
    return model, (torch.randn(B, 16, 3),), Truth(att, not_reported=nr, note=(
        "residual attention: a layer's scores are its own q.k plus the previous layer's "
        "scores; keys are [bs, H, dk, q_len] (permuted, no transpose at the matmul); "
        "channels folded into the batch"))


# ---- Autoformer: auto-correlation (FFT, top-k lags), no score -----------------------------------
# thuml/Autoformer layers/AutoCorrelation.py, layers/Autoformer_EncDec.py, layers/Embed.py

class AutoCorrelation(nn.Module):
    def __init__(self, factor=1):
        super().__init__()
        self.factor = factor

    def time_delay_agg(self, values, corr):
        head, channel, length = values.shape[1], values.shape[2], values.shape[3]
        top_k = int(self.factor * math.log(length))
        mean_value = torch.mean(torch.mean(corr, dim=1), dim=1)
        index = torch.topk(torch.mean(mean_value, dim=0), top_k, dim=-1)[1]
        weights = torch.stack([mean_value[:, index[i]] for i in range(top_k)], dim=-1)
        tmp_corr = torch.softmax(weights, dim=-1)
        delays_agg = torch.zeros_like(values).float()
        for i in range(top_k):
            pattern = torch.roll(values, -int(index[i]), -1)
            delays_agg = delays_agg + pattern * tmp_corr[:, i][:, None, None, None].repeat(
                1, head, channel, length)
        return delays_agg

    def forward(self, queries, keys, values):
        length = queries.shape[1]
        q_fft = torch.fft.rfft(queries.permute(0, 2, 3, 1).contiguous(), dim=-1)
        k_fft = torch.fft.rfft(keys.permute(0, 2, 3, 1).contiguous(), dim=-1)
        corr = torch.fft.irfft(q_fft * torch.conj(k_fft), n=length, dim=-1)
        v = self.time_delay_agg(values.permute(0, 2, 3, 1).contiguous(), corr)
        return v.permute(0, 3, 1, 2)


class AutoCorrelationLayer(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.inner_correlation = AutoCorrelation()
        self.query_projection = nn.Linear(d_model, d_model)
        self.key_projection = nn.Linear(d_model, d_model)
        self.value_projection = nn.Linear(d_model, d_model)
        self.out_projection = nn.Linear(d_model, d_model)
        self.n_heads = n_heads

    def forward(self, queries, keys, values):
        b, n, _ = queries.shape
        h = self.n_heads
        q = self.query_projection(queries).view(b, n, h, -1)
        k = self.key_projection(keys).view(b, n, h, -1)
        v = self.value_projection(values).view(b, n, h, -1)
        return self.out_projection(self.inner_correlation(q, k, v).reshape(b, n, -1))


class SeriesDecomp(nn.Module):
    def __init__(self, kernel_size=5):
        super().__init__()
        self.kernel_size = kernel_size
        self.avg = nn.AvgPool1d(kernel_size, stride=1, padding=0)

    def forward(self, x):
        pad = (self.kernel_size - 1) // 2
        front = x[:, 0:1, :].repeat(1, pad, 1)
        end = x[:, -1:, :].repeat(1, pad, 1)
        mean = self.avg(torch.cat([front, x, end], dim=1).permute(0, 2, 1)).permute(0, 2, 1)
        return x - mean, mean


class AutoformerEncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.attention = AutoCorrelationLayer(d_model, n_heads)
        self.conv1 = nn.Conv1d(d_model, d_ff, kernel_size=1, bias=False)
        self.conv2 = nn.Conv1d(d_ff, d_model, kernel_size=1, bias=False)
        self.decomp1, self.decomp2 = SeriesDecomp(), SeriesDecomp()
        self.dropout = nn.Dropout(0.05)

    def forward(self, x):
        x = x + self.dropout(self.attention(x, x, x))
        x, _ = self.decomp1(x)
        y = self.dropout(F.relu(self.conv1(x.transpose(-1, 1))))
        y = self.dropout(self.conv2(y).transpose(-1, 1))
        res, _ = self.decomp2(x + y)
        return res


class AutoformerEncoderForecaster(nn.Module):
    def __init__(self, c_in=3, d_model=D, n_heads=4, d_ff=64, seq_len=16, pred_len=4):
        super().__init__()
        self.enc_embedding = nn.Module()
        self.enc_embedding.value_embedding = nn.Conv1d(c_in, d_model, 3, padding=1,
                                                       padding_mode="circular", bias=False)
        self.enc_embedding.temporal_embedding = nn.Linear(4, d_model, bias=False)
        self.encoder = nn.Module()
        self.encoder.attn_layers = nn.ModuleList(AutoformerEncoderLayer(d_model, n_heads, d_ff)
                                                 for _ in range(2))
        self.encoder.norm = nn.LayerNorm(d_model)
        self.projection = nn.Linear(d_model, c_in)
        self.time_proj = nn.Linear(seq_len, pred_len)

    def forward(self, x_enc, x_mark_enc):
        x = self.enc_embedding.value_embedding(x_enc.permute(0, 2, 1)).transpose(1, 2)
        x = x + self.enc_embedding.temporal_embedding(x_mark_enc)
        for layer in self.encoder.attn_layers:
            x = layer(x)
        x = self.projection(self.encoder.norm(x))  # [b, seq_len, c_in]
        return self.time_proj(x.transpose(1, 2)).transpose(1, 2)


@member("autoformer-autocorr-none")
def autoformer():
    """After thuml/Autoformer layers/AutoCorrelation.py (AutoCorrelation, AutoCorrelationLayer)."""
    model = AutoformerEncoderForecaster()
    p = "encoder.attn_layers"
    nr = [f"{p}.{i}.attention.{n}.weight" for i in range(2)
          for n in ("query_projection", "key_projection")]
    return model, (torch.randn(B, 16, 3), torch.randn(B, 16, 4)), Truth([], not_reported=nr, note=(
        "auto-correlation: q and k meet in an FFT cross-correlation over lags; top-k over "
        "lags (no experts) and a softmax over those k correlations: no q.k score, no router: "
        "nothing reported, no warning"))


# ---- DETR: conv backbone, positions on q and k, learned object queries -------------------------
# facebookresearch/detr models/detr.py, models/transformer.py, models/backbone.py
# (FrozenBatchNorm2d), models/position_encoding.py (PositionEmbeddingSine); the decoder's
# target is a learned embedding split off the query embedding, as Deformable-DETR does (DETR's
# zero target makes the first decoder self-attention's scores reach nothing)

class FrozenBatchNorm2d(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.register_buffer("weight", torch.ones(n) + 0.1 * torch.randn(n))
        self.register_buffer("bias", 0.1 * torch.randn(n))
        self.register_buffer("running_mean", 0.1 * torch.randn(n))
        self.register_buffer("running_var", torch.ones(n))

    def forward(self, x):
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        bias = self.bias - self.running_mean * scale
        return x * scale[None, :, None, None] + bias[None, :, None, None]


def sine_positions(b, h, w, num_pos_feats, temperature=10000):
    not_mask = torch.ones(b, h, w)
    y_embed = not_mask.cumsum(1, dtype=torch.float32)
    x_embed = not_mask.cumsum(2, dtype=torch.float32)
    eps, scale = 1e-6, 2 * math.pi
    y_embed = y_embed / (y_embed[:, -1:, :] + eps) * scale
    x_embed = x_embed / (x_embed[:, :, -1:] + eps) * scale
    dim_t = torch.arange(num_pos_feats, dtype=torch.float32)
    dim_t = temperature ** (2 * (dim_t // 2) / num_pos_feats)
    pos_x = x_embed[:, :, :, None] / dim_t
    pos_y = y_embed[:, :, :, None] / dim_t
    pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
    pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
    return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


class DetrEncoderLayer(nn.Module):
    def __init__(self, d, nhead, ff):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, nhead, dropout=0.1)
        self.linear1, self.linear2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.dropout = nn.Dropout(0.1)
        self.dropout1, self.dropout2 = nn.Dropout(0.1), nn.Dropout(0.1)

    def forward(self, src, pos):
        q = k = src + pos
        src = self.norm1(src + self.dropout1(self.self_attn(q, k, value=src)[0]))
        src2 = self.linear2(self.dropout(F.relu(self.linear1(src))))
        return self.norm2(src + self.dropout2(src2))


class DetrDecoderLayer(nn.Module):
    def __init__(self, d, nhead, ff):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, nhead, dropout=0.1)
        self.multihead_attn = nn.MultiheadAttention(d, nhead, dropout=0.1)
        self.linear1, self.linear2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.dropout = nn.Dropout(0.1)

    def forward(self, tgt, memory, pos, query_pos):
        q = k = tgt + query_pos
        tgt = self.norm1(tgt + self.dropout(self.self_attn(q, k, value=tgt)[0]))
        tgt2 = self.multihead_attn(query=tgt + query_pos, key=memory + pos, value=memory)[0]
        tgt = self.norm2(tgt + self.dropout(tgt2))
        tgt2 = self.linear2(self.dropout(F.relu(self.linear1(tgt))))
        return self.norm3(tgt + self.dropout(tgt2))


class DetrTransformer(nn.Module):
    def __init__(self, d, nhead, ff, layers):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(DetrEncoderLayer(d, nhead, ff) for _ in range(layers))
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(DetrDecoderLayer(d, nhead, ff) for _ in range(layers))
        self.decoder.norm = nn.LayerNorm(d)

    def forward(self, src, query_embed, pos_embed):
        bs, c, h, w = src.shape
        src = src.flatten(2).permute(2, 0, 1)
        pos_embed = pos_embed.flatten(2).permute(2, 0, 1)
        query_pos, tgt = torch.split(query_embed, c, dim=1)
        query_pos = query_pos.unsqueeze(1).repeat(1, bs, 1)
        tgt = tgt.unsqueeze(1).repeat(1, bs, 1)
        memory = src
        for layer in self.encoder.layers:
            memory = layer(memory, pos_embed)
        out, hs = tgt, []
        for layer in self.decoder.layers:
            out = layer(out, memory, pos_embed, query_pos)
            hs.append(self.decoder.norm(out))
        return torch.stack(hs).transpose(1, 2)


class DETR(nn.Module):
    def __init__(self, d=D, nhead=4, num_queries=5, classes=4):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), FrozenBatchNorm2d(16),
                                      nn.ReLU(), nn.Conv2d(16, 24, 3, 2, 1, bias=False),
                                      FrozenBatchNorm2d(24), nn.ReLU())
        self.input_proj = nn.Conv2d(24, d, kernel_size=1)
        self.query_embed = nn.Embedding(num_queries, 2 * d)
        self.transformer = DetrTransformer(d, nhead, 2 * d, 2)
        self.class_embed = nn.Linear(d, classes + 1)
        self.bbox_embed = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 4))

    def forward(self, samples):
        src = self.backbone(samples)
        b, _, h, w = src.shape
        pos = sine_positions(b, h, w, self.input_proj.out_channels // 2)
        hs = self.transformer(self.input_proj(src), self.query_embed.weight, pos)
        return {"pred_logits": self.class_embed(hs)[-1],
                "pred_boxes": self.bbox_embed(hs).sigmoid()[-1]}


@member("detr-queries")
def detr():
    """After facebookresearch/detr models/detr.py and models/transformer.py (post-norm layers)."""
    model = DETR()
    att = []
    for i in range(2):
        p = f"transformer.encoder.layers.{i}.self_attn"
        att.append(Attn(i, 4, 4, 8, *heads_contiguous(f"{p}.in_proj_weight", 4, 4, 8), p))
    for i in range(2):
        for name, kind in (("self_attn", "self"), ("multihead_attn", "cross")):
            p = f"transformer.decoder.layers.{i}.{name}"
            att.append(Attn(2 + i, 4, 4, 8, *heads_contiguous(f"{p}.in_proj_weight", 4, 4, 8),
                            p, kind))
    nr = ["class_embed.weight", "bbox_embed.0.weight", "query_embed.weight"]
    return model, image(), Truth(att, not_reported=nr, stacks=True, note=(
        "positions are added to q and k (not v) before in_proj; time-first MHA; encoder and "
        "decoder (self and cross) sites each their own layer"))


# ---- OpenFold Evoformer: row/column/triangle attention, gating, pair bias -----------------------
# aqlaboratory/openfold openfold/model/primitives.py (Attention), msa.py (MSARowAttentionWith
# PairBias, MSAColumnAttention), triangular_attention.py, triangular_multiplicative_update.py,
# evoformer.py (EvoformerBlock)

class OFAttention(nn.Module):
    def __init__(self, c_q, c_hidden, no_heads):
        super().__init__()
        self.c_hidden, self.no_heads = c_hidden, no_heads
        self.linear_q = nn.Linear(c_q, c_hidden * no_heads, bias=False)
        self.linear_k = nn.Linear(c_q, c_hidden * no_heads, bias=False)
        self.linear_v = nn.Linear(c_q, c_hidden * no_heads, bias=False)
        self.linear_o = nn.Linear(c_hidden * no_heads, c_q)
        self.linear_g = nn.Linear(c_q, c_hidden * no_heads)

    def forward(self, q_x, kv_x, biases):
        q = self.linear_q(q_x).view(q_x.shape[:-1] + (self.no_heads, -1)).transpose(-2, -3)
        k = self.linear_k(kv_x).view(kv_x.shape[:-1] + (self.no_heads, -1)).transpose(-2, -3)
        v = self.linear_v(kv_x).view(kv_x.shape[:-1] + (self.no_heads, -1)).transpose(-2, -3)
        q = q / math.sqrt(self.c_hidden)
        a = torch.matmul(q, k.permute(*range(k.dim() - 2), k.dim() - 1, k.dim() - 2))
        for b in biases:
            a = a + b
        a = torch.softmax(a, dim=-1)
        o = torch.matmul(a, v).transpose(-2, -3)
        g = torch.sigmoid(self.linear_g(q_x)).view(q_x.shape[:-1] + (self.no_heads, -1))
        o = (o * g).reshape(o.shape[:-2] + (-1,))
        return self.linear_o(o)


class MSARowAttentionWithPairBias(nn.Module):
    def __init__(self, c_m, c_z, c_hidden, no_heads):
        super().__init__()
        self.layer_norm_m = nn.LayerNorm(c_m)
        self.layer_norm_z = nn.LayerNorm(c_z)
        self.linear_z = nn.Linear(c_z, no_heads, bias=False)
        self.mha = OFAttention(c_m, c_hidden, no_heads)

    def forward(self, m, z):
        m = self.layer_norm_m(m)  # [*, S, N, c_m]
        z = self.linear_z(self.layer_norm_z(z))  # [*, N, N, H]
        z = z.permute(0, 3, 1, 2).unsqueeze(-4)  # [*, 1, H, N, N]
        return self.mha(m, m, [z])


class MSAColumnAttention(nn.Module):
    def __init__(self, c_m, c_hidden, no_heads):
        super().__init__()
        self._msa_att = nn.Module()
        self._msa_att.layer_norm_m = nn.LayerNorm(c_m)
        self._msa_att.mha = OFAttention(c_m, c_hidden, no_heads)

    def forward(self, m):
        m = m.transpose(-2, -3)
        m = self._msa_att.layer_norm_m(m)
        m = self._msa_att.mha(m, m, [])
        return m.transpose(-2, -3)


class TriangleAttention(nn.Module):
    def __init__(self, c_in, c_hidden, no_heads, starting):
        super().__init__()
        self.starting = starting
        self.layer_norm = nn.LayerNorm(c_in)
        self.linear = nn.Linear(c_in, no_heads, bias=False)
        self.mha = OFAttention(c_in, c_hidden, no_heads)

    def forward(self, x):
        if not self.starting:
            x = x.transpose(-2, -3)
        x = self.layer_norm(x)
        triangle_bias = self.linear(x).permute(0, 3, 1, 2).unsqueeze(-4)  # [*, 1, H, N, N]
        x = self.mha(x, x, [triangle_bias])
        if not self.starting:
            x = x.transpose(-2, -3)
        return x


class TriangleMultiplication(nn.Module):
    def __init__(self, c_z, c_hidden, outgoing):
        super().__init__()
        self.outgoing = outgoing
        self.layer_norm_in = nn.LayerNorm(c_z)
        self.linear_a_p, self.linear_a_g = nn.Linear(c_z, c_hidden), nn.Linear(c_z, c_hidden)
        self.linear_b_p, self.linear_b_g = nn.Linear(c_z, c_hidden), nn.Linear(c_z, c_hidden)
        self.linear_g, self.linear_z = nn.Linear(c_z, c_z), nn.Linear(c_hidden, c_z)
        self.layer_norm_out = nn.LayerNorm(c_hidden)

    def forward(self, z):
        z = self.layer_norm_in(z)
        a = torch.sigmoid(self.linear_a_g(z)) * self.linear_a_p(z)
        b = torch.sigmoid(self.linear_b_g(z)) * self.linear_b_p(z)
        eq = "bikc,bjkc->bijc" if self.outgoing else "bkic,bkjc->bijc"
        x = self.linear_z(self.layer_norm_out(torch.einsum(eq, a, b)))
        return x * torch.sigmoid(self.linear_g(z))


class Transition(nn.Module):
    def __init__(self, c, n=2):
        super().__init__()
        self.layer_norm = nn.LayerNorm(c)
        self.linear_1, self.linear_2 = nn.Linear(c, n * c), nn.Linear(n * c, c)

    def forward(self, x):
        return self.linear_2(F.relu(self.linear_1(self.layer_norm(x))))


class OuterProductMean(nn.Module):
    def __init__(self, c_m, c_z, c_hidden=4):
        super().__init__()
        self.layer_norm = nn.LayerNorm(c_m)
        self.linear_1, self.linear_2 = nn.Linear(c_m, c_hidden), nn.Linear(c_m, c_hidden)
        self.linear_out = nn.Linear(c_hidden * c_hidden, c_z)

    def forward(self, m):
        m = self.layer_norm(m)
        a, b = self.linear_1(m), self.linear_2(m)
        outer = torch.einsum("bsic,bsjd->bijcd", a, b).flatten(-2)
        return self.linear_out(outer) / m.shape[1]


class EvoformerBlock(nn.Module):
    def __init__(self, c_m=16, c_z=8, h_msa=2, c_msa=8, h_pair=2, c_pair=4):
        super().__init__()
        self.msa_att_row = MSARowAttentionWithPairBias(c_m, c_z, c_msa, h_msa)
        self.msa_att_col = MSAColumnAttention(c_m, c_msa, h_msa)
        self.msa_transition = Transition(c_m)
        self.outer_product_mean = OuterProductMean(c_m, c_z)
        self.tri_mul_out = TriangleMultiplication(c_z, 8, True)
        self.tri_mul_in = TriangleMultiplication(c_z, 8, False)
        self.tri_att_start = TriangleAttention(c_z, c_pair, h_pair, True)
        self.tri_att_end = TriangleAttention(c_z, c_pair, h_pair, False)
        self.pair_transition = Transition(c_z)

    def forward(self, m, z):
        m = m + self.msa_att_row(m, z)
        m = m + self.msa_att_col(m)
        m = m + self.msa_transition(m)
        z = z + self.outer_product_mean(m)
        z = z + self.tri_mul_out(z)
        z = z + self.tri_mul_in(z)
        z = z + self.tri_att_start(z)
        z = z + self.tri_att_end(z)
        return m, z + self.pair_transition(z)


class MiniEvoformer(nn.Module):
    def __init__(self, msa_feat=7, pair_feat=5, c_m=16, c_z=8, blocks=2):
        super().__init__()
        self.linear_msa = nn.Linear(msa_feat, c_m)
        self.linear_pair = nn.Linear(pair_feat, c_z)
        self.evoformer = nn.Module()
        self.evoformer.blocks = nn.ModuleList(EvoformerBlock(c_m, c_z) for _ in range(blocks))
        self.evoformer.linear = nn.Linear(c_m, 12)
        self.distogram = nn.Linear(c_z, 10)

    def forward(self, msa, pair):
        m, z = self.linear_msa(msa), self.linear_pair(pair)
        for blk in self.evoformer.blocks:
            m, z = blk(m, z)
        z = z + z.transpose(-2, -3)
        return self.distogram(z), self.evoformer.linear(m[:, 0])


@member("openfold-evoformer")
def openfold():
    """After aqlaboratory/openfold openfold/model/evoformer.py, msa.py, triangular_attention.py,
    primitives.py (Attention with gating and biases)."""
    model = MiniEvoformer()
    att, n = [], 0
    for i in range(2):
        p = f"evoformer.blocks.{i}"
        for mod, h, dh in (("msa_att_row.mha", 2, 8), ("msa_att_col._msa_att.mha", 2, 8),
                           ("tri_att_start.mha", 2, 4), ("tri_att_end.mha", 2, 4)):
            att.append(sep(f"{p}.{mod}", h, h, dh, "linear_q", "linear_k", block=n))
            n += 1
    nr = ["evoformer.blocks.0.msa_att_row.mha.linear_g.weight",
          "evoformer.blocks.0.msa_att_row.linear_z.weight",
          "evoformer.blocks.0.tri_mul_out.linear_a_p.weight",
          "evoformer.blocks.0.tri_mul_out.linear_b_p.weight",
          "evoformer.blocks.0.outer_product_mean.linear_1.weight"]
    msa = torch.randn(B, 3, 5, 7)     # [batch, sequences, residues, features]
    pair = torch.randn(B, 5, 5, 5)    # [batch, residues, residues, features]
    return model, (msa, pair), Truth(att, not_reported=nr, stacks=True, note=(
        "four attention sites per Evoformer block (MSA row with pair bias, MSA column, "
        "triangle start, triangle end): numbered like blip2-qformer, each its own layer; "
        "the triangle multiplications (einsum of two gated projections, no softmax) are not"))


# ---- ViT for small datasets: shifted patch tokens, locality self-attention ----------------------
# lucidrains/vit-pytorch vit_pytorch/vit_for_small_dataset.py (SPT, LSA, ViT)

class SPT(nn.Module):
    def __init__(self, dim, patch_size, channels=3):
        super().__init__()
        self.patch_size = patch_size
        patch_dim = patch_size * patch_size * 5 * channels
        self.to_patch_tokens = nn.Sequential(nn.LayerNorm(patch_dim), nn.Linear(patch_dim, dim))

    def forward(self, x):
        shifts = ((1, -1, 0, 0), (-1, 1, 0, 0), (0, 0, 1, -1), (0, 0, -1, 1))
        x = torch.cat((x, *[F.pad(x, s) for s in shifts]), dim=1)
        b, c, hh, ww = x.shape
        p = self.patch_size
        # 'b c (h p1) (w p2) -> b (h w) (p1 p2 c)'
        x = x.reshape(b, c, hh // p, p, ww // p, p).permute(0, 2, 4, 3, 5, 1)
        return self.to_patch_tokens(x.reshape(b, (hh // p) * (ww // p), p * p * c))


class LSA(nn.Module):
    def __init__(self, dim, heads, dim_head):
        super().__init__()
        inner = dim_head * heads
        self.heads = heads
        self.temperature = nn.Parameter(torch.log(torch.tensor(dim_head ** -0.5)))
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, inner * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(0.0))

    def forward(self, x):
        x = self.norm(x)
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2)
                   for t in self.to_qkv(x).chunk(3, dim=-1))
        dots = torch.matmul(q, k.transpose(-1, -2)) * self.temperature.exp()
        mask = torch.eye(dots.shape[-1], dtype=torch.bool)
        dots = dots.masked_fill(mask, -torch.finfo(dots.dtype).max)
        attn = dots.softmax(dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class SmallFeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(),
                                 nn.Linear(hidden, dim))

    def forward(self, x):
        return self.net(x)


class SmallViT(nn.Module):
    def __init__(self, img=16, patch=4, dim=D, depth=2, heads=4, dim_head=8, classes=10):
        super().__init__()
        self.to_patch_embedding = SPT(dim, patch)
        self.pos_embedding = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim))
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(nn.ModuleList(
            [LSA(dim, heads, dim_head), SmallFeedForward(dim, 2 * dim)]) for _ in range(depth))
        self.mlp_head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, classes))

    def forward(self, img):
        x = self.to_patch_embedding(img)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.pos_embedding[:, :x.shape[1]]
        for attn, ff in self.transformer.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.mlp_head(x[:, 0])


@member("vit-small-lsa-spt")
def vit_small():
    """After lucidrains/vit-pytorch vit_pytorch/vit_for_small_dataset.py (SPT, LSA)."""
    model = SmallViT()
    att = []
    for i in range(2):
        p = f"transformer.layers.{i}.0"
        att.append(Attn(i, 4, 4, 8, *heads_contiguous(f"{p}.to_qkv.weight", 4, 4, 8), p))
    nr = ["to_patch_embedding.to_patch_tokens.1.weight", "mlp_head.1.weight"]
    return model, image(), Truth(att, not_reported=nr, note=(
        "locality self-attention: a learned temperature (exp) instead of 1/sqrt(dh), the "
        "diagonal masked; the image enters through pads and a reshape, no conv"))


# ---- LLaMA-Adapter (peft adaption prompt) -------------------------------------------------------
# huggingface/peft src/peft/tuners/adaption_prompt/layer.py (AdaptedAttention), utils.py
# (llama_compute_query_states)

class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.num_key_value_heads = cfg.num_key_value_heads
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)

    def forward(self, hidden_states, position_embeddings):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        rep = self.num_heads // self.num_key_value_heads
        o = attend(q, repeat_kv(k, rep), repeat_kv(v, rep))
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1)), None


class AdaptedAttention(nn.Module):
    def __init__(self, adapter_len, model, hidden_size):
        super().__init__()
        self.model = model
        self.adapter_len = adapter_len
        self.adaption_prompt = nn.Parameter(torch.empty(1, adapter_len, hidden_size).normal_())
        self.adaption_gate = nn.Parameter(torch.zeros(1))

    def forward(self, hidden_states, position_embeddings):
        output, _ = self.model(hidden_states, position_embeddings)
        bsz, q_len, _ = output.shape
        m = self.model
        factor = m.k_proj.in_features // m.k_proj.out_features
        key = m.k_proj(self.adaption_prompt)
        value = m.v_proj(self.adaption_prompt)
        adapter_k = key.view(1, self.adapter_len, m.num_heads // factor, m.head_dim).repeat(
            bsz, 1, 1, 1).transpose(1, 2)
        adapter_v = value.view(1, self.adapter_len, m.num_heads // factor, m.head_dim).repeat(
            bsz, 1, 1, 1).transpose(1, 2)
        adapter_k = torch.repeat_interleave(adapter_k, repeats=factor, dim=1)
        adapter_v = torch.repeat_interleave(adapter_v, repeats=factor, dim=1)
        # llama_compute_query_states: q_proj again, rotary on the query alone
        q = m.q_proj(hidden_states).view(bsz, q_len, m.num_heads, m.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q = q * cos + torch.cat((-q[..., m.head_dim // 2:], q[..., :m.head_dim // 2]), -1) * sin
        scores = torch.matmul(q, adapter_k.transpose(2, 3)) / math.sqrt(m.head_dim)
        scores = self.adaption_gate * F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        adapter_output = torch.matmul(scores, adapter_v).transpose(1, 2).reshape(bsz, q_len, -1)
        return output + m.o_proj(adapter_output), None


class LlamaLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(cfg.hidden_size, 64, bias=False)
        self.mlp.up_proj = nn.Linear(cfg.hidden_size, 64, bias=False)
        self.mlp.down_proj = nn.Linear(64, cfg.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, rope):
        x = x + self.self_attn(self.input_layernorm(x), rope)[0]
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size)
        self.model.rotary_emb = RotaryEmbedding(cfg.head_dim)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(x, input_ids.shape[1])
        for layer in self.model.layers:
            x = layer(x, rope)
        return self.lm_head(self.model.norm(x))


class PeftAdaptionPromptModel(nn.Module):
    """peft's get_peft_model(model, AdaptionPromptConfig(adapter_len, adapter_layers=1)):
    base frozen, the top layers' self_attn wrapped."""

    def __init__(self, model, adapter_len=4, adapter_layers=1):
        super().__init__()
        self.base_model = model
        for p in model.parameters():
            p.requires_grad_(False)
        layers = model.model.layers
        for layer in layers[len(layers) - adapter_layers:]:
            layer.self_attn = AdaptedAttention(adapter_len, layer.self_attn,
                                               model.config.hidden_size)

    def forward(self, input_ids):
        return self.base_model(input_ids)


@member("llama-adapter-prompt")
def llama_adapter():
    """After huggingface/peft tuners/adaption_prompt (AdaptedAttention, compute_query_states)."""
    cfg = config(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 vocab_size=VOCAB, num_hidden_layers=2)
    base = LlamaForCausalLM(cfg)
    base.config = cfg
    model = PeftAdaptionPromptModel(base)
    att = [sep("base_model.model.layers.0.self_attn", 4, 2, 8, block=0),
           sep("base_model.model.layers.1.self_attn.model", 4, 2, 8, block=1)]
    nr = ["base_model.model.layers.1.self_attn.adaption_prompt", "base_model.lm_head.weight"]
    return model, tokens(), Truth(att, not_reported=nr, note=(
        "the wrapped attention scores q against its keys and, in a second softmax, against "
        "k_proj of the learned prompt (zero-gated): the same q/k rows, one site per layer; "
        "the base is frozen (as peft-lora-llama-b, its rows are the truth)"))


# ---- Falcon-H1: Mamba and attention in parallel ------------------------------------------------
# huggingface/transformers src/transformers/models/falcon_h1/modeling_falcon_h1.py
# (FalconH1DecoderLayer, FalconH1Attention with key_multiplier, FalconH1MLP); holdout4's
# Mamba-1 mixer stands in for the Mamba-2 mixer: what is held out is the parallel layout

class FalconH1Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_heads, self.num_key_value_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.key_multiplier = cfg.key_multiplier
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)

    def forward(self, x, rope):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) * self.key_multiplier
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        rep = self.num_heads // self.num_key_value_heads
        o = attend(q, repeat_kv(k, rep), repeat_kv(v, rep))
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class FalconH1MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.hidden_size
        self.gate_proj = nn.Linear(d, 64, bias=False)
        self.up_proj = nn.Linear(d, 64, bias=False)
        self.down_proj = nn.Linear(64, d, bias=False)
        self.gate_multiplier, self.down_multiplier = cfg.mlp_multipliers

    def forward(self, x):
        y = self.up_proj(x) * F.silu(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.feed_forward = FalconH1MLP(cfg)
        self.mamba = MambaMixer(cfg.hidden_size)
        self.self_attn = FalconH1Attention(cfg)
        self.attention_in_multiplier = cfg.attention_in_multiplier
        self.ssm_out_multiplier = cfg.ssm_out_multiplier
        self.attn_out_multiplier = cfg.attention_out_multiplier
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, hidden_states, rope):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        mamba_hidden = self.mamba(hidden_states) * self.ssm_out_multiplier
        attn_hidden = self.self_attn(hidden_states * self.attention_in_multiplier, rope)
        hidden_states = residual + mamba_hidden + attn_hidden * self.attn_out_multiplier
        residual = hidden_states
        return residual + self.feed_forward(self.pre_ff_layernorm(hidden_states))


class FalconH1ForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.embedding_multiplier = cfg.embedding_multiplier
        self.model.layers = nn.ModuleList(FalconH1DecoderLayer(cfg)
                                          for _ in range(cfg.num_hidden_layers))
        self.model.final_layernorm = RMSNorm(cfg.hidden_size)
        self.model.rotary_emb = RotaryEmbedding(cfg.head_dim)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head_multiplier = cfg.lm_head_multiplier

    def forward(self, input_ids):
        x = self.model.embed_tokens(input_ids) * self.model.embedding_multiplier
        rope = self.model.rotary_emb(x, input_ids.shape[1])
        for layer in self.model.layers:
            x = layer(x, rope)
        return self.lm_head(self.model.final_layernorm(x)) * self.lm_head_multiplier


@member("falcon-h1-parallel")
def falcon_h1():
    """After transformers' models/falcon_h1/modeling_falcon_h1.py (FalconH1DecoderLayer)."""
    cfg = config(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 vocab_size=VOCAB, num_hidden_layers=2, key_multiplier=0.5,
                 attention_in_multiplier=1.5, attention_out_multiplier=0.8,
                 ssm_out_multiplier=0.6, mlp_multipliers=(0.7, 1.2), embedding_multiplier=2.0,
                 lm_head_multiplier=0.5)
    model = FalconH1ForCausalLM(cfg)
    att = [sep(f"model.layers.{i}.self_attn", 4, 2, 8, block=i) for i in range(2)]
    nr = ["model.layers.0.mamba.in_proj.weight", "model.layers.0.mamba.x_proj.weight",
          "model.layers.1.feed_forward.gate_proj.weight"]
    return model, tokens(), Truth(att, not_reported=nr, note=(
        "Mamba and attention side by side in one layer (their outputs summed): one site per "
        "layer, keys scaled by key_multiplier"))


# ---- phi-1.5 MixFormerSequential: one nn.Sequential of everything -------------------------------
# microsoft/phi-1_5 (early revision) modeling_mixformer_sequential.py (Embedding, RotaryEmbedding,
# MHA, SelfAttention, ParallelBlock, CausalLMHead, MixFormerSequentialForCausalLM)

class MixEmbedding(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(0.0)

    def forward(self, input_ids):
        return self.drop(self.wte(input_ids.view(-1, input_ids.shape[-1])))


class MixRotary(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)),
                             persistent=False)

    def forward(self, qkv):  # [b, t, 3, h, dh]
        t = qkv.shape[1]
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]  # [t, 1, rot/2]

        def rot(x):
            x_rot, x_pass = x[..., :self.dim], x[..., self.dim:]
            x1, x2 = x_rot.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x_pass], dim=-1)
        return torch.stack([rot(qkv[:, :, 0]), rot(qkv[:, :, 1]), qkv[:, :, 2]], dim=2)


class MixSelfAttention(nn.Module):
    def forward(self, qkv):
        q, k, v = qkv.unbind(dim=2)
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        t = scores.shape[-1]
        scores = scores + torch.triu(torch.full((t, t), -10000.0), 1)
        attention = torch.softmax(scores, dim=-1)
        return torch.einsum("bhts,bshd->bthd", attention, v)


class MixMHA(nn.Module):
    def __init__(self, d, n_head, rotary_dim):
        super().__init__()
        self.head_dim, self.n_head = d // n_head, n_head
        self.rotary_emb = MixRotary(rotary_dim)
        self.Wqkv = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)
        self.inner_attn = MixSelfAttention()

    def forward(self, x):
        qkv = self.Wqkv(x)
        qkv = qkv.view(*qkv.shape[:-1], 3, self.n_head, self.head_dim)  # '... (three h d)'
        context = self.inner_attn(self.rotary_emb(qkv))
        return self.out_proj(context.reshape(*context.shape[:-2], -1))


class ParallelBlock(nn.Module):
    def __init__(self, d, n_head, rotary_dim):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.resid_dropout = nn.Dropout(0.0)
        self.mixer = MixMHA(d, n_head, rotary_dim)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.ln(hidden_states)
        attn = self.mixer(hidden_states)
        ff = self.mlp.fc2(F.gelu(self.mlp.fc1(hidden_states), approximate="tanh"))
        return self.resid_dropout(attn) + self.resid_dropout(ff) + residual


class CausalLMHead(nn.Module):
    def __init__(self, d, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.linear = nn.Linear(d, vocab)

    def forward(self, x):
        return self.linear(self.ln(x)).to(torch.float32)


class MixFormerSequentialForCausalLM(nn.Module):
    def __init__(self, d=D, n_head=4, n_layer=2, rotary_dim=4, vocab=VOCAB):
        super().__init__()
        modules = [MixEmbedding(vocab, d)]
        modules += [ParallelBlock(d, n_head, rotary_dim) for _ in range(n_layer)]
        modules.append(CausalLMHead(d, vocab))
        self.layers = nn.Sequential(*modules)

    def forward(self, input_ids, labels=None):
        return {"logits": self.layers(input_ids)}


@member("phi1-mixformer-sequential")
def phi1_mixformer():
    """After microsoft/phi-1_5's early modeling_mixformer_sequential.py (MixFormerSequential)."""
    model = MixFormerSequentialForCausalLM()
    att = [Attn(i, 4, 4, 8, *heads_contiguous(f"layers.{i + 1}.mixer.Wqkv.weight", 4, 4, 8),
                f"layers.{i + 1}.mixer") for i in range(2)]
    nr = ["layers.1.mlp.fc1.weight", "layers.3.linear.weight"]
    return model, tokens(), Truth(att, not_reported=nr, note=(
        "the blocks sit at layers.1 and layers.2 of one nn.Sequential whose layers.0 is the "
        "embedding: the blocks are the attentions' order (as x-transformers'), so 0 and 1"))


# ---- DistilBERT with a required attention_mask --------------------------------------------------
# huggingface/transformers src/transformers/models/distilbert/modeling_distilbert.py
# (MultiHeadSelfAttention, TransformerBlock, DistilBertForSequenceClassification)

class DistilMHSA(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.dim = n_heads, dim
        self.q_lin, self.k_lin = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_lin, self.out_lin = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.dropout = nn.Dropout(0.1)

    def forward(self, query, key, value, mask):
        bs, q_length, dim = query.size()
        k_length = key.size(1)
        dph = self.dim // self.n_heads

        def shape(x):
            return x.view(bs, -1, self.n_heads, dph).transpose(1, 2)
        q, k, v = shape(self.q_lin(query)), shape(self.k_lin(key)), shape(self.v_lin(value))
        q = q / math.sqrt(dph)
        scores = torch.matmul(q, k.transpose(2, 3))
        mask = (mask == 0).view(bs, 1, 1, k_length).expand_as(scores)
        scores = scores.masked_fill(mask, torch.tensor(torch.finfo(scores.dtype).min))
        weights = self.dropout(F.softmax(scores, dim=-1))
        context = torch.matmul(weights, v).transpose(1, 2).contiguous().view(bs, -1, dim)
        return (self.out_lin(context),)


class DistilBlock(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.attention = DistilMHSA(dim, n_heads)
        self.sa_layer_norm = nn.LayerNorm(dim, eps=1e-12)
        self.ffn = nn.Module()
        self.ffn.lin1, self.ffn.lin2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.output_layer_norm = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x, attn_mask):
        sa = self.sa_layer_norm(self.attention(x, x, x, attn_mask)[0] + x)
        ffn = self.ffn.lin2(F.gelu(self.ffn.lin1(sa)))
        return self.output_layer_norm(ffn + sa)


class DistilBertForSequenceClassification(nn.Module):
    def __init__(self, dim=D, n_heads=4, n_layers=2, labels=3):
        super().__init__()
        self.distilbert = nn.Module()
        emb = nn.Module()
        emb.word_embeddings = nn.Embedding(VOCAB, dim)
        emb.position_embeddings = nn.Embedding(32, dim)
        emb.LayerNorm = nn.LayerNorm(dim, eps=1e-12)
        self.distilbert.embeddings = emb
        self.distilbert.transformer = nn.Module()
        self.distilbert.transformer.layer = nn.ModuleList(DistilBlock(dim, n_heads)
                                                          for _ in range(n_layers))
        self.pre_classifier = nn.Linear(dim, dim)
        self.classifier = nn.Linear(dim, labels)
        self.dropout = nn.Dropout(0.2)

    def forward(self, input_ids, attention_mask):
        emb = self.distilbert.embeddings
        x = emb.word_embeddings(input_ids) + emb.position_embeddings(
            torch.arange(input_ids.shape[1])[None])
        x = emb.LayerNorm(x)
        for layer in self.distilbert.transformer.layer:
            x = layer(x, attention_mask)
        pooled = self.dropout(F.relu(self.pre_classifier(x[:, 0])))
        return (self.classifier(pooled),)


@member("distilbert-required-mask")
def distilbert():
    """After transformers' models/distilbert/modeling_distilbert.py (a required mask)."""
    model = DistilBertForSequenceClassification()
    ids = tokens()[0]
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    att = [sep(f"distilbert.transformer.layer.{i}.attention", 4, 4, 8, "q_lin", "k_lin", block=i)
           for i in range(2)]
    nr = ["pre_classifier.weight", "classifier.weight"]
    return model, (ids, mask), Truth(att, not_reported=nr, note=(
        "forward(input_ids, attention_mask) with both required and positional"))


# ---- fairseq BASE layer: balanced assignment to expert centroids --------------------------------
# facebookresearch/fairseq fairseq/modules/base_layer.py (BaseLayer, BaseSublayer), fairseq/
# modules/multihead_attention.py, transformer_decoder.py (a BaseLayer inserted into the layers);
# one process holds all E experts here (fairseq: one per worker, All2All between them)

def balanced_assignment(scores):
    """Each expert takes n // E tokens, best affinities first (a greedy stand-in for fairseq's
    auction in libbase); a token left over goes to its best expert."""
    n, e = scores.shape
    cap = n // e
    expert_of = [-1] * n
    load = [0] * e
    for idx in torch.argsort(scores.flatten(), descending=True).tolist():
        t, x = divmod(idx, e)
        if expert_of[t] < 0 and load[x] < cap:
            expert_of[t] = x
            load[x] += 1
    best = scores.argmax(dim=1).tolist()
    return torch.tensor([x if x >= 0 else best[t] for t, x in enumerate(expert_of)])


class BaseSublayer(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff1, self.ff2 = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, xs):
        return xs + self.ff2(F.relu(self.ff1(self.norm(xs))))


class BaseLayer(nn.Module):
    def __init__(self, d, num_experts=4, ffn=64):
        super().__init__()
        centroids = torch.empty(num_experts, d)
        nn.init.orthogonal_(centroids, gain=0.1)
        self.expert_centroids = nn.Parameter(centroids)
        self.expert_network = nn.ModuleList(nn.Sequential(BaseSublayer(d, ffn))
                                            for _ in range(num_experts))

    def forward(self, input_features, *args, **kwargs):
        features = input_features.reshape(-1, input_features.size(-1))
        is_training = input_features.requires_grad
        with torch.no_grad():
            token_expert_affinities = features.matmul(self.expert_centroids.transpose(0, 1))
        if is_training:
            expert_of = balanced_assignment(token_expert_affinities)
        else:  # greedy_assignment
            expert_of = torch.topk(token_expert_affinities, k=1, dim=1).indices.view(-1)
        out = torch.zeros_like(features)
        for e, net in enumerate(self.expert_network):
            idx = (expert_of == e).nonzero().view(-1)
            if idx.numel():
                routed = features[idx]
                alpha = torch.sigmoid(routed.mv(self.expert_centroids[e])).unsqueeze(1)
                out = out.index_add(0, idx, alpha * net(routed) + (1 - alpha) * routed)
        return out.view(input_features.size()), None, None


class FairseqMultiheadAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.q_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, query, attn_mask):
        tgt_len, bsz, d = query.size()
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(query), self.v_proj(query)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2)) + attn_mask.unsqueeze(0)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v).transpose(0, 1).contiguous().view(tgt_len, bsz, d)
        return self.out_proj(attn), None


class FairseqDecoderLayer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.self_attn = FairseqMultiheadAttention(d, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, self_attn_mask=None):
        x = x + self.self_attn(self.self_attn_layer_norm(x), self_attn_mask)[0]
        x = x + self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))
        return x, None, None


class BaseLM(nn.Module):
    def __init__(self, d=D, heads=4, layers=2):
        super().__init__()
        self.decoder = nn.Module()
        dec = self.decoder
        dec.embed_tokens = nn.Embedding(VOCAB, d)
        dec.embed_scale = math.sqrt(d)
        dec.embed_positions = nn.Embedding(32, d)
        dec.layers = nn.ModuleList(FairseqDecoderLayer(d, heads) for _ in range(layers))
        dec.layers.insert(((0 + 1) * layers) // 2, BaseLayer(d))  # base_layers=1
        dec.layer_norm = nn.LayerNorm(d)
        dec.output_projection = nn.Linear(d, VOCAB, bias=False)

    def forward(self, prev_output_tokens):
        dec = self.decoder
        x = dec.embed_scale * dec.embed_tokens(prev_output_tokens) + dec.embed_positions(
            torch.arange(prev_output_tokens.shape[1]))[None]
        x = x.transpose(0, 1)
        mask = causal_mask(x.shape[0])
        for layer in dec.layers:
            x, _, _ = layer(x, self_attn_mask=mask)
        return dec.output_projection(dec.layer_norm(x).transpose(0, 1)), {"attn": None}


@member("base-layer-balanced")
def base_layer():
    """After fairseq's fairseq/modules/base_layer.py (BaseLayer) in a fairseq decoder."""
    model = BaseLM()
    att = [sep(f"decoder.layers.{i}.self_attn", 4, 4, 8, block=i) for i in (0, 2)]
    rt = [Router(1, 4, 1, Rows("decoder.layers.1.expert_centroids", range(4)),
                 "decoder.layers.1")]
    nr = ["decoder.layers.1.expert_network.0.0.ff1.weight", "decoder.output_projection.weight"]
    return model, tokens(), Truth(att, rt, not_reported=nr, note=(
        "the BASE layer is a layer of its own (decoder.layers.1) between two decoder layers: "
        "block indices 0, 1 (router), 2; its router is the raw Parameter expert_centroids "
        "[E, d]: top-1 (balanced in training, topk(k=1) otherwise)"))


# ---- Megatron-core: sinkhorn load balancing, top-1 ---------------------------------------------
# NVIDIA/Megatron-LM megatron/core/transformer/moe/router.py (TopKRouter, sinkhorn_load_
# balancing), moe/moe_utils.py (sinkhorn), transformer/attention.py (SelfAttention with
# linear_qkv), dot_product_attention.py, moe/experts.py (SequentialMLP)

def sinkhorn(cost, tol=0.0001):
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), dtype=cost.dtype)
    eps = 0.00000001
    error = 1e9
    d1_old = d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


class TopKRouter(nn.Module):
    def __init__(self, d, num_experts, topk=1):
        super().__init__()
        self.topk, self.num_experts = topk, num_experts
        self.weight = nn.Parameter(torch.randn(num_experts, d) * 0.2)

    def forward(self, x):
        logits = F.linear(x, self.weight).view(-1, self.num_experts)
        if self.training:
            with torch.no_grad():
                norm_logits = sinkhorn(logits.to(dtype=torch.float32))
                _, indices = torch.topk(norm_logits, k=self.topk, dim=1)
            logits = torch.sigmoid(logits)
            scores = torch.gather(logits, 1, indices)
        else:
            logits = torch.sigmoid(logits)
            scores, indices = torch.topk(logits, k=self.topk, dim=1)
        return scores, indices


class MegatronMLP(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.linear_fc1 = nn.Linear(d, 2 * ffn, bias=False)
        self.linear_fc2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        a, b = torch.chunk(self.linear_fc1(x), 2, dim=-1)
        return self.linear_fc2(F.silu(a) * b)


class MoELayer(nn.Module):
    def __init__(self, d, num_experts=4, ffn=32):
        super().__init__()
        self.router = TopKRouter(d, num_experts)
        self.experts = nn.Module()
        self.experts.local_experts = nn.ModuleList(MegatronMLP(d, ffn) for _ in range(num_experts))

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        scores, indices = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts.local_experts):
            tok, slot = (indices == e).nonzero(as_tuple=True)
            if tok.numel():
                out = out.index_add(0, tok, expert(x[tok]) * scores[tok, slot].unsqueeze(-1))
        return out.view(shape)


class MegatronSelfAttention(nn.Module):
    def __init__(self, d, heads, groups):
        super().__init__()
        self.np, self.ng, self.hn = heads, groups, d // heads
        self.linear_qkv = nn.Linear(d, (heads + 2 * groups) * self.hn, bias=False)
        self.linear_proj = nn.Linear(heads * self.hn, d, bias=False)

    def forward(self, hidden_states):  # [s, b, h]
        sq, b, _ = hidden_states.shape
        mixed = self.linear_qkv(hidden_states).view(sq, b, self.ng,
                                                    (self.np // self.ng + 2) * self.hn)
        query, key, value = torch.split(mixed, [self.np // self.ng * self.hn, self.hn, self.hn],
                                        dim=3)
        query = query.reshape(sq, b, self.np, self.hn)
        key = key.repeat_interleave(self.np // self.ng, dim=2)
        value = value.repeat_interleave(self.np // self.ng, dim=2)
        q = query.reshape(sq, b * self.np, self.hn).transpose(0, 1)
        k = key.reshape(sq, b * self.np, self.hn).transpose(0, 1)
        scores = torch.baddbmm(torch.empty(b * self.np, sq, sq), q, k.transpose(1, 2), beta=0.0,
                               alpha=1.0 / math.sqrt(self.hn))
        probs = torch.softmax(scores.view(b, self.np, sq, sq) + causal_mask(sq), dim=-1)
        v = value.reshape(sq, b * self.np, self.hn).transpose(0, 1)
        ctx = torch.bmm(probs.view(b * self.np, sq, sq), v).view(b, self.np, sq, self.hn)
        ctx = ctx.permute(2, 0, 1, 3).reshape(sq, b, -1)
        return self.linear_proj(ctx)


class MegatronMoELayer(nn.Module):
    def __init__(self, d, heads, groups):
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.self_attention = MegatronSelfAttention(d, heads, groups)
        self.pre_mlp_layernorm = RMSNorm(d)
        self.mlp = MoELayer(d)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class MegatronGPT(nn.Module):
    def __init__(self, d=D, heads=4, groups=2, layers=2):
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(VOCAB, d)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(MegatronMoELayer(d, heads, groups)
                                            for _ in range(layers))
        self.decoder.final_layernorm = RMSNorm(d)
        self.output_layer = nn.Linear(d, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embedding.word_embeddings(input_ids).transpose(0, 1).contiguous()
        for layer in self.decoder.layers:
            x = layer(x)
        return self.output_layer(self.decoder.final_layernorm(x)).transpose(0, 1).contiguous()


@member("megatron-sinkhorn-top1")
def megatron_sinkhorn():
    """After Megatron-core's moe/router.py (TopKRouter, sinkhorn_load_balancing)."""
    model = MegatronGPT()
    att, rt = [], []
    for i in range(2):
        p = f"decoder.layers.{i}"
        att.append(Attn(i, 4, 2, 8, *heads_grouped(f"{p}.self_attention.linear_qkv.weight",
                                                   4, 2, 8), f"{p}.self_attention"))
        rt.append(Router(i, 4, 1, Rows(f"{p}.mlp.router.weight", range(4)), f"{p}.mlp.router"))
    nr = ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    return model, tokens(), Truth(att, rt, not_reported=nr, note=(
        "top-1 over the sinkhorn-normalized logits (no_grad) in training, sigmoid scores "
        "gathered; time-first [s, b, h]; linear_qkv grouped per query group"))


# ---- torchscale X-MoE: cosine router in a low dimension -----------------------------------------
# microsoft/torchscale torchscale/component/xmoe/routing.py (Top2Gate with use_xmoe,
# top2gating), xmoe/moe_layer.py (MOELayer), architecture/decoder.py (moe_freq)

def gumbel_rsample(shape):
    one, zero = torch.tensor(1.0), torch.tensor(0.0)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def top2gating(logits, capacity_factor=1.0, training=True):
    gates = F.softmax(logits, dim=1, dtype=torch.float)
    num_tokens, num_experts = gates.shape
    capacity = 2 * math.ceil(num_tokens / num_experts) * capacity_factor
    capacity = int(capacity)
    indices1_s = torch.argmax(gates, dim=1, keepdim=True)
    mask1 = F.one_hot(indices1_s.squeeze(1), num_classes=num_experts)
    logits_w_noise = logits + gumbel_rsample(logits.shape) if training else logits
    logits_except1 = logits_w_noise.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1, keepdim=True)
    mask2 = F.one_hot(indices2_s.squeeze(1), num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    mask1 = mask1 * torch.lt(locations1, capacity)
    mask2 = mask2 * torch.lt(locations2, capacity)
    gates1_s = (gates * mask1).sum(dim=1)
    gates2_s = (gates * mask2).sum(dim=1)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
    gates = (gates1_s / denom_s, gates2_s / denom_s)
    return gates, (indices1_s.squeeze(1), indices2_s.squeeze(1)), (mask1.sum(1), mask2.sum(1))


class Top2Gate(nn.Module):
    def __init__(self, model_dim, num_experts, reduction=16):
        super().__init__()
        self.wg_reduction = nn.Linear(model_dim, reduction, bias=False)
        wg = torch.empty(num_experts, reduction)
        nn.init.orthogonal_(wg, gain=0.32)
        # the forward renormalizes wg in place to norm 1.5; start at its fixed point
        for _ in range(50):
            old = wg.clone()
            wg.mul_(1.5 / wg.norm(p=2.0, dim=1, keepdim=True))
            if torch.equal(old, wg):
                break
        self.register_parameter("wg", nn.Parameter(wg))

    def forward(self, x):
        x = self.wg_reduction(x)
        with torch.no_grad():
            wg_norm = self.wg.norm(p=2.0, dim=1, keepdim=True)
            self.wg.mul_(1.5 / wg_norm)
        logits = self._cosine(x, self.wg)
        return top2gating(logits, training=self.training)

    @staticmethod
    def _cosine(mat1, mat2, eps=1e-4):
        mat2 = F.normalize(mat2.float(), p=2.0, dim=1, eps=eps)
        return mat1.float().matmul(mat2.transpose(0, 1)).type_as(mat1)


class XMoELayer(nn.Module):
    def __init__(self, d, num_experts=4, ffn=32):
        super().__init__()
        self.gate = Top2Gate(d, num_experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, ffn), nn.GELU(),
                                                   nn.Linear(ffn, d)) for _ in range(num_experts))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        gates, indices, kept = self.gate(x)
        out = torch.zeros_like(x)
        for g, idx, keep in zip(gates, indices, kept):
            for e, expert in enumerate(self.experts):
                tok = ((idx == e) & (keep > 0)).nonzero().view(-1)
                if tok.numel():
                    out = out.index_add(0, tok, expert(x[tok]) * g[tok].unsqueeze(-1))
        return out.view(shape)


class TorchscaleMHA(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.q_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        bsz, tgt_len, d = x.shape
        q = self.q_proj(x) * self.scaling
        k, v = self.k_proj(x), self.v_proj(x)
        q, k, v = (t.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
                   .reshape(bsz * self.num_heads, tgt_len, self.head_dim) for t in (q, k, v))
        w = torch.bmm(q, k.transpose(1, 2)) + causal_mask(tgt_len)
        w = F.softmax(w, dim=-1, dtype=torch.float32)
        attn = torch.bmm(w, v).view(bsz, self.num_heads, tgt_len, self.head_dim)
        return self.out_proj(attn.transpose(1, 2).reshape(bsz, tgt_len, d))


class TorchscaleDecoderLayer(nn.Module):
    def __init__(self, d, heads, is_moe):
        super().__init__()
        self.self_attn = TorchscaleMHA(d, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.is_moe_layer = is_moe
        if is_moe:
            self.moe_layer = XMoELayer(d)
        else:
            self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x):
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        h = self.final_layer_norm(x)
        return x + (self.moe_layer(h) if self.is_moe_layer else self.ffn(h))


class TorchscaleDecoder(nn.Module):
    def __init__(self, d=D, heads=4, layers=2, moe_freq=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(TorchscaleDecoderLayer(d, heads, (i + 1) % moe_freq == 0)
                                    for i in range(layers))
        self.layer_norm = nn.LayerNorm(d)
        self.output_projection = nn.Linear(d, VOCAB, bias=False)

    def forward(self, prev_output_tokens):
        x = self.embed_tokens(prev_output_tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output_projection(self.layer_norm(x))


@member("xmoe-cosine-top2")
def xmoe():
    """After microsoft/torchscale component/xmoe/routing.py (Top2Gate, use_xmoe)."""
    model = TorchscaleDecoder()
    att = [sep(f"layers.{i}.self_attn", 4, 4, 8, block=i) for i in range(2)]
    g = "layers.1.moe_layer.gate"

    def composed(params):  # the [E, d] weight the layer's input meets
        wg = F.normalize(params[f"{g}.wg"].float(), p=2.0, dim=1, eps=1e-4)
        return wg.matmul(params[f"{g}.wg_reduction.weight"].float())
    rt = [Router(1, 4, 2, Rows(f"{g}.wg", range(4), eff=composed), g)]
    nr = ["layers.0.ffn.0.weight", "layers.1.moe_layer.experts.0.0.weight"]
    return model, tokens(), Truth(att, rt, not_reported=nr, note=(
        "judgement call: the logits are wg_reduction(x) against wg's E rows L2-normalized "
        "(wg also renormalized in place to 1.5), linear in x: the router is the composed "
        "[E, d] weight normalize(wg) @ wg_reduction.weight (Rows.eff), not wg [E, 16] alone; "
        "top-2 (second by gumbel sampling in training), capacity; MoE every second layer"))


# ---- MoBA: top-k over key blocks, not a router --------------------------------------------------
# MoonshotAI/MoBA moba/moba_naive.py (moba_attn_varlen_naive), moba/wrapper.py

def moba_naive(q, k, v, chunk, topk):
    """q, k, v [b, h, t, d]; each query attends to its own block and the top-k-1 best
    earlier blocks by q . mean(k_block), causally."""
    b, h, t, d = q.shape
    nblk = (t + chunk - 1) // chunk
    key_gate_weight = torch.stack([k[:, :, i * chunk:(i + 1) * chunk].mean(dim=2)
                                   for i in range(nblk)], dim=2)  # [b, h, nblk, d]
    gate = torch.einsum("bhsd,bhnd->bhsn", q.float(), key_gate_weight.float())
    pos = torch.arange(t)
    blk_of = pos // chunk
    future = torch.arange(nblk)[None, :] > blk_of[:, None]  # [t, nblk]
    own = torch.arange(nblk)[None, :] == blk_of[:, None]
    gate = gate.masked_fill(future, float("-inf")).masked_fill(own, float("inf"))
    top = torch.topk(gate, k=min(topk, nblk), dim=-1, largest=True, sorted=False).indices
    chosen = torch.zeros(gate.shape, dtype=torch.bool).scatter_(-1, top, True)
    chosen = chosen & ~future
    token_mask = chosen.repeat_interleave(chunk, dim=-1)[..., :t]
    token_mask = token_mask & (pos[None, :] <= pos[:, None])
    qk = torch.einsum("bhxd,bhyd->bhxy", q, k).masked_fill(~token_mask, float("-inf"))
    p = (qk * d ** -0.5).softmax(dim=-1)
    return torch.einsum("bhxy,bhyd->bhxd", p, v)


class MobaLlamaAttention(LlamaAttention):
    def forward(self, hidden_states, position_embeddings):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        o = moba_naive(q, k, v, chunk=2, topk=2)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1)), None


@member("moba-topk-blocks")
def moba():
    """After MoonshotAI/MoBA moba/moba_naive.py, patched into a LLaMA attention."""
    cfg = config(hidden_size=D, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                 vocab_size=VOCAB, num_hidden_layers=2)
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        old = layer.self_attn
        layer.self_attn = MobaLlamaAttention(cfg)
        layer.self_attn.load_state_dict(old.state_dict())
    att = [sep(f"model.layers.{i}.self_attn", 4, 4, 8, block=i) for i in range(2)]
    nr = ["model.layers.0.mlp.gate_proj.weight", "lm_head.weight"]
    return model, tokens(), Truth(att, not_reported=nr, note=(
        "top-k over key blocks by q . mean(k) picks which keys a query sees: the q.k "
        "softmax is an attention site per layer; the block top-k is no router"))


# ---- SimCLR on a small ViT: InfoNCE in the forward ----------------------------------------------
# sthalles/SimCLR simclr.py (info_nce_loss), models/resnet_simclr.py (projection head);
# the encoder a timm-style ViT (Attention with fused qkv)

class TimmAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = attend(q, k, v, causal=False)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class TimmBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), TimmAttention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim, 2 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SimCLRViT(nn.Module):
    def __init__(self, dim=D, heads=4, depth=2, out_dim=16, temperature=0.07):
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.patch_embed = nn.Conv2d(3, dim, 4, 4)
        self.backbone.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.backbone.pos_embed = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.backbone.blocks = nn.ModuleList(TimmBlock(dim, heads) for _ in range(depth))
        self.backbone.norm = nn.LayerNorm(dim)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, out_dim))
        self.temperature = temperature

    def encode(self, x):
        bb = self.backbone
        x = bb.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([bb.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + bb.pos_embed
        for blk in bb.blocks:
            x = blk(x)
        return self.head(bb.norm(x)[:, 0])

    def info_nce_loss(self, features, n_views=2):
        batch = features.shape[0] // n_views
        labels = torch.cat([torch.arange(batch) for _ in range(n_views)], dim=0)
        labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()
        features = F.normalize(features, dim=1)
        similarity_matrix = torch.matmul(features, features.T)
        mask = torch.eye(labels.shape[0], dtype=torch.bool)
        labels = labels[~mask].view(labels.shape[0], -1)
        similarity_matrix = similarity_matrix[~mask].view(similarity_matrix.shape[0], -1)
        positives = similarity_matrix[labels.bool()].view(labels.shape[0], -1)
        negatives = similarity_matrix[~labels.bool()].view(similarity_matrix.shape[0], -1)
        logits = torch.cat([positives, negatives], dim=1) / self.temperature
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        return logits, labels

    def forward(self, x1, x2):
        features = self.encode(torch.cat([x1, x2], dim=0))
        logits, labels = self.info_nce_loss(features)
        return F.cross_entropy(logits, labels), logits


@member("simclr-vit-infonce")
def simclr():
    """After sthalles/SimCLR simclr.py (info_nce_loss) on a timm-style ViT backbone."""
    model = SimCLRViT()
    att = []
    for i in range(2):
        p = f"backbone.blocks.{i}.attn"
        att.append(Attn(i, 4, 4, 8, *heads_contiguous(f"{p}.qkv.weight", 4, 4, 8), p))
    nr = ["head.0.weight", "head.2.weight"]
    x = torch.randn(B, 3, 16, 16)
    return model, (x, x + 0.1 * torch.randn_like(x)), Truth(att, not_reported=nr, note=(
        "the forward returns the InfoNCE loss: a softmax (cross-entropy) over the projection "
        "head's similarities z z^T / tau: not attention, the head is not reported"))


# ==== round 5b: written after round 5's results were seen (scored apart) =========================

# ---- Multi-Token Attention: a key-query convolution over the scores -----------------------------
# facebookresearch/RAM projects/mta (Multi-Token Attention: a grouped Conv2d over each head's
# masked scores before the softmax, head mixing after it)

class MTAAttention(nn.Module):
    def __init__(self, d, heads, cq=2, ck=3, head_group=2):
        super().__init__()
        self.n_heads, self.head_dim = heads, d // heads
        self.cq, self.ck, self.head_group = cq, ck, head_group
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.mta_kernel = nn.Parameter(torch.randn(heads, 1, cq, ck) * 0.3)
        self.head_kernel = nn.Parameter(torch.eye(head_group).repeat(heads // head_group, 1, 1)
                                        + 0.1 * torch.randn(heads // head_group, head_group,
                                                            head_group))

    def forward(self, x, freqs):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *freqs)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, 0.0)
        # key-query convolution: causal in queries (pad above), keys padded on the left
        scores = F.pad(scores, (self.ck - 1, 0, self.cq - 1, 0))
        scores = F.conv2d(scores, self.mta_kernel, groups=self.n_heads)
        scores = scores.masked_fill(future, float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).type_as(q)
        # head mixing within groups of heads
        g = self.n_heads // self.head_group
        probs = probs.view(b, g, self.head_group, t, t)
        probs = torch.einsum("bgitu,gij->bgjtu", probs, self.head_kernel).reshape(b, -1, t, t)
        o = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1)
        return self.wo(o)


class MTABlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.attention_norm = RMSNorm(d)
        self.attention = MTAAttention(d, heads)
        self.ffn_norm = RMSNorm(d)
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(d, 64, bias=False)
        self.feed_forward.w3 = nn.Linear(d, 64, bias=False)
        self.feed_forward.w2 = nn.Linear(64, d, bias=False)

    def forward(self, x, freqs):
        x = x + self.attention(self.attention_norm(x), freqs)
        h = self.ffn_norm(x)
        ff = self.feed_forward
        return x + ff.w2(F.silu(ff.w1(h)) * ff.w3(h))


class LinguaTransformer(nn.Module):
    def __init__(self, d=D, heads=4, layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, d)
        self.rope_embeddings = RotaryEmbedding(d // heads)
        self.layers = nn.ModuleList(MTABlock(d, heads) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.output = nn.Linear(d, VOCAB, bias=False)

    def forward(self, token_values):
        h = self.tok_embeddings(token_values)
        freqs = self.rope_embeddings(h, token_values.shape[1])
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h))


@member("mta-score-conv")
def mta():
    """After facebookresearch/RAM projects/mta (Multi-Token Attention) in a lingua transformer."""
    model = LinguaTransformer()
    att = [sep(f"layers.{i}.attention", 4, 4, 8, "wq", "wk", block=i) for i in range(2)]
    nr = ["layers.0.feed_forward.w1.weight", "output.weight"]
    return model, tokens(), Truth(att, not_reported=nr, note=(
        "each head's masked q.k scores go through a grouped Conv2d over (query, key) before "
        "the softmax (the heads stay apart), heads are mixed after it: the heads are the "
        "wq/wk rows' (as cait-talking-heads)"))


# ---- Graphormer: a dict batch of graph tensors, attention biases from structure -----------------
# microsoft/Graphormer graphormer/modules/graphormer_layers.py (GraphNodeFeature, GraphAttnBias),
# graphormer_graph_encoder.py, graphormer_graph_encoder_layer.py, multihead_attention.py

class GraphNodeFeature(nn.Module):
    def __init__(self, num_heads, num_atoms, num_in_degree, num_out_degree, hidden_dim):
        super().__init__()
        self.atom_encoder = nn.Embedding(num_atoms + 1, hidden_dim, padding_idx=0)
        self.in_degree_encoder = nn.Embedding(num_in_degree, hidden_dim, padding_idx=0)
        self.out_degree_encoder = nn.Embedding(num_out_degree, hidden_dim, padding_idx=0)
        self.graph_token = nn.Embedding(1, hidden_dim)

    def forward(self, batched_data):
        x = batched_data["x"]
        n_graph = x.size(0)
        node_feature = self.atom_encoder(x).sum(dim=-2)
        node_feature = node_feature + self.in_degree_encoder(batched_data["in_degree"]) + \
            self.out_degree_encoder(batched_data["out_degree"])
        graph_token = self.graph_token.weight.unsqueeze(0).repeat(n_graph, 1, 1)
        return torch.cat([graph_token, node_feature], dim=1)


class GraphAttnBias(nn.Module):
    def __init__(self, num_heads, num_edges, num_spatial):
        super().__init__()
        self.num_heads = num_heads
        self.edge_encoder = nn.Embedding(num_edges + 1, num_heads, padding_idx=0)
        self.spatial_pos_encoder = nn.Embedding(num_spatial, num_heads, padding_idx=0)
        self.graph_token_virtual_distance = nn.Embedding(1, num_heads)

    def forward(self, batched_data):
        attn_bias, spatial_pos = batched_data["attn_bias"], batched_data["spatial_pos"]
        n_graph, n_node = batched_data["x"].size()[:2]
        graph_attn_bias = attn_bias.clone().unsqueeze(1).repeat(1, self.num_heads, 1, 1)
        spatial_pos_bias = self.spatial_pos_encoder(spatial_pos).permute(0, 3, 1, 2)
        graph_attn_bias[:, :, 1:, 1:] = graph_attn_bias[:, :, 1:, 1:] + spatial_pos_bias
        t = self.graph_token_virtual_distance.weight.view(1, self.num_heads, 1)
        graph_attn_bias[:, :, 1:, 0] = graph_attn_bias[:, :, 1:, 0] + t
        graph_attn_bias[:, :, 0, :] = graph_attn_bias[:, :, 0, :] + t
        edge_input = self.edge_encoder(batched_data["attn_edge_type"]).mean(-2).permute(0, 3, 1, 2)
        graph_attn_bias[:, :, 1:, 1:] = graph_attn_bias[:, :, 1:, 1:] + edge_input
        return graph_attn_bias + attn_bias.unsqueeze(1)


class GraphormerMHA(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.q_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, query, attn_bias):
        tgt_len, bsz, d = query.size()
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(query), self.v_proj(query)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        attn_weights = attn_weights + attn_bias.view(bsz * self.num_heads, tgt_len, tgt_len)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v).transpose(0, 1).contiguous().view(tgt_len, bsz, d)
        return self.out_proj(attn)


class GraphormerEncoderLayer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.self_attn = GraphormerMHA(d, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x, self_attn_bias):
        x = x + self.self_attn(self.self_attn_layer_norm(x), self_attn_bias)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class GraphormerModel(nn.Module):
    def __init__(self, d=D, heads=4, layers=2):
        super().__init__()
        self.graph_encoder = nn.Module()
        ge = self.graph_encoder
        ge.graph_node_feature = GraphNodeFeature(heads, 20, 8, 8, d)
        ge.graph_attn_bias = GraphAttnBias(heads, 6, 8)
        ge.emb_layer_norm = nn.LayerNorm(d)
        ge.layers = nn.ModuleList(GraphormerEncoderLayer(d, heads) for _ in range(layers))
        self.lm_head_transform_weight = nn.Linear(d, d)
        self.layer_norm = nn.LayerNorm(d)
        self.embed_out = nn.Linear(d, 1)

    def forward(self, batched_data):
        ge = self.graph_encoder
        attn_bias = ge.graph_attn_bias(batched_data)
        x = ge.emb_layer_norm(ge.graph_node_feature(batched_data)).transpose(0, 1)
        for layer in ge.layers:
            x = layer(x, attn_bias)
        x = self.layer_norm(F.gelu(self.lm_head_transform_weight(x.transpose(0, 1))))
        return self.embed_out(x[:, 0, :])


def graph_batch(n_graph=B, n_node=6):
    g = torch.Generator().manual_seed(5)
    return {"x": torch.randint(1, 21, (n_graph, n_node, 3), generator=g),
            "in_degree": torch.randint(1, 8, (n_graph, n_node), generator=g),
            "out_degree": torch.randint(1, 8, (n_graph, n_node), generator=g),
            "spatial_pos": torch.randint(1, 8, (n_graph, n_node, n_node), generator=g),
            "attn_bias": torch.zeros(n_graph, n_node + 1, n_node + 1),
            "attn_edge_type": torch.randint(0, 7, (n_graph, n_node, n_node, 2), generator=g)}


class GraphormerTask(nn.Module):
    """The model called with the collated batch (fairseq's graph_prediction task passes
    sample["net_input"]["batched_data"])."""

    def __init__(self):
        super().__init__()
        self.encoder = GraphormerModel()

    def forward(self, batched_data):
        return self.encoder(batched_data)


@member("graphormer-dict-graph")
def graphormer():
    """After microsoft/Graphormer graphormer/modules (GraphNodeFeature, GraphAttnBias, encoder)."""
    model = GraphormerTask()
    p = "encoder.graph_encoder.layers"
    att = [sep(f"{p}.{i}.self_attn", 4, 4, 8, block=i) for i in range(2)]
    nr = ["encoder.lm_head_transform_weight.weight", "encoder.embed_out.weight"]
    return model, (graph_batch(),), Truth(att, not_reported=nr, note=(
        "one positional argument, a dict of six integer and float graph tensors; per-head "
        "biases from shortest paths and edges added to q.k; time-first fairseq attention"))


# ---- Point Transformer: vector attention over k nearest neighbours ------------------------------
# lucidrains/point-transformer-pytorch point_transformer_pytorch/point_transformer_pytorch.py
# (PointTransformerLayer with num_neighbors)

def batched_index_select(values, indices, dim=1):
    value_dims = values.shape[(dim + 1):]
    values_shape, indices_shape = values.shape, indices.shape
    indices = indices[(..., *((None,) * len(value_dims)))]
    indices = indices.expand(*((-1,) * len(indices_shape)), *value_dims)
    value_expand_len = len(indices_shape) - (dim + 1)
    values = values[(*((slice(None),) * dim), *((None,) * value_expand_len), ...)]
    value_expand_shape = [-1] * len(values.shape)
    expand_slice = slice(dim, (dim + value_expand_len))
    value_expand_shape[expand_slice] = indices.shape[expand_slice]
    values = values.expand(*value_expand_shape)
    dim += value_expand_len
    return values.gather(dim, indices)


class PointTransformerLayer(nn.Module):
    def __init__(self, dim, pos_mlp_hidden_dim=16, attn_mlp_hidden_mult=2, num_neighbors=4):
        super().__init__()
        self.num_neighbors = num_neighbors
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.pos_mlp = nn.Sequential(nn.Linear(3, pos_mlp_hidden_dim), nn.ReLU(),
                                     nn.Linear(pos_mlp_hidden_dim, dim))
        self.attn_mlp = nn.Sequential(nn.Linear(dim, dim * attn_mlp_hidden_mult), nn.ReLU(),
                                      nn.Linear(dim * attn_mlp_hidden_mult, dim))

    def forward(self, x, pos):
        n = x.shape[1]
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        rel_pos = pos[:, :, None, :] - pos[:, None, :, :]
        rel_pos_emb = self.pos_mlp(rel_pos)
        qk_rel = q[:, :, None, :] - k[:, None, :, :]
        v = v[:, None].expand(-1, n, -1, -1)
        rel_dist = rel_pos.norm(dim=-1)
        _, indices = rel_dist.topk(self.num_neighbors, largest=False)
        v = batched_index_select(v, indices, dim=2)
        qk_rel = batched_index_select(qk_rel, indices, dim=2)
        rel_pos_emb = batched_index_select(rel_pos_emb, indices, dim=2)
        v = v + rel_pos_emb
        sim = self.attn_mlp(qk_rel + rel_pos_emb)
        attn = sim.softmax(dim=-2)
        return torch.einsum("bijd,bijd->bid", attn, v)


class PointTransformerClassifier(nn.Module):
    def __init__(self, in_dim=4, dim=D, depth=2, classes=5):
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.layers = nn.ModuleList(PointTransformerLayer(dim) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, feats, pos):
        x = self.embed(feats)
        for layer, norm in zip(self.layers, self.norms):
            x = x + layer(norm(x), pos)
        return self.head(x.mean(dim=1))


@member("point-transformer-vector-none")
def point_transformer():
    """After lucidrains/point-transformer-pytorch (PointTransformerLayer, vector attention)."""
    model = PointTransformerClassifier()
    nr = ["layers.0.to_qkv.weight", "layers.1.to_qkv.weight", "layers.0.attn_mlp.2.weight"]
    return model, (torch.randn(B, 10, 4), torch.randn(B, 10, 3)), Truth([], not_reported=nr, note=(
        "vector attention: an MLP of q_i - k_j (plus a position MLP), a softmax per channel "
        "over the k nearest neighbours (topk over distances, no experts): no q.k product: "
        "nothing reported, no warning"))


# ---- Slot Attention: a softmax over the slots (queries), iterated ------------------------------
# lucidrains/slot-attention slot_attention/multi_head_slot_attention.py (MultiHeadSlotAttention)

class MultiHeadSlotAttention(nn.Module):
    def __init__(self, num_slots, dim, heads=4, dim_head=8, iters=3, eps=1e-8, hidden_dim=64):
        super().__init__()
        self.dim, self.num_slots, self.iters, self.eps = dim, num_slots, iters, eps
        self.heads, self.scale = heads, dim_head ** -0.5
        self.slots_mu = nn.Parameter(torch.randn(1, 1, dim))
        self.slots_logsigma = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.xavier_uniform_(self.slots_logsigma)
        self.norm_input = nn.LayerNorm(dim)
        self.norm_slots = nn.LayerNorm(dim)
        dim_inner = dim_head * heads
        self.to_q = nn.Linear(dim, dim_inner)
        self.to_k = nn.Linear(dim, dim_inner)
        self.to_v = nn.Linear(dim, dim_inner)
        self.combine_heads = nn.Linear(dim_inner, dim)
        self.gru = nn.GRUCell(dim, dim)
        self.norm_pre_ff = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden_dim), nn.ReLU(inplace=True),
                                 nn.Linear(hidden_dim, dim))

    def split_heads(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.heads, -1).transpose(1, 2)

    def forward(self, inputs):
        b, n, d = inputs.shape
        mu = self.slots_mu.expand(b, self.num_slots, -1)
        sigma = self.slots_logsigma.exp().expand(b, self.num_slots, -1)
        slots = mu + sigma * torch.randn(mu.shape, device=inputs.device, dtype=inputs.dtype)
        inputs = self.norm_input(inputs)
        k = self.split_heads(self.to_k(inputs))
        v = self.split_heads(self.to_v(inputs))
        for _ in range(self.iters):
            slots_prev = slots
            slots = self.norm_slots(slots)
            q = self.split_heads(self.to_q(slots))
            dots = torch.einsum("...id,...jd->...ij", q, k) * self.scale
            attn = dots.softmax(dim=-2) + self.eps
            attn = attn / attn.sum(dim=-1, keepdim=True)
            updates = torch.einsum("...jd,...ij->...id", v, attn)
            updates = self.combine_heads(updates.transpose(1, 2).reshape(b, self.num_slots, -1))
            slots = self.gru(updates.reshape(-1, d), slots_prev.reshape(-1, d))
            slots = slots.reshape(b, -1, d)
            slots = slots + self.mlp(self.norm_pre_ff(slots))
        return slots


class SlotAutoEncoder(nn.Module):
    """A CNN encoder with a soft position embedding, slot attention, a per-slot readout."""

    def __init__(self, dim=D, num_slots=3):
        super().__init__()
        self.encoder_cnn = nn.Sequential(nn.Conv2d(3, dim, 5, padding=2), nn.ReLU(),
                                         nn.Conv2d(dim, dim, 5, padding=2), nn.ReLU())
        self.encoder_pos = nn.Linear(4, dim)
        self.fc1, self.fc2 = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.slot_attention = MultiHeadSlotAttention(num_slots, dim)
        self.readout = nn.Linear(dim, 4)

    def forward(self, image):
        x = self.encoder_cnn(image)
        b, c, h, w = x.shape
        ys = torch.linspace(0.0, 1.0, h)[:, None].expand(h, w)
        xs = torch.linspace(0.0, 1.0, w)[None, :].expand(h, w)
        grid = torch.stack([ys, xs, 1 - ys, 1 - xs], dim=-1).reshape(1, h * w, 4)
        x = x.flatten(2).transpose(1, 2) + self.encoder_pos(grid)
        x = self.fc2(F.relu(self.fc1(nn.functional.layer_norm(x, (c,)))))
        return self.readout(self.slot_attention(x))


@member("slot-attention-heads")
def slot_attention():
    """After lucidrains/slot-attention multi_head_slot_attention.py (MultiHeadSlotAttention)."""
    model = SlotAutoEncoder()
    att = [sep("slot_attention", 4, 4, 8, "to_q", "to_k", block=0)]
    nr = ["readout.weight", "slot_attention.combine_heads.weight"]
    return model, image(hw=8), Truth(att, not_reported=nr, note=(
        "judgement call: the softmax runs over the slots (the queries) and then each slot's "
        "weights are renormalized over the inputs; its logits are q.k per head all the "
        "same: one site, applied 3 times per forward (one set of weights), at layer 0 as "
        "albert-shared's; slots drawn with torch.randn in the forward"))
