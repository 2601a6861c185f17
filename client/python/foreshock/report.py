"""The report a Monitor hands to its transport: plain host data (numpy),
independent of how it travels (libforeshock through ctypes, or a test's
recorder). Mirrors proto/foreshock.proto's Report."""
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np


@dataclass
class AttentionGram:
    layer: int
    head: int                # query head
    kv_head: Optional[int]   # GQA key head the query head reads; None for plain MHA
    window: int
    dh: int
    ga: np.ndarray           # float32 upper triangle of A A^T, n = 2*dh, row-major
    gb: np.ndarray           # float32 upper triangle of B B^T
    shard_index: int = 0
    shard_count: int = 1


@dataclass
class AttentionSpectrum:
    """Spectra the trainer computed from a head's Grams (foreshock.spectra):
    sigma^2 values, float32, descending; all zero for an absent spectrum
    (a frozen update), NaN for a head whose Grams were not finite."""
    layer: int
    head: int                # query head
    kv_head: Optional[int]   # GQA key head the query head reads; None for plain MHA
    window: int
    dh: int
    d2: np.ndarray           # sigma^2(Delta2), 2*dh values
    d1: np.ndarray           # sigma^2(Delta1), 2*dh values
    d3: np.ndarray           # sigma^2(Delta3), dh values
    w: np.ndarray            # sigma^2(K(t0)), dh values
    q_delta_sq: float        # |dWq|^2 = tr Qdd
    q_sq: float              # |Wq|^2 = tr Qww
    k_sq: float              # |Wk|^2 = tr Kww
    k_delta_sq: float        # |dWk|^2 = tr Kdd
    cqk: Optional[float]     # tr(Qdd Kdd) / (tr Qdd tr Kdd); None when absent


@dataclass
class RouterGram:
    layer: int
    n_experts: int
    gram: np.ndarray         # float32 upper triangle of WR WR^T
    shard_index: int = 0
    shard_count: int = 1


@dataclass
class RouterTokens:
    layer: int
    n_experts: int
    n_tok: int
    sum_h: float
    sum_h2: float
    sum_lse2: float
    load: np.ndarray         # uint64 [E]
    sum_p: np.ndarray        # float64 [E]


@dataclass
class Report:
    step: int
    time_unix: Optional[float] = None
    scalars: dict = field(default_factory=dict)   # loss, grad_norm, lr, loss_scale, tokens, step_time,
    #                                               step_update_ratio
    layer_weight_norm: Optional[np.ndarray] = None
    layer_update_ratio: Optional[np.ndarray] = None
    attention: list = field(default_factory=list)   # AttentionGram or AttentionSpectrum
    router_grams: List[RouterGram] = field(default_factory=list)
    router_tokens: List[RouterTokens] = field(default_factory=list)
