"""Weights held as DTensors: FSDP2 (`fully_shard`) and tensor parallel
(`parallelize_module`) models.

Their parameters are torch.distributed.tensor.DTensor: each rank holds a
shard, the shape is the whole weight's (so discovery sees the model as one
process would). At the steps the Monitor reads weights (sketch steps and
the steps whose weights a later window needs as its base) it gathers each
monitored Q/K/router weight whole with DTensor.full_tensor(): a collective,
so every rank of the mesh calls it, for the same weights in the same order
(the Monitor's spec order, the same on every rank) at the same steps; the
Monitor therefore reads weights on every rank of such a model, not only on
the one that sends. The sketches are then those of the whole weights:
identical on every rank, sent by one (rank 0, or the local group's lead,
as for replicated weights). Between those steps nothing is gathered.

Cost at a read step: the all-gather of the monitored weights (Q, K and
router rows; not V, O or the MLP) and, on every rank, the Grams and a copy
of them for the snapshots, as on the sending rank.
"""
import torch


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor  # torch >= 2.4
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor  # torch 2.0 - 2.3
        except ImportError:
            return None
    return DTensor


def has_dtensors(model):
    """True when any parameter of `model` is a DTensor."""
    cls = _dtensor_class()
    if cls is None:
        return False
    return any(isinstance(p, cls) for p in model.parameters())


def full(x):
    """x with every DTensor (alone or in a tuple) gathered whole: a
    collective for DTensors, the same object otherwise."""
    if isinstance(x, tuple):
        return tuple(full(t) for t in x)
    cls = _dtensor_class()
    if cls is not None and isinstance(x, cls):
        return x.full_tensor()
    return x


SHARDED_LATE = ("foreshock: the monitored weights are DTensors but were not when this "
                "Monitor was made (fully_shard / parallelize_module after Monitor(...)): the "
                "other ranks would not join the gather and this rank would wait for them "
                "forever. Make the Monitor after sharding the model")


def gather(weights, expected):
    """{key: tensor or tuple} with DTensors gathered whole, in the dict's
    order (Monitor._weights builds it in spec order on every rank).
    expected: the model had DTensors when the Monitor was made, so every
    rank reads weights at the same steps; otherwise a DTensor here raises
    (SHARDED_LATE) rather than wait in a collective the other ranks never
    join."""
    if not expected:
        cls = _dtensor_class()
        if cls is not None and any(isinstance(t, cls) for v in weights.values()
                                   for t in (v if isinstance(v, tuple) else (v,))):
            raise RuntimeError(SHARDED_LATE)
        return weights
    return {k: full(v) for k, v in weights.items()}
