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
    scalars: dict = field(default_factory=dict)   # loss, grad_norm, lr, loss_scale, tokens, step_time
    layer_weight_norm: Optional[np.ndarray] = None
    layer_update_ratio: Optional[np.ndarray] = None
    attention: List[AttentionGram] = field(default_factory=list)
    router_grams: List[RouterGram] = field(default_factory=list)
    router_tokens: List[RouterTokens] = field(default_factory=list)
