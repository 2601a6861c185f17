"""Projection weights that are computed, not stored.

The weight a projection multiplies by is not always one of the model's
parameters:
  parametrizations   torch.nn.utils.parametrize.register_parametrization,
                     parametrizations.weight_norm / spectral_norm /
                     orthogonal: module.weight is computed from `original`
                     (or original0, original1) at each access;
  old-style hooks    torch.nn.utils.weight_norm / spectral_norm: a forward
                     pre-hook recomputes module.weight from weight_g and
                     weight_v (weight_orig) before each call;
  LoRA               PEFT's LoraLayer (base_layer, lora_A / lora_B
                     ModuleDicts, scaling per adapter) and loralib's
                     Linear (lora_A / lora_B parameters, scaling): the
                     output is base(x) + scale * B(A(x)), so the weight
                     the attention reads is W + scale * B @ A. Over a
                     weight stored [in, out] (fan_in_fan_out: GPT-2's
                     Conv1D) the sum is W + (scale * B @ A)^T;
  kohya-ss           sd-scripts' LoRAModule replaces its Linear's forward
                     with its own: W + multiplier * scale * up @ down;
  loralib merged     MergedLinear (LoRA on some chunks of a fused qkv):
                     each enabled chunk's rows get their own B @ A;
  DoRA               PEFT's use_dora: the output is rescaled per output
                     row, m / |W + scale * B @ A|_row (the norm detached),
                     so the weight is that diagonal times W + scale * B @ A;
                     with several active adapters each rescales the sum
                     so far (PEFT's forward in eval or without dropout).
The weight monitored is the effective one, recomputed at each get() from
the parameters as they are then: what the next forward multiplies by.

weight_getter(module) gives that getter (None for a plain weight);
lora_parameters(model) the ids of the adapters' own parameters, which are
no projection of their own.
"""
import contextlib

import torch
import torch.nn as nn


def _parametrized(module, name):
    try:
        from torch.nn.utils import parametrize
        return parametrize.is_parametrized(module, name)
    except (ImportError, AttributeError):
        return False


@contextlib.contextmanager
def _eval(module):
    """module's parametrizations in eval mode meanwhile: spectral_norm's
    power iteration (which updates its u, v buffers) does not run on a read."""
    plist = module.parametrizations if hasattr(module, "parametrizations") else None
    modes = [(m, m.training) for m in plist.modules()] if plist is not None else []
    try:
        for m, _ in modes:
            m.training = False
        yield
    finally:
        for m, was in modes:
            m.training = was


def _hook(module, name):
    """The old-style weight_norm / spectral_norm pre-hook computing module.name."""
    try:
        from torch.nn.utils.spectral_norm import SpectralNorm
        from torch.nn.utils.weight_norm import WeightNorm
    except ImportError:
        return None
    for h in module._forward_pre_hooks.values():
        if isinstance(h, (WeightNorm, SpectralNorm)) and getattr(h, "name", None) == name:
            return h
    return None


def _magnitude(module, name):
    """PEFT DoRA's magnitude vector [out] of adapter `name` (a module with a
    weight in current PEFT, a ParameterDict entry in older releases)."""
    mags = getattr(module, "lora_magnitude_vector", None)
    if mags is None or name not in mags:
        return None
    m = mags[name]
    m = getattr(m, "weight", m)
    return m if isinstance(m, torch.Tensor) and m.dim() == 1 else None


def _product(wb, wa, scale):
    """delta() -> scale * B @ A, read when called (the adapters train)."""
    return lambda: (wb @ wa) * scale


def _merged_delta(module):
    """loralib MergedLinear (enable_lora: LoRA on some of a fused
    projection's equal chunks, e.g. q and v of GPT-2's c_attn): delta() ->
    [out, in] with chunk g's rows B_g @ A_g * scaling, zero elsewhere."""
    on = list(getattr(module, "enable_lora", None) or [])
    ind = getattr(module, "lora_ind", None)
    a, b = module.lora_A, module.lora_B
    groups = sum(1 for x in on if x)
    if not groups or not isinstance(ind, torch.Tensor) or ind.dtype != torch.bool or \
            a.shape[0] % groups or b.shape[0] % groups:
        return None
    r, rows = a.shape[0] // groups, b.shape[0] // groups
    if b.shape[1] != r or int(ind.sum()) != b.shape[0]:
        return None

    def delta():
        parts = [b[g * rows:(g + 1) * rows] @ a[g * r:(g + 1) * r] for g in range(groups)]
        out = a.new_zeros((ind.numel(), a.shape[1]))
        out[ind] = torch.cat(parts) * module.scaling
        return out
    return delta


def _patched_owner(module):
    """kohya-ss sd-scripts' LoRAModule: it replaces its Linear's forward
    with its own (a bound method in the Linear's __dict__) and adds
    lora_up(lora_down(x)) * multiplier * scale; the owner, or None."""
    fwd = module.__dict__.get("forward")
    owner = getattr(fwd, "__self__", None)
    if owner is None or owner is module or not isinstance(owner, nn.Module):
        return None
    down, up = getattr(owner, "lora_down", None), getattr(owner, "lora_up", None)
    ok = all(isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
             for m in (down, up))
    return owner if ok and hasattr(owner, "multiplier") and hasattr(owner, "scale") else None


def _lora_parts(module):
    """[(delta(), DoRA magnitude or None)] of module's active, unmerged
    LoRA adapters (PEFT, loralib, kohya-ss), each delta() the scaled
    [out, in] update it adds; None when it is no LoRA layer (or one this
    cannot sum)."""
    owner = _patched_owner(module)
    if owner is not None:
        return [(_product(owner.lora_up.weight, owner.lora_down.weight,
                          float(owner.multiplier) * float(owner.scale)), None)]
    a, b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if a is None or b is None:
        return None
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return []
    if isinstance(a, nn.ModuleDict) and isinstance(b, nn.ModuleDict):   # PEFT
        active = getattr(module, "active_adapters", None)
        if active is None:
            active = getattr(module, "active_adapter", None)
        active = [active] if isinstance(active, str) else list(active or a.keys())
        dora = getattr(module, "use_dora", None)
        dora = dora if isinstance(dora, dict) else {}
        merged = set(getattr(module, "merged_adapters", None) or [])
        scaling = getattr(module, "scaling", {})
        out = []
        for n in active:
            if n in merged or n not in a or n not in b or n not in scaling:
                continue
            wa, wb = getattr(a[n], "weight", None), getattr(b[n], "weight", None)
            if not isinstance(wa, torch.Tensor) or not isinstance(wb, torch.Tensor) or \
                    wa.dim() != 2 or wb.dim() != 2:
                return None
            mag = _magnitude(module, n) if dora.get(n) else None
            if dora.get(n) and mag is None:
                return None  # DoRA without a magnitude this can read
            out.append((_product(wb, wa, scaling[n]), mag))
        return out
    if isinstance(a, nn.Parameter) and isinstance(b, nn.Parameter) and a.dim() == 2 and \
            b.dim() == 2 and isinstance(getattr(module, "scaling", None), (int, float)):
        if getattr(module, "enable_lora", None) is not None:             # loralib merged
            delta = _merged_delta(module)
            return [(delta, None)] if delta is not None else None
        return [(_product(b, a, module.scaling), None)]                  # loralib
    return None


def _lora_base(module):
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Module) else module


def lora_delta(w, parts, fan_in_fan_out=False):
    """The weight w becomes with the adapters `parts` (_lora_parts), in w's
    own layout: w + delta per plain adapter (PEFT's get_delta_weight),
    rescaled per output row by m / |w + delta| for a DoRA one; a w stored
    [in, out] (fan_in_fan_out) is summed as [out, in] and handed back
    transposed. A delta of another shape is an adapter this does not know:
    ValueError."""
    base = w.t() if fan_in_fan_out else w
    run = base
    for delta, mag in parts:
        d = delta()
        if d.shape != base.shape:
            raise ValueError(f"LoRA update of shape {tuple(d.shape)} for a weight of "
                             f"{tuple(base.shape)}")
        if mag is None:
            run = run + d
        else:
            norm = torch.linalg.norm(base + d, dim=1)
            run = (mag / norm).to(run.dtype).unsqueeze(1) * (run + d)
    return run.t() if fan_in_fan_out else run


def weight_getter(module, name="weight"):
    """get() -> the effective `name` weight of module now (no grad), or None
    when it is a plain parameter with nothing computed or added."""
    parts = _lora_parts(module) if name == "weight" else None
    if parts is not None:
        base = _lora_base(module)
        inner = weight_getter(base) if base is not module else None

        def lora():
            with torch.no_grad():
                w = inner() if inner is not None else getattr(base, "weight")
                return lora_delta(w, _lora_parts(module) or [],
                                  bool(getattr(module, "fan_in_fan_out", False)))
        try:
            lora()
        except (ValueError, RuntimeError, AttributeError, TypeError):
            return inner  # an adapter layout this does not know: the base weight
        return lora
    if _parametrized(module, name):
        def param():
            with torch.no_grad(), _eval(module):
                return getattr(module, name)
        return param
    hook = _hook(module, name)
    if hook is not None:
        def old():
            with torch.no_grad():
                if type(hook).__name__ == "SpectralNorm":
                    return hook.compute_weight(module, do_power_iteration=False)
                return hook.compute_weight(module)
        return old
    return None


def lora_parameters(model):
    """ids of every LoRA adapter parameter (lora_A / lora_B, DoRA's
    magnitudes, kohya's lora_down / lora_up) of model."""
    out = set()
    for m in model.modules():
        if _lora_parts(m) is None:
            continue
        owner = _patched_owner(m)
        for attr in ("lora_A", "lora_B", "lora_magnitude_vector", "lora_down", "lora_up"):
            holder = owner if attr in ("lora_down", "lora_up") else m
            if holder is None or not hasattr(holder, attr):
                continue
            v = getattr(holder, attr)
            for p in (v.parameters() if isinstance(v, nn.Module) else [v]):
                out.add(id(p))
    return out


def lora_bases(model):
    """id(base weight parameter) -> getter of the effective weight, for every
    LoRA layer (the pass sees F.linear with the base weight)."""
    out = {}
    for m in model.modules():
        if _lora_parts(m) is None:
            continue
        w = getattr(_lora_base(m), "weight", None)
        if isinstance(w, nn.Parameter):
            get = weight_getter(m)
            if get is not None:
                out[id(w)] = get
    return out


def computed(model):
    """[(module, qualified name, attribute)] of every weight computed at
    each access or call (parametrizations, old-style hooks)."""
    out = []
    for mname, m in model.named_modules():
        names = set()
        plist = getattr(m, "parametrizations", None)
        if isinstance(plist, nn.ModuleDict):
            names |= {n for n in plist.keys() if _parametrized(m, n)}
        for h in m._forward_pre_hooks.values():
            n = getattr(h, "name", None)
            if isinstance(n, str) and _hook(m, n) is h:
                names.add(n)
        for n in sorted(names):
            out.append((m, f"{mname}.{n}" if mname else n, n))
    return out


def current(module, attr):
    """The tensor the running forward got for module.attr: the
    parametrization's cached value (inside parametrize.cached()) or the
    attribute an old-style hook set."""
    if _parametrized(module, attr):
        try:
            from torch.nn.utils import parametrize
            return parametrize._cache.get((id(module), attr))
        except (ImportError, AttributeError):
            return None
    return module.__dict__.get(attr)
