"""A zoo of small replicas of public model code, each with its ground truth.

Every member is a function returning (model, example_input, truth):
  model          an nn.Module written here after the public code it is named
                 for: the same module, attribute and config names and the
                 same forward structure (views, transposes, rotary, qk-norm,
                 GQA repeat, fused projections, SDPA or explicit softmax),
                 tiny sizes, random weights;
  example_input  what model(*example_input) takes (a tuple of arguments),
                 or a dict: model(**example_input) (a keyword-only forward;
                 call() runs either);
  truth          a Truth: every attention site and every router, with the
                 exact weight rows each query/key head reads, and the
                 parameters that must not be reported.

The replicas run on torch 1.13 (Debian) and 2.x: where the public code calls
F.scaled_dot_product_attention, the replica calls it when torch has it and
writes the softmax out otherwise (as nanoGPT itself does).

Layer numbering (Truth.stacks): in a model with one stack of blocks, an
attention's and a router's layer is the index of its block. In an
encoder-decoder (stacks=True) the numbering is the discoverer's choice,
but every attention site gets its own layer (the daemon keys per-head
series by layer and head: the encoder's block 0 and the decoder's block 0
must not collide, nor a decoder block's self- and cross-attention), and a
router shares the layer of the self-attention of its block.

Families: decoders, encdec, moe and research were written alongside the
discoverer; holdout (24 members) was written after it, without reading it,
to score it on layouts it was not written against. Blind score, before the
fixes it led to: 15 of 24 right (holdout.py says which failed and why);
after them 24 of 24. holdout2, a second blind round written after those
fixes: 20 of 22 (round 2), then 9 more written after seeing those results
(round 2b): 7 of 9 on torch 1.13, 8 of 9 on 2.15 (holdout2.py says which
and why). gaps: one or two members per layout discovery was known to miss
(casts of top-k indices, computed weights, 1x1 convolutions, LoRA,
keyword-only and dict-batch forwards), written with the fixes. holdout3, a
third blind round (written by a tester who had not read the discoverer,
before the gaps fixes): 14 of 21 on torch 1.13 and 2.15, then 3 of 5 more
(holdout3.py says which and why); its 9 misses were fixed afterwards.
holdout4, a fourth blind round by another tester, after the gaps fixes:
17 of 23 on both torches, then 3 of 3 more (holdout4.py says which and why);
after the fixes they led to, 26 of 26. holdout5, a fifth blind round by another
tester: 18 of 20 on torch 1.13, 17 of 20 on 2.15, then 1 of 4 more (round 5b,
written after seeing those; holdout5.py says which and why). holdout6, a sixth blind
round by another tester: 9 of 11 on torch 1.13, 10 of 11 on 2.15, then 9 of 9
more (round 6b; holdout6.py says which and why). holdout7, a seventh blind round by
another tester: 8 of 8 on both torches, then 9 of 9 more (round 7b). holdout8, an
eighth blind round (hand-written research code) by another tester: 10 of 11 on
both torches, then 5 of 8 more (round 8b; holdout8.py says which and why). holdout9, a
ninth blind round (traced, opaque, stateless and adapter-wrapped code) by another tester:
9 of 12 on both torches, then 5 of 8 more (round 9b; holdout9.py says which and why). holdout10,
a tenth blind round (production training stacks: TransformerEngine, flash-attn, xformers,
Liger, Unsloth, LitGPT, llm-foundry, nanotron, DeepSpeed-Ulysses, Megatron-core MoE) by
another tester: 8 of 12 on both torches, then 3 of 8 more (round 10b; holdout10.py says which
and why) holdout11, an eleventh blind round (recent LLM architectures and
long-context attention: ring and tiled online softmax, NSA, Mamba/attention/MoE hybrids, zero
experts, KV sharing) by another tester: 12 of 12 on both torches, then 7 of 8 more (round 11b;
holdout11.py says which and why). holdout12, a twelfth blind round (transformers trained at scale
beyond text LLMs: diffusion and video DiTs, ViT-22B, SigLIP's pooling head, LLaVA, Qwen2.5-VL's
vision, speech, HSTU, TimesFM, Moirai, Mask2Former; Flax-layout kernels, head-major bmm, list
inputs) by another tester: 16 of 16 on both torches.

Judgement calls a discoverer may dispute (each member's Truth.note says so):
  retnet-no-softmax  retention (q k^T times a decay mask, no softmax) is no
                     attention score by the client's definition: nothing is
                     reported and no warning is called for;
  baddbmm-tiled-gqa  keys tiled with .repeat: query head h reads key head
                     h % Hkv, so the spec lists the query heads grouped by
                     the key head they read;
  soft-moe-no-router Soft MoE mixes every token into every slot (no top-k):
                     no router;
  blip2-qformer      a Q-Former layer with both self- and cross-attention is
                     numbered like an encoder-decoder (stacks): each site
                     its own layer; so are CLIP's two towers (clip-dual-tower);
  x-transformers   its `layers` list interleaves attention and feed-forward
                   entries (0, 2, ...); the blocks are the attentions' order
                   (0, 1, ...), so layer indices stay dense;
  expert-choice    each expert takes its top `capacity` tokens; a token is
                   processed by capacity_factor experts on average, which is
                   what top_k means to the token statistics: top_k = 1 here;
  albert-shared    one attention module applied at every depth is one site
                   (one set of weights) at layer 0; so is CLIP's attention
                   pool, outside any numbered block;
  MLA (DeepSeek)   monitored with composed numbers, or named in a warning;
  computed weights a parametrization, weight_norm or LoRA (gaps.py): the
                   rows are those of the weight the forward multiplies by
                   (g v/|v|, W + scale B A), recomputed from the parameters,
                   not of any one parameter (Rows.eff);
  peft-lora-llama-b  (holdout3) Wq = base_layer.weight + scaling * B A with
                   B = 0 at the start: the truth names the frozen base
                   weight's rows, which equal the effective weight while
                   B = 0 (gaps.py's peft-lora-llama trains B);
  bitnet-ste-bitlinear  the score uses the fake-quantized weight: the truth
                   names the trainable weight's rows;
  mmoe-dense-gates a dense softmax mixture of experts per task (no top-k): no
                   router, as soft-moe-no-router;
  modsquad-noisy-fgate  f_gate is Linear(d, 2E): E logit rows, then E noise
                   scales; the router is the logit rows;
  mamba2-hybrid    SSD's C B^T product (no softmax) is no attention site;
                   a hybrid's Mamba/recurrent blocks count in the block index
                   (as in jamba-hybrid), so its attention is layer 2, not 0.
  zamba-shared-attn  (holdout4) one attention module shared by the hybrid
                   layers 1 and 3 is one site (as albert-shared's), at the
                   block of its first application (albert-shared's first is
                   0); the Mamba layers, another class that the hybrid layer
                   wraps, count in the block index as in mamba2-hybrid: 1.
  slot-attention-heads  (holdout5) Slot Attention's softmax runs over the
                   slots (queries), then each slot's weights are renormalized
                   over the inputs: its logits are q.k per head, so a site
                   (one module iterated: layer 0, as albert-shared);
  xcit-xca-classattn  (holdout5) XCA's softmax over channel-by-channel
                   scores (q^T k over tokens) is no token score: not a site;
  cait-talking-heads, mta-score-conv  (holdout5) the heads' logits are mixed
                   (a Linear over heads, a grouped conv over (query, key))
                   between q.k^T and the softmax: the heads are still the
                   Wq/Wk rows' (the logits before the mix);
  xmoe-cosine-top2  (holdout5) logits = wg_reduction(x) @ normalize(wg)^T are
                   linear in x: the router is the composed [E, d] weight
                   normalize(wg) @ wg_reduction.weight (Rows.eff); wg's
                   [E, 16] rows against the reduced input would be defensible.
  hstu-silu-none   (holdout12) HSTU's pointwise silu(q k^T + bias) / n (no
                   softmax, as sigmoid-attn-none): no site, no warning;
  llava-clip-llama, stdit3-spatial-temporal, hunyuan-dit-skips, wan21-t2v-lists,
  mask2former-masked-xattn, siglip-map-head
                   (holdout12) two towers, self and cross attention in one
                   block, or a pooling head after the blocks: numbered like an
                   encoder-decoder (stacks).
"""
import importlib
from dataclasses import dataclass, field
from typing import List

FAMILIES = ("decoders", "encdec", "moe", "research", "holdout", "holdout2", "gaps", "holdout3",
            "holdout4", "holdout5", "holdout6", "holdout7", "holdout8", "holdout9", "holdout10",
            "holdout11", "holdout12")

_MEMBERS = []


@dataclass
class Rows:
    """Rows of a weight in PyTorch [out, in] layout. `param` is the
    qualified name in model.named_parameters(). t=True: the parameter is
    stored [in, out] (HF Conv1D, x @ W with a raw Parameter); then `rows`
    are its columns. A parameter with more than 2 dims is flattened to
    [prod(leading), last] (t=False) or [first, prod(rest)] (t=True), or
    [first, prod(rest)] with rows its rows (conv=True, and any kernel-1
    convolution weight [out, in, 1(, 1)] with t=False). eff/also: a
    computed weight (below)."""
    param: str
    rows: range
    t: bool = False
    conv: bool = False       # a conv weight [out, in, *kernel] (1x1): flattened to
    #                          [out, prod(rest)], rows are output channels
    eff: object = None       # a computed weight: eff(named parameters) -> the [out, in]
    #                          weight the forward multiplies by (a parametrization,
    #                          weight_norm, LoRA's W + s B A); rows are its rows, and
    #                          verify_truth scales them through `param`'s rows
    also: tuple = ()         # parameters whose same rows verify_truth scales with
    #                          param's (LoRA's lora_B: W + s B A scales row by row)


@dataclass
class Attn:
    """One attention site: the query heads read q[h], the key heads k[g];
    query head h reads key head h // (n_heads // n_kv_heads). mla=True: a
    multi-head latent attention (DeepSeek-V2/V3) whose Q/K are products of
    low-rank projections with a norm between them; it must be accounted
    for (monitored with n_heads and head_dim = nope + rope dims, or named in
    Discovery.skipped), and its rows are not compared."""
    block: object
    n_heads: int
    n_kv_heads: int
    head_dim: int
    q: List[Rows]
    k: List[Rows]
    module: str
    kind: str = "self"
    mla: bool = False


@dataclass
class Router:
    """One MoE router: weight is all E rows of its [E, d] logits weight."""
    block: object
    n_experts: int
    top_k: int
    weight: Rows
    module: str


@dataclass
class Truth:
    attention: List[Attn]
    routers: List[Router] = field(default_factory=list)
    not_reported: List[str] = field(default_factory=list)  # parameter names
    stacks: bool = False
    note: str = ""


def member(name):
    """Decorator registering a zoo member under `name` ([a-z0-9-])."""
    def deco(fn):
        _MEMBERS.append((name, fn))
        return fn
    return deco


def members():
    """[(name, fn)] of every member, in family order."""
    for fam in FAMILIES:
        importlib.import_module(f"{__name__}.{fam}")
    names = [n for n, _ in _MEMBERS]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"zoo members registered twice: {sorted(dup)}")
    return list(_MEMBERS)


# ---- truth helpers ---------------------------------------------------------------------------

def heads_separate(wq, wk, h, kv, dh, t=False):
    """q/k in their own projections, head h at rows h*dh."""
    return ([Rows(wq, range(i * dh, (i + 1) * dh), t) for i in range(h)],
            [Rows(wk, range(g * dh, (g + 1) * dh), t) for g in range(kv)])


def separate_truth(prefix, blocks, h, kv, dh, q="q_proj.weight", k="k_proj.weight",
                   attn="self_attn"):
    """[Attn] of blocks `prefix.{i}` whose attention `attn` has q/k in
    their own projections (heads_separate), layer i each."""
    att = []
    for i in blocks:
        m = f"{prefix}.{i}.{attn}"
        att.append(Attn(i, h, kv, dh, *heads_separate(f"{m}.{q}", f"{m}.{k}", h, kv, dh), m))
    return att


def heads_contiguous(w, h, kv, dh, t=False):
    """One fused [q (h*dh); k (kv*dh); v (kv*dh)] projection."""
    return ([Rows(w, range(i * dh, (i + 1) * dh), t) for i in range(h)],
            [Rows(w, range((h + g) * dh, (h + g + 1) * dh), t) for g in range(kv)])


def heads_grouped(w, h, kv, dh, t=False):
    """Fused, grouped per KV head: [q_g (h/kv heads); k_g; v_g] for each g
    (GPT-NeoX/BLOOM with kv = h, Falcon new_decoder_architecture, Megatron)."""
    per = h // kv
    qs, ks = [], []
    for g in range(kv):
        base = g * (per + 2) * dh
        qs += [Rows(w, range(base + j * dh, base + (j + 1) * dh), t) for j in range(per)]
        ks.append(Rows(w, range(base + per * dh, base + (per + 1) * dh), t))
    return qs, ks


def first(x):
    """The first tensor of a model output (tensor, tuple or dict)."""
    if isinstance(x, (tuple, list)):
        return first(x[0])
    if isinstance(x, dict):
        return first(next(iter(x.values())))
    return x


def call(model, inputs):
    """model's forward on a member's example input: a tuple of arguments, or
    a dict of keyword arguments (a keyword-only forward)."""
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs)
