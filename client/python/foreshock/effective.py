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
                     the attention reads is W + scale * B @ A.
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


def _lora_parts(module):
    """[(A weight [r, in], B weight [out, r], scale)] of module's active,
    unmerged LoRA adapters (PEFT or loralib); None when it is no LoRA layer."""
    a, b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if a is None or b is None:
        return None
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return []
    if isinstance(a, nn.ModuleDict) and isinstance(b, nn.ModuleDict):   # PEFT
        active = getattr(module, "active_adapters", None)
        active = [active] if isinstance(active, str) else list(active or a.keys())
        dora = getattr(module, "use_dora", None)
        if getattr(module, "fan_in_fan_out", False) or (
                isinstance(dora, dict) and any(dora.get(n) for n in active)):
            return None  # a transposed base or DoRA's magnitudes: not this sum
        scaling = getattr(module, "scaling", {})
        out = []
        for n in active:
            if n in a and n in b and n in scaling:
                wa, wb = getattr(a[n], "weight", None), getattr(b[n], "weight", None)
                if not isinstance(wa, torch.Tensor) or not isinstance(wb, torch.Tensor) or \
                        wa.dim() != 2 or wb.dim() != 2:
                    return None
                out.append((wa, wb, scaling[n]))
        return out
    if isinstance(a, nn.Parameter) and isinstance(b, nn.Parameter) and a.dim() == 2 and \
            b.dim() == 2 and isinstance(getattr(module, "scaling", None), (int, float)):
        if getattr(module, "fan_in_fan_out", False):
            return None
        return [(a, b, module.scaling)]                                   # loralib
    return None


def _lora_base(module):
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Module) else module


def lora_delta(w, parts):
    """w + sum of scale * B @ A (the sum PEFT's get_delta_weight adds)."""
    for wa, wb, scale in parts:
        w = w + (wb @ wa) * scale
    return w


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
                return lora_delta(w, _lora_parts(module) or [])
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
    """ids of every LoRA adapter parameter (lora_A / lora_B) of model."""
    out = set()
    for m in model.modules():
        if _lora_parts(m) is None:
            continue
        for attr in ("lora_A", "lora_B"):
            v = getattr(m, attr)
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
