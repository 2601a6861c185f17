"""Compares what discovery found in a zoo member with its Truth.

compare(model, found, truth) returns the list of what is wrong (empty when
the discovery is exactly right). A reported spec is paired with a truth site
by content: the spec's weight rows that equal rows of the site's weights
(random weights: no two rows of a model are equal). Then it must match
exactly: numbers, every query and key head's rows in order, the layer, and
nothing reported beyond the truth (Truth.not_reported names the parameters
that tempt a discoverer: MLP gates, per-head output gates, classifier heads,
state-space projections).

perfect(model, truth) builds the specs a correct discoverer would return
(the checker's self-test compares it, and broken copies of it).

verify_truth(model, inputs, truth) checks the truth itself against the
model's forward pass (its docstring says how).
"""
import types

import torch


def _matrix(p, r, write=False):
    """p as the 2-D matrix whose rows r.rows names (Rows' docstring); a view
    of p when write (scaled in place). A kernel-1 convolution weight
    [out, in, 1(, 1)] reads as [out, in] with or without r.conv."""
    flat = p.view if write else p.reshape
    kernel1 = p.dim() > 2 and all(n == 1 for n in p.shape[2:])
    if r.conv or (kernel1 and not r.t):
        return flat(p.shape[0], -1)
    return flat(p.shape[0], -1).t() if r.t else flat(-1, p.shape[-1])


def weight_rows(params, r):
    """[len(rows), d] float64 copy of the rows r names."""
    if r.eff is not None:
        with torch.no_grad():
            p = r.eff(params)
    else:
        p = params[r.param]
    return _matrix(p.detach().to("cpu", torch.float64), r)[list(r.rows)]


def stack(params, rows_list):
    return torch.cat([weight_rows(params, r) for r in rows_list], 0)


def _t64(x):
    return x.detach().to("cpu", torch.float64)


def _overlap(a, b):
    """Whether a [n, d] and b [m, d] share a row."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or not len(a) or not len(b):
        return False
    return bool((a[:, None, :] == b[None, :, :]).all(-1).any())


def _attention_rows(spec, errs):
    try:
        wq, wk = spec.get()
        wq, wk = _t64(wq), _t64(wk)
    except Exception as e:  # a broken getter is a wrong answer, not a crash of the test
        errs.append(f"attention {spec.name}: get() raised {e!r}")
        return None
    if wq.dim() != 2 or wk.dim() != 2:
        errs.append(f"attention {spec.name}: get() gave shapes {tuple(wq.shape)}, "
                    f"{tuple(wk.shape)} (want 2-D)")
        return None
    return wq, wk


def _router_rows(spec, errs):
    try:
        w = _t64(spec.get())
    except Exception as e:
        errs.append(f"router {spec.name}: get() raised {e!r}")
        return None
    if w.dim() != 2:
        errs.append(f"router {spec.name}: get() gave shape {tuple(w.shape)} (want [E, d])")
        return None
    return w


def _rows_text(r):
    rr = r.rows
    if rr.step != 1:
        return f"rows {rr.start}:{rr.stop}:{rr.step}"
    return f"rows {rr.start}-{rr.stop - 1}"


def _site(a):
    return f"attention {a.module} (block {a.block})"


def compare(model, found, truth):
    params = dict(model.named_parameters())
    errs = []
    att = [(s, _attention_rows(s, errs)) for s in found.attention]
    att = [(s, r) for s, r in att if r is not None]
    rts = [(s, _router_rows(s, errs)) for s in found.routers]
    rts = [(s, r) for s, r in rts if r is not None]
    used_a, used_r = set(), set()
    layer_of = {}  # id(truth site) -> reported layer

    for a in truth.attention:
        if a.mla:
            hit = [i for i, (s, _) in enumerate(att) if s.name.startswith(a.module + ".")
                   or s.name == a.module]
            skipped = [sk for sk in found.skipped if sk[0] == "attention" and (
                sk[1] == a.module or sk[1].startswith(a.module + ".")
                or a.module.startswith(sk[1] + "."))]
            if len(hit) == 1:
                s = att[hit[0]][0]
                used_a.add(hit[0])
                layer_of[id(a)] = s.layer
                if (s.n_heads, s.n_kv_heads, s.head_dim) != (a.n_heads, a.n_kv_heads, a.head_dim):
                    errs.append(f"{_site(a)} (MLA): H={s.n_heads} Hkv={s.n_kv_heads} "
                                f"dh={s.head_dim}, want H={a.n_heads} Hkv={a.n_kv_heads} "
                                f"dh={a.head_dim}")
            elif not skipped:
                errs.append(f"{_site(a)} (MLA): neither monitored nor named in a warning")
            continue
        tq, tk = stack(params, a.q), stack(params, a.k)
        # paired by query rows (key rows may be shared across layers), else by key rows
        hit = [i for i, (s, (wq, wk)) in enumerate(att) if i not in used_a and _overlap(wq, tq)]
        hit = hit or [i for i, (s, (wq, wk)) in enumerate(att) if i not in used_a and
                      _overlap(wk, tk)]
        if not hit:
            errs.append(f"{_site(a)}: not reported (H={a.n_heads} Hkv={a.n_kv_heads} "
                        f"dh={a.head_dim})")
            continue
        if len(hit) > 1:
            errs.append(f"{_site(a)}: reported {len(hit)} times "
                        f"({', '.join(att[i][0].name for i in hit)})")
        i = hit[0]
        used_a.update(hit)
        s, (wq, wk) = att[i]
        layer_of[id(a)] = s.layer
        nums = (s.n_heads, s.n_kv_heads, s.head_dim)
        want = (a.n_heads, a.n_kv_heads, a.head_dim)
        if nums != want:
            errs.append(f"{_site(a)}: reported as {s.name} H={nums[0]} Hkv={nums[1]} "
                        f"dh={nums[2]}, want H={want[0]} Hkv={want[1]} dh={want[2]}")
            continue
        if wq.shape != tq.shape or wk.shape != tk.shape:
            errs.append(f"{_site(a)}: Wq {tuple(wq.shape)} Wk {tuple(wk.shape)}, want "
                        f"{tuple(tq.shape)} {tuple(tk.shape)}")
            continue
        dh = a.head_dim
        for h in range(a.n_heads):
            if not torch.equal(wq[h * dh:(h + 1) * dh], tq[h * dh:(h + 1) * dh]):
                errs.append(f"{_site(a)}: query head {h} rows differ from {a.q[h].param} "
                            f"{_rows_text(a.q[h])}")
                break
        for g in range(a.n_kv_heads):
            if not torch.equal(wk[g * dh:(g + 1) * dh], tk[g * dh:(g + 1) * dh]):
                errs.append(f"{_site(a)}: key head {g} rows differ from {a.k[g].param} "
                            f"{_rows_text(a.k[g])}")
                break
    for i, (s, _) in enumerate(att):
        if i not in used_a:
            errs.append(f"reported attention {s.name} (layer {s.layer}, H={s.n_heads}) that "
                        "is no attention site of the model")

    for r in truth.routers:
        tw = weight_rows(params, r.weight)
        hit = [i for i, (s, w) in enumerate(rts) if i not in used_r and _overlap(w, tw)]
        where = f"router {r.module} (block {r.block})"
        if not hit:
            errs.append(f"{where}: not reported (E={r.n_experts} top-{r.top_k})")
            continue
        if len(hit) > 1:
            errs.append(f"{where}: reported {len(hit)} times")
        used_r.update(hit)
        s, w = rts[hit[0]]
        layer_of[id(r)] = s.layer
        if (s.n_experts, s.top_k) != (r.n_experts, r.top_k):
            errs.append(f"{where}: reported as {s.name} E={s.n_experts} top-{s.top_k}, want "
                        f"E={r.n_experts} top-{r.top_k}")
        elif w.shape != tw.shape or not torch.equal(w, tw):
            errs.append(f"{where}: weight {tuple(w.shape)} is not {r.weight.param}")
    for i, (s, w) in enumerate(rts):
        if i not in used_r:
            errs.append(f"reported router {s.name} (layer {s.layer}, E={s.n_experts}) that is "
                        "no router of the model")

    for pname in truth.not_reported:
        p = _t64(params[pname])
        p = p.reshape(-1, p.shape[-1]) if p.dim() > 1 else p[None]
        pt = _t64(params[pname])
        pt = pt.reshape(pt.shape[0], -1).t() if pt.dim() > 1 else pt[None]
        for s, (wq, wk) in att:
            if any(_overlap(x, y) for x in (wq, wk) for y in (p, pt)):
                errs.append(f"{pname} must not be reported, but attention {s.name} reads it")
        for s, w in rts:
            if _overlap(w, p) or _overlap(w, pt):
                errs.append(f"{pname} must not be reported, but router {s.name} is it")

    for sk in found.skipped:
        if not any(a.mla and (sk[1] == a.module or sk[1].startswith(a.module + ".")
                              or a.module.startswith(sk[1] + "."))
                   for a in truth.attention):
            errs.append(f"warned SKIPPED {sk[0]} {sk[1]} ({sk[2]}), which the model does not "
                        "call for")

    errs += _layers(truth, layer_of)
    return errs


def _layers(truth, layer_of):
    errs = []
    if not truth.stacks:
        for site in list(truth.attention) + list(truth.routers):
            got = layer_of.get(id(site))
            if got is not None and got != site.block:
                kind = "router" if hasattr(site, "top_k") else "attention"
                errs.append(f"{kind} {site.module}: layer {got}, want its block index "
                            f"{site.block}")
        return errs
    seen = {}
    for a in truth.attention:
        got = layer_of.get(id(a))
        if got is None:
            continue
        if got in seen:
            errs.append(f"attention {a.module} and {seen[got]} share layer {got}")
        seen[got] = a.module
    for r in truth.routers:
        got = layer_of.get(id(r))
        mates = [a for a in truth.attention if a.block == r.block and a.kind == "self"]
        if got is None or not mates or layer_of.get(id(mates[0])) is None:
            continue
        want = layer_of[id(mates[0])]
        if got != want:
            errs.append(f"router {r.module}: layer {got}, but its block's attention "
                        f"{mates[0].module} has layer {want}")
    return errs


def perfect(model, truth):
    """A Discovery-like answer built from the truth: what a correct
    discoverer returns. Layers: block indices, or a running count per
    attention site with stacks."""
    from foreshock.layouts import AttentionSpec, Discovery, RouterSpec
    params = dict(model.named_parameters())
    found = Discovery()
    layer = {}
    for n, a in enumerate(truth.attention):
        layer[id(a)] = n if truth.stacks else a.block
        if a.mla:
            found.skipped.append(("attention", a.module, "MLA", "spec"))
            continue
        found.attention.append(AttentionSpec(
            layer[id(a)], a.n_heads, a.n_kv_heads, a.head_dim,
            (lambda a=a: (stack(params, a.q), stack(params, a.k))), name=a.module))
    for r in truth.routers:
        if truth.stacks:
            mate = next(a for a in truth.attention if a.block == r.block and a.kind == "self")
            lay = layer[id(mate)]
        else:
            lay = r.block
        found.routers.append(RouterSpec(lay, r.n_experts, r.top_k,
                                        (lambda r=r: weight_rows(params, r.weight)),
                                        name=r.module))
    return found


def copy_found(found):
    out = types.SimpleNamespace(attention=list(found.attention), routers=list(found.routers),
                                skipped=list(found.skipped))
    return out


# ---- the truth against the model's own forward pass ------------------------------------------

def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return []


def _bias_name(pname):
    if pname.endswith(".weight"):
        return pname[:-len("weight")] + "bias"
    if pname.endswith("_weight"):
        return pname[:-len("weight")] + "bias"
    return None


def _scale(params, rows_list, c):
    """Multiplies the rows (and their bias entries) by c, in place."""
    for r in rows_list:
        p = params[r.param]
        w = _matrix(p, r, write=True)
        idx = torch.tensor(list(r.rows))
        w[idx] = w[idx] * c
        for name in r.also:
            a = params[name]
            a[idx] = a[idx] * c
        b = params.get(_bias_name(r.param)) if not r.t or p.dim() == 2 else None
        if b is not None and b.dim() == 1 and b.shape[0] == w.shape[0]:
            b[idx] = b[idx] * c


def verify_truth(model, inputs, truth, seed=0):
    """Checks each attention site's rows against the forward pass, returns
    the errors. The score of query head h and key head g is q_h . k_g:
    negating a key head's rows (and biases) together with the rows of every
    query head said to read it -- in every layer, for keys shared across
    layers -- leaves every score, so the output, unchanged (through rotary
    embeddings, qk-norms: RMSNorm, LayerNorm without bias, F.normalize, a
    norm over the whole projection, and clamps alike) only when those are
    the rows these heads read. The output must change when those query rows
    are negated with another key head's (their scores flip sign), and when
    noise is added to query head 0's rows. A computed weight's rows
    (Rows.eff) are scaled through the parameter rows they are made of
    (Rows.param, and Rows.also: LoRA's lora_B).
    Routers: zeroing the weight must change the output."""
    errs = []
    params = dict(model.named_parameters())
    was = model.training
    model.eval()
    saved = {n: p.detach().clone() for n, p in params.items()}

    def run():
        torch.manual_seed(seed)
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        return [t.detach().double() for t in _tensors(out) if t.is_floating_point()]

    def same(a, b):
        return len(a) == len(b) and all(x.shape == y.shape and torch.allclose(
            x, y, rtol=1e-4, atol=1e-5 * max(1.0, float(y.abs().max()))) for x, y in zip(a, b))

    def restore():
        for n, p in params.items():
            p.copy_(saved[n])

    try:
        with torch.no_grad():
            base = run()
            # every query group reading one key head's rows (layers may share keys)
            readers = {}
            for a in truth.attention:
                if a.mla:
                    continue
                rep = a.n_heads // a.n_kv_heads
                for g in range(a.n_kv_heads):
                    key = (a.k[g].param, tuple(a.k[g].rows), a.k[g].t)
                    readers.setdefault(key, (a.k[g], []))[1].extend(a.q[g * rep:(g + 1) * rep])
            keys = list(readers.values())
            for j, (krows, qrows) in enumerate(keys):
                where = f"key rows {_rows_text(krows)} of {krows.param}"
                _scale(params, qrows + [krows], -1.0)
                if not same(run(), base):
                    errs.append(f"{where}: negating them with the query heads said to read "
                                "them changed the output: not the rows these heads read")
                restore()
                other = [keys[(j + 1) % len(keys)][0]] if len(keys) > 1 else []
                _scale(params, qrows + other, -1.0)
                if same(run(), base):
                    errs.append(f"{where}: negating their query heads"
                                + (" with other key rows" if other else "")
                                + " left the output unchanged: these rows are not used")
                restore()
            for a in truth.attention:
                if a.mla:
                    continue
                r = a.q[0]
                p = params[r.param]
                w = _matrix(p, r, write=True)
                idx = torch.tensor(list(r.rows))
                w[idx] = w[idx] + torch.randn(w[idx].shape, dtype=w.dtype) * (w[idx].std() + 1e-3)
                if same(run(), base):
                    errs.append(f"attention {a.module}: noise on query head 0's "
                                f"{_rows_text(r)} of {r.param} left the output unchanged")
                restore()
            for rt in truth.routers:
                w = weight_rows(params, rt.weight)
                if w.shape[0] != rt.n_experts:
                    errs.append(f"router {rt.module}: weight rows {w.shape[0]} != E")
                _scale(params, [rt.weight], 0.0)  # uniform logits: a different dispatch
                if same(run(), base):
                    errs.append(f"router {rt.module}: zeroing {rt.weight.param} left the "
                                "output unchanged")
                restore()
    finally:
        with torch.no_grad():
            restore()
        model.train(was)
    return errs


# ---- what discovery must leave as it found it ------------------------------------------------

def _hook_count(model):
    n = 0
    for m in model.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                     "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            n += len(getattr(m, attr, None) or {})
    import torch.nn.modules.module as mm
    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        n += len(getattr(mm, attr, None) or {})
    return n


def side_effects(model, fn):
    """Runs fn() (a discovery); returns (its result, what it changed in the
    model or the process): a parameter or buffer value (BatchNorm running
    statistics, caches), a gradient left behind, requires_grad, train/eval
    modes, hooks left registered, torch's RNG state, grad mode."""
    state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    grads = {n: p.grad is None for n, p in model.named_parameters()}
    req = {n: p.requires_grad for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    hooks = _hook_count(model)
    rng = torch.get_rng_state()
    grad_mode = torch.is_grad_enabled()
    result = fn()
    errs = []
    after = model.state_dict(keep_vars=True)
    changed = [k for k, v in state.items() if k not in after or after[k].shape != v.shape
               or not torch.equal(after[k].detach(), v)]
    if changed:
        errs.append(f"discovery changed parameters or buffers: {', '.join(changed[:4])}"
                    + (f" (+{len(changed) - 4} more)" if len(changed) > 4 else ""))
    left = [n for n, p in model.named_parameters() if grads.get(n) and p.grad is not None]
    if left:
        errs.append(f"discovery left gradients on {', '.join(left[:4])}")
    flipped = [n for n, p in model.named_parameters() if req.get(n) != p.requires_grad]
    if flipped:
        errs.append(f"discovery changed requires_grad of {', '.join(flipped[:4])}")
    moded = [n or "(model)" for n, m in model.named_modules() if modes.get(n) != m.training]
    if moded:
        errs.append(f"discovery changed train/eval mode of {', '.join(moded[:4])}")
    if _hook_count(model) != hooks:
        errs.append(f"discovery left hooks registered ({hooks} before, {_hook_count(model)} "
                    "after)")
    if not torch.equal(torch.get_rng_state(), rng):
        errs.append("discovery advanced torch's random number generator")
    if torch.is_grad_enabled() != grad_mode:
        errs.append("discovery changed grad mode")
    return result, errs
