"""Discovery by observation: one forward pass, watched op by op.

layouts.py finds attention and routers by module and attribute names. This
module finds them by what the model computes, whatever the names: it runs
one forward pass under a torch function mode (torch.overrides.
TorchFunctionMode, torch 1.13 and 2.x) and follows the output of every
projection weight to the attention score and to the router's top-k.

Projections. A weight is a parameter of the model (or a view of one: a
slice of a fused in_proj_weight, a transpose) used as
  F.linear(x, W)             output feature i reads W[i, :]
  x @ W, mm/addmm(.., W)     output feature i reads W[:, i]
  einsum("..d,dhk->..hk")    output features: W's axes that reach the
                             output (in the output's order), input: its
                             one contracted axis
  conv1d/2d/3d, kernel 1x1,  output channel i reads W[i, :, 0, ..]
  groups 1                   (to_qkv = nn.Conv2d(dim, 3 * inner, 1))
A tensor the forward computes from parameters alone (F.normalize(wg), a
cast, w * s: _Recipe) is a computed weight, recomputed at each get(); a
router weight multiplying another projection's whole output is reported
composed with it (Source.after, Source.full_getter).
A computed weight is a projection weight too (effective.py): the value a
parametrization gave this forward (the pass runs inside
parametrize.cached(), so F.linear gets that one tensor), or the one an
old-style weight_norm / spectral_norm hook set; its Source recomputes it
at each get(). LoRA: the base weight's Source reads W + scale * B @ A,
and the adapters' A and B are no projections (B(A(x)) carries no labels,
so base(x) + B(A(x)) keeps the base's).
Each output feature is labelled with its weight and its row (a "shadow":
an integer tensor of the output's shape, expanded, so it costs no memory
until a copy needs it). Every layout op (view, reshape, transpose,
permute, chunk, split, unbind, indexing, cat, expand, repeat_interleave,
flatten, ...) is applied to the shadow too; an elementwise op (scaling, a
norm over head_dim, rotary's x*cos + rotate_half(x)*sin, dtype changes)
keeps its first labelled operand's shadow (and when it combines two
different rows of one weight, the pair is kept: a rotation written as
(x1 c - x2 s, x1 s + x2 c) labels both halves x1, and a head that then
reads a row twice gets its one missing partner back). So at the score
every q and k element says which weight row it came from.

Attention score. matmul/bmm/baddbmm/einsum of two labelled operands,
contracting q's last axis with k's, whose labels do not vary along the
token axes, and whose result then goes through softmax over its key axis
or its query axis (Slot Attention), as the product's shapes or einsum
subscripts placed them and layout ops then moved them (_score_axes: time-
first [i, j, b, n] scores softmax'd over dim 1; when a reshape merged one
away, either of the last two), or exp (an online or
scatter softmax written out; scaling, masks, padding, dtype changes, and
a Linear or convolution of the score alone (talking heads, Multi-Token
Attention's conv) in between are followed: _carry_score); or q * k of
rows picked by index tensors (or broadcast against each other) summed
over the head dimension (a graph's per-edge (q[dst] * k[src]).sum(-1):
_pair_product, _dot_sum); or the q and k
of F.scaled_dot_product_attention (enable_gqa too); or the in-projection
of F.multi_head_attention_forward (its num_heads and weights). A q.k
product that instead weights the values (score @ v) before any softmax or
exp confirmed it, and never is confirmed, is retention / linear attention:
Observation.unnormed (discover() drops names' q/k pair for it). A product
the labels cannot read (one side unlabelled, or labels varying along the
token axis) that still reaches a softmax or exp is kept in
Observation.normed (names' pair for it stays); one whose one side is a
head-split projection and the other unlabelled is a site of reason UNREAD
(layouts.py warns of it: JetMoE's routed queries). From it:
query heads H = distinct q row lists, KV heads Hkv = distinct k row lists
(k broadcast, expanded or repeat_interleave'd to the query heads is seen
as such), head_dim = the contracted length, and each head's exact Wq / Wk
rows, ordered by the position they meet at in the dot product.

Where values go. Every op seen passes on which sources its inputs derive
from (whatever the op: convolutions and FFTs too). Observation.escaped: the
sources some value derived from left the seen ops (taken by no op the pass
saw and not returned, e.g. the input of a C++ or numpy kernel, or read out
by numpy()/tolist()); Observation.met: the sources two values derived from
met in one matmul/bmm/einsum/SDPA. A source in neither is no q.k product
(discover() drops names' head-count-unknown warning for it).

Routers. A projection whose output's last axis is all E rows of one
weight, in order (or one of equal chunks of them: a noisy gate's
Linear(d, 2E) chunked into E logits and E noise scales routes on the
logits' rows), reaching topk over that axis (k = its k), argmax, topk(k=1)
or max(dim) (top-1; each further one over the logits with the first choice
masked or scattered away adds one), a sort whose first k < E indices are
used, multinomial (k = its samples), or a threshold at the router's own
kthvalue over that axis (probs >= probs.kthvalue(E - k + 1): k; with >,
kthvalue(E - k)) whose mask is then used, after any softmax, sigmoid, bias
or mask, and whose indices are then used (one-hot, indexed with, a
comparison's mask that then selects or weights: dispatch; a comparison
only reduced to a count or mean, a top-k accuracy, is none; a cast or copy
on the way, .long()/.int()/.to()/.type()/.clone()/.contiguous()/.detach(),
is no use and carries the indices on;
argsort counts as sort; indices no seen op takes and the forward does
not return went to a scripted or C++ function: used; indices whose every
use ends in a value kept on a module and not returned, an accuracy metric,
chose no experts). softmax(q k^T) @ v over one projection's E outputs (an
attention-style router, Yuan2-M32) keeps v's labels: output i is still
expert i's. A gate whose
output never reaches a topk/argmax (a per-head output gate Linear(d, H),
a SwiGLU gate) is not a router.

Cost and side effects. One forward pass under torch.no_grad(), with the
caller's example input or a probe batch (observe() builds one: token ids
[1, 8] when the model has an embedding, else [1, 8, d] or an image for a
first Conv2d (its side from img_size/image_size, else from a learned
position embedding's grid), channel-first floats [1, C, T] for a first
Conv1d, with token ids or one integer per example for further required
arguments; then other input widths of its Linear/LayerNorm modules for
an input narrower than the model or a second float input), plus the shadows' bookkeeping. Nothing of it stays: the
torch and CUDA RNG states are restored, every buffer (BatchNorm running
statistics, counters, caches kept as buffers) is copied back, train/eval
mode is left as it is, use_cache=False is passed when forward takes it,
and the mode is popped. Hooks the user registered do run once more.
"""
import contextlib
import inspect
import itertools
import sys
import weakref

import torch
import torch.nn as nn

from . import effective

# What torch's Module raises when a class defines no forward (every version
# in use: 'Module [Name] is missing the required "forward" function').
_MISSING_FORWARD = 'missing the required "forward" function'

try:
    from torch.overrides import TorchFunctionMode
except ImportError:  # torch < 1.13
    TorchFunctionMode = None

_ATTR = "_foreshock_obs"    # the per-tensor label dict during the pass
_FLOW = "_foreshock_flow"   # per tensor: [sources it derives from, used by a seen op]
_VIEWS = "_foreshock_views"  # per base tensor: the flow records of its views the mode saw
_PROD = "_foreshock_prod"   # per tensor: products of two values it derives from (_products)
_NONE = -1                  # shadow value of a position no projection wrote
_SHIFT = 32                 # shadow value = source << 32 | row

_LAYOUT = {
    "view", "reshape", "transpose", "permute", "contiguous", "__getitem__", "chunk", "split",
    "unbind", "tensor_split", "narrow", "flatten", "unflatten", "squeeze", "unsqueeze",
    "expand", "repeat", "repeat_interleave", "movedim", "moveaxis", "swapaxes", "swapdims",
    "t", "T", "mT", "select", "index_select", "gather", "roll", "flip", "view_as",
    "reshape_as", "expand_as", "clone", "detach", "split_with_sizes", "unsafe_split",
    "unsafe_chunk", "take_along_dim", "tile", "broadcast_to",
}
_STACK = {"cat", "concat", "concatenate", "stack", "hstack", "vstack"}
_SAME = {"to", "float", "half", "bfloat16", "double", "type_as", "type", "cuda", "cpu",
         "requires_grad_", "detach_", "contiguous", "long", "int", "short", "byte", "char"}
# dtype casts and copies are no use of top-k indices: the copy carries the
# router's tags on to its dispatch (MegaBlocks casts its indices to int32
# before sorting them; a cast before the [..., :k] slice keeps k the slice's)
_NOT_ELEMENTWISE = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm",
                    "einsum", "linear", "conv1d", "conv2d", "conv3d", "bilinear", "cumsum",
                    "cumprod", "sort", "argsort", "topk", "argmax", "argmin", "max", "min",
                    "sum", "mean", "softmax", "log_softmax", "scaled_dot_product_attention",
                    "multi_head_attention_forward", "embedding", "outer", "kron", "dot",
                    "tensordot", "matrix_power", "cross", "fft", "view_as_complex",
                    "view_as_real", "scatter", "scatter_add", "index_add"}
_SCORE_OPS = {"matmul", "__matmul__", "bmm", "baddbmm", "einsum"}
_MUL = {"mul", "__mul__", "__rmul__", "multiply"}
_GATHER = {"__getitem__", "index_select", "gather", "take_along_dim"}  # rows picked by index
_MAX_PAIRS = 4096           # distinct (q row, k row) pairs a summed product may hold
_RECENT = 32                # labelled tensors kept to find rows an unseen indexing took
_MAX_MATCH = 1 << 22        # (rows x rows) compared to find them (_unseen_rows)
_MAX_VIAS = 16              # labelled views of one base kept for views the mode missed (_set)
# Ops a score may pass through on its way to the softmax, beside layout and elementwise
# ops: a Linear or convolution over it (talking heads mix the heads' logits, Multi-Token
# Attention convolves each head's (query, key) plane) and padding (_carry_score)
_SCORE_CARRY = {"linear", "conv1d", "conv2d", "conv3d", "pad", "_pad", "constant_pad_nd"}
UNREAD = "unread"           # Site.reason: a score whose q or k the labels cannot read
_CARRIED = ("score", "normed", "act", "ridx", "rdim", "kth", "rmask")  # tags layout ops carry
# (and "saxes", a score's (query axis, key axis), which a layout op may move: _score_axes)
# Top-k indices compared (idx == e, idx.eq(labels), isin) are a mask, no use yet: the mask
# dispatches when an op selects or weights by it (x[mask], where, nonzero, mask * w); these
# ops pass it on (a sum or mean over some axes too), and a count or mean of all of it
# (top-k accuracy: .any(-1).float().mean()) is a statistic, no dispatch (_mask_use)
_MASK_MAKE = {"eq", "__eq__", "ne", "__ne__", "isin"}
_MASK_PASS = _MASK_MAKE | {"any", "all", "logical_and", "logical_or", "logical_not",
                           "logical_xor", "__and__", "__or__", "__xor__", "__invert__",
                           "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor"}
_MASK_STAT = {"sum", "mean", "count_nonzero", "nansum", "nanmean"}
# x >= t / x > t (and t <= x / t < x): a threshold; True when x is the larger side first
_COMPARE = {"ge": True, "__ge__": True, "gt": True, "__gt__": True,
            "le": False, "__le__": False, "lt": False, "__lt__": False}
_PROBE_WIDTHS = 4           # input widths a probe batch tries (the model's, then others)
_PROBE_LONG = 400           # time steps of a channel-first probe (a strided conv front end)
_MAX_MIXES = 4096            # elementwise ops whose label pairs are kept (rotary repair)
_ROUTER_MAX_E = 4096        # a topk over more outputs than this is not routing
# Ops that read a tensor's metadata or one scalar of it, not its values: no escape.
_META = {"size", "dim", "ndim", "numel", "nelement", "shape", "stride", "__len__", "dtype",
         "device", "layout", "is_contiguous", "requires_grad", "is_floating_point",
         "is_complex", "element_size", "storage_offset", "is_cuda", "is_leaf", "item",
         "__bool__", "__int__", "__float__", "__index__", "__repr__", "__format__", "__hash__",
         "names", "grad_fn", "_version", "is_sparse", "is_quantized", "is_meta"}
_PRODUCTS = _SCORE_OPS | {"scaled_dot_product_attention"}
# A topk over activations (a k-sparse MLP's relu(W x)) selects features, not experts.
_ACTIVATIONS = {"relu", "relu_", "gelu", "silu", "silu_", "tanh", "softplus", "leaky_relu",
                "elu", "mish", "hardtanh", "relu6", "selu", "celu", "glu", "square"}


def _custom_op(func):
    """True for an operator registered outside torch (torch.library: a
    namespace other than aten/prims, or a custom_op): the pass sees its
    inputs and outputs, nothing inside."""
    ops = getattr(torch, "_ops", None)
    kinds = tuple(k for k in (getattr(ops, "OpOverloadPacket", None),
                              getattr(ops, "OpOverload", None)) if k is not None)
    if kinds and isinstance(func, kinds):
        ns = getattr(func, "namespace", None) or getattr(func, "_qualified_op_name", "")
        if not ns and callable(getattr(func, "name", None)):
            ns = func.name()
        return str(ns).split("::")[0] not in ("aten", "prims", "")
    return type(func).__name__ == "CustomOpDef"


def _unpack(sh, n):
    """The n slices of labels sh along the first axis (after the batch
    axis) of size n whose slices differ (q, k, v stacked: flash-attn's
    qkvpacked [B, T, 3, H, D], unpadded [total, 3, H, D]); None if none."""
    for ax in range(1, sh.dim() - 1):
        if sh.shape[ax] != n:
            continue
        parts = sh.unbind(ax)
        if not any(torch.equal(parts[0], p) for p in parts[1:]):
            return parts
    return None


def _heads_4d(sh):
    """Labels of q or k as 4-D [B, *, *, D]: unpadded [total, H, D] gets a
    batch axis, BMGHK [B, M, G, H, K] merges G and H; None otherwise."""
    if sh is None:
        return None
    if sh.dim() == 3:
        return sh.unsqueeze(0)
    if sh.dim() == 5:
        return sh.reshape(sh.shape[0], sh.shape[1], sh.shape[2] * sh.shape[3], sh.shape[4])
    return sh if sh.dim() == 4 else None


def _fname(func):
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _tag(t):
    return getattr(t, _ATTR, None) if isinstance(t, torch.Tensor) else None


def _set(t, **kw):
    if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter):
        return
    d = getattr(t, _ATTR, None)
    if d is None:
        d = {}
        try:
            setattr(t, _ATTR, d)
        except (AttributeError, RuntimeError):
            return
    d.update(kw)
    base = t._base if "sh" in kw else None
    if base is not None and not isinstance(base, nn.Parameter):
        # torch 1.13's F.linear on [B, T, d] returns a view of a [B*T, out]
        # result: views taken from it later (qkv[0], unseen by the mode) have
        # that result as _base. The base keeps its labelled views, in the
        # order labelled (_shadow reads its labels from all of them: the
        # last, k.transpose(-2, -1) of qkv[1], covers only k's positions).
        bd = getattr(base, _ATTR, None)
        if bd is None:
            bd = {}
            try:
                setattr(base, _ATTR, bd)
            except (AttributeError, RuntimeError, TypeError):
                return
        if "sh" not in bd:
            vias = bd.setdefault("via", [])
            vias[:] = [r for r in vias if r() is not None and r() is not t]
            vias.append(weakref.ref(t))
            del vias[1:-(_MAX_VIAS - 1)]  # the first (the whole output, often) and the last
            bd["vn"] = bd.get("vn", 0) + 1


def _tagd(t):
    """t's labels, or those of the view of a labelled base the mode missed."""
    d = _tag(t)
    if d is not None:
        return d
    sh = _shadow(t)
    return None if sh is None else {"sh": sh}


def _shadow(t):
    d = _tag(t)
    if d is not None:
        return d.get("sh")
    # A view the mode did not see (torch 1.13 does not route integer
    # indexing, qkv[0], through it): the same window of its base's labels.
    root = getattr(t, "_base", None) if isinstance(t, torch.Tensor) else None
    d = _tag(root)
    if d is None or d.get("cplx") or not root.is_contiguous():
        return None
    views = [root] if d.get("sh") is not None else [r() for r in d.get("via", ())]
    views = [v for v in views if v is not None and _tag(v) is not None and
             _tag(v).get("sh") is not None and not _tag(v).get("cplx")]
    if not views:
        return None
    try:
        key = (d.get("vn"), tuple(id(v) for v in views))
        flat = d.get("flat")
        if flat is None or flat[0] != key:
            # the labels by storage position of the root, from its labelled
            # views in the order labelled: a later one's labels win where
            # it has any
            labels = torch.full((root.numel(),), _NONE, dtype=torch.long, device=root.device)
            for v in views:
                try:
                    win = labels.as_strided(v.shape, v.stride(),
                                            v.storage_offset() - root.storage_offset())
                    sh = _tag(v)["sh"].to(labels.device)
                    win.copy_(torch.where(sh >= 0, sh, win))
                except RuntimeError:  # an expanded view, its positions overlapping
                    continue
            flat = d["flat"] = (key, labels)
        return flat[1].as_strided(t.shape, t.stride(), t.storage_offset() - root.storage_offset())
    except RuntimeError:
        return None


def _flow_of(t):
    """t's [sources, used] record; for a view the mode did not see (torch
    1.13 does not route integer indexing, mask[e], through it) one made of
    its base's and those of the base's seen views, now all used. Only
    unlabelled ones: a projection's output split by unseen indexing
    (q, k, v = qkv[0], qkv[1], qkv[2]) may have sent its other parts to a
    kernel the pass cannot see, so one part's use is not theirs."""
    r = getattr(t, _FLOW, None)
    if r is not None or isinstance(t, nn.Parameter):
        return r
    base = getattr(t, "_base", None)
    if base is None or isinstance(base, nn.Parameter):
        return None
    rs = [] if _shadow(base) is not None else [getattr(base, _FLOW, None)]
    rs = [x for x in rs + list(getattr(base, _VIEWS, ())) if x is not None]
    if not rs:
        return None
    for x in rs:
        x[1] = True
    return [frozenset().union(*[x[0] for x in rs]), True]


def _note_view(o, r):
    """Keeps a seen, unlabelled view's flow record on its base, for _flow_of."""
    base = getattr(o, "_base", None)
    if base is None or isinstance(base, nn.Parameter) or _shadow(o) is not None:
        return
    views = getattr(base, _VIEWS, None)
    if views is None:
        try:
            setattr(base, _VIEWS, [r])
        except (AttributeError, RuntimeError):
            pass
    elif len(views) < 64:
        views.append(r)


def _einsum_operands(args):
    """(equation, operands) of an einsum call: einsum(eq, a, b) or
    einsum(eq, [a, b])."""
    ops = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    return (args[0] if args else None), list(ops)


def _no_ellipsis(eq, ops):
    """eq with each '...' spelled out in letters it does not use (right-
    aligned, as einsum broadcasts them), or eq itself; None when it cannot."""
    eq = eq.replace(" ", "")
    if "..." not in eq:
        return eq
    if "->" not in eq:
        return None
    ins, res = eq.split("->")
    subs = ins.split(",")
    if len(subs) != len(ops):
        return None
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    counts = [o.dim() - (len(sub) - 3) if "..." in sub else 0 for sub, o in zip(subs, ops)]
    n = max(counts)
    if min(counts) < 0 or n > len(free):
        return None
    letters = "".join(free[:n])
    subs = [sub.replace("...", letters[n - c:]) for sub, c in zip(subs, counts)]
    return ",".join(subs) + "->" + res.replace("...", letters)


def _score_axes(name, func, args, kwargs, o, axes):
    """Where a layout op puts a score's (query axis, key axis): the op run
    on a meta tensor of the input's shape (contiguous strides), each axis
    found again as the one output axis of the same size and stride (or,
    through a slice, score[..., :n], of the same stride and no larger);
    None when one is merged, split or indexed away, or the op cannot run
    there."""
    x = args[0]
    if axes is None or not isinstance(x, torch.Tensor) or not isinstance(o, torch.Tensor):
        return None
    try:
        m = torch.empty(x.shape, device="meta")
        rest = list(args)
        rest[0] = m
        res = func(*rest, **kwargs)
    except Exception:  # an op that takes other tensors (an index) or no meta tensor
        return None
    if isinstance(res, (tuple, list)):
        res = [r for r in res if isinstance(r, torch.Tensor) and r.shape == o.shape]
        if len({(r.shape, r.stride()) for r in res}) != 1:
            return None
        res = res[0]
    if not isinstance(res, torch.Tensor) or res.shape != o.shape:
        return None
    out = []
    for i in axes:
        js = [j for j in range(res.dim()) if res.stride(j) == m.stride(i) and (
            res.shape[j] == m.shape[i] or name in ("__getitem__", "narrow") and
            2 <= res.shape[j] < m.shape[i])]
        if len(js) != 1 or m.shape[i] < 2:
            return None
        out.append(js[0])
    return tuple(out)


def _flat(seq):
    for a in seq:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


class Source:
    """One projection weight as used by one kind of call: output feature i
    reads the weight elements at row_off[i] + j * stride, j < width,
    counted from the parameter's storage offset."""

    def __init__(self, index, pname, param, row_off, stride, width, how, owner=None):
        self.index, self.pname, self.param = index, pname, param
        self.row_off, self.stride, self.width, self.how = row_off, stride, width, how
        self.rows = len(row_off)
        self.owner = owner      # (module, attribute): the weight looked up at each get()
        self.fresh = None       # get() of a computed weight (effective.py), or None
        self.chunk_of = None    # the whole weight's Source when this is one chunk of its rows
        # the projection whose whole output this weight multiplies, nothing but casts and
        # layout between (a router's low-dimensional reduction): None when none, False
        # when the calls seen disagree
        self.after = None
        self.fed = set()        # indices of the sources this weight's inputs derive from

    def current(self):
        """The weight now: a computed weight recomputed (effective.py), or
        the owner's attribute when it is still a tensor of the shape seen (a
        parameter replaced since, by a wrapper or a checkpoint load, is
        followed), else the one seen."""
        if self.fresh is not None:
            w = self.fresh()
            if isinstance(w, torch.Tensor) and w.shape == self.param.shape:
                return w if w.stride() == self.param.stride() else w.contiguous()
        if self.owner is not None:
            w = getattr(self.owner[0], self.owner[1], None)
            if isinstance(w, torch.Tensor) and w.shape == self.param.shape and \
                    w.stride() == self.param.stride():
                return w
        return self.param

    @property
    def module(self):
        return self.pname.rpartition(".")[0]

    def full_getter(self):
        """get() -> the [rows, d] map from the input features to this
        weight's outputs: its rows, or, when it multiplies another
        projection's whole output (self.after: X-MoE's router logits
        wg_reduction(x) @ normalize(wg)^T), its rows times that one's."""
        get = self.getter(list(range(self.rows)))
        first = self.after
        if not first or first.rows != self.width:
            return get
        get1 = first.getter(list(range(first.rows)))

        def composed():
            w = get()
            return w.matmul(get1().to(w.dtype))
        return composed

    def getter(self, rows):
        """get() -> [len(rows), width] tensor of these output rows (a view
        when they are a contiguous run of a [out, in] weight's rows)."""
        p = self.param
        cur = self.current
        offs = [self.row_off[r] for r in rows]
        if (p.dim() == 2 and self.stride == p.stride(1) and self.width == p.shape[1]
                and all(o % p.stride(0) == 0 for o in offs)):
            idx = [o // p.stride(0) for o in offs]
            if idx == list(range(idx[0], idx[0] + len(idx))):
                a, b = idx[0], idx[0] + len(idx)
                return lambda: cur()[a:b]
            rt = torch.tensor(idx, dtype=torch.long)
            return lambda: cur().index_select(0, rt.to(p.device))
        off = torch.tensor(offs, dtype=torch.long)[:, None] + \
            torch.arange(self.width, dtype=torch.long)[None, :] * self.stride
        span = int(off.max()) + 1

        def get():
            w = cur()
            flat = w.reshape(-1) if w.is_contiguous() else w.as_strided(
                (span,), (1,), w.storage_offset())
            return flat[off.to(w.device)]
        return get


_NOT_RECIPE = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
               "feature_alpha_dropout", "bernoulli", "multinomial", "poisson", "rand_like",
               "randn_like", "randint_like", "normal", "__setitem__", "copy_", "set_"}
_MAX_RECIPE_OPS = 64        # ops a weight computed from parameters may take (_Recipe)


class _Recipe:
    """A tensor the forward computed from parameters alone (F.normalize(wg),
    w * scale, w.t(), a cast): the op and its arguments, parameters and other
    recipes, so a weight made of it is recomputed at each get()."""

    def __init__(self, func, args, kwargs, pname, ops):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.pname, self.ops = pname, ops  # ops: the op names, a signature

    def __call__(self):
        with torch.no_grad():
            return self._run()

    def _run(self):
        return self.func(*_resolve(self.args), **_resolve(self.kwargs))


class _ParamRef:
    """A parameter in a _Recipe: its owner's attribute now when that is
    still a tensor of its shape (a parameter replaced since, by a wrapper or
    a checkpoint load, is followed, as Source.current does), else itself."""

    def __init__(self, param, owner):
        self.param, self.owner = param, owner

    def now(self):
        if self.owner is not None:
            w = getattr(self.owner[0], self.owner[1], None)
            if isinstance(w, torch.Tensor) and w.shape == self.param.shape:
                return w
        return self.param


def _resolve(a):
    if isinstance(a, _Recipe):
        return a._run()
    if isinstance(a, _ParamRef):
        return a.now()
    if isinstance(a, (list, tuple)):
        return type(a)(_resolve(x) for x in a)
    if isinstance(a, dict):
        return {k: _resolve(v) for k, v in a.items()}
    return a


class Site:
    """An attention score (kind "attention") or a routing top-k ("router")
    seen in the pass, in the order first seen."""

    def __init__(self, kind, order):
        self.kind, self.order = kind, order
        self.name = ""
        self.reason = None          # why it cannot be monitored, or None
        # attention
        self.q_src = self.k_src = None
        self.q_srcs, self.k_srcs = [], []       # every weight q / k read from
        self.q_heads, self.k_heads = [], []     # per head: row list, in dot-product order
        self.kv_of = []                         # query head -> key head
        self.n_heads = self.n_kv_heads = self.head_dim = 0
        self.via = ""
        self.q_parts = self.k_parts = None      # merged sites: per head (source, rows)
        self.group = ""                         # merged sites: the module holding the heads
        # router
        self.src, self.top_k, self.dispatched, self.normed = None, 0, False, ""
        self.argmax_picks = []                  # distinct argmax results seen
        self.used_k = 0                         # widest top-k indices used to dispatch
        self.sorted = False                     # indices from a sort: k is the slice used

    def attention_getter(self):
        if self.q_parts is None:
            gq = self.q_src.getter([r for h in self.q_heads for r in h])
            gk = self.k_src.getter([r for h in self.k_heads for r in h])
            return lambda: (gq(), gk())
        gq, gk = _parts_getter(self.q_parts), _parts_getter(self.k_parts)
        return lambda: (gq(), gk())


def _parts_getter(parts):
    """get() of per-head (source, rows) that may come from several weights:
    runs of one source are read together."""
    runs = []
    for src, rows in parts:
        if runs and runs[-1][0] is src:
            runs[-1][1].extend(rows)
        else:
            runs.append((src, list(rows)))
    gets = [src.getter(rows) for src, rows in runs]
    if len(gets) == 1:
        return gets[0]
    return lambda: torch.cat([g() for g in gets], dim=0)


def _group(site, list_prefixes):
    """Where a site's heads live: a ModuleList of per-head modules deeper
    than the block list (Karpathy's heads = ModuleList([Head(...)])) groups
    the sites of its entries; else the site's own module. A per-head
    module is the list entry itself (its projections are the entry's own):
    an entry holding the site deeper down (blocks.0.attn.q in a list of
    stages of blocks: PVT's single-head stages) is a block, not a head."""
    parts = _common_module([s.pname for s in site.q_srcs + site.k_srcs]).split(".")
    lists = [i for i in range(1, len(parts)) if parts[i].isdigit()
             and ".".join(parts[:i]) in list_prefixes]
    if len(lists) >= 2 and lists[-1] == len(parts) - 1:
        return ".".join(parts[:lists[-1]])
    return ".".join(parts)


def _common_module(names):
    cols = [n.split(".")[:-1] for n in names]
    out = []
    for col in zip(*cols):
        if len(set(col)) != 1:
            break
        out.append(col[0])
    return ".".join(out)


def drop_derived_keys(sites):
    """Of two scores of the same queries, one whose keys are a projection of
    the other's keys (Native Sparse Attention's compressed branch: a
    Linear over blocks of k_proj's output, beside the selected and sliding
    branches that read k_proj's keys) is a branch of that attention, not
    its key weight: the score that reads the upstream keys stands."""
    def qsig(s):
        return (id(getattr(s, "q_src", None)), str(getattr(s, "q_heads", None)))
    out = []
    for s in sites:
        k = getattr(s, "k_src", None)
        derived = s.reason is None and k is not None and any(
            o is not s and o.reason is None and qsig(o) == qsig(s) and
            getattr(o, "k_src", None) is not None and o.k_src is not k and
            o.k_src.index in k.fed for o in sites)
        if not derived:
            out.append(s)
    return out


def merge_sites(sites, list_prefixes):
    """One site per attention: identical sites (a module applied twice) are
    one; the sites of one group with disjoint rows (one score per head, in a
    loop or from per-head modules) are the heads of one attention."""
    out, groups = [], {}
    for s in sites:
        if s.reason is not None or s.n_heads < 1:
            out.append(s)
            continue
        key = (_group(s, list_prefixes), s.head_dim)
        groups.setdefault(key, []).append(s)
        if len(groups[key]) == 1:
            out.append(key)
    merged = []
    for item in out:
        if isinstance(item, Site):
            merged.append(item)
            continue
        members = groups[item]
        uniq = []
        for s in members:
            sig = (s.q_src, s.k_src, str(s.q_heads), str(s.k_heads))
            if all(sig != (u.q_src, u.k_src, str(u.q_heads), str(u.k_heads)) for u in uniq):
                uniq.append(s)
        if len(uniq) == 1 or any(s.n_heads != 1 for s in uniq):
            merged.extend(uniq)  # one site, or whole attentions (T5's self and cross)
            continue
        q = [(s.q_src, tuple(h)) for s in uniq for h in s.q_heads]
        widths = {s.q_src.width for s in uniq} | {s.k_src.width for s in uniq}
        if len(set(q)) != len(q) or len({r for src, h in q for r in ((src, x) for x in h)}) \
                != sum(len(h) for _, h in q) or len(widths) != 1:
            merged.extend(uniq)  # overlapping rows: distinct attentions
            continue
        m = Site("attention", uniq[0].order)
        m.via, m.head_dim, m.group = uniq[0].via, uniq[0].head_dim, item[0]
        m.q_src, m.k_src = uniq[0].q_src, uniq[0].k_src
        m.q_srcs = [s.q_src for s in uniq]
        m.k_srcs = [s.k_src for s in uniq]
        k_parts, q_by_k = [], {}
        for s in uniq:
            per = s.n_heads // s.n_kv_heads
            for h, rows in enumerate(s.q_heads):
                kp = (s.k_src, tuple(s.k_heads[h // per]))
                if kp not in k_parts:
                    k_parts.append(kp)
                q_by_k.setdefault(k_parts.index(kp), []).append((s.q_src, list(rows)))
        sizes = {len(v) for v in q_by_k.values()}
        if len(sizes) != 1:
            merged.extend(uniq)
            continue
        m.q_parts = [qp for g in range(len(k_parts)) for qp in q_by_k[g]]
        m.k_parts = [(src, list(rows)) for src, rows in k_parts]
        m.n_heads, m.n_kv_heads = len(m.q_parts), len(m.k_parts)
        merged.append(m)
    return merged


class Observation:
    """What one observed pass saw: sources, attention and router sites,
    and whether it ran (error: why not)."""

    def __init__(self):
        self.sources, self.sources_by_key = [], {}
        self.attention, self.routers = [], []
        self.error = None
        self.unnormed = []      # q.k products used as weights with no softmax (retention)
        # Where each source's outputs went (by Source.index): `escaped` holds
        # those some value derived from left the ops the pass sees (a C++ or
        # numpy kernel, a tensor no seen op took), `met` those two values
        # derived from met in a matmul/bmm/einsum/SDPA. A source in neither
        # only fed seen ops that formed no product of it with itself.
        self.escaped, self.met = set(), set()
        # (sources, sources): a product of two values derived from these, one
        # without labels, that went on to a softmax or exp (a score unread)
        self.normed = []
        self.input_desc = ""
        self.failures = 0       # ops whose bookkeeping failed (the pass went on)
        # no probe batch fit the forward (it wants inputs a probe cannot
        # guess): the pass waits for a real batch (Monitor: the first one)
        self.waits = False


def _group_heads(qr, kr):
    """Query and key heads of a score from its paired rows of labels (qr[i]
    meets kr[i]): (q_heads, k_heads, order, None), the distinct rows of each
    side in first-seen order and the query heads grouped by the key head
    they read; or (None, None, None, why) when a query head meets two key
    heads, a head reads one row twice, or the query heads do not split
    evenly over the key heads."""
    q_heads, k_heads, kv_of = [], [], {}
    for q, k in zip(qr, kr):
        tq, tk = tuple(q), tuple(k)
        if tq not in q_heads:
            q_heads.append(tq)
        if tk not in k_heads:
            k_heads.append(tk)
        h, g = q_heads.index(tq), k_heads.index(tk)
        if kv_of.setdefault(h, g) != g:
            return None, None, None, f"query head {h} meets two key heads"
    if any(len(set(t)) != len(t) for t in q_heads + k_heads):
        return None, None, None, "a head reads the same weight row twice"
    per = {}
    for h in range(len(q_heads)):
        per.setdefault(kv_of[h], []).append(h)
    if len({len(v) for v in per.values()}) != 1 or len(per) != len(k_heads):
        return None, None, None, "query heads are not split evenly over the key heads"
    return q_heads, k_heads, [h for g in range(len(k_heads)) for h in per[g]], None


class _Tracker(TorchFunctionMode if TorchFunctionMode is not None else object):

    def __init__(self, params, obs):
        super().__init__()
        self.params = params        # id(param) -> name
        self.owners = {}            # id(param) -> (module, attribute)
        self.obs = obs
        self.candidates = []        # score candidates, Site per matmul of two labelled operands
        self.topks = {}             # source index -> Site
        self.failures = 0
        self.mixes = []             # [N, 2] label pairs one elementwise op combined
        self.unnormed = []          # score candidates used in a product before confirmed
        self.flows = []             # every [sources, used] record made (_flow)
        self.escaped, self.met = set(), set()
        self._new_src = None        # the source the op just watched projected
        self._new_idx = []          # (indices tensor, router site) the op just made
        self.lora = set()           # ids of LoRA adapter parameters: no projection of their own
        self.fresh = {}             # id(parameter) -> get() of its effective weight (LoRA base)
        self.computed = []          # (module, name, attribute) of computed weights
        self.passed = []            # top-k indices a cast or layout op passed on (finish())
        self.flow_failed = False    # then where values went is not known
        self._partners = None
        self.normed = []            # (sources, sources) of unread products softmax'd (_products)
        self.recent = []            # weak references to the last labelled tensors (_unseen_rows)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _fname(func)
        try:
            self._after(name, func, args, kwargs, out)
        except Exception:  # bookkeeping must never change the model's pass
            self.failures += 1
        try:
            self._recipe(name, func, args, kwargs, out)
        except Exception:
            self.failures += 1
        try:
            self._flow(name, args, kwargs, out)
        except Exception:
            self.failures += 1
            self.flow_failed = True
        try:
            self._products(name, args, kwargs, out)
        except Exception:
            self.failures += 1
            self.flow_failed = True
        return out

    def _products(self, name, args, kwargs, out):
        """Products the labels cannot read, followed to a softmax or exp.

        A matmul/bmm/einsum of two values (no weight) that formed no score
        candidate (_candidate) tags its result with the sources each side
        derives from: one side may have lost its labels (keys through a
        convolution over time), or the labels vary along a token axis
        (queries folded into the sequence, keys projected over tokens);
        elementwise and layout ops carry the tag, any other op drops it. A
        softmax or exp of a tagged value (or an SDPA / attention kernel whose
        q and k formed no candidate) records the pair in `normed`: a score
        may be there, unread. Not recorded: a product with a softmax output
        (probabilities times values, after any score) and one of two
        labelled values whose labels vary along both token axes (q k^T over
        one projection's E outputs: a mixing of them, no score)."""
        ins = [a for a in itertools.chain(_flat(args), _flat(kwargs.values()))
               if isinstance(a, torch.Tensor)]
        if name in ("softmax", "log_softmax", "_softmax", "exp", "exp_", "exp2", "logsumexp"):
            for a in ins[:1]:
                for pr in getattr(a, _PROD, ()):
                    if len(self.normed) < _MAX_MIXES:
                        self.normed.append(pr)
            return
        if name in _PRODUCTS or (("attn" in name or "attention" in name) and len(ins) >= 3):
            if name == "baddbmm":
                ins = ins[1:]
            if name in _PRODUCTS and name != "scaled_dot_product_attention" and len(ins) != 2:
                return
            two = [a for a in ins[:2] if self._param(a) is None]
            outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                    if isinstance(o, torch.Tensor)]
            if len(two) != 2 or any((_tag(o) or {}).get("score") for o in outs):
                return
            if any((_tag(a) or {}).get("smax") or (_tag(a) or {}).get("normed") == "softmax"
                   or (_tag(a) or {}).get("score") for a in two):
                return
            shs = [_shadow(a) for a in two]
            if name in ("matmul", "__matmul__", "bmm", "baddbmm") and all(
                    sh is not None and sh.dim() >= 2 and not bool((sh < 0).any())
                    for sh in shs):
                qa, kb = shs
                if not torch.equal(qa[..., :1, :].expand_as(qa), qa) and \
                        not torch.equal(kb[..., :1].expand_as(kb), kb):
                    return
            pr = tuple((_flow_of(a) or (frozenset(),))[0] for a in two)
            if name in _SCORE_OPS:
                for o in outs:
                    try:
                        setattr(o, _PROD, (pr,))
                    except (AttributeError, RuntimeError):
                        pass
            elif len(self.normed) < _MAX_MIXES:
                self.normed.append(pr)
            return
        if name in _NOT_ELEMENTWISE and name not in _LAYOUT:
            return
        prs = []
        for a in ins:
            for pr in getattr(a, _PROD, ()):
                if all(pr is not x for x in prs):
                    prs.append(pr)
        if not prs:
            return
        for o in (_flat(out) if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor) and not isinstance(o, nn.Parameter):
                try:
                    setattr(o, _PROD, tuple(prs[:8]))
                except (AttributeError, RuntimeError):
                    pass

    def _flow(self, name, args, kwargs, out):
        """Which sources each value derives from, through every op seen."""
        new, self._new_src = self._new_src, None
        ins = [a for a in itertools.chain(_flat(args), _flat(kwargs.values()))
               if isinstance(a, torch.Tensor)]
        srcs, per = set(), []
        for a in ins:
            r = _flow_of(a)
            if r is not None:
                r[1] = True
                srcs |= r[0]
                if self._param(a) is None:
                    per.append(r[0])
        if name in _PRODUCTS or ("attn" in name or "attention" in name):
            for i in range(len(per)):
                for j in range(i + 1, len(per)):
                    self.met |= per[i] & per[j]
        if new is not None:
            srcs.add(new)
        marks, self._new_idx = self._new_idx, []  # top-k indices: where they go (reach)
        if not srcs and not marks:
            return
        outs = [o for o in (_flat(out) if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor)]
        if name == "__setitem__" and ins:
            outs = [ins[0]]
        if not outs:
            if name not in _META:
                self.escaped |= srcs  # numpy(), tolist(), data_ptr(): values left
            return
        fs = frozenset(srcs)
        for o in outs:
            if isinstance(o, nn.Parameter):
                continue
            mine = [("idx", id(site)) for t, site in marks if t is o]
            r = [fs | frozenset(mine) if mine else fs, False]
            try:
                setattr(o, _FLOW, r)
            except (AttributeError, RuntimeError):
                self.escaped |= srcs
                continue
            self.flows.append(r)
            _note_view(o, r)

    # ---- projections -------------------------------------------------------------------

    def _param(self, t):
        """(name, parameter) when t is a parameter or a view of one."""
        if not isinstance(t, torch.Tensor):
            return None
        n = self.params.get(id(t))
        if n is not None:
            return n, t
        base = getattr(t, "_base", None)
        if base is not None and id(base) in self.params:
            return self.params[id(base)], base
        return None

    def _computed(self, t):
        """(name, tensor, get()) when t is a computed weight (a parametrization's
        value, an old-style weight_norm's) this forward got, else None."""
        if not isinstance(t, torch.Tensor) or not self.computed:
            return None
        base = getattr(t, "_base", None)
        for m, name, attr in self.computed:
            cur = effective.current(m, attr)
            if cur is not None and (cur is t or cur is base):  # the weight or a view (w.t())
                return name, cur, effective.weight_getter(m, attr)
        return None

    def _recipe(self, name, func, args, kwargs, out):
        """Tags a tensor computed from parameters alone (each tensor input a
        parameter or such a tensor; not in place, not random) with its
        _Recipe: used as a projection weight (x @ F.normalize(wg)^T), it is a
        computed weight, recomputed at each get()."""
        if not isinstance(out, torch.Tensor) or isinstance(out, nn.Parameter) or \
                name in _NOT_RECIPE or name in _META or \
                (name.endswith("_") and not name.endswith("__")):
            return
        pname, ops, n = None, [], 0
        stack = [args, kwargs]

        def swap(a):
            nonlocal pname, n
            if isinstance(a, torch.Tensor):
                n += 1
                if isinstance(a, nn.Parameter) and id(a) in self.params:
                    pname = pname or self.params[id(a)]
                    return _ParamRef(a, self.owners.get(id(a)))
                r = (_tag(a) or {}).get("pfn")
                if r is None:
                    raise LookupError
                pname = pname or r.pname
                ops.extend(r.ops)
                return r
            if isinstance(a, (list, tuple)):
                return type(a)(swap(x) for x in a)
            if isinstance(a, dict):
                return {k: swap(v) for k, v in a.items()}
            return a
        try:
            rargs, rkwargs = swap(stack[0]), swap(stack[1])
        except (LookupError, TypeError):
            return
        if not n or len(ops) >= _MAX_RECIPE_OPS:
            return
        _set(out, pfn=_Recipe(func, rargs, rkwargs, pname, tuple(ops) + (name,)))

    def _is_weight(self, t):
        return self._param(t) is not None or self._computed(t) is not None or \
            (_tag(t) or {}).get("pfn") is not None

    def _weight(self, w):
        """(name, parameter or computed tensor) of a projection weight; None
        for no weight and for a LoRA adapter's A or B (the base carries it)."""
        p = self._param(w)
        if p is not None:
            return None if id(p[1]) in self.lora else p
        c = self._computed(w)
        if c is None:
            r = (_tag(w) or {}).get("pfn")
            if r is None:
                return None
            self.fresh[id(w)] = r  # computed from parameters by the forward: recomputed
            return r.pname, w
        self.fresh[id(c[1])] = c[2]
        return c[0], c[1]

    def _source(self, pname, param, row_off, stride, width, how):
        r = (_tag(param) or {}).get("pfn")
        # a weight the forward computes anew at each call: one source by how it is made
        key = (pname, tuple(row_off), stride, width) + ((r.ops,) if r is not None else ())
        s = self.obs.sources_by_key.get(key)
        if s is None:
            s = Source(len(self.obs.sources), pname, param, list(row_off), stride, width, how,
                       self.owners.get(id(param)))
            s.fresh = self.fresh.get(id(param))
            self.obs.sources.append(s)
            self.obs.sources_by_key[key] = s
        return s

    def _label_out(self, out, src, feat_shape, feat_dims):
        """Labels out's feature axes (feat_dims, sizes feat_shape) with src rows."""
        n = len(src.row_off)
        ids = (torch.arange(n, dtype=torch.long, device=out.device) + (src.index << _SHIFT))
        shape = [1] * out.dim()
        for d, s in zip(feat_dims, feat_shape):
            shape[d] = s
        ids = ids.view(shape).expand(out.shape)
        _set(out, sh=ids, lin=src.index)
        self._note_recent(out)

    def _after_projection(self, x, src):
        """Notes the projection whose whole output x is (its rows in order
        along x's last axis, nothing but casts and layout ops since), as the
        one src multiplies (Source.after)."""
        d = _tag(x) if isinstance(x, torch.Tensor) else None
        first = None
        if d is not None and d.get("lin") is not None and d.get("sh") is not None:
            sh, first = d["sh"], self.obs.sources[d["lin"]]
            want = torch.arange(first.rows, device=sh.device) + (first.index << _SHIFT)
            if sh.dim() < 1 or sh.shape[-1] != first.rows or first.rows != src.width or \
                    not torch.equal(sh, want.expand_as(sh)):
                first = None
        if src.after is None:
            src.after = first if first is not None else False
        elif src.after is not first:
            src.after = False

    def _linear(self, x, w, out, how):
        if (_tag(x) or {}).get("pfn") is not None and (_tag(w) or {}).get("pfn") is not None:
            return False  # parameters times parameters: a weight computed, no projection
        p = self._weight(w)
        if p is None or w.dim() != 2 or not isinstance(out, torch.Tensor):
            return False
        pname, param = p
        base = w.storage_offset() - param.storage_offset()
        if how == "linear":       # out[..., i] = sum_j x[j] w[i, j]
            rows, s_row, s_col, width = w.shape[0], w.stride(0), w.stride(1), w.shape[1]
        else:                     # x @ w: out[..., i] = sum_j x[j] w[j, i]
            rows, s_row, s_col, width = w.shape[1], w.stride(1), w.stride(0), w.shape[0]
        src = self._source(pname, param, [base + i * s_row for i in range(rows)], s_col, width,
                           how)
        r = _flow_of(x) if isinstance(x, torch.Tensor) else None
        if r is not None:
            src.fed |= {i for i in r[0] if isinstance(i, int)}
        self._after_projection(x, src)
        self._label_out(out, src, [rows], [out.dim() - 1])
        self._new_src = src.index
        return True

    def _conv(self, args, kwargs, out):
        """A 1x1 convolution (groups 1) is a projection of the channel axis:
        output channel i reads W[i, :, 0, ...]."""
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
        x = args[0] if args else kwargs.get("input")
        if not isinstance(w, torch.Tensor) or not isinstance(x, torch.Tensor) or \
                not isinstance(out, torch.Tensor) or w.dim() < 3 or groups != 1 or \
                any(s != 1 for s in w.shape[2:]) or x.dim() not in (w.dim() - 1, w.dim()):
            return False
        p = self._weight(w)
        if p is None:
            return False
        pname, param = p
        base = w.storage_offset() - param.storage_offset()
        src = self._source(pname, param, [base + i * w.stride(0) for i in range(w.shape[0])],
                           w.stride(1), w.shape[1], "conv")
        self._label_out(out, src, [w.shape[0]], [0 if x.dim() == w.dim() - 1 else 1])
        self._new_src = src.index
        return True

    def _einsum_projection(self, eq, ops, out):
        if len(ops) != 2 or "..." in eq or "->" not in eq:
            return False
        ins, res = eq.replace(" ", "").split("->")
        subs = ins.split(",")
        for wi in (0, 1):
            p = self._param(ops[wi])
            if p is None or self._param(ops[1 - wi]) is not None:
                continue
            w, ws = ops[wi], subs[wi]
            contracted = [c for c in ws if c not in res]
            kept = [c for c in res if c in ws]
            if len(contracted) != 1 or not kept or len(set(ws)) != len(ws):
                return False
            pname, param = p
            base = w.storage_offset() - param.storage_offset()
            c = ws.index(contracted[0])
            sizes = [w.shape[ws.index(k)] for k in kept]
            strides = [w.stride(ws.index(k)) for k in kept]
            offs = []
            for idx in itertools.product(*[range(s) for s in sizes]):
                offs.append(base + sum(i * s for i, s in zip(idx, strides)))
            src = self._source(pname, param, offs, w.stride(c), w.shape[c], "einsum")
            dims = [res.index(k) for k in kept]
            if dims != sorted(dims):
                return False
            n = len(offs)
            ids = torch.arange(n, dtype=torch.long, device=out.device) + (src.index << _SHIFT)
            shape = [1] * out.dim()
            for d, s in zip(dims, sizes):
                shape[d] = s
            _set(out, sh=ids.view(shape).expand(out.shape))
            self._new_src = src.index
            return True
        return False

    # ---- attention ---------------------------------------------------------------------

    def _pairs(self, sq, sk):
        """sq: [*bq, K] q labels, sk: [*bk, K] k labels at one token ->
        [N, K] pairs after broadcasting the batch axes, or None."""
        if sq.shape[-1] != sk.shape[-1] or sq.shape[-1] < 1:
            return None
        try:
            bs = torch.broadcast_shapes(sq.shape[:-1], sk.shape[:-1])
        except RuntimeError:
            return None
        k = sq.shape[-1]
        a = sq.expand(*bs, k).reshape(-1, k).cpu()
        b = sk.expand(*bs, k).reshape(-1, k).cpu()
        return a, b

    def _candidate(self, a, b, out, via, axes=None):
        """a: q labels [..., Tq, K] (token axis -2), b: k labels [..., Tk, K];
        axes: out's (query axis, key axis) when known (a softmax over either
        confirms the score), else None (then either of out's last two)."""
        if a.dim() < 2 or b.dim() < 2:
            return
        if not torch.equal(a[..., :1, :].expand_as(a), a) or \
                not torch.equal(b[..., :1, :].expand_as(b), b):
            return  # labels vary along the token axis: not q.k^T
        pairs = self._pairs(a[..., 0, :], b[..., 0, :])
        if pairs is None:
            return
        site = self._site_from_pairs(*pairs, via)
        if site is not None:
            site.pairs = pairs  # (q labels, k labels) as the operand order gave them: _swap
            self.candidates.append(site)
            if isinstance(out, torch.Tensor) and axes is not None:
                axes = tuple(x % out.dim() for x in axes)
            _set(out, score=site, saxes=axes)

    def _site_from_pairs(self, qa, ka, via):
        site = Site("attention", 0)
        site.via = via
        if bool((qa < 0).any()) or bool((ka < 0).any()):
            site.reason = "some q/k features come from no projection weight this pass saw"
            site.q_srcs = [self.obs.sources[i] for i in sorted(set(
                (qa[qa >= 0] >> _SHIFT).tolist()))]
            site.k_srcs = [self.obs.sources[i] for i in sorted(set(
                (ka[ka >= 0] >> _SHIFT).tolist()))]
            return site
        qs, ks = (qa >> _SHIFT), (ka >> _SHIFT)
        qsrc, ksrc = sorted(set(qs.unique().tolist())), sorted(set(ks.unique().tolist()))
        site.q_srcs = [self.obs.sources[i] for i in qsrc]
        site.k_srcs = [self.obs.sources[i] for i in ksrc]
        if len(qsrc) != 1 or len(ksrc) != 1:
            if self._per_head_site(site, qa, ka):
                return site
            site.reason = "mixed"
            site.head_dim = qa.shape[-1]
            site.n_heads = len({tuple(r) for r in qa.tolist()})
            site.n_kv_heads = len({tuple(r) for r in ka.tolist()})
            return site
        site.q_src, site.k_src = self.obs.sources[qsrc[0]], self.obs.sources[ksrc[0]]
        mask = (1 << _SHIFT) - 1
        qr, kr = self._unpair(qa.tolist()), self._unpair(ka.tolist())
        qr = [[x & mask for x in r] for r in qr]
        kr = [[x & mask for x in r] for r in kr]
        site.head_dim = len(qr[0])
        q_heads, k_heads, order, reason = _group_heads(qr, kr)
        if reason:
            site.reason = reason
            return site
        site.q_heads = [list(q_heads[h]) for h in order]
        site.k_heads = [list(t) for t in k_heads]
        site.n_heads, site.n_kv_heads = len(q_heads), len(k_heads)
        # q and k may read inputs of different widths (cross-attention to a
        # context or media stream): sketch.attention_grams reduces each side
        # over its own width, so the site is monitored all the same.
        return site

    def _per_head_site(self, site, qa, ka):
        """q and k from several weights, each head's from one: Yuan 2.0's
        cat([q_proj(x), k_proj(x)]).view(.., H, 2 dh).chunk(2) gives heads
        whose query and key are plain rows of q_proj or of k_proj. The site
        keeps per-head (source, rows) parts, as merged sites do. False when
        one head reads two weights (MLA: a key head is a latent projection's
        rows beside a shared rope key's) or the heads do not pair evenly."""
        qr, kr = self._unpair(qa.tolist()), self._unpair(ka.tolist())
        if any(len({x >> _SHIFT for x in r}) != 1 for r in qr + kr):
            return False
        q_heads, k_heads, order, reason = _group_heads(qr, kr)
        if reason:
            return False
        mask = (1 << _SHIFT) - 1

        def part(t):
            return self.obs.sources[t[0] >> _SHIFT], [x & mask for x in t]
        for heads in (q_heads, k_heads):  # one side's rows stack into one [rows, d] weight
            if len({part(t)[0].width for t in heads}) != 1:
                return False
        site.q_parts = [part(q_heads[h]) for h in order]
        site.k_parts = [part(t) for t in k_heads]
        site.q_heads = [list(q_heads[h]) for h in order]   # full labels: distinct per weight
        site.k_heads = [list(t) for t in k_heads]
        site.q_src, site.k_src = site.q_parts[0][0], site.k_parts[0][0]
        site.group = _common_module([s.pname for s in site.q_srcs + site.k_srcs])
        site.head_dim = len(qr[0])
        site.n_heads, site.n_kv_heads = len(q_heads), len(k_heads)
        return True

    def _unpair(self, rows):
        """Rows of labels with a repeat put right: a rotation written as
        (x1 c - x2 s, x1 s + x2 c) labels both outputs with x1 (the first
        operand); a repeated label whose one mixing partner the row lacks
        is that partner."""
        if all(len(set(r)) == len(r) for r in rows) or not self.mixes:
            return rows
        if self._partners is None:
            self._partners = {}
            for pairs in self.mixes:
                for a, b in pairs.tolist():
                    self._partners.setdefault(a, set()).add(b)
                    self._partners.setdefault(b, set()).add(a)
        out = []
        for r in rows:
            seen, new = set(), []
            for x in r:
                if x in seen:
                    cand = self._partners.get(x, set()) - set(r) - seen
                    if len(cand) == 1:
                        x = next(iter(cand))
                seen.add(x)
                new.append(x)
            out.append(new)
        return out

    def _mix(self, sa, sb, shape):
        """Records which labels one elementwise op combined (same weight only:
        a rotation's pairs, not a residual sum of two projections)."""
        if len(self.mixes) >= _MAX_MIXES:
            return
        try:
            a = sa.expand(shape).reshape(-1)
            b = sb.to(sa.device).expand(shape).reshape(-1)
        except RuntimeError:
            return
        if torch.equal(a, b) or bool((a < 0).any()) or bool((b < 0).any()) or \
                not torch.equal(a >> _SHIFT, b >> _SHIFT):
            return
        diff = a != b
        self.mixes.append(torch.unique(torch.stack((a[diff], b[diff]), 1), dim=0).cpu())
        self._partners = None

    def _score(self, name, args, kwargs, out):
        if name in ("matmul", "__matmul__", "bmm"):
            a = args[0] if args else kwargs.get("input")
            b = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
        elif name == "baddbmm":  # alibi.baddbmm(batch1=q, batch2=k_t, ...) in BLOOM
            a = args[1] if len(args) > 1 else kwargs.get("batch1")
            b = args[2] if len(args) > 2 else kwargs.get("batch2")
        else:
            return
        sa, sb = _shadow(a), _shadow(b)
        if (sa is None) != (sb is None):
            self._unread(a, b, sa, sb, out)
        if sa is None or sb is None or sa.dim() < 2 or sb.dim() < 2:
            return
        # q [..., Tq, K] @ kT [..., K, Tk]
        self._candidate(sa, sb.transpose(-1, -2), out, name, (-2, -1))

    def _unread(self, a, b, sa, sb, out):
        """q @ k^T with one side a head-split projection (labels constant
        along its token axis) and the other derived from projections but
        with no labels: JetMoE's mixture of attention heads, whose query is
        each token's top-k expert projections put back by index_add. Once a
        softmax over its keys confirms it, the score is a site of reason
        UNREAD, which layouts.py names in Discovery.skipped unless names'
        attention reads the labelled weight (keys through a convolution)."""
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or \
                a.dim() < 2 or b.dim() < 2 or a.shape[-1] != b.shape[-2]:
            return
        lab, other = (sa.transpose(-1, -2), b) if sa is not None else (sb, a)
        if bool((lab < 0).any()) or not torch.equal(lab[..., :1].expand_as(lab), lab):
            return  # lab: [..., K, T], constant along its token axis T
        r = _flow_of(other)
        if r is None or not r[0] or _tag(other) is not None and (
                _tag(other).get("smax") or _tag(other).get("score")):
            return
        site = Site("attention", 0)
        site.via, site.reason = "matmul", UNREAD
        srcs = sorted(set((lab >> _SHIFT).unique().tolist()))
        side = [self.obs.sources[i] for i in srcs]
        site.q_srcs, site.k_srcs = (side, []) if sa is not None else ([], side)
        site.head_dim = lab.shape[-2]
        self.candidates.append(site)
        _set(out, score=site, saxes=(out.dim() - 2, out.dim() - 1))

    def _expert_mix(self, name, args, out):
        """softmax(q k^T) @ v over one projection's E outputs (Yuan2-M32's
        attention router: q, k, v = Linear(d, E)(x) viewed [.., E, 1]): p @ v
        mixes v's E outputs among themselves, output i still expert i's, so
        the result carries v's labels and a top-k over it routes by v."""
        if name not in ("matmul", "__matmul__", "bmm") or len(args) != 2 or \
                not isinstance(out, torch.Tensor):
            return
        p, v = args
        if not (_tag(p) or {}).get("smax") or _tag(out) is not None:
            return
        sv = _shadow(v)
        if sv is None or sv.dim() < 2 or sv.shape[-1] != 1 or out.shape != sv.shape or \
                self._router_src(None, -1, sv.transpose(-1, -2)) is None:
            return
        _set(out, sh=sv)

    def _einsum_score(self, eq, ops, out):
        if len(ops) != 2 or "..." in eq or "->" not in eq:
            return
        sa, sb = _shadow(ops[0]), _shadow(ops[1])
        if sa is None and sb is None:  # rows picked by indexing torch 1.13 does not show
            ua, ub = self._unseen_rows(ops[0]), self._unseen_rows(ops[1])
            if ua is not None and ub is not None:
                for o, u in ((ops[0], ua), (ops[1], ub)):
                    _set(o, **u)
                sa, sb = ua["sh"], ub["sh"]
        if sa is None or sb is None:
            return
        ins, res = eq.replace(" ", "").split("->")
        s0, s1 = ins.split(",")
        contracted = [c for c in s0 if c in s1 and c not in res]
        if len(contracted) != 1:
            return
        c = contracted[0]
        if s0 == s1 and len(set(s0)) == len(s0) and sorted(res) == sorted(s0.replace(c, "")) \
                and (_tag(ops[0]) or {}).get("gath") and (_tag(ops[1]) or {}).get("gath"):
            # "ehc,ehc->eh" of rows picked by index: q[dst] . k[src] per pair (_pair_product)
            order = [s0.index(x) for x in res] + [s0.index(c)]
            self._pair_site(sa.permute(*order), sb.permute(*order), out, "einsum")
            return
        batch = [x for x in res if x in s0 and x in s1]
        q_only = [x for x in s0 if x not in s1 and x in res]
        k_only = [x for x in s1 if x not in s0 and x in res]
        # One q-only label is the query token axis, the others (heads, as
        # in "bhid,bjd->bhij" with one key head) broadcast over k; the same
        # for k. The labels must not vary along the token axes (_candidate).
        for tq in reversed(q_only):
            for tk in reversed(k_only):
                qx = [x for x in q_only if x != tq]
                kx = [x for x in k_only if x != tk]
                a = sa.permute(*[s0.index(x) for x in batch + qx + [tq, c]])
                b = sb.permute(*[s1.index(x) for x in batch + kx + [tk, c]])
                a = a.reshape(a.shape[:len(batch) + len(qx)] + (1,) * len(kx) + a.shape[-2:])
                b = b.reshape(b.shape[:len(batch)] + (1,) * len(qx) + b.shape[len(batch):])
                before = len(self.candidates)
                self._candidate(a, b, out, "einsum", (res.index(tq), res.index(tk)))
                if len(self.candidates) > before:
                    return

    def _sdpa(self, args, kwargs, out):
        q = args[0] if args else kwargs.get("query")
        k = args[1] if len(args) > 1 else kwargs.get("key")
        sq, sk = _shadow(q), _shadow(k)
        if sq is None or sk is None or sq.dim() < 2:
            return
        if kwargs.get("enable_gqa") and sq.dim() >= 3 and sk.dim() >= 3 and \
                sq.shape[-3] != sk.shape[-3] and sq.shape[-3] % sk.shape[-3] == 0:
            sk = sk.repeat_interleave(sq.shape[-3] // sk.shape[-3], dim=-3)
        before = len(self.candidates)
        self._candidate(sq, sk, out, "scaled_dot_product_attention")
        if len(self.candidates) > before:
            self._confirm(self.candidates[-1])

    def _mha(self, func, args, kwargs):
        try:
            b = inspect.signature(func).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return
        a = b.arguments
        h, e = a.get("num_heads"), a.get("embed_dim_to_check")
        if not isinstance(h, int) or not isinstance(e, int) or h < 1 or e % h:
            return
        dh = e // h
        site = Site("attention", 0)
        site.via = "multi_head_attention_forward"
        if a.get("use_separate_proj_weight"):
            pq, pk = self._param(a.get("q_proj_weight")), self._param(a.get("k_proj_weight"))
            if pq is None or pk is None:
                return
            wq, wk = a["q_proj_weight"], a["k_proj_weight"]
            qs = self._source(pq[0], pq[1], [i * wq.stride(0) for i in range(e)], wq.stride(1),
                              wq.shape[1], "linear")
            ks = self._source(pk[0], pk[1], [i * wk.stride(0) for i in range(e)], wk.stride(1),
                              wk.shape[1], "linear")
            qrows, krows = list(range(e)), list(range(e))
        else:
            p = self._param(a.get("in_proj_weight"))
            if p is None:
                return
            w = a["in_proj_weight"]
            src = self._source(p[0], p[1], [i * w.stride(0) for i in range(w.shape[0])],
                               w.stride(1), w.shape[1], "linear")
            qs = ks = src
            qrows, krows = list(range(e)), list(range(e, 2 * e))
        site.q_src, site.k_src = qs, ks
        site.q_srcs, site.k_srcs = [qs], [ks]
        site.q_heads = [qrows[i * dh:(i + 1) * dh] for i in range(h)]
        site.k_heads = [krows[i * dh:(i + 1) * dh] for i in range(h)]
        site.n_heads = site.n_kv_heads = h
        site.head_dim = dh
        self.candidates.append(site)
        self._confirm(site)

    def _weights_used(self, args):
        """A q.k product multiplied on (score @ v) before any softmax or exp
        confirmed it: retention / linear attention, if none ever does."""
        ts = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
        if len(ts) != 2:
            return
        for a, b in (ts, ts[::-1]):
            site = (_tag(a) or {}).get("score")
            if site is None or site.order or any(site is u for u in self.unnormed):
                continue
            # the other side is values, not a weight (talking heads mix scores by a
            # parameter before their softmax) nor another score
            if self._param(b) is None and (_tag(b) or {}).get("score") is None:
                self.unnormed.append(site)

    def _value_product(self, name, args):
        """Weights softmax'd over the axis the score's left operand gave
        (sw) meet the values: the axis the product sums over is the key axis.
        When it is that left axis, the score was k @ q^T ([key, query], the
        softmax over dim -2, transposed before @ v, or einsum "..jd,..id->..ji"):
        the site's query and key swap. Summed over the other axis (Slot
        Attention: slots compete, each slot's weights then sum the inputs),
        the site stays as found."""
        if name == "einsum":
            eq, ops = _einsum_operands(args)
            if not isinstance(eq, str) or "->" not in eq or "..." in eq:
                return
            ins, res = eq.replace(" ", "").split("->")
            subs = ins.split(",")
            if len(subs) != len(ops):
                return
            pairs = [(o, [i for i, c in enumerate(sub) if c not in res])
                     for o, sub in zip(ops, subs) if isinstance(o, torch.Tensor)]
        elif name == "baddbmm" or len(args) < 2:
            return
        else:
            a, b = args[0], args[1]
            pairs = [(a, [a.dim() - 1] if isinstance(a, torch.Tensor) else []),
                     (b, [b.dim() - 2] if isinstance(b, torch.Tensor) and b.dim() >= 2 else [])]
        for t, summed in pairs:
            d = _tag(t) if isinstance(t, torch.Tensor) else None
            if d is None or d.get("sw") is None or len(summed) != 1:
                continue
            site, (qax, kax) = d["sw"], d["swaxes"]
            if summed[0] == qax:
                self._swap(site)

    def _swap(self, site):
        """The site with its query and key exchanged (_value_product), once."""
        pairs = getattr(site, "pairs", None)
        if pairs is None or getattr(site, "swapped", False):
            return
        new = self._site_from_pairs(pairs[1], pairs[0], site.via)
        if new is None:
            return
        order = site.order
        site.__dict__.update(new.__dict__)
        site.order, site.swapped, site.pairs = order, True, (pairs[1], pairs[0])

    def _confirm(self, site):
        if site.order:
            return
        site.order = 1 + len(self.obs.attention) + len(self.obs.routers)
        self.obs.attention.append(site)

    # ---- routers -----------------------------------------------------------------------

    def _router_src(self, t, dim, sh=None):
        """The source whose all rows, in order, t's axis `dim` carries."""
        sh = _shadow(t) if sh is None else sh
        if sh is None or sh.dim() == 0:
            return None
        dim = dim % sh.dim()
        if dim != sh.dim() - 1:
            return None
        line = sh[(0,) * (sh.dim() - 1)]
        v0 = int(line[0])
        if v0 < 0:
            return None
        src = self.obs.sources[v0 >> _SHIFT]
        e = line.shape[0]
        start = v0 & ((1 << _SHIFT) - 1)
        # all E rows, or one of equal chunks of them (a noisy gate's
        # Linear(d, 2E) chunked into E logits and E noise scales)
        if e < 2 or e > _ROUTER_MAX_E or src.rows % e or start % e:
            return None
        want = torch.arange(e, device=line.device) + v0
        if not torch.equal(line, want) or not torch.equal(sh, line.expand_as(sh)):
            return None
        if src.rows != e:
            src = self._source(src.pname, src.param, src.row_off[start:start + e], src.stride,
                               src.width, src.how)
            src.fresh = self.obs.sources[v0 >> _SHIFT].fresh
            src.chunk_of = self.obs.sources[v0 >> _SHIFT]
        return src

    def _topk(self, name, args, kwargs, out):
        t = args[0]
        if name == "topk":
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            idx = out[1]
        elif name == "argmax":
            k, dim = 1, args[1] if len(args) > 1 else kwargs.get("dim")
            idx = out
        elif name in ("sort", "argsort"):  # sort(.., descending=True)[1][.., :k]: k is the slice
            dim = args[1] if len(args) > 1 and isinstance(args[1], int) else kwargs.get("dim",
                                                                                        -1)
            if name == "sort" and not isinstance(out, tuple):
                return
            k, idx = 0, (out[1] if name == "sort" else out)
        elif name == "multinomial":  # experts sampled from the router's probabilities
            k = args[1] if len(args) > 1 else kwargs.get("num_samples")
            dim, idx = -1, out
        else:  # max(dim)
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim is None or not isinstance(out, tuple):
                return
            k, idx = 1, out[1]
        if not isinstance(dim, int) or not isinstance(k, int):
            return
        if (_tag(t) or {}).get("act"):
            return
        src = self._router_src(t, dim)
        choice = None
        if src is None and name == "topk" and t.dim() == 2:
            # expert choice: each expert takes its top-k tokens from the
            # transposed [E, tokens] scores; a token gets k * E / tokens
            src = self._router_src(None, -1, _shadow(t).transpose(0, 1))
            if src is None or dim % 2 != 1:
                return
            choice = max(1, round(k * src.rows / t.shape[1]))
        if src is None:
            return
        site = self._router_site(src, t)
        self._new_idx.append((idx, site))
        if choice is not None:
            site.top_k = max(site.top_k, choice)
            site.normed = (site.normed + " " if site.normed else "") + "expert-choice"
            _set(idx, ridx=site)
            return
        if name in ("sort", "argsort"):
            site.sorted = True
        elif name == "multinomial" or (name == "topk" and k != 1):
            site.top_k = max(site.top_k, k)
        else:
            # GShard/DeepSpeed top-2 takes a second argmax (or topk(k=1):
            # lucidrains' top1()) over the logits with the first choice
            # masked: each one that picks other experts is one more choice
            # per token (a repeat is not).
            picks = site.argmax_picks
            flat = idx.detach().reshape(-1)
            if not any(p.shape == flat.shape and torch.equal(p, flat) for p in picks):
                picks.append(flat)
            site.top_k = max(site.top_k, len(picks))
            if name != "topk":
                _set(idx, ridx=site)
                return
        _set(idx, ridx=site, rdim=idx.dim())
        if len(self.passed) < _MAX_MIXES:  # handed to a scripted or C++ function: finish()
            self.passed.append(idx)

    def _passed(self, out):
        """Keeps top-k indices a cast or layout op passed on, for finish()."""
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            d = _tag(o)
            if d is not None and "ridx" in d and not d["ridx"].dispatched and \
                    len(self.passed) < _MAX_MIXES:
                self.passed.append(o)

    def finish(self):
        """After the forward: top-k indices, or a cast or copy of them
        (top_expert.int()), that no seen op then took and the forward did
        not return went to a kernel the pass cannot see (MegaBlocks' CUDA
        sort and histogram, a torch.jit.script dispatch function): that is
        their use, as it was before casts were followed."""
        for o in self.passed:
            d = _tag(o)
            r = getattr(o, _FLOW, None)
            if d is not None and not d["ridx"].dispatched and (r is None or not r[1]):
                self._uses("opaque kernel", (o,), {})
        _untag(self.passed)
        self.passed = []

    def _router_site(self, src, t):
        site = self.topks.get(src.index)
        if site is None:
            site = Site("router", 0)
            site.src = src
            site.normed = (_tag(t) or {}).get("normed", "")
            self.topks[src.index] = site
        return site

    def _kthvalue(self, args, kwargs, out):
        """probs.kthvalue(j, dim=-1): the j-th smallest of a router's E
        outputs, a threshold for a top-k mask (_threshold)."""
        t = args[0]
        j = args[1] if len(args) > 1 else kwargs.get("k")
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        if not isinstance(j, int) or not isinstance(dim, int) or not isinstance(out, tuple):
            return
        if (_tag(t) or {}).get("act"):
            return
        src = self._router_src(t, dim)
        if src is not None and 1 < j <= src.rows:
            _set(out[0], kth=(src, j))

    def _threshold(self, name, args, out):
        """probs >= probs.kthvalue(E - k + 1).values (or > kthvalue(E - k)):
        a mask of each token's top k experts, a routing choice like topk's."""
        x, thr = (args[0], args[1]) if _COMPARE[name] else (args[1], args[0])
        kth = (_tag(thr) or {}).get("kth")
        if kth is None or not isinstance(out, torch.Tensor) or (_tag(x) or {}).get("act"):
            return
        src, j = kth
        if self._router_src(x, -1) is not src:
            return
        strict = name in ("gt", "__gt__", "lt", "__lt__")
        k = src.rows - j + (0 if strict else 1)
        if not 1 <= k < src.rows:
            return
        site = self._router_site(src, x)
        site.top_k = max(site.top_k, k)
        _set(out, ridx=site)
        self._new_idx.append((out, site))

    def _mask_use(self, name, args, kwargs, out):
        """True when the op is no use of the top-k indices or mask it takes:
        a comparison makes a mask of them, a logical op or any/all passes
        a mask on, so does a sum or mean over some of its axes, and one
        over all of them (a scalar) is a statistic."""
        pairs = [(a, _tag(a)) for a in itertools.chain(_flat(args), _flat(kwargs.values()))]
        pairs = [(a, d) for a, d in pairs if d is not None and "ridx" in d]
        tagged = [d for _, d in pairs]
        if not tagged:
            return False
        mask = any(d.get("rmask") for d in tagged)
        if name in _MASK_MAKE and not mask:  # the indices compared: their width is taken
            if not all([self._width_used(d, a) for a, d in pairs]):
                return False  # a sort's full ranking compared: as before
        if name in _MASK_MAKE or (mask and name in _MASK_PASS):
            for o in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(o, torch.Tensor):
                    _set(o, ridx=tagged[0]["ridx"], rmask=True)
            self._passed(out)  # a mask no seen op takes (x[mask] on torch 1.13): finish()
            return True
        if not (mask and name in _MASK_STAT and all(d.get("rmask") for d in tagged)):
            return False
        if isinstance(out, torch.Tensor) and out.dim() == 0:
            return True  # a count or mean over everything: a statistic
        if isinstance(out, torch.Tensor):  # per token or per expert: still a mask's counts
            _set(out, ridx=tagged[0]["ridx"], rmask=True)
            self._passed(out)
        return True

    def _width_used(self, d, a):
        """Notes how many of the indices a (tags d) a use takes: a sort's
        slice [..., :k] is its k, a noisy top-k keeps k of k + 1. False for
        a sort's full ranking (no choice of experts)."""
        s = d["ridx"]
        if d.get("rmask"):
            return True  # a mask of indices whose width its comparison took
        if s.sorted:
            if d.get("rdim") is None or a.dim() != d["rdim"] or \
                    not 1 <= a.shape[-1] < s.src.rows:
                return False
            s.top_k = max(s.top_k, a.shape[-1])
        if d.get("rdim") is not None and a.dim() == d["rdim"] and a.shape[-1] >= 1:
            s.used_k = max(s.used_k, a.shape[-1])
        return True

    def _uses(self, name, args, kwargs):
        skip = args[0] if args and (name in _LAYOUT or name in _SAME) else None
        for a in itertools.chain(_flat(args), _flat(kwargs.values())):
            if a is skip:  # a view of the indices is no use of them
                continue
            d = _tag(a)
            if d is None and isinstance(a, torch.Tensor):  # idx[e], unseen on torch 1.13
                d = _tag(getattr(a, "_base", None))
            if d is not None and "ridx" in d:
                s = d["ridx"]
                if not self._width_used(d, a):
                    continue
                if not s.dispatched:
                    s.dispatched = True
                    s.order = 1 + len(self.obs.attention) + len(self.obs.routers)
                    self.obs.routers.append(s)

    # ---- propagation -------------------------------------------------------------------

    def _carry_score(self, name, args, kwargs, out):
        """A score through a Linear, a convolution or padding (_SCORE_CARRY)
        is still that score: the softmax it reaches confirms the q.k product
        it came from. Only when the score is the op's one input derived from
        the pass's projections and keeps its rank: the others are weights,
        biases or constants (a value mixed with another projection's output
        is judged as it is)."""
        x = args[0] if args else kwargs.get("input")
        site = (_tagd(x) or {}).get("score")
        if site is None or not isinstance(out, torch.Tensor) or out.dim() != x.dim() or \
                out.dim() < 2:
            return
        for a in itertools.chain(_flat(args[1:]), _flat(kwargs.values())):
            if isinstance(a, torch.Tensor) and a is not x and not self._is_weight(a):
                r = _flow_of(a)
                if r is not None and r[0]:
                    return
        _set(out, score=site, saxes=(_tagd(x) or {}).get("saxes"))

    def _after(self, name, func, args, kwargs, out):
        if name in _SCORE_CARRY:
            self._carry_score(name, args, kwargs, out)
        if not (name in _MASK_MAKE or name in _MASK_PASS or name in _MASK_STAT) or \
                not self._mask_use(name, args, kwargs, out):
            self._uses(name, args, kwargs)
        if name in _SCORE_OPS:
            self._weights_used(args)
            self._value_product(name, args)
        if name == "linear":
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            if self._linear(args[0] if args else kwargs.get("input"), w, out, "linear"):
                return
        if name in ("conv1d", "conv2d", "conv3d"):
            if self._conv(args, kwargs, out):
                return
        if name in ("matmul", "__matmul__", "mm") and len(args) == 2:
            # x @ W: W a weight, x none (a learned query computed from a
            # parameter, latents.expand(..) @ W, is an input)
            if self._is_weight(args[1]) and self._param(args[0]) is None and \
                    self._computed(args[0]) is None:
                if self._linear(args[0], args[1], out, "matmul"):
                    return
        if name == "__rmatmul__" and len(args) == 2:
            if self._param(args[0]) is not None and self._linear(args[1], args[0], out,
                                                                  "matmul"):
                return
        if name == "addmm" and len(args) >= 3 and self._param(args[2]) is not None:
            if self._linear(args[1], args[2], out, "matmul"):
                return
        if name == "einsum":
            eq, ops = _einsum_operands(args)
            if isinstance(eq, str) and all(isinstance(o, torch.Tensor) for o in ops):
                eq = _no_ellipsis(eq, ops)
                if eq is None:
                    return
                if self._einsum_projection(eq, ops, out):
                    return
                self._einsum_score(eq, ops, out)
            return
        if name in _SCORE_OPS:
            self._score(name, args, kwargs, out)
            self._expert_mix(name, args, out)
            return
        if name == "scaled_dot_product_attention":
            self._sdpa(args, kwargs, out)
            return
        if name == "multi_head_attention_forward":
            self._mha(func, args, kwargs)
            return
        if name in ("softmax", "log_softmax", "_softmax"):
            t = args[0] if args else kwargs.get("input")
            d = _tagd(t)
            dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
            if d is not None:
                site = d.get("score")
                # over the keys, or over the queries (Slot Attention's slots
                # compete for each input): the same q.k bilinear form. The
                # axes are the ones the product put them on, wherever layout
                # ops moved them (time-first [i, j, b, n] scores softmax'd
                # over dim 1); unknown, either of the last two
                ax = d.get("saxes")
                if site is not None and isinstance(dim, int) and t.dim() >= 2 and (
                        dim % t.dim() in ax if ax is not None else
                        dim % t.dim() >= t.dim() - 2):
                    self._confirm(site)
                    if ax is not None and dim % t.dim() == ax[0] and \
                            isinstance(out, torch.Tensor) and out.shape == t.shape:
                        # over the left operand's axis: the keys (k @ q^T) or the
                        # queries (slots competing); the value product says which
                        _set(out, sw=site, swaxes=ax)
                if "sh" in d and isinstance(out, torch.Tensor) and out.shape == t.shape:
                    _set(out, sh=d["sh"], normed="softmax")
            if (d is None or "sh" not in d) and isinstance(dim, int) and t.dim() and \
                    dim % t.dim() == t.dim() - 1:
                _set(out, smax=True)  # a distribution over the last axis (_expert_mix)
            return
        if name in ("topk", "argmax", "max", "sort", "argsort", "multinomial"):
            if args and _shadow(args[0]) is not None:
                self._topk(name, args, kwargs, out)
            return
        if name in ("__setitem__", "copy_"):
            self._write(name, args)
            return
        if name == "view_as_complex":
            sh = _shadow(args[0])
            if sh is not None and sh.shape[-1] == 2:
                _set(out, sh=sh, cplx=True)
            return
        if name == "view_as_real":
            d = _tag(args[0])
            if d is not None and d.get("cplx"):
                _set(out, sh=d["sh"])
            return
        if name in _LAYOUT or name in _SAME:
            self._layout(name, func, args, kwargs, out)
            self._passed(out)
            return
        if name in _STACK:
            self._stack(func, args, kwargs, out)
            return
        if name in ("exp", "exp_", "exp2") and args:
            d = _tagd(args[0])
            if d is not None and d.get("score") is not None:
                self._confirm(d["score"])  # softmax written out (a flash kernel's exp(s - m))
        if name == "scatter" and args and isinstance(out, torch.Tensor):
            d = _tagd(args[0])  # values written into a labelled tensor (a mask): labels stay
            if d is not None and "sh" in d and d["sh"].shape == out.shape:
                _set(out, sh=d["sh"], **{k: v for k, v in d.items() if k == "normed"})
            return
        if name == "kthvalue" and args and _shadow(args[0]) is not None:
            self._kthvalue(args, kwargs, out)
            return
        if name == "sum":
            self._dot_sum(args, kwargs, out)
            return
        if name in _NOT_ELEMENTWISE:
            return
        if _custom_op(func) and self._opaque_projection(args, out):
            return
        if ("attn" in name or "attention" in name) and \
                any(isinstance(a, torch.Tensor) for a in args):
            self._fused_attention(name, args, out)
            return
        if name in _MUL:
            self._pair_product(args, out)
        self._elementwise(name, args, kwargs, out)
        if name in _COMPARE and len(args) >= 2:
            self._threshold(name, args, out)

    def _fused_attention(self, name, args, out):
        """An attention kernel reached as a torch op (flash-attn, xformers,
        TransformerEngine's fused attention): q and k are its first
        floating tensors, [B, H, T, D] or [B, T, H, D] (the token axis is
        the one the labels do not vary along), also as packed inputs (q, k
        and v stacked on an axis of 3: flash-attn's qkvpacked; k and v on an
        axis of 2 after a separate q: kvpacked), unpadded varlen
        [total, H, D], or xformers' BMGHK [B, M, G, H, K] (heads G * H)."""
        ts = []
        for a in args:
            if not isinstance(a, torch.Tensor) or not a.is_floating_point():
                break
            ts.append(a)
        sh = [_shadow(t) for t in ts[:3]]
        if not sh or sh[0] is None:
            return
        if len(ts) == 1:
            qk = _unpack(sh[0], 3)
            sq, sk = qk[:2] if qk is not None else (None, None)
        elif len(ts) == 2 and sh[1] is not None and sh[1].dim() == sh[0].dim() + 1:
            kv = _unpack(sh[1], 2)
            sq, sk = sh[0], kv[0] if kv is not None else None
        else:
            sq, sk = sh[0], sh[1] if len(sh) > 1 else None
        sq, sk = _heads_4d(sq), _heads_4d(sk)
        if sq is None or sk is None:
            return

        def const(t, ax):
            return torch.equal(t.narrow(ax, 0, 1).expand_as(t), t)
        if not (const(sq, 2) and const(sk, 2)) and const(sq, 1) and const(sk, 1):
            sq, sk = sq.transpose(1, 2), sk.transpose(1, 2)
        if sq.shape[1] != sk.shape[1] and sk.shape[1] and sq.shape[1] % sk.shape[1] == 0:
            sk = sk.repeat_interleave(sq.shape[1] // sk.shape[1], dim=1)
        before = len(self.candidates)
        self._candidate(sq, sk, out, name)
        if len(self.candidates) > before:
            self._confirm(self.candidates[-1])

    def _opaque_projection(self, args, out):
        """An operator the pass cannot see into (a torch.library op: a
        fused layer norm + GEMM, an FP8 GEMM) taking activations x and a
        2-D projection weight W, whose output is x's shape with W's rows
        (or, W stored [in, out], its columns) as the last axis: a
        projection by W, as F.linear (what it does to x before the GEMM,
        a norm or a cast, does not change which row makes which output
        feature). True when it labelled the output."""
        o = out if isinstance(out, torch.Tensor) else next(
            (t for t in out if isinstance(t, torch.Tensor)), None) \
            if isinstance(out, (tuple, list)) else None
        if o is None or o.dim() < 2:
            return False
        ts = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        ws = [w for w in ts if w.dim() == 2 and self._is_weight(w)]
        xs = [x for x in ts if x.dim() >= 2 and not self._is_weight(x)
              and x.shape[:-1] == o.shape[:-1]]
        for w in ws:
            for x in xs:
                if x.shape[-1] == w.shape[1] and o.shape[-1] == w.shape[0]:
                    return self._linear(x, w, o, "linear")
                if x.shape[-1] == w.shape[0] and o.shape[-1] == w.shape[1]:
                    return self._linear(x, w, o, "matmul")
        return False

    def _pair_product(self, args, out):
        """q * k elementwise, both sides labelled, each pairing rows of one
        token with rows of another: both picked by an index tensor (a
        graph's q[dst] * k[src] per edge) or broadcast against each other
        (q[:, :, None] * k[:, None]). Tags the product with both sides'
        labels; summed over an axis it is a score (_dot_sum)."""
        ts = [a for a in args[:2] if isinstance(a, torch.Tensor)]
        if len(ts) != 2 or not isinstance(out, torch.Tensor) or out.dim() < 2:
            return
        a, b = ts
        da, db = _tagd(a) or self._unseen_rows(a), _tagd(b) or self._unseen_rows(b)
        if not da or not db or da.get("sh") is None or db.get("sh") is None or \
                da.get("cplx") or db.get("cplx"):
            return

        def ones(x):
            n = out.dim() - x.dim()
            return {i for i in range(out.dim()) if (i < n or x.shape[i - n] == 1)
                    and out.shape[i] > 1}
        outer = bool(ones(a) - ones(b)) and bool(ones(b) - ones(a))
        if not (outer or (da.get("gath") and db.get("gath"))):
            return
        try:
            pair = (da["sh"].expand(out.shape), db["sh"].to(da["sh"].device).expand(out.shape))
        except RuntimeError:
            return
        _set(out, pdot=pair)

    def _note_recent(self, t):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.is_floating_point():
            self.recent.append(weakref.ref(t))
            del self.recent[:-_RECENT]

    def _unseen_rows(self, t):
        """Labels of rows picked by an index the pass did not see (torch
        1.13 does not route tensor indexing, q[dst], through the mode): a
        fresh tensor whose every slice along its first axis equals one of a
        recently labelled tensor of the same trailing shape is those rows."""
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or not t.is_floating_point() or \
                _tag(t) is not None or getattr(t, _FLOW, None) is not None or \
                getattr(t, "_base", None) is not None or t.shape[0] < 1:
            return None
        for ref in reversed(self.recent):
            x = ref()
            d = _tag(x) if x is not None else None
            if d is None or d.get("sh") is None or d.get("cplx") or x.dtype != t.dtype or \
                    x.device != t.device or x.shape[1:] != t.shape[1:] or \
                    x.shape[0] * t.shape[0] * max(1, t[0].numel()) > _MAX_MATCH:
                continue
            xf, tf = x.reshape(x.shape[0], -1), t.reshape(t.shape[0], -1)
            if not bool((xf == tf[:1]).all(-1).any()):
                continue  # its first row is none of x's: no need to compare the rest
            eq = (tf[:, None] == xf[None]).all(-1)
            if not bool(eq.any(1).all()):
                continue
            return {"sh": d["sh"][eq.int().argmax(1).to(d["sh"].device)], "gath": True}
        return None

    def _dot_sum(self, args, kwargs, out):
        """(q * k).sum(head_dim) of a tagged product (_pair_product): a q.k
        score per pair, heads read from the labels along the summed axis;
        confirmed as any score is, by a softmax or exp (a scatter softmax)."""
        t = args[0] if args else kwargs.get("input")
        pd = (_tag(t) or {}).get("pdot")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if isinstance(dim, (list, tuple)) and len(dim) == 1:
            dim = dim[0]
        if pd is None or not isinstance(out, torch.Tensor) or not isinstance(dim, int) or \
                out.dim() != t.dim() - 1:
            return
        d = dim % t.dim()
        self._pair_site(*(x.movedim(d, -1) for x in pd), out, "mul-sum")

    def _pair_site(self, qa, kb, out, via):
        """A score candidate from q and k labels paired position by position,
        the contracted axis last: heads from the distinct (q row, k row)
        pairs, in the order first seen."""
        k = qa.shape[-1]
        rows = torch.cat([qa.reshape(-1, k), kb.reshape(-1, k)], 1)
        if k < 2 or bool((rows < 0).any()):
            return
        u, inv = torch.unique(rows, dim=0, return_inverse=True)
        if u.shape[0] > _MAX_PAIRS:
            return
        pos = torch.arange(inv.shape[0], device=inv.device)
        first = torch.full((u.shape[0],), inv.shape[0], dtype=torch.long, device=inv.device)
        first = first.scatter_reduce(0, inv, pos, reduce="amin")
        u = u[first.argsort()].cpu()  # pairs in the order first seen
        site = self._site_from_pairs(u[:, :k], u[:, k:], via)
        if site is None or site.reason is not None or site.n_heads < 1:
            return
        self.candidates.append(site)
        _set(out, score=site, saxes=None)

    def _layout(self, name, func, args, kwargs, out):
        if not args:
            return
        d = _tagd(args[0])
        if d is None:
            return
        if d.get("sw") is not None:  # softmax'd weights (_value_product): their axes move
            for o in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(o, torch.Tensor):
                    ax = d["swaxes"] if o.shape == args[0].shape and name in _SAME else \
                        _score_axes(name, func, args, kwargs, o, d["swaxes"])
                    if ax is not None:
                        _set(o, sw=d["sw"], swaxes=ax)
        if name in _GATHER and d.get("sh") is not None and any(
                isinstance(a, torch.Tensor) and not a.is_floating_point() and
                a.dtype != torch.bool and a.numel() > 1
                for a in _flat(list(args[1:]) + list(kwargs.values()))):
            gath = {"gath": True}
        else:
            gath = {}
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if name in _SAME:
            for o in outs:
                if isinstance(o, torch.Tensor) and "sh" in d and o.shape[:len(d["sh"].shape)] \
                        == d["sh"].shape[:o.dim()]:
                    sh = d["sh"]
                    if sh.device != o.device:
                        sh = sh.to(o.device)
                    _set(o, sh=sh, **{k: v for k, v in d.items() if k in (
                        "score", "normed", "cplx", "act", "lin", "pdot", "gath")})
                elif isinstance(o, torch.Tensor):
                    _set(o, **{k: v for k, v in d.items() if k in _CARRIED})
                if isinstance(o, torch.Tensor) and "score" in d:
                    _set(o, saxes=d.get("saxes") if o.shape == args[0].shape else None)
            return
        if d.get("cplx"):
            return
        sh = d.get("sh")
        if sh is not None:
            rest = list(args)
            rest[0] = sh
            try:
                res = func(*rest, **kwargs)
            except RuntimeError:
                rest[0] = sh.contiguous()
                res = func(*rest, **kwargs)
            res_t = res if isinstance(res, (tuple, list)) else (res,)
            for o, r in zip(outs, res_t):
                if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and \
                        r.shape == o.shape:
                    _set(o, sh=r, **({"lin": d["lin"]} if "lin" in d else {}), **gath)
                    self._note_recent(o)
        if any(k in d for k in _CARRIED):
            for o in outs:
                if isinstance(o, torch.Tensor):
                    _set(o, **{k: v for k, v in d.items() if k in _CARRIED and
                               (k != "rdim" or o.dim() == v)})
                    if "score" in d:
                        _set(o, saxes=_score_axes(name, func, args, kwargs, o,
                                                  d.get("saxes")))

    def _stack(self, func, args, kwargs, out):
        seq = args[0] if args else kwargs.get("tensors")
        if not isinstance(seq, (list, tuple)) or not isinstance(out, torch.Tensor):
            return
        if not any(_shadow(t) is not None for t in seq):
            return
        parts = []
        for t in seq:
            sh = _shadow(t)
            if sh is None:
                sh = torch.full(t.shape, _NONE, dtype=torch.long, device=t.device)
            parts.append(sh.to(out.device))
        res = func(parts, *args[1:], **kwargs)
        if isinstance(res, torch.Tensor) and res.shape == out.shape:
            _set(out, sh=res)

    def _write(self, name, args):
        if name == "copy_" and len(args) >= 2:
            dst, src = args[0], args[1]
            sh = _shadow(src)
            if sh is None or not isinstance(dst, torch.Tensor):
                return
            try:
                base = getattr(dst, "_base", None)
                if base is not None and base.is_contiguous():
                    # a write into a slice of a fresh tensor (key_states[..., :n].copy_(k))
                    sb = _shadow(base)
                    sb = (torch.full(base.shape, _NONE, dtype=torch.long, device=base.device)
                          if sb is None else sb.contiguous().clone())
                    view = sb.as_strided(dst.shape, dst.stride(),
                                         dst.storage_offset() - base.storage_offset())
                    view.copy_(sh.to(sb.device).expand(dst.shape))
                    _set(base, sh=sb)
                _set(dst, sh=sh.expand(dst.shape))
            except RuntimeError:
                pass
            return
        if len(args) < 3:
            return
        dst, idx, val = args[0], args[1], args[2]
        sv = _shadow(val)
        if sv is None or not isinstance(dst, torch.Tensor):
            return
        sd = _shadow(dst)
        base = (sd.clone() if sd is not None else
                torch.full(dst.shape, _NONE, dtype=torch.long, device=dst.device))
        if not base.is_contiguous() or base.stride() != tuple(
                torch.empty(base.shape).stride()):
            base = base.contiguous()
        try:
            base[idx] = sv
        except (RuntimeError, IndexError, TypeError):
            return
        _set(dst, sh=base)

    def _elementwise(self, name, args, kwargs, out):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        tagged = [(a, _tagd(a)) for a in itertools.chain(_flat(args), _flat(kwargs.values()))]
        tagged = [(a, d) for a, d in tagged if d is not None]
        if not tagged:
            return
        labelled = [(a, d["sh"]) for a, d in tagged if d.get("sh") is not None
                    and not d.get("cplx")]
        if len(labelled) == 2 and isinstance(out, torch.Tensor) and \
                labelled[0][1].shape == labelled[1][1].shape == out.shape:
            self._mix(labelled[0][1], labelled[1][1], out.shape)
        for o in outs:
            if not isinstance(o, torch.Tensor):
                continue
            for a, d in tagged:
                sh = d.get("sh")
                keep = {k: v for k, v in d.items() if k in ("score", "normed", "saxes", "sw",
                                                              "swaxes")
                        and tuple(a.shape) == tuple(o.shape)}
                if name == "sigmoid" and sh is not None:
                    keep["normed"] = "sigmoid"
                if name in _ACTIVATIONS or d.get("act"):
                    keep["act"] = d.get("act") or name
                if sh is not None and not d.get("cplx"):
                    try:
                        if torch.broadcast_shapes(sh.shape, o.shape) == o.shape:
                            _set(o, sh=sh.to(o.device).expand(o.shape), **keep)
                            break
                    except RuntimeError:
                        pass
                elif sh is not None and d.get("cplx") and o.is_complex():
                    try:
                        _set(o, sh=sh.expand(*o.shape, 2), cplx=True)
                        break
                    except RuntimeError:
                        pass
                if keep:
                    _set(o, **keep)
                    break


# ---- the pass --------------------------------------------------------------------------------

def _first(model, kinds):
    for m in model.modules():
        if isinstance(m, kinds):
            return m
    return None


def _width(model):
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            return m.embed_dim
        if isinstance(m, nn.Linear):
            return m.in_features
        if isinstance(m, nn.LayerNorm) and m.normalized_shape:
            return m.normalized_shape[-1]
        for p in m.parameters(recurse=False):
            if p.dim() == 2:
                return p.shape[-1]
            if p.dim() == 1 and p.is_floating_point():
                return p.shape[0]
    return None


def _grid(model):
    """The side of a ViT's square patch grid from its learned position
    embedding ([1, n (+1 class token), d], named *pos*), or None."""
    for n, p in model.named_parameters():
        if "pos" in n.rpartition(".")[2] and p.dim() == 3 and p.shape[0] == 1:
            for k in (p.shape[1], p.shape[1] - 1):
                r = int(round(k ** 0.5))
                if r > 0 and r * r == k:
                    return r
            return None
    return None


def _first_weighted(model):
    """The first module (in module order) that holds a weight of its own."""
    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)):
            return m
    return None


def _widths(model):
    """_width first, then the other input widths of Linear and LayerNorm
    modules in module order (a context or media stream of its own width:
    Perceiver's inputs, Flamingo's visual features), at most _PROBE_WIDTHS."""
    out = []
    first = _width(model)
    if first:
        out.append(first)
    for m in model.modules():
        w = (m.in_features if isinstance(m, nn.Linear) else m.normalized_shape[-1]
             if isinstance(m, nn.LayerNorm) and m.normalized_shape else m.kdim
             if isinstance(m, nn.MultiheadAttention) else None)
        if w and w not in out:
            out.append(w)
        if len(out) >= _PROBE_WIDTHS:
            break
    return out


def probe_inputs(model, batch=1, seq=8):
    """Candidate probe inputs [(description, args, kwargs)] for model's forward."""
    try:
        p = next(model.parameters())
        dev, dt = p.device, (p.dtype if p.is_floating_point() else torch.float32)
    except StopIteration:
        dev, dt = torch.device("cpu"), torch.float32
    try:
        sig = inspect.signature(model.forward)
        names = [n for n, q in sig.parameters.items()
                 if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)
                 and q.default is inspect.Parameter.empty]
        extra = {"use_cache": False} if "use_cache" in sig.parameters else {}
        params = set(sig.parameters)
        # forward(self, *, input_ids, attention_mask=None): required keyword-only arguments
        kwonly = [n for n, q in sig.parameters.items()
                  if q.kind == q.KEYWORD_ONLY and q.default is inspect.Parameter.empty]
    except (TypeError, ValueError):
        names, extra, params, kwonly = ["x"], {}, set(), []
    out = []
    gen = torch.Generator().manual_seed(0)  # the probe draws nothing from torch's RNG

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=dt)
    emb = _first(model, nn.Embedding)
    if emb is not None:
        ids = torch.randint(0, max(1, min(emb.num_embeddings, 64)), (batch, seq),
                            generator=gen).to(dev)
        kw = dict(extra)
        kw.update({n: None if "mask" in n else ids for n in kwonly})
        # every required positional argument: token ids, None for a mask
        args = tuple(None if "mask" in n else ids for n in names) or (() if kwonly else (ids,))
        out.append((f"token ids [{batch}, {seq}]", args, kw))
        if len(names) > 1:  # a second stream beside the tokens (media, context): floats
            for w in _widths(model):
                more = tuple(None if "mask" in n else randn(batch, seq, w) for n in names[1:])
                out.append((f"token ids [{batch}, {seq}] and floats [{batch}, {seq}, {w}]",
                            (ids,) + more, dict(kw)))
        if len(names) == 1 and not kwonly:  # forward(batch): a data loader's dict, whole
            out.append((f"a dict batch {{'input_ids': token ids [{batch}, {seq}]}}",
                        ({"input_ids": ids},), dict(kw)))
        if "decoder_input_ids" in params:
            kw2 = dict(kw)
            kw2["decoder_input_ids"] = ids
            out.insert(0, (f"token ids [{batch}, {seq}] (encoder and decoder)", (ids,), kw2))
    conv = _first(model, nn.Conv2d)
    firsts = []     # (description, first input) of a model that begins with a convolution
    if conv is not None:
        size = None
        for m in model.modules():  # the model's, or its image encoder's (an encoder-decoder)
            size = getattr(getattr(m, "patch_embed", None), "img_size", None)  # timm
            if size is None:
                size = getattr(getattr(m, "config", None), "image_size", None)  # transformers
            if size is not None:
                break
        size = size[0] if isinstance(size, (tuple, list)) else size
        size = size if isinstance(size, int) else conv.kernel_size[0] * 4
        sizes = [size]
        side = _grid(model)  # a ViT's learned positions fix its patch grid
        if side and side * conv.stride[0] not in sizes:
            sizes.append(side * conv.stride[0])
        for size in sizes:
            img = randn(batch, conv.in_channels, size, size)
            desc = f"images [{batch}, {conv.in_channels}, {size}, {size}]"
            out.append((desc, (img,), dict(extra)))
            firsts.append((desc, img))
    c1 = _first_weighted(model)
    if isinstance(c1, nn.Conv1d):
        # channel-first [B, C, T] (audio features, a waveform): T long
        # enough for a strided front end, then short for few positions
        for t in (_PROBE_LONG, 2 * seq):
            firsts.append((f"floats [{batch}, {c1.in_channels}, {t}]",
                           randn(batch, c1.in_channels, t)))
            if c1.in_channels == 1:  # a raw waveform [B, samples]
                firsts.append((f"floats [{batch}, {t}]", randn(batch, t)))
    for desc, x in firsts:
        # the first input, then for the other required arguments token ids
        # (a decoder's), or one small integer per example (timesteps, class
        # labels, lengths); None for a mask
        rest = [("", None)]
        if len(names) > 1:
            rest = [(" and one integer per example", torch.ones(batch, dtype=torch.long,
                                                                 device=dev))]
            if emb is not None:
                rest.insert(0, (f" and token ids [{batch}, {seq}]", ids))
        for more, v in rest:
            if not more and desc.startswith("images"):
                continue  # tried above
            args = (x,) + tuple(None if "mask" in n else v for n in names[1:])
            out.append((desc + more, args, dict(extra)))
    for i, d in enumerate(_widths(model)):
        x = randn(batch, seq, d)
        x2 = randn(seq, d)
        for desc, v in ((f"floats [{batch}, {seq}, {d}]", x), (f"floats [{seq}, {d}]", x2)):
            kw = dict(extra)
            kw.update({n: None if "mask" in n else v for n in kwonly})
            out.append((desc, tuple(None if "mask" in n else v for n in names)
                        or (() if kwonly else (v,)), kw))
            if i:
                break
    return out


class _Restore:
    """RNG states and every buffer, put back on exit."""

    def __init__(self, model, kept=None):
        self.model = model
        self.kept = kept    # gets the tensors the forward left on its modules

    def __enter__(self):
        self.rng = torch.get_rng_state()
        self.cuda = (torch.cuda.get_rng_state_all() if torch.cuda.is_available()
                     and torch.cuda.is_initialized() else None)
        # (module, name, the buffer object, its values): a forward that
        # replaces a buffer (a rotary cache rebuilt) gets the old one back
        self.bufs = [(m, n, b, b.detach().clone()) for m in self.model.modules()
                     for n, b in m._buffers.items() if b is not None]
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for m, n, b, v in self.bufs:
                if m._buffers.get(n) is not b:
                    m._buffers[n] = b
                if b.shape == v.shape:
                    b.copy_(v)
                else:  # resized in place
                    b.data = v
        torch.set_rng_state(self.rng)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        # tensors a forward keeps on its modules (self.attn = p_attn) lose their labels
        held = [v for m in self.model.modules() for v in vars(m).values()
                if isinstance(v, torch.Tensor)]
        if self.kept is not None:
            try:
                self.kept(held)
            except Exception:
                pass
        _untag(held + [b for _, _, b, _ in self.bufs])
        return False


def _looped_vmap(vmap):
    """vmap(func, in_dims, out_dims) that, for flat positional arguments
    (in_dims an int, or one int or None per argument) and a tensor or a
    tuple of tensors out, calls func once per index of the mapped axis and
    stacks the results: the pass then sees each call's ops on slices of
    the real weights (one head's attention vmapped over stacked [H, dh, d]
    weights reads as a loop over heads), which a batched tensor hides.
    Anything else, or any failure, is the real vmap."""
    def wrapped(func, in_dims=0, out_dims=0, *vargs, **vkw):
        real = vmap(func, in_dims, out_dims, *vargs, **vkw)

        def call(*args, **kwargs):
            dims = [in_dims] * len(args) if isinstance(in_dims, int) else in_dims
            if kwargs or not isinstance(dims, (tuple, list)) or len(dims) != len(args) or \
                    not all(d is None or (isinstance(d, int) and isinstance(a, torch.Tensor))
                            for a, d in zip(args, dims)):
                return real(*args, **kwargs)
            sizes = {a.shape[d] for a, d in zip(args, dims) if d is not None}
            if len(sizes) != 1:
                return real(*args, **kwargs)
            try:
                outs = [func(*[a.select(d, i) if d is not None else a
                               for a, d in zip(args, dims)]) for i in range(sizes.pop())]
                if all(isinstance(o, torch.Tensor) for o in outs) and isinstance(out_dims, int):
                    return torch.stack(outs, out_dims)
                if all(isinstance(o, tuple) for o in outs):
                    od = [out_dims] * len(outs[0]) if isinstance(out_dims, int) else out_dims
                    return tuple(torch.stack([o[j] for o in outs], od[j])
                                 for j in range(len(outs[0])))
            except Exception:
                pass
            return real(*args, **kwargs)
        return call
    return wrapped


class _LoopedVmap:
    """torch.vmap, torch.func.vmap and functorch.vmap replaced by
    _looped_vmap for the observed pass (module attributes: code that
    looks vmap up when it runs; a name bound at import keeps the real
    one), put back on exit."""

    def __enter__(self):
        self.saved = []
        homes = [torch, getattr(torch, "func", None), sys.modules.get("functorch")]
        for m in homes:
            v = getattr(m, "vmap", None) if m is not None else None
            if callable(v):
                self.saved.append((m, v))
                try:
                    m.vmap = _looped_vmap(v)
                except (AttributeError, TypeError):
                    self.saved.pop()
        return self

    def __exit__(self, *exc):
        for m, v in self.saved:
            m.vmap = v
        return False


def _eager(fn):
    """fn with TorchDynamo off for its whole call (compiled submodules run
    eagerly, so the mode sees their ops and nothing is recompiled)."""
    dynamo = sys.modules.get("torch._dynamo")  # not imported: nothing is compiled
    disable = getattr(dynamo, "disable", None) if dynamo is not None else None
    return disable(fn) if disable is not None else fn


def _untag(tensors):
    for t in tensors:
        for attr in (_ATTR, _FLOW, _PROD, _VIEWS):
            if hasattr(t, attr):
                try:
                    delattr(t, attr)
                except AttributeError:
                    pass


def _leaves(obj, depth=0):
    """The tensors of a forward's result (tuples, lists, dicts, ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 8 and isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _leaves(x, depth + 1)
    elif depth < 8 and isinstance(obj, dict):
        for x in obj.values():
            yield from _leaves(x, depth + 1)


def _cached(computed):
    """parametrize.cached() when the model has parametrizations: one value
    per forward, which the pass can recognise when F.linear gets it."""
    if computed:
        try:
            from torch.nn.utils import parametrize
            return parametrize.cached()
        except (ImportError, AttributeError):
            pass
    return contextlib.nullcontext()


def observe(model, example_input=None, example_kwargs=None, label="example_input"):
    """One observed forward pass of model (Observation). example_input: a
    tensor, a tuple of positional arguments or a dict of keyword arguments;
    None tries probe batches (probe_inputs) until one runs. label names the
    input in Observation.error (the Monitor's "the first batch"). Never
    raises: Observation.error says why nothing was seen."""
    obs = Observation()
    if TorchFunctionMode is None:
        obs.error = f"torch {torch.__version__} has no TorchFunctionMode"
        return obs
    params = {id(p): n for n, p in model.named_parameters()}
    owners = {id(p): (m, n) for m in model.modules()
              for n, p in m.named_parameters(recurse=False)}
    if example_input is not None or example_kwargs:
        if isinstance(example_input, dict):
            tries = [(label, (), dict(example_input))]
        elif isinstance(example_input, (tuple, list)):
            tries = [(label, tuple(example_input), dict(example_kwargs or {}))]
        elif example_input is None:
            tries = [(label, (), dict(example_kwargs))]
        else:
            tries = [(label, (example_input,), dict(example_kwargs or {}))]
        try:  # no key/value cache from this pass
            if "use_cache" in inspect.signature(model.forward).parameters:
                for _, _, kw in tries:
                    kw.setdefault("use_cache", False)
        except (TypeError, ValueError):
            pass
    else:
        # seq 8, then 2 for a model with fewer positions than that
        tries = probe_inputs(model) + [t for t in probe_inputs(model, seq=2)
                                       if t[0].startswith("token ids")]
        if not tries:
            obs.error = "no probe input could be built (no embedding, Linear or norm width)"
            return obs
    errors = []
    target = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the eager module
    try:  # computed weights (effective.py): LoRA adapters, parametrizations, weight_norm
        lora, fresh, computed = (effective.lora_parameters(model), effective.lora_bases(model),
                                 effective.computed(model))
    except Exception:
        lora, fresh, computed = set(), {}, []
    for desc, args, kwargs in tries:
        trial = Observation()
        tracker = _Tracker(params, trial)
        tracker.owners = owners
        tracker.lora, tracker.fresh, tracker.computed = lora, dict(fresh), computed
        result = None
        kept = []   # flow records of tensors the forward left on its modules (a metric)
        try:
            with _Restore(model, lambda held: kept.extend(
                    r for r in (getattr(t, _FLOW, None) for t in held) if r is not None)), \
                    torch.no_grad(), _cached(computed), _LoopedVmap(), tracker:
                result = _eager(target)(*args, **kwargs)
        except Exception as e:  # the model did not take this input: next one
            text = str(e).splitlines()[0][:160] if str(e) else ""
            errors.append(f"{desc}: {type(e).__name__}: {text}")
            continue
        finally:
            _untag(list(_flat(args)) + list(_flat(kwargs.values())))
        outs = []
        try:
            outs = list(_leaves(result))
            for t in outs:  # what the forward returns is used
                r = getattr(t, _FLOW, None)
                if r is not None:
                    r[1] = True
            tracker.finish()
        except Exception:
            tracker.failures += 1
        try:
            reach = set()
            for t in outs:  # what the forward returns is used
                r = getattr(t, _FLOW, None)
                if r is not None:
                    r[1] = True
                    reach |= r[0]
            _untag(outs)
            # Top-k indices that dispatch reach what the forward returns, or
            # a kernel the pass cannot see; indices whose every use ends in a
            # value kept on a module or dropped (an accuracy metric:
            # logits.argmax(-1) == labels) chose no experts.
            # Positive evidence only: a kept value derives from them, and
            # nothing returned, dropped or passed to an unseen kernel does
            # (an op the mode does not see, torch 1.13's integer indexing,
            # breaks the trail: such indices stay routers).
            held = {id(r) for r in kept}
            stored = set()
            for r in kept:
                stored |= r[0]
            for r in tracker.flows:
                if not r[1] and id(r) not in held:
                    reach |= r[0]
            reach |= tracker.escaped
            trial.routers = [s for s in trial.routers if ("idx", id(s)) in reach
                             or ("idx", id(s)) not in stored]
            trial.escaped = set(tracker.escaped)
            for srcs, used in tracker.flows:
                if not used:  # taken by no op the pass saw: an opaque kernel's input
                    trial.escaped |= srcs
            trial.met = set(tracker.met)
            trial.normed = list(tracker.normed)
            if tracker.flow_failed:
                raise RuntimeError("flow bookkeeping failed")
        except Exception:
            tracker.failures += 1
            trial.escaped = {s.index for s in trial.sources}
        del result
        trial.input_desc = desc
        trial.failures = tracker.failures
        # confirmed later in the pass (the same module run again with a softmax): attention
        trial.unnormed = [s for s in tracker.unnormed if not s.order]
        lists = {n for n, m in model.named_modules() if isinstance(m, (nn.ModuleList,
                                                                        nn.Sequential))}
        try:
            trial.attention = merge_sites(drop_derived_keys(trial.attention), lists)
        except Exception:  # keep the sites as seen
            trial.failures += 1
        return trial
    if type(model).forward is nn.Module.forward or getattr(type(model).forward, "__name__",
                                                           "") == "_forward_unimplemented" \
            or (errors and all(_MISSING_FORWARD in str(e) for e in errors)):
        # The last: a base class's forward that only raises torch's own
        # "missing forward" error (Lightning's LightningModule.forward).
        obs.error = "the model has no forward()"
    else:
        what = ("a probe batch" if example_input is None and not example_kwargs else
                "the example input" if label == "example_input" else label)
        more = f" (+{len(errors) - 1} other probes)" if len(errors) > 1 else ""
        obs.error = f"its forward did not run on {what}: {errors[0]}{more}"
        obs.waits = example_input is None and not example_kwargs
    return obs
