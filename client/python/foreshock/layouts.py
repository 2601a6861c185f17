"""Where the attention Q/K weights and the MoE routers live in a model.

find_attention() recognises, per attention module:

  fused, contiguous rows [q; k; v]     nanoGPT/GPT-2 `c_attn` (also HF's
                                       transposed Conv1D), timm `qkv`,
                                       Phi-3 `qkv_proj`, MPT `Wqkv`,
                                       nn.MultiheadAttention `in_proj_weight`
                                       (GQA allowed: [q: H*dh; k: Hkv*dh; v])
  fused, grouped rows                  Megatron-core `linear_qkv` and
    [q_g (H/G heads); k_g; v_g] per G  GPT-NeoX/Bloom `query_key_value`
                                       (G = H: [q_h; k_h; v_h] per head)
  separate projections                 LLaMA/Qwen/Mistral `q_proj`/`k_proj`
                                       (GQA), Meta's `wq`/`wk`, BERT
                                       `query`/`key`, diffusers `to_q`/`to_k`,
                                       T5 `q`/`k`

Head counts come from the module's attributes (n_head, num_heads,
num_attention_heads, num_key_value_heads, head_dim, ... or its `config`),
else from the Monitor's n_heads/n_kv_heads/head_dim. Anything else: pass
your own AttentionSpec list (`get` returns the current Wq [H*dh, d] and
Wk [Hkv*dh, d], PyTorch [out, in] layout, d possibly this rank's shard).

find_routers() recognises a router beside an `experts` container: a child
named gate/router/wg/w_gate (or gate.wg, DeepSpeed) with a [E, d] weight,
as in Mixtral, Qwen-MoE, DeepSeek-MoE, Megatron-core and DeepSpeed-MoE.

Layer index: the first integer in the module's qualified name
("model.layers.5.self_attn" -> 5), so attention and router of one block
share it; discovery order when names carry no distinct integers.
"""
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn

log = logging.getLogger("foreshock")

_H_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads",
            "num_attention_heads_per_partition", "n_local_heads")
_KV_ATTRS = ("n_kv_heads", "n_kv_head", "num_key_value_heads", "num_kv_heads",
             "num_query_groups_per_partition", "num_query_groups", "n_local_kv_heads")
_DH_ATTRS = ("head_dim", "head_size", "hidden_size_per_attention_head", "d_head", "dim_head",
             "attention_head_size")
_FUSED_CONTIGUOUS = ("c_attn", "qkv", "qkv_proj", "Wqkv", "in_proj")
_FUSED_GROUPED = ("linear_qkv", "query_key_value")
_SEPARATE = (("q_proj", "k_proj"), ("wq", "wk"), ("query", "key"), ("to_q", "to_k"), ("q", "k"))
_ROUTER_NAMES = ("gate", "router", "wg", "w_gate", "gating")
_TOPK_ATTRS = ("top_k", "num_experts_per_tok", "topk", "moe_top_k", "router_topk", "k")


@dataclass
class AttentionSpec:
    """One attention layer. `get()` returns (Wq [H*dh, d], Wk [Hkv*dh, d]) of
    the current weights (views are fine; they are not modified). Query head
    h reads key head h // (n_heads // n_kv_heads). head_offset/kv_offset
    shift the head indices sent (heads split across tensor-parallel ranks)."""
    layer: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    get: Callable[[], Tuple[torch.Tensor, torch.Tensor]]
    name: str = ""
    head_offset: int = 0
    kv_offset: int = 0


@dataclass
class RouterSpec:
    """One MoE router. `get()` returns WR [E, d]. `module` is hooked for
    the token statistics: its output is taken as the logits when it is a
    tensor whose last dimension is E, else the logits are recomputed from
    its first input as F.linear(x, WR, bias)."""
    layer: int
    n_experts: int
    top_k: int
    get: Callable[[], torch.Tensor]
    module: Optional[nn.Module] = None
    bias: Optional[Callable[[], Optional[torch.Tensor]]] = None
    name: str = ""


def _attr(objs, names):
    for o in objs:
        if o is None:
            continue
        for n in names:
            v = getattr(o, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _weight_getter(mod):
    """[out, in] weight of a projection: nn.Linear (and subclasses such as
    Megatron's ColumnParallelLinear), or HF's Conv1D, which stores [in, out]."""
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None, None
    if type(mod).__name__ == "Conv1D" and getattr(mod, "nf", None) == w.shape[1]:
        return (lambda m=mod: m.weight.t()), w.shape[1]
    return (lambda m=mod: m.weight), w.shape[0]


def _layer_number(name):
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def _heads(module, out_rows, kind, n_heads, n_kv_heads, head_dim, name):
    """(H, Hkv, dh) for a fused projection with out_rows = (H + 2 Hkv) dh."""
    cfg = getattr(module, "config", None)
    h = _attr((module, cfg), _H_ATTRS) or n_heads
    kv = _attr((module, cfg), _KV_ATTRS) or n_kv_heads
    dh = _attr((module, cfg), _DH_ATTRS) or head_dim
    if not h:
        log.warning("foreshock: %s (%s): head count unknown, skipped (pass n_heads=)", name, kind)
        return None
    if kv is None and dh:
        if out_rows % dh == 0 and (out_rows // dh - h) % 2 == 0:
            kv = (out_rows // dh - h) // 2
    kv = kv or h
    if dh is None:
        if out_rows % (h + 2 * kv):
            log.warning("foreshock: %s: %d rows do not split into %d+2x%d heads, skipped",
                        name, out_rows, h, kv)
            return None
        dh = out_rows // (h + 2 * kv)
    if (h + 2 * kv) * dh != out_rows or h % kv:
        log.warning("foreshock: %s: rows %d != (%d + 2*%d) * %d or heads not grouped, skipped",
                    name, out_rows, h, kv, dh)
        return None
    return h, kv, dh


def _contiguous(get, h, kv, dh):
    def f():
        w = get()
        return w[:h * dh], w[h * dh:(h + kv) * dh]
    return f


def _grouped(get, h, kv, dh):
    per = h // kv

    def f():
        w = get()
        g = w.reshape(kv, (per + 2) * dh, w.shape[-1])
        return (g[:, :per * dh].reshape(h * dh, w.shape[-1]),
                g[:, per * dh:(per + 1) * dh].reshape(kv * dh, w.shape[-1]))
    return f


def _match_attention(name, m, n_heads, n_kv_heads, head_dim):
    """An AttentionSpec (layer unset) for module m, or None."""
    if isinstance(m, nn.MultiheadAttention):
        h, dh = m.num_heads, m.head_dim
        if m.in_proj_weight is not None:
            return AttentionSpec(-1, h, h, dh, _contiguous(lambda: m.in_proj_weight, h, h, dh),
                                 name + ".in_proj_weight")
        return AttentionSpec(-1, h, h, dh, lambda: (m.q_proj_weight, m.k_proj_weight),
                             name + ".q/k_proj_weight")
    children = dict(m.named_children())
    for cname in _FUSED_GROUPED + _FUSED_CONTIGUOUS:
        if cname in children:
            get, rows = _weight_getter(children[cname])
            if get is None:
                continue
            kind = "grouped" if cname in _FUSED_GROUPED else "contiguous"
            hkd = _heads(m, rows, kind, n_heads, n_kv_heads, head_dim, f"{name}.{cname}")
            if hkd is None:
                return None
            h, kv, dh = hkd
            make = _grouped if kind == "grouped" else _contiguous
            return AttentionSpec(-1, h, kv, dh, make(get, h, kv, dh), f"{name}.{cname}")
    for qn, kn in _SEPARATE:
        if qn in children and kn in children:
            gq, q_rows = _weight_getter(children[qn])
            gk, k_rows = _weight_getter(children[kn])
            if gq is None or gk is None:
                continue
            cfg = getattr(m, "config", None)
            h = _attr((m, cfg), _H_ATTRS) or n_heads
            dh = _attr((m, cfg), _DH_ATTRS) or head_dim
            if not h and not dh:
                log.warning("foreshock: %s: head count unknown, skipped (pass n_heads=)", name)
                return None
            dh = dh or q_rows // h
            h = h or q_rows // dh
            if h * dh != q_rows or k_rows % dh or h % (k_rows // dh):
                log.warning("foreshock: %s: q rows %d, k rows %d do not fit %d heads of %d",
                            name, q_rows, k_rows, h, dh)
                return None
            kv = k_rows // dh
            return AttentionSpec(-1, h, kv, dh, lambda a=gq, b=gk: (a(), b()),
                                 f"{name}.{qn}/{kn}")
    return None


def _number(specs):
    """Assigns layer indices: integers in names when distinct, else order."""
    nums = [_layer_number(s.name) for s in specs]
    if all(n is not None for n in nums) and len(set(nums)) == len(nums):
        for s, n in zip(specs, nums):
            s.layer = n
    else:
        for i, s in enumerate(specs):
            s.layer = i
    return specs


def find_attention(model, n_heads=None, n_kv_heads=None, head_dim=None):
    """AttentionSpecs for every attention module of `model` in a known
    layout (module docstring), in module order."""
    specs, claimed = [], set()
    for name, m in model.named_modules():
        if any(name.startswith(c + ".") for c in claimed):
            continue
        s = _match_attention(name, m, n_heads, n_kv_heads, head_dim)
        if s is not None:
            specs.append(s)
            claimed.add(name)
    return _number(specs)


def find_routers(model, top_k=None):
    """RouterSpecs for MoE routers beside an `experts` container."""
    specs = []
    for name, m in model.named_modules():
        if not hasattr(m, "experts"):
            continue
        children = dict(m.named_children())
        router, rname = None, None
        for cname in _ROUTER_NAMES:
            c = children.get(cname)
            if c is None:
                continue
            if isinstance(getattr(c, "weight", None), torch.Tensor) and c.weight.dim() == 2:
                router, rname = c, f"{name}.{cname}"
            elif hasattr(c, "wg"):  # DeepSpeed TopKGate
                router, rname = c.wg, f"{name}.{cname}.wg"
            if router is not None:
                break
        if router is None:
            continue
        e = router.weight.shape[0]
        n_exp = _attr((m, getattr(m, "config", None)), ("num_experts", "num_local_experts",
                                                         "n_routed_experts"))
        if n_exp is not None and n_exp != e:
            log.warning("foreshock: %s: weight has %d rows but %d experts, skipped", rname, e,
                        n_exp)
            continue
        k = (_attr((m, router, getattr(m, "config", None)), _TOPK_ATTRS) or top_k)
        if not k:
            log.warning("foreshock: %s: top-k unknown, assuming 2 (pass top_k=)", rname)
            k = 2
        bias = getattr(router, "bias", None)
        specs.append(RouterSpec(-1, e, min(k, e), lambda r=router: r.weight, module=router,
                                bias=(lambda r=router: r.bias) if bias is not None else None,
                                name=rname))
    return _number(specs)
