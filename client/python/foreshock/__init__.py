"""Foreshock's PyTorch client: streams sketches of a model's attention Q/K
and MoE router weights, router token statistics and training scalars to
foreshockd. See client/python/README.md.

    import foreshock
    mon = foreshock.Monitor(model, endpoint="127.0.0.1:7781", run="exp-1")
    ...
    mon.step(step, loss=loss, grad_norm=gn, lr=lr)   # once per optimizer step
"""
from .advice import Advice, Rescue
from .layouts import AttentionSpec, Discovery, RouterSpec, discover, find_attention, find_routers
from .monitor import Monitor, parse_endpoint
from .report import AttentionGram, AttentionSpectrum, Report, RouterGram, RouterTokens

__version__ = "0.1.0"
__all__ = ["Monitor", "Advice", "Rescue", "AttentionSpec", "RouterSpec", "find_attention", "find_routers",
           "discover", "Discovery",
           "Report", "AttentionGram", "AttentionSpectrum", "RouterGram", "RouterTokens",
           "parse_endpoint"]
