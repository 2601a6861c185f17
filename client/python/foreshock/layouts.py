"""Where the attention Q/K weights and the MoE routers live in a model.

discover() walks the model once and returns what it will monitor, what it
skipped and why (Discovery.summary(), logged once by the Monitor).
find_attention() / find_routers() are its two halves.

ATTENTION. A module is an attention module when it is an
nn.MultiheadAttention or has one of these children (2-D weights):

  fused, contiguous rows [q; k; v]     nanoGPT/GPT-2 `c_attn` (also HF's
                                       transposed Conv1D), timm `qkv`,
                                       Phi-3 `qkv_proj`, MPT/DBRX `Wqkv`,
                                       lucidrains `to_qkv`, Baichuan
                                       `W_pack`, `in_proj`, nn.MultiheadAttention
                                       `in_proj_weight` (GQA allowed:
                                       [q: H*dh; k: Hkv*dh; v: Hkv*dh])
  fused, grouped rows                  Megatron-core `linear_qkv`,
    [q_g (H/G heads); k_g; v_g] per G  GPT-NeoX/Bloom/Falcon `query_key_value`,
                                       InternLM2 `wqkv` (G = H: [q_h; k_h; v_h])
  separate projections                 LLaMA/Qwen/Mistral `q_proj`/`k_proj`,
                                       Meta `wq`/`wk`, BERT `query`/`key`,
                                       diffusers `to_q`/`to_k`, T5 `q`/`k`,
                                       DistilBERT `q_lin`/`k_lin`, `linear_q`/
                                       `linear_k`, `q_linear`/`k_linear`,
                                       `query_proj`/`key_proj`, `w_q`/`w_k`,
                                       `Wq`/`Wk`
A module with an `A_log` parameter or `x_proj`/`dt_proj`/`conv1d` children
is a state-space layer (Mamba's `in_proj`), never attention. A projection
child may be a 1x1 convolution (its [out, in, 1, 1] weight's out rows) or
hold a computed weight (effective.py: a parametrization, weight_norm,
LoRA's W + scale * B @ A): its getter returns that effective weight.

Head counts: H, Hkv and dh are each taken from the first of these that
says (positive int attributes; names in _H_ATTRS, _KV_ATTRS, _DH_ATTRS):
the module itself, its `config` (also `cfg`, `args`, `params`, `hparams`;
objects or dicts), then each parent module outwards (and its config), then
the Monitor's n_heads / n_kv_heads / head_dim. A flag `multi_query` (True)
means Hkv = 1; `num_key_value_groups` / `n_rep` (query heads per KV head)
gives Hkv = H / groups. What is missing is inferred from the weights:
  separate q/k   dh = q rows / H, or H = q rows / dh, or dh = k rows / Hkv;
                 Hkv = k rows / dh
  fused          rows = (H + 2 Hkv) dh. The input size of the output
                 projection (o_proj, out_proj, c_proj, proj, dense, wo, o,
                 linear_proj, to_out, ...) is the query part H*dh, so with
                 one of H or dh it gives the other and Hkv. Without it and
                 without a KV attribute the layer is taken as plain
                 multi-head (Hkv = H) -- a GQA model names its KV heads.
If no head count and no head dim can be established (only d_model and the
rows), the module is skipped with the reason, never guessed; so is one
whose numbers contradict each other or its rows. Fix: Monitor(n_heads=,
n_kv_heads=, head_dim=) or attention=[AttentionSpec(...)]: `get` returns
the current Wq [H*dh, d] and Wk [Hkv*dh, d], PyTorch [out, in] layout,
d possibly this rank's shard.

ROUTERS. A router is a child module or a 2-D nn.Parameter [E, d] of a
module, named router, gate, wg, w_gate, gating, switch, moe_gate,
router_gate, gate_network, gating_network, routing or expert_gate; a
router-named child without a weight of its own may hold it one level down
(DeepSpeed `gate.wg`, Switch `router.classifier`, or its only Linear).
E = the weight's rows. It is taken
  - when the module also has experts: an `experts` attribute, a child
    module whose name contains "expert", or a 3-D (stacked experts)
    parameter. A num_experts / num_local_experts / n_routed_experts / ...
    attribute on the module or its config that disagrees with E skips it;
  - without experts beside it, only when 2 <= E <= d/2 and no sibling
    projection has the same shape (the `up` of a GLU) or reads E inputs
    (the `down` of an MLP): a SwiGLU gate Linear(d, ffn) is not a router.
Never routers: gate_proj, up_proj, w1, w3, fc1, c_fc (MLP projections,
whatever their size), anything with fewer than 2 outputs (a mixture-of-
depths or shared-expert gate), anything inside an attention module.
top_k is the first of top_k, num_experts_per_tok, moe_top_k,
n_experts_per_token, ... (_TOPK_ATTRS; a bare `k` only on the router or
its MoE module) on the router, its module, the module's config, then the
parents outwards and their configs, then the Monitor's top_k; else
DEFAULT_TOP_K (2, Mixtral/GShard), said in the summary. Fix:
Monitor(top_k=) or routers=[RouterSpec(...)].

OBSERVATION. After names, discover() runs one observed forward pass
(observe.py) that finds attention scores and routing top-ks whatever the
names; it confirms names' specs, replaces them where it disagrees (a
"corrected by observation" line), adds what names missed and drops a
router-named weight whose output reaches no topk. Every observed site it
cannot monitor is in `skipped` with the reason and the fix (MLA has its
own message).

Layer index: the block index, the outermost ModuleList/Sequential entry a
spec lives in, counted over the entries holding a spec in module order
(encoder blocks, then decoder blocks), so attention and router of one
block share it; a
block's second attention (cross-attention) takes the next index and the
later blocks shift. Without block lists: discovery order.
"""
import logging
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn

from . import effective
from .observe import _common_module

log = logging.getLogger("foreshock")

_H_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "nheads", "heads",
            "num_q_heads", "num_query_heads", "n_q_heads", "n_local_heads",
            "num_attention_heads_per_partition")
_KV_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head", "n_head_kv",
             "num_kv", "kv_heads", "n_kv", "num_query_groups_per_partition", "num_query_groups",
             "n_local_kv_heads", "multi_query_group_num")
_GROUP_ATTRS = ("num_key_value_groups", "num_queries_per_kv", "n_rep")  # H / Hkv
_MQA_FLAGS = ("multi_query", "multi_query_attention")                 # True: Hkv = 1
_DH_ATTRS = ("head_dim", "d_head", "hd", "head_size", "dim_head", "attention_head_size",
             "hidden_size_per_attention_head", "key_value_proj_dim", "kv_channels", "d_kv", "d_k")
_CONFIG_ATTRS = ("config", "cfg", "args", "params", "hparams")

_FUSED_CONTIGUOUS = ("c_attn", "qkv", "qkv_proj", "Wqkv", "to_qkv", "W_pack", "qkv_linear",
                     "in_proj")
_FUSED_GROUPED = ("linear_qkv", "query_key_value", "wqkv")
_SEPARATE = (("q_proj", "k_proj"), ("wq", "wk"), ("query", "key"), ("to_q", "to_k"),
             ("q", "k"), ("q_lin", "k_lin"), ("linear_q", "linear_k"),
             ("q_linear", "k_linear"), ("query_proj", "key_proj"), ("w_q", "w_k"),
             ("Wq", "Wk"))
_OUT_PROJ = ("o_proj", "out_proj", "c_proj", "proj", "dense", "wo", "o", "linear_proj",
             "to_out", "out", "out_lin", "proj_out", "o_linear", "linear_out", "Wo", "w_o")
_SSM_MARKS = ("A_log", "x_proj", "dt_proj", "conv1d")

_ROUTER_NAMES = ("router", "gate", "wg", "w_gate", "gating", "switch", "moe_gate",
                 "router_gate", "gate_network", "gating_network", "routing", "expert_gate")
_ROUTER_INNER = ("wg", "classifier", "linear", "proj", "layer", "gate", "router")
_EXPERTS_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "n_experts",
                  "moe_num_experts", "num_moe_experts")
_TOPK_ATTRS = ("top_k", "num_experts_per_tok", "moe_top_k", "n_experts_per_token",
               "num_experts_per_token", "experts_per_token", "topk", "router_topk",
               "moe_router_topk", "num_selected_experts", "n_activated_experts",
               "top_k_experts", "moe_k")
_TOPK_LOCAL = ("k",)  # too generic for parents and configs
DEFAULT_TOP_K = 2

ATTENTION_FIX = ("pass n_heads=/n_kv_heads=/head_dim= to Monitor, or "
                 "attention=[foreshock.AttentionSpec(...)]")
ROUTER_FIX = "pass routers=[foreshock.RouterSpec(...)] to Monitor"
TOPK_FIX = "pass top_k= to Monitor"


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


class _Skip(Exception):
    """A candidate that cannot be monitored: str(e) is the reason.
    unknown: its head count could not be found (_UNKNOWN); children: the
    names, attributes of the candidate module, of the projections it was
    judged from (one fused, or q and k), for _unknown_not_attention."""

    def __init__(self, reason, unknown=False, children=()):
        super().__init__(reason)
        self.unknown, self.children = unknown, tuple(children)


class Discovery:
    """What discover() found. attention / routers: the specs to monitor.
    skipped: (kind, name, reason, fix) of candidates that look like
    attention or routers but could not be used (the summary warns).
    not_routers: (name, reason) of router-named weights judged not to be
    routers (said in the summary, no warning). notes: (name, text, fix) of
    guesses made (a default top-k). how: spec name -> where its numbers
    came from."""

    def __init__(self):
        self.attention, self.routers = [], []
        self.skipped, self.not_routers, self.notes = [], [], []
        self.how = {}
        self.corrections = []   # (name, text): where the observed pass overruled names
        self.not_attention = []  # (name, reason, fix): name-found attention the pass ruled out
        self.order = {}         # spec name -> when the observed pass saw it
        self.observation = None
        self.attention_given = self.routers_given = False
        # (skipped entry, projection attribute names) of attention
        # candidates skipped for an unknown head count (_Skip.children)
        self.unknown_heads = []
        self.layers = None
        self.before_filter = (0, 0)

    @property
    def waits(self):
        """No probe batch fit the model's forward: the observed pass waits
        for a real batch (a Monitor observes the first one at its first
        step(); example_input= gives one now)."""
        obs = self.observation
        return bool(obs is not None and getattr(obs, "waits", False)) and not (
            self.attention_given and self.routers_given)

    @property
    def level(self):
        if self.skipped or self.notes:
            return logging.WARNING
        if not self.attention and not self.routers and not (
                self.attention_given and self.routers_given) and not self.waits:
            return logging.WARNING
        return logging.INFO

    def summary(self, model_name="model"):
        """The one multi-line summary the Monitor logs at start."""
        lines = []
        if self.attention or self.routers:
            parts = []
            if self.attention:
                parts.append(_attention_headline(self.attention))
            if self.routers:
                parts.append(_router_headline(self.routers))
            lines.append(f"foreshock: monitoring {model_name}: " + "; ".join(parts))
        elif self.attention_given and self.routers_given:
            lines.append(f"foreshock: monitoring {model_name}: scalars only (attention=[] and "
                         "routers=[] given)")
        elif self.waits:
            lines.append(
                f"foreshock: nothing found by names in {model_name} yet; the observed pass "
                "waits for the first batch (no probe batch fits its forward): a Monitor "
                "observes the first batch the model is called with at its first step(), "
                "then logs what it monitors (or pass example_input=)")
        elif self.skipped:
            lines.append(
                f"foreshock: found NOTHING it can monitor in {model_name}: what it found is "
                "SKIPPED below, each with the reason and its fix; only scalars (loss, "
                "grad_norm, lr, ...) will be sent")
        else:
            lines.append(
                f"foreshock: found NOTHING to monitor in {model_name}: no attention Q/K weights "
                "and no MoE routers in a layout discovery knows; only scalars (loss, grad_norm, "
                "lr, ...) will be sent. Fix: pass attention=[foreshock.AttentionSpec(...)] "
                "and/or routers=[foreshock.RouterSpec(...)] to Monitor (client/python/README.md, "
                "\"What it finds and how\")")
        for what, specs, given, arg in (("attention", self.attention, self.attention_given,
                                         "attention="),
                                        ("routers", self.routers, self.routers_given,
                                         "routers=")):
            if given:
                lines.append(f"  {what}: {len(specs)} given by {arg}")
            elif specs:
                for head, names in _groups(specs, what, self.how):
                    how = self.how.get(names[0])
                    lines.append(f"  {what}: {head}: {_names(names)}"
                                 + (f" [{how}]" if how else ""))
            else:
                lines.append(f"  {what}: none found")
        if self.layers is not None:
            lines.append(f"  layers={sorted(self.layers)} kept {len(self.attention)} of "
                         f"{self.before_filter[0]} attention layers, {len(self.routers)} of "
                         f"{self.before_filter[1]} routers")
        grouped = {}
        for kind, name, reason, fix in self.skipped:
            grouped.setdefault((kind, reason, fix), []).append(name)
        for (kind, reason, fix), names in grouped.items():
            lines.append(f"  SKIPPED {kind} {_names(names)}: {reason}; fix: {fix}")
        grouped = {}
        for name, text, fix in self.notes:
            grouped.setdefault((text, fix), []).append(name)
        for (text, fix), names in grouped.items():
            lines.append(f"  note: {_names(names)}: {text}; fix: {fix}")
        for name, text in self.corrections:
            lines.append(f"  corrected by observation: {name}: {text}")
        obs = self.observation
        if obs is not None and not (self.attention_given and self.routers_given):
            if obs.error is None:
                lines.append(f"  observed: one forward pass ({obs.input_desc}): "
                             f"{_n(len(obs.attention), 'attention score')}, "
                             f"{_n(len(obs.routers), 'routing top-k')}")
            elif self.waits:
                lines.append(f"  observed: not yet ({obs.error}); the observed pass waits "
                             "for the first batch (a Monitor's first step()), or pass "
                             "example_input=")
            else:
                lines.append(f"  observed: nothing ({obs.error}); names only")
        grouped = {}
        for name, reason in self.not_routers:
            grouped.setdefault(reason, []).append(name)
        for reason, names in grouped.items():
            lines.append(f"  not routers: {_names(names)}: {reason}")
        grouped = {}
        for name, reason, fix in self.not_attention:
            grouped.setdefault((reason, fix), []).append(name)
        for (reason, fix), names in grouped.items():
            lines.append(f"  not attention: {_names(names)}: {reason}; fix: {fix}")
        return "\n".join(lines)

    def log(self, model_name="model"):
        log.log(self.level, "%s", self.summary(model_name))


def _names(names, limit=3):
    s = ", ".join(n or "(model)" for n in names[:limit])
    if len(names) > limit:
        s += f" (+{len(names) - limit} more)"
    return s


def _n(count, noun):
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _join(name, child):
    return f"{name}.{child}" if name else child


def ranges_text(values):
    """Integers as sorted ranges, duplicates dropped: [9, 4, 5, 6, 7, 5] -> '4-7,9'."""
    values = sorted(set(values))
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out)


def _attention_headline(specs):
    shapes = {}
    for s in specs:
        shapes.setdefault((s.n_heads, s.n_kv_heads, s.head_dim), []).append(s)
    parts = []
    for (h, kv, dh), ss in shapes.items():
        gqa = (f", GQA {kv} KV heads ({h // kv} query heads per KV head)" if kv != h else "")
        parts.append(f"{_n(len(ss), 'attention layer')} x {h} heads (head_dim {dh}{gqa})")
    return " + ".join(parts)


def _router_headline(specs):
    shapes = {}
    for s in specs:
        shapes.setdefault((s.n_experts, s.top_k), []).append(s)
    return " + ".join(f"{_n(len(ss), 'MoE router')} ({e} experts, top-{k})"
                      for (e, k), ss in shapes.items())


def _groups(specs, what, how=None):
    shapes = {}
    for s in specs:
        key = ((s.n_heads, s.n_kv_heads, s.head_dim) if what == "attention"
               else (s.n_experts, s.top_k))
        shapes.setdefault(key + ((how or {}).get(s.name, ""),), []).append(s)
    for key, ss in shapes.items():
        nums = [s.layer for s in ss]
        layers = ("layer " if len(set(nums)) == 1 else "layers ") + ranges_text(nums)
        if what == "attention":
            head = f"{layers}: H={key[0]} Hkv={key[1]} dh={key[2]}"
        else:
            head = f"{layers}: E={key[0]} top-{key[1]}"
        yield head, [s.name for s in ss]


# ---- attribute lookup -----------------------------------------------------------------------

def _int(v):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        return None
    return int(v) if v > 0 else None


def _get(obj, name):
    try:
        if isinstance(obj, Mapping):
            return obj.get(name)
        return getattr(obj, name, None)
    except Exception:  # a property that raises
        return None


def _configs(obj):
    for c in _CONFIG_ATTRS:
        v = _get(obj, c)
        if v is not None and not isinstance(v, (nn.Module, torch.Tensor)) and not callable(v):
            yield c, v


def _sources(name, module, modules, near=None):
    """(label, object) to read attributes from, nearest first: `near`
    objects, the module, its configs, then each parent and its configs."""
    out = list(near or [])
    out.append((name, module))
    parts = name.split(".") if name else []
    chain = [(name, module)] + [(".".join(parts[:i]), modules.get(".".join(parts[:i])))
                                for i in range(len(parts) - 1, -1, -1)]
    for i, (n, m) in enumerate(chain):
        if m is None:
            continue
        if i:
            out.append((n, m))
        for c, v in _configs(m):
            out.append((_join(n, c), v))
    return out


def _lookup(sources, names):
    """(value, 'where.attr') of the first positive int attribute, or (None, None)."""
    for label, obj in sources:
        for n in names:
            v = _int(_get(obj, n))
            if v is not None:
                return v, (f"{label}.{n}" if label else n)
    return None, None


def _flag(sources, names):
    for label, obj in sources:
        for n in names:
            v = _get(obj, n)
            if isinstance(v, bool):
                return v, (f"{label}.{n}" if label else n)
    return None, None


def _proj_shape(mod):
    """(out, in, getter of the [out, in] weight) of a projection: nn.Linear
    and subclasses (Megatron's ColumnParallelLinear), HF's Conv1D (stored
    [in, out]), a 1x1 convolution ([out, in, 1, 1]: its out rows), a
    computed weight (effective.py: a parametrization, weight_norm, LoRA's
    W + scale B A); a ModuleList/Sequential (diffusers' to_out) gives its
    first projection. None when it has no floating 2-D weight."""
    try:
        get = effective.weight_getter(mod)
        w = get() if get is not None else None
    except Exception:  # a computed weight that cannot be read: no projection
        return None
    if get is not None:
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
            return None
        return w.shape[0], w.shape[1], get
    w = getattr(mod, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() > 2 and w.is_floating_point() and \
            isinstance(mod, nn.modules.conv._ConvNd) and not mod.transposed and \
            mod.groups == 1 and all(k == 1 for k in w.shape[2:]):
        return w.shape[0], w.shape[1], (lambda m=mod: m.weight.flatten(1))
    if isinstance(w, torch.Tensor):
        if w.dim() != 2 or not w.is_floating_point():
            return None
        if type(mod).__name__ == "Conv1D" and getattr(mod, "nf", None) == w.shape[1]:
            return w.shape[1], w.shape[0], (lambda m=mod: m.weight.t())
        return w.shape[0], w.shape[1], (lambda m=mod: m.weight)
    if isinstance(mod, (nn.ModuleList, nn.Sequential)):
        for c in mod.children():
            p = _proj_shape(c)
            if p is not None:
                return p
    return None


def _layer_number(name):
    for part in name.split("."):
        if part.isdigit():
            return int(part)
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


# ---- attention ------------------------------------------------------------------------------

class _Heads:
    """The head numbers an attention module's surroundings state, with where."""

    def __init__(self, sources, fallback):
        self.h, self.h_at = _lookup(sources, _H_ATTRS)
        self.kv, self.kv_at = _lookup(sources, _KV_ATTRS)
        self.dh, self.dh_at = _lookup(sources, _DH_ATTRS)
        groups, groups_at = _lookup(sources, _GROUP_ATTRS)
        mqa, mqa_at = _flag(sources, _MQA_FLAGS)
        n_heads, n_kv_heads, head_dim = fallback
        if self.h is None and n_heads:
            self.h, self.h_at = n_heads, "Monitor(n_heads=)"
        if self.dh is None and head_dim:
            self.dh, self.dh_at = head_dim, "Monitor(head_dim=)"
        if self.kv is None and mqa:
            self.kv, self.kv_at = 1, mqa_at
        if self.kv is None and groups and self.h and self.h % groups == 0:
            self.kv, self.kv_at = self.h // groups, f"{self.h_at} / {groups_at}"
        if self.kv is None and n_kv_heads:
            self.kv, self.kv_at = n_kv_heads, "Monitor(n_kv_heads=)"

    def said(self):
        s = [f"{k}={v} ({at})" for k, v, at in (("H", self.h, self.h_at),
                                                 ("Hkv", self.kv, self.kv_at),
                                                 ("dh", self.dh, self.dh_at)) if v]
        return ", ".join(s) if s else "no head attributes"

    def check(self, h, kv, dh):
        for k, want, at, got in (("H", self.h, self.h_at, h), ("Hkv", self.kv, self.kv_at, kv),
                                 ("dh", self.dh, self.dh_at, dh)):
            if want is not None and want != got:
                raise _Skip(f"{k}={want} ({at}) contradicts the weights ({k}={got})")
        if kv < 1 or h < 1 or dh < 1 or h % kv:
            raise _Skip(f"H={h}, Hkv={kv}, dh={dh} do not form query groups")


_UNKNOWN = ("head count unknown: no head-count or head-dim attribute on the module, its "
            "config or its parents")


def _fused_heads(rows, o_in, hd):
    """(H, Hkv, dh, how) for a fused projection with rows = (H + 2 Hkv) dh."""
    o_ok = o_in is not None and 0 < o_in < rows
    if hd.dh:
        dh = hd.dh
        if rows % dh:
            raise _Skip(f"{rows} rows are not a multiple of dh={dh} ({hd.dh_at})")
        total = rows // dh
        if hd.h:
            h, how = hd.h, f"H: {hd.h_at}; dh: {hd.dh_at}"
        elif o_ok and o_in % dh == 0:
            h, how = o_in // dh, f"H: output projection input {o_in} / dh ({hd.dh_at})"
        elif hd.kv:
            h, how = total - 2 * hd.kv, f"H: rows / dh - 2 Hkv ({hd.kv_at}, {hd.dh_at})"
        elif total % 3 == 0:
            h, how = total // 3, f"H: rows / (3 dh) ({hd.dh_at}, no KV attribute: MHA)"
        else:
            raise _Skip(f"{rows} rows / dh={dh} = {total} heads do not split into q, k, v")
        if (total - h) % 2 or total <= h:
            raise _Skip(f"{rows} rows do not hold H={h} query heads of {dh} plus equal k, v")
        kv = hd.kv or (total - h) // 2
        hd.check(h, kv, dh)
        if (h + 2 * kv) * dh != rows:
            raise _Skip(f"{rows} rows != (H={h} + 2 Hkv={kv}) * dh={dh}")
        return h, kv, dh, how
    if hd.h:
        h = hd.h
        if o_ok and o_in % h == 0 and (rows - o_in) % (2 * (o_in // h)) == 0:
            dh = o_in // h
            kv = (rows - o_in) // (2 * dh)
            how = f"H: {hd.h_at}; dh, Hkv: output projection input {o_in}"
        elif hd.kv:
            if rows % (h + 2 * hd.kv):
                raise _Skip(f"{rows} rows do not split into (H={h} + 2 Hkv={hd.kv}) heads")
            kv, dh = hd.kv, rows // (h + 2 * hd.kv)
            how = f"H: {hd.h_at}; Hkv: {hd.kv_at}; dh: rows"
        else:
            if rows % (3 * h):
                raise _Skip(f"{rows} rows do not split into 3 x H={h} heads ({hd.h_at}; no KV "
                            "attribute and no output projection to tell GQA)")
            kv, dh = h, rows // (3 * h)
            how = f"H: {hd.h_at}; dh: rows / 3H (no KV attribute: MHA)"
        hd.check(h, kv, dh)
        return h, kv, dh, how
    if hd.kv and o_ok and (rows - o_in) % (2 * hd.kv) == 0:
        dh = (rows - o_in) // (2 * hd.kv)
        if dh and o_in % dh == 0:
            h = o_in // dh
            hd.check(h, hd.kv, dh)
            return h, hd.kv, dh, f"Hkv: {hd.kv_at}; H, dh: output projection input {o_in}"
    raise _Skip(f"{_UNKNOWN}, and {rows} fused rows do not determine it", unknown=True)


def _separate_heads(q_rows, k_rows, hd):
    if hd.dh:
        dh, how = hd.dh, f"dh: {hd.dh_at}"
        if q_rows % dh or k_rows % dh:
            raise _Skip(f"q rows {q_rows} / k rows {k_rows} are not multiples of dh={dh} "
                        f"({hd.dh_at})")
    elif hd.h:
        if q_rows % hd.h:
            raise _Skip(f"q rows {q_rows} are not a multiple of H={hd.h} ({hd.h_at})")
        dh, how = q_rows // hd.h, f"H: {hd.h_at}; dh: q rows / H"
    elif hd.kv:
        if k_rows % hd.kv:
            raise _Skip(f"k rows {k_rows} are not a multiple of Hkv={hd.kv} ({hd.kv_at})")
        dh, how = k_rows // hd.kv, f"Hkv: {hd.kv_at}; dh: k rows / Hkv"
    else:
        raise _Skip(f"{_UNKNOWN}, and q rows {q_rows}, k rows {k_rows} do not determine it",
                    unknown=True)
    if k_rows % dh or q_rows % dh:
        raise _Skip(f"q rows {q_rows}, k rows {k_rows} do not hold heads of dh={dh}")
    h, kv = q_rows // dh, k_rows // dh
    hd.check(h, kv, dh)
    return h, kv, dh, how


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


def _is_ssm(m, children):
    return any(n in children for n in _SSM_MARKS) or isinstance(getattr(m, "A_log", None),
                                                                torch.Tensor)


def _match_attention(name, m, modules, fallback):
    """(AttentionSpec with layer unset, how) for module m, None when m is not
    attention; raises _Skip when it is but cannot be used."""
    if isinstance(m, nn.MultiheadAttention):
        h, dh = m.num_heads, m.head_dim
        if m.in_proj_weight is not None:
            return AttentionSpec(-1, h, h, dh, _contiguous(lambda: m.in_proj_weight, h, h, dh),
                                 _join(name, "in_proj_weight")), "nn.MultiheadAttention.num_heads"
        return AttentionSpec(-1, h, h, dh, lambda: (m.q_proj_weight, m.k_proj_weight),
                             _join(name, "q/k_proj_weight")), "nn.MultiheadAttention.num_heads"
    children = dict(m.named_children())
    if not children or _is_ssm(m, children):
        return None
    for cname in _FUSED_GROUPED + _FUSED_CONTIGUOUS:
        if cname not in children:
            continue
        p = _proj_shape(children[cname])
        if p is None:
            continue
        rows, _, get = p
        o = next((_proj_shape(children[n]) for n in _OUT_PROJ if n in children
                  and _proj_shape(children[n]) is not None), None)
        hd = _Heads(_sources(name, m, modules), fallback)
        try:
            h, kv, dh, how = _fused_heads(rows, o[1] if o else None, hd)
        except _Skip as e:
            raise _Skip(f"fused {cname} ({rows} rows): {e}", e.unknown, (cname,)) from None
        kind = _grouped if cname in _FUSED_GROUPED else _contiguous
        return AttentionSpec(-1, h, kv, dh, kind(get, h, kv, dh), _join(name, cname)), how
    for qn, kn in _SEPARATE:
        if qn not in children or kn not in children:
            continue
        pq, pk = _proj_shape(children[qn]), _proj_shape(children[kn])
        if pq is None or pk is None:
            continue
        if pq[1] != pk[1]:
            raise _Skip(f"{qn} reads {pq[1]} inputs but {kn} reads {pk[1]}")
        hd = _Heads(_sources(name, m, modules), fallback)
        try:
            h, kv, dh, how = _separate_heads(pq[0], pk[0], hd)
        except _Skip as e:
            raise _Skip(f"{qn}/{kn}: {e}", e.unknown, (qn, kn)) from None
        return AttentionSpec(-1, h, kv, dh, lambda a=pq[2], b=pk[2]: (a(), b()),
                             _join(name, f"{qn}/{kn}")), how
    return None


def _find_attention(model, fallback, found):
    modules = dict(model.named_modules())
    specs, claimed = [], []
    for name, m in modules.items():
        if any(name.startswith(c + ".") or c == "" for c in claimed):
            continue
        try:
            r = _match_attention(name, m, modules, fallback)
        except _Skip as e:
            found.skipped.append(("attention", name, str(e), ATTENTION_FIX))
            if e.unknown and e.children:
                found.unknown_heads.append((found.skipped[-1], e.children))
            claimed.append(name)
            continue
        if r is not None:
            spec, how = r
            specs.append(spec)
            found.how[spec.name] = how
            claimed.append(name)
    return _number(specs), claimed


def find_attention(model, n_heads=None, n_kv_heads=None, head_dim=None):
    """AttentionSpecs of `model` (discover(): names, then the observed
    pass), by layer. Skipped modules: see discover()."""
    return discover(model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim).attention


# ---- routers --------------------------------------------------------------------------------

def _router_weight(c):
    """(holder module, [E, d] weight getter, E, d, inner name) of a
    router-named child module, or None."""
    p = _proj_shape(c) if not isinstance(c, (nn.ModuleList, nn.Sequential)) else None
    if p is not None:
        return c, p[2], p[0], p[1], ""
    kids = [(n, k) for n, k in c.named_children() if _proj_shape(k) is not None
            and not isinstance(k, (nn.ModuleList, nn.Sequential))]
    pick = next(((n, k) for n, k in kids if n in _ROUTER_INNER), None)
    if pick is None and len(kids) == 1:
        pick = kids[0]
    if pick is None:
        return None
    n, k = pick
    p = _proj_shape(k)
    return k, p[2], p[0], p[1], "." + n


def _has_experts(m, router_name):
    if getattr(m, "experts", None) is not None:
        return True
    for n, c in m.named_children():
        if n != router_name and "expert" in n.lower():
            return True
    return any(p.dim() == 3 for n, p in m.named_parameters(recurse=False) if n != router_name)


def _mlp_sibling(m, router_name, e, d):
    """Name of a sibling projection that makes the gate an MLP/GLU hidden
    layer: one with its shape (GLU up) or one reading e inputs (down)."""
    for n, c in m.named_children():
        if n == router_name:
            continue
        p = _proj_shape(c)
        if p is None:
            continue
        if (p[0], p[1]) == (e, d):
            return f"{n} has the same shape [{e}, {d}] (a GLU)"
        if p[1] == e:
            return f"{n} reads its {e} outputs (an MLP)"
    return None


def _router_candidates(m):
    for n, c in m.named_children():
        if n.lower() in _ROUTER_NAMES:
            r = _router_weight(c)
            if r is not None:
                yield n, r
    for n, p in m.named_parameters(recurse=False):
        if n.lower() in _ROUTER_NAMES and p.dim() == 2 and p.is_floating_point():
            yield n, (None, (lambda m=m, n=n: getattr(m, n)), p.shape[0], p.shape[1], "")


def _find_routers(model, top_k, found, claimed):
    modules = dict(model.named_modules())
    specs, done = [], []
    for name, m in modules.items():
        if any(name == c or name.startswith(c + ".") or c == "" for c in claimed + done):
            continue
        for cname, (holder, get, e, d, inner) in _router_candidates(m):
            rname = _join(name, cname + inner)
            experts = _has_experts(m, cname)
            if e < 2:
                found.not_routers.append((rname, f"{e} output (a scalar gate)"))
                continue
            cfgs = [(_join(name, c), v) for c, v in _configs(m)]
            n_exp, n_exp_at = _lookup([(rname, holder)] + [(name, m)] + cfgs, _EXPERTS_ATTRS)
            if n_exp is not None and n_exp != e:
                done.append(name)
                found.skipped.append(("router", rname, f"{e} rows but {n_exp} experts "
                                      f"({n_exp_at})", ROUTER_FIX))
                break
            if not experts:
                why = _mlp_sibling(m, cname, e, d)
                if why:
                    found.not_routers.append((rname, f"[{e}, {d}] weight where {why}"))
                    continue
                if e > d // 2:
                    found.not_routers.append((
                        rname, f"[{e}, {d}] weight with no experts beside it and more than d/2 "
                        f"outputs: a gating projection (if it is a router: {ROUTER_FIX})"))
                    continue
            near = [(rname, holder)] if holder is not None else []
            if holder is not None and inner:
                near.append((_join(name, cname), getattr(m, cname)))
            srcs = _sources(name, m, modules, near=near)
            k, k_at = _lookup(srcs[:len(near) + 1], _TOPK_LOCAL + _TOPK_ATTRS)
            if k is None:
                k, k_at = _lookup(srcs, _TOPK_ATTRS)
            if k is None and top_k:
                k, k_at = top_k, "Monitor(top_k=)"
            if k is None:
                k, k_at = DEFAULT_TOP_K, "default"
                found.notes.append((rname, f"top-k assumed {DEFAULT_TOP_K} (no top_k / "
                                    "num_experts_per_tok / moe_top_k attribute on the router, "
                                    "its module, their configs or parents)", TOPK_FIX))
            hook = holder if holder is not None else m
            if holder is None and e == d:
                hook = None  # its output [.., d] would read as logits
                found.notes.append((rname, "no token statistics: a parameter router whose "
                                    "module's output width equals E", ROUTER_FIX))
            bias = getattr(holder, "bias", None) if holder is not None else None
            bias = bias if isinstance(bias, torch.Tensor) else None
            specs.append(RouterSpec(-1, e, min(k, e), get, module=hook,
                                    bias=(lambda r=holder: r.bias) if bias is not None else None,
                                    name=rname))
            found.how[rname] = (f"E: weight rows; top-k: {k_at}; "
                                + ("experts beside it" if experts else "no experts container"))
            done.append(name)
            break
    return _number(specs)


def find_routers(model, top_k=None):
    """RouterSpecs for the MoE routers of `model` (module docstring)."""
    return discover(model, top_k=top_k).routers


# ---- observation (observe.py) and layer numbering -------------------------------------------

MLA_FIX = ("attention=[foreshock.AttentionSpec(layer, n_heads, n_kv_heads, head_dim, "
           "get=lambda: (Wq, Wk))] with Wq, Wk composed over one input space (e.g. "
           "q_b_proj.weight @ q_a_proj.weight, which leaves out the norm between them), or "
           "attention=[] to monitor none")


def _storage(t):
    if t is None:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError):
        try:
            return t.storage().data_ptr()
        except Exception:
            return None


def _rel(name, prefix):
    name = name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name
    return name[:-len(".weight")] if name.endswith(".weight") else name


def _site_name(site):
    if site.group:
        return site.group
    qn, kn = site.q_src.pname, site.k_src.pname
    qp, kp = qn.split("."), kn.split(".")
    common = []
    for a, b in zip(qp[:-1], kp[:-1]):
        if a != b:
            break
        common.append(a)
    prefix = ".".join(common)
    if qn == kn:
        if qn.endswith(".in_proj_weight") or qn == "in_proj_weight":
            return qn
        return qn[:-len(".weight")] if qn.endswith(".weight") else qn
    return _join(prefix, f"{_rel(qn, prefix)}/{_rel(kn, prefix)}")


def _mixed_text(site, prefix):
    q = sorted({_rel(s.pname, prefix) for s in site.q_srcs})
    k = sorted({_rel(s.pname, prefix) for s in site.k_srcs})
    return (f"low-rank / MLA-style attention ({site.n_heads} heads of {site.head_dim}): q comes "
            f"from {', '.join(q)} and k from {', '.join(k)}, so a head's Q/K product is not "
            "one Wq/Wk pair over one input (a latent projection, a norm and a shared rope key "
            "sit between); not monitored, not approximated")


def _obs_spec(site):
    return AttentionSpec(-1, site.n_heads, site.n_kv_heads, site.head_dim,
                         site.attention_getter(), _site_name(site))


def _same_weights(a, b):
    try:
        wa, wb = a.get(), b.get()
        return all(x.shape == y.shape and torch.equal(x.detach(), y.detach().to(x.device))
                   for x, y in zip(wa, wb))
    except Exception:
        return False


_NO_SOFTMAX = "q.k product without softmax (retention / linear attention)"
_ANYWAY = "pass attention=[foreshock.AttentionSpec(...)] to Monitor to monitor it anyway"


def _merge_attention(att, obs, found):
    """Names' specs confirmed, corrected or added to by the observed sites."""
    out = list(att)
    firsts = []
    for a in att:
        try:
            firsts.append(a.get()[0])
        except Exception:
            firsts.append(None)
    seen, warned, added = set(), set(), set()
    scored = {_storage(s.q_src.param) for s in obs.attention if s.q_src is not None}
    for site in getattr(obs, "unnormed", ()):
        # Positive evidence, not absence: the pass saw these q and k rows meet
        # in a product that then weighted the values with no softmax or exp
        # (retention, linear attention). A q/k pair whose score the pass never
        # saw (an opaque kernel: flash_attn_cuda, xformers ops) stays.
        params = {_storage(x.param) for x in site.q_srcs + site.k_srcs}
        for a in [a for a in out if _storage(_safe_q(a)) in params - scored]:
            out.remove(a)
            i = att.index(a)
            firsts[i] = None
            found.how.pop(a.name, None)
            found.not_attention.append((a.name, _NO_SOFTMAX, _ANYWAY))
        pnames = [x.pname for x in site.q_srcs + site.k_srcs]
        for sk in [x for x in found.skipped if x[0] == "attention" and any(
                _under(p, x[1]) for p in pnames)]:
            found.skipped.remove(sk)
            found.not_attention.append((sk[1], _NO_SOFTMAX, _ANYWAY))
    for site in obs.attention:
        if site.reason == _UNREAD:  # _unread_sites
            continue
        if site.reason is not None:
            if site.reason == "mixed":
                name = sorted({s.module for s in site.q_srcs + site.k_srcs})[0]
                name = _common_module([s.pname for s in site.q_srcs + site.k_srcs]) or name
                reason, fix = _mixed_text(site, name), MLA_FIX
            else:
                name = _common_module([s.pname for s in site.q_srcs + site.k_srcs]) or "(model)"
                reason, fix = f"observed attention score: {site.reason}", (
                    "attention=[foreshock.AttentionSpec(layer, n_heads, n_kv_heads, head_dim, "
                    "get=lambda: (Wq, Wk))] with Wq, Wk over one input space")
            params = {_storage(x.param) for x in site.q_srcs + site.k_srcs}
            gone = [a for a in out if _storage(_safe_q(a)) in params]
            for a in gone:
                out.remove(a)
                found.how.pop(a.name, None)
                name = a.name.split("/")[0].rpartition(".")[0] or name
            if name in warned:
                continue
            warned.add(name)
            found.skipped = [x for x in found.skipped  # the pass's reason replaces names'
                             if not (x[0] == "attention" and _under(name, x[1]))]
            found.skipped.append(("attention", name, reason, fix))
            continue
        spec = _obs_spec(site)
        desc = (f"observed ({site.via}): H={spec.n_heads} Hkv={spec.n_kv_heads} "
                f"dh={spec.head_dim} from the score's shapes, rows from the weights")
        now = _now(site.q_src)
        match = [i for i, w in enumerate(firsts) if i not in seen and
                 (_derives(w, site.q_src.param) or (now is not None and _derives(w, now)))]
        if match:
            i = match[0]
            seen.add(i)
            old = att[i]
            if (old.n_heads, old.n_kv_heads, old.head_dim) == (spec.n_heads, spec.n_kv_heads,
                                                                spec.head_dim) and \
                    _same_weights(old, spec):
                found.how[old.name] = (found.how.get(old.name, "") +
                                       "; confirmed by the observed pass").lstrip("; ")
                found.order[old.name] = site.order
                continue
            out[out.index(old)] = spec
            spec.name = old.name if old.name else spec.name
            found.corrections.append((spec.name, f"names gave H={old.n_heads} "
                                      f"Hkv={old.n_kv_heads} dh={old.head_dim} "
                                      f"({found.how.get(old.name, '')}); the observed pass "
                                      f"gives H={spec.n_heads} Hkv={spec.n_kv_heads} "
                                      f"dh={spec.head_dim} and its rows: observation used"))
            found.how[spec.name] = desc
            found.order[spec.name] = site.order
            continue
        pnames = [x.pname for x in site.q_srcs]
        found.skipped = [x for x in found.skipped if not (x[0] == "attention" and any(
            _under(pname, x[1]) for pname in pnames))]
        # the same name from names, or an observed site with the same weights: one;
        # observed sites on other slices of one stacked parameter (w_qkv[i] per
        # layer) are one attention each, in pass order (each its own layer)
        if any(a.name == spec.name and (id(a) not in added or _same_weights(a, spec))
               for a in out):
            continue
        added.add(id(spec))
        out.append(spec)
        found.how[spec.name] = desc
        found.order[spec.name] = site.order
    # A names' spec no observed site matched whose Wq is rows of a weight an
    # observed score read (GPT-2's cross-attention c_attn: [k; v] of the
    # encoder states, not a fused qkv): the pass saw what those rows do.
    read = [x.param for s in obs.attention if s.reason is None
            for x in list(s.q_srcs) + list(s.k_srcs)]
    for i, a in enumerate(att):
        if i in seen or a not in out or firsts[i] is None:
            continue
        hit = next((p for p in read if _derives(firsts[i], p)), None)
        if hit is None:
            continue
        out.remove(a)
        found.corrections.append((a.name, f"names gave H={a.n_heads} Hkv={a.n_kv_heads} "
                                  f"dh={a.head_dim} ({found.how.get(a.name, '')}); the "
                                  "observed pass saw its rows meet other weights' in its "
                                  "scores: observation used"))
        found.how.pop(a.name, None)
    return out


_NO_PRODUCT = ("observed: its outputs only reach ops the pass sees, and no two of them meet "
               "in a product (convolutions, FFT, gating): no attention")


def _unknown_not_attention(model, obs, found, scored_rule=True):
    """A fused projection (or a q and k pair) names took for attention but
    skipped (head count unknown) is no attention when the pass saw it run
    and saw where all its outputs went: only into ops it sees (none
    escaped to an opaque kernel, which could be attention the pass cannot
    see), and either never two of them into one matmul/einsum/SDPA (no
    q.k product), or, as names' q/k pairs are disproved
    (_unscored_not_attention, the same DTensor guard: scored_rule),
    products of them that formed no score: the pass's bookkeeping never
    failed and no score, retention product or unread product that reached
    a softmax or exp read the weight (vector attention: an MLP of
    q_i - k_j, its softmax-weighted values summed by an einsum). Its
    warning becomes a line under "not attention"."""
    modules = dict(model.named_modules())
    escaped, met = getattr(obs, "escaped", None), getattr(obs, "met", None)
    if escaped is None or met is None:
        return
    read = None  # storages of weights a score or a softmax'd product read
    if scored_rule and not getattr(obs, "failures", 1) and \
            getattr(obs, "normed", None) is not None:
        read = {_storage(x.param) for site in obs.attention + obs.unnormed
                for x in site.q_srcs + site.k_srcs}
        read |= {_storage(obs.sources[i].param) for pr in obs.normed for side in pr
                 for i in side if isinstance(i, int) and 0 <= i < len(obs.sources)}
    # a skip the observed pass has since replaced is no longer in skipped
    for sk, names in [(x, n) for x, n in found.unknown_heads if x in found.skipped]:
        m = modules.get(sk[1])
        children = [getattr(m, n, None) for n in names] if m else []
        keys = [_storage(p[2]()) for p in (_proj_shape(c) if isinstance(c, nn.Module) else None
                                           for c in children) if p]
        if not keys:
            continue
        # Every named projection (the fused one, or q and k) is judged; one
        # the pass did not see run, or whose output escaped or fed a score,
        # keeps the warning.
        idx, ok = set(), True
        for key in keys:
            i = {s.index for s in obs.sources if _storage(s.param) == key}
            if not i or i & escaped or (i & met and (read is None or key in read)):
                ok = False
            idx |= i
        if not ok:
            continue
        found.skipped.remove(sk)
        found.not_attention.append((sk[1], _NO_SCORE if idx & met else _NO_PRODUCT,
                                    "if it is attention, pass "
                                    "attention=[foreshock.AttentionSpec(...)] to Monitor"))


_UNREAD = "unread"  # observe.UNREAD
_UNREAD_FIX = ("attention=[foreshock.AttentionSpec(layer, n_heads, n_kv_heads, head_dim, "
               "get=lambda: (Wq, Wk))] with the Wq rows a head reads (an expert's, or their "
               "mean), or attention=[] to monitor none")


def _unread_sites(att, obs, found):
    """Scores whose one side the labels could not read (observe._unread):
    a query built per token from routed expert projections (JetMoE's
    mixture of attention heads) has no fixed Wq rows, so the site is named
    in Discovery.skipped, under the module holding the labelled side's
    weight. When names' attention reads that weight (keys through a
    convolution over time, queries plain), names' spec stands, unwarned."""
    held = set()
    for a in att:
        try:
            held |= {_storage(w) for w in a.get()}
        except Exception:
            pass
    for site in obs.attention:
        if site.reason != _UNREAD:
            continue
        side = site.q_srcs or site.k_srcs
        if not side or any(_storage(x.param) in held for x in side):
            continue
        mod = _common_module([x.pname for x in side])
        name = mod.rpartition(".")[0] or mod or "(model)"
        if any(x[0] == "attention" and _under(name, x[1]) for x in found.skipped):
            continue
        which, other = ("query", "key") if site.q_srcs else ("key", "query")
        rel = ", ".join(sorted({_rel(x.pname, name) for x in side}))
        found.skipped.append(("attention", name, (
            f"observed attention score (softmax over keys, dh={site.head_dim}): its {which} "
            f"is {rel}'s rows, but its {other} is no fixed weight's rows (built per token by "
            "ops the labels cannot follow, e.g. routed expert projections put back by "
            "index_add); not monitored, not approximated"), _UNREAD_FIX))


_NO_SCORE = ("observed: the pass ran, q and k reached only ops it sees, and no score of them "
             "(q.k^T then softmax over keys) formed: no attention (random-feature or kernel "
             "attention)")


def _unscored_not_attention(att, obs, found):
    """Names' q/k pairs the observed pass disproves. A pair stays when the
    pass could have missed its score: some of q's or k's values left the
    ops the pass sees (a CUDA kernel, a C++ extension: Observation.escaped),
    a value derived from q met one derived from k in a product that went on
    to a softmax or exp without the labels reading it (Observation.normed:
    keys through a convolution over time), the pass never reached the
    weights, or some op's bookkeeping failed. Otherwise (FAVOR+: q and k
    into random-feature maps, then products with no softmax over keys; an
    attention-style router's softmax over its E outputs) it is no attention
    and moves under "not attention", with no warning. Returns the specs
    kept."""
    if getattr(obs, "failures", 1) or getattr(obs, "normed", None) is None:
        return att
    seen = {}
    for s in obs.sources:
        seen.setdefault(_storage(s.param), set()).add(s.index)
    scored = {_storage(x.param) for site in obs.attention for x in site.q_srcs + site.k_srcs}
    scored |= {_storage(x.param) for site in obs.unnormed for x in site.q_srcs + site.k_srcs}
    keep = []
    for a in att:
        try:
            wq, wk = a.get()
            kq, kk = _storage(wq), _storage(wk)
        except Exception:
            keep.append(a)
            continue
        qi, ki = seen.get(kq, set()), seen.get(kk, set())
        if not qi or not ki or kq in scored or kk in scored or (qi | ki) & obs.escaped or any(
                (qi & x and ki & y) or (qi & y and ki & x) for x, y in obs.normed):
            keep.append(a)
            continue
        found.how.pop(a.name, None)
        found.not_attention.append((a.name, _NO_SCORE, _ANYWAY))
    return keep


def _derives(w, param):
    """Whether names' Wq w is (a view or a copy of) rows of param."""
    if w is None or w.dim() != 2 or w.shape[0] == 0:
        return False
    if _storage(w) == _storage(param):
        return True
    p = param.detach()
    if p.numel() % w.shape[-1]:
        return False
    try:
        rows = p.reshape(-1, w.shape[-1])
        return bool((rows == w[:1].detach().to(rows.device)).all(-1).any())
    except Exception:
        return False


def _now(src):
    """A computed source's weight now (effective.py: LoRA's W + scale B A, a
    parametrization): names' getter gives a fresh tensor of these values."""
    if src.fresh is None:
        return None
    try:
        return src.current()
    except Exception:
        return None


def _safe_q(spec):
    try:
        return spec.get()[0]
    except Exception:
        return None


def _under(pname, module):
    return module == "" or pname == module or pname.startswith(module + ".")


def _router_module(model, src):
    modules = dict(model.named_modules())
    owner = modules.get(src.module)
    leaf = src.pname.rpartition(".")[2]
    if owner is not None and getattr(owner, leaf, None) is src.param and leaf == "weight" \
            and isinstance(owner, nn.Linear):
        b = owner.bias
        if not isinstance(b, torch.Tensor):
            return owner, None
        if src.chunk_of is None:
            return owner, (lambda m=owner: m.bias)
        # one chunk of the weight's rows (a noisy gate's logits half): its bias rows
        rows = [o // src.param.stride(0) for o in src.row_off]
        a, z = rows[0], rows[-1] + 1
        return owner, (lambda m=owner: m.bias[a:z])
    if src.rows == src.width:
        return None, None
    return owner, None


def _merge_routers(model, rts, obs, found, top_k):
    out = list(rts)
    by_param = {}
    for r in rts:
        try:
            by_param[_storage(r.get())] = r
        except Exception:
            pass
    routed = set()
    factors = {}  # storage of a projection a router's weight is composed with -> the router
    for site in obs.routers:
        src = site.src
        key = _storage(src.param)
        routed.add(key)
        old = by_param.get(key)
        if old is not None and src.chunk_of is not None:
            # names took the whole weight; the pass routes on one chunk of its rows
            out.remove(old)
            found.how.pop(old.name, None)
            old = None
        now = _now(src)
        if old is None and now is not None:  # a computed router weight: by value
            old = next((r for r in rts if _same_router(r, now)), None)
        k = min(site.top_k, site.used_k) if site.used_k else site.top_k
        if old is not None and getattr(src, "after", None) and old.n_experts == src.rows:
            # names' weight multiplies another projection's whole output: the
            # router's map from the input features is the product (as below)
            old.get = src.full_getter()
            factors[_storage(src.after.param)] = old.name
            found.how[old.name] = (found.how.get(old.name, "") + f"; times {src.after.pname}, "
                                   "whose outputs it multiplies (observed)").lstrip("; ")
        if old is not None:
            if old.n_experts == src.rows and old.top_k == k:
                found.how[old.name] = (found.how.get(old.name, "") +
                                       "; confirmed by the observed pass").lstrip("; ")
            elif old.n_experts == src.rows and "top-k: default" in found.how.get(old.name, ""):
                old.top_k = min(k, src.rows)
                found.how[old.name] = found.how[old.name].replace(
                    "top-k: default", "top-k: the observed topk's k")
            else:
                found.corrections.append((old.name, f"names gave E={old.n_experts} "
                                          f"top-{old.top_k}; the observed pass gives "
                                          f"E={src.rows} top-{k}: observation used"))
                old.n_experts, old.top_k = src.rows, min(k, src.rows)
                found.how[old.name] = f"observed: E from the top-k's width, top-k from its k"
            if not getattr(src, "after", None) and not _router_shaped(old, src):
                # the weight as the pass used it: a raw [d, E] parameter in
                # x @ w_gate is read [E, d] (its columns), as the Monitor hooks it
                old.get = src.getter(list(range(src.rows)))
                found.how[old.name] = (found.how.get(old.name, "") +
                                       "; its [E, d] rows as the pass read them").lstrip("; ")
            found.notes = [n for n in found.notes if not (n[0] == old.name and
                                                          "top-k assumed" in n[1])]
            continue
        name = src.pname[:-len(".weight")] if src.pname.endswith(".weight") else src.pname
        hook, bias = _router_module(model, src)
        get = src.full_getter() if hasattr(src, "full_getter") else \
            src.getter(list(range(src.rows)))
        if getattr(src, "after", None):
            factors[_storage(src.after.param)] = name
        spec = RouterSpec(-1, src.rows, min(k, src.rows), get, module=hook, bias=bias,
                          name=name)
        if hook is None:
            found.notes.append((name, "no token statistics: a parameter router whose "
                                "module's output width equals E", ROUTER_FIX))
        found.not_routers = [n for n in found.not_routers if n[0] != name]
        found.skipped = [x for x in found.skipped if not (x[0] == "router" and x[1] == name)]
        out.append(spec)
        found.how[name] = (f"observed: {site.normed + ' then ' if site.normed else ''}"
                           f"{'argmax' if k == 1 else 'topk'} over its {src.rows} outputs, "
                           "indices used to dispatch" + (
                               f"; the weight times {src.after.pname}, whose outputs it "
                               "multiplies" if getattr(src, "after", None) else ""))
    used = {_storage(s.param) for s in obs.sources}
    keep = []
    for r in out:
        try:
            key = _storage(r.get())
        except Exception:
            key = None
        if key in factors and key not in routed:
            found.not_routers.append((r.name, "observed: the first factor of router "
                                      f"{factors[key]}'s weight (its outputs are that "
                                      "router's input; reported composed)"))
            found.notes = [n for n in found.notes if n[0] != r.name]
            found.how.pop(r.name, None)
            continue
        if key in used and key not in routed:
            found.not_routers.append((r.name, "observed: its outputs reach no topk/argmax "
                                      "that dispatches tokens (a gate, not a router)"))
            found.notes = [n for n in found.notes if n[0] != r.name]
            found.how.pop(r.name, None)
            continue
        keep.append(r)
    return keep


def _router_shaped(spec, src):
    """Whether spec.get() is the [E, width] map src's pass read."""
    try:
        return tuple(spec.get().shape) == (src.rows, src.width)
    except Exception:
        return False


def _same_router(spec, w):
    try:
        g = spec.get()
        return g.shape == w.shape and torch.equal(g.detach(), w.detach().to(g.device))
    except Exception:
        return False


def _block_key(path, modules):
    parts = path.split(".") if path else []
    if parts and parts[0].isdigit() and isinstance(modules.get(""), (nn.ModuleList,
                                                                     nn.Sequential)):
        return parts[0]
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if parts[i].isdigit() and isinstance(modules.get(prefix), (nn.ModuleList,
                                                                     nn.Sequential)):
            return f"{prefix}.{parts[i]}"
    return None


def _nested_kinds(kinds, slots, modules):
    """(list, class) of the block classes a site-holding block wraps: a
    hybrid layer that wraps a Mamba layer of the class its list's other
    entries have (Zamba's ZambaHybridLayer: shared attention, then a
    ZambaMambaDecoderLayer) makes those entries blocks too. Only composite
    classes of the model's own (with submodules; not torch.nn's)."""
    out = set()
    for k in slots:
        m = modules.get(k)
        head = k.rpartition(".")[0]
        if m is None or (head, type(m)) not in kinds:
            continue
        for sub in m.modules():
            if sub is m or type(sub).__module__.startswith("torch.") or \
                    next(sub.children(), None) is None:
                continue
            out.add((head, type(sub)))
    return out


def _number_blocks(model, att, rts, skipped=()):
    """Layer = block index: the outermost ModuleList/Sequential entry a spec
    lives in, counted over the entries that hold one, in module order
    (encoder blocks before decoder blocks,
    each distinct); a block's attention and router share it. A block with a
    second attention (a decoder's cross-attention) takes one more index for
    it, so that every attention has a layer of its own (the daemon keys
    per-head series by layer and head); the blocks after it shift by one."""
    modules = dict(model.named_modules())
    order = {n: i for i, n in enumerate(modules)}
    specs = list(att) + list(rts)
    paths = [s.name.split("/")[0] for s in specs]
    keys = [_block_key(p, modules) for p in paths]
    if not any(k is not None for k in keys):
        _number(att)
        _number(rts)
        return
    for i, (p, k) in enumerate(zip(paths, keys)):
        if k is None:
            parts = p.split(".")
            keys[i] = parts[0] if len(parts) > 1 else ""

    # Blocks are the entries that hold a monitored site: x-transformers'
    # list interleaves attention and feed-forward entries, an nn.Sequential
    # model holds its embedding and head beside the blocks.
    slots = set(keys)
    for name in skipped:  # a skipped attention (MLA) still makes its entry a block
        k = _block_key(name, modules)
        if k is not None:
            slots.add(k)

    # A hybrid's blocks without a monitored site (Mamba or recurrent blocks
    # of the same block class as its attention blocks) keep their place:
    # layer = index in the block list. Generic containers (x-transformers'
    # ModuleList entries) are not a block class.
    kinds = {(k.rpartition(".")[0], type(modules[k])) for k in slots
             if k in modules and "." in k
             and not isinstance(modules[k], (nn.ModuleList, nn.Sequential))}
    kinds |= _nested_kinds(kinds, slots, modules)
    for n, m in modules.items():
        head, _, tail = n.rpartition(".")
        if tail.isdigit() and (head, type(m)) in kinds and \
                isinstance(modules.get(head), (nn.ModuleList, nn.Sequential)):
            slots.add(n)

    def rank(k):
        i = order.get(k)
        if i is None:
            i = min((v for n, v in order.items() if n.startswith(k + ".")), default=len(order))
        return (i, k)
    n_att = {}
    for s, k in zip(specs, keys):
        if isinstance(s, AttentionSpec):
            n_att[k] = n_att.get(k, 0) + 1
    base, nxt = {}, 0
    for k in sorted(slots, key=rank):
        base[k] = nxt
        nxt += max(1, n_att.get(k, 0))
    used = {}
    for s, k in zip(specs, keys):
        if isinstance(s, AttentionSpec):
            s.layer = base[k] + used.get(k, 0)
            used[k] = used.get(k, 0) + 1
        else:
            s.layer = base[k]


def discover(model, attention=None, routers=None, layers=None, n_heads=None, n_kv_heads=None,
             head_dim=None, top_k=None, example_input=None, observe=True):
    """Discovery of `model`: attention / routers given (lists of specs) are
    kept as they are; None discovers them: by names (module docstring), then
    by one observed forward pass (observe.py) with example_input (a tensor,
    a tuple of arguments or a dict of keyword arguments) or a probe batch,
    which confirms, corrects and adds to what names found. observe=False
    uses names only; an observe.Observation uses that pass. `layers` keeps
    only those layer indices. .summary() says what, what not and why;
    .log() logs it once."""
    from . import observe as obs_mod
    found = Discovery()
    att, claimed = _find_attention(model, (n_heads, n_kv_heads, head_dim), found)
    rts = (_find_routers(model, top_k, found, claimed) if routers is None else list(routers))
    obs = None
    if attention is None or routers is None:
        if isinstance(observe, obs_mod.Observation):
            obs = observe
        elif observe:
            obs = obs_mod.observe(model, example_input)
    found.observation = obs
    if obs is not None and obs.error is None:
        try:
            att2 = _merge_attention(att, obs, found) if attention is None else att
            rts2 = _merge_routers(model, rts, obs, found, top_k) if routers is None else rts
            att, rts = att2, rts2
        except Exception as e:  # discovery must not fail on a model it cannot read
            obs.error = f"its result could not be merged ({type(e).__name__}: {e})"
    if obs is not None and obs.error is None and attention is None:
        try:
            # Not over DTensor weights: tensor parallelism redistributes q
            # and k between the ops the pass sees (to_local/from_local) and
            # their score was never observed: a tensor-parallel LLaMA lost
            # every attention to this rule.
            from . import dtensor as _dt
            sharded = _dt.has_dtensors(model)
        except Exception:  # keep names' pairs
            sharded = True
        try:
            _unknown_not_attention(model, obs, found, scored_rule=not sharded)
        except Exception:  # keep the warning
            pass
        try:
            if not sharded:
                att = _unscored_not_attention(att, obs, found)
        except Exception:  # keep names' pairs
            pass
        try:
            _unread_sites(att, obs, found)
        except Exception:  # nothing to warn of
            pass
    if attention is not None:
        att = list(attention)
        found.attention_given = True
        found.skipped = [s for s in found.skipped if s[0] != "attention"]
    else:
        att = [a for a in att]
    if routers is not None:
        found.routers_given = True
        found.skipped = [s for s in found.skipped if s[0] != "router"]
        found.notes = [n for n in found.notes if n[2] != TOPK_FIX]
    att.sort(key=lambda a: found.order.get(a.name, float("inf")))
    held = [n for kind, n, _, _ in found.skipped]
    if attention is None and routers is None:
        _number_blocks(model, att, rts, held)
    elif attention is None:
        _number_blocks(model, att, [], held)
    elif routers is None:
        _number_blocks(model, [], rts, held)
    if attention is None:
        att.sort(key=lambda a: (a.layer, a.head_offset))
    if routers is None:
        rts.sort(key=lambda r: r.layer)
    if layers is not None:
        keep = set(layers)
        found.layers = keep
        found.before_filter = (len(att), len(rts))
        att = [a for a in att if a.layer in keep]
        rts = [r for r in rts if r.layer in keep]
    found.attention, found.routers = att, rts
    return found
