"""DTensors between stages: a tensor-parallel stage's DTensor output crosses as its local shard, with what the
receiving stage needs to make it the same DTensor again (see [Note: tensor parallel stages]).

Each tp rank of a stage sends to the same tp rank of the next stage (the
pipelines of one replica are its lanes), so the local shard is all that
travels: the message's header carries the placements on the tp mesh and the
global shape, and the receiver rebuilds the DTensor on its own tp mesh
(``DTensor.from_local`` without a check: the shard is what the sender had).
Gradients travel the same way with their own placements (a ``Replicate``
activation's gradient may come back ``Partial``): the sending stage's
backward starts from a DTensor gradient as the plain module's would.
"""
import inspect
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["Sharding", "split", "rebuild", "is_dtensor", "like"]

#: Placement kinds on the wire.
_REPLICATE, _SHARD, _PARTIAL_SUM, _PARTIAL_AVG = 0, 1, 2, 3


class Sharding(NamedTuple):
    """How a DTensor lies on its mesh, as a message's header carries it: per mesh dimension a placement
    ``(kind, dim)`` (replicate, shard along ``dim``, partial sum, partial average), and the global shape."""

    placements: Tuple[Tuple[int, int], ...]
    shape: Tuple[int, ...]


def is_dtensor(tensor: Any) -> bool:
    return hasattr(tensor, "to_local") and hasattr(tensor, "placements")


def like(value: Any, own: Any) -> Any:
    """``value`` to load into ``own``: a whole tensor for a DTensor as this rank's shards of it (each rank takes
    its own part, with no message), anything else as it is."""
    if not is_dtensor(own) or not isinstance(value, Tensor) or is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    if tuple(value.shape) != tuple(own.shape):
        return value  # the load's own size check names the key
    whole = value.detach().to(own.device)
    if "src_data_rank" in inspect.signature(distribute_tensor).parameters:
        return distribute_tensor(whole, own.device_mesh, own.placements, src_data_rank=None)
    return distribute_tensor(whole, own.device_mesh, own.placements)  # from the mesh's first rank


def split(tensor: Tensor) -> Tuple[Tensor, Optional[Sharding]]:
    """A tensor as it crosses: a DTensor's local shard and its :class:`Sharding`; a plain tensor as it is (a
    collective's result in flight, once it is there).

    Raises:
        ValueError: a placement that cannot cross (a partial reduction other than a sum or an average, or a
            placement other than DTensor's own).
    """
    if not is_dtensor(tensor):
        return _waited(tensor), None
    placements = []
    for placement in tensor.placements:  # type: ignore[attr-defined]
        placements.append(_code(placement))
    local = _waited(tensor.to_local())  # type: ignore[attr-defined]
    return local, Sharding(tuple(placements), tuple(tensor.shape))


def _waited(tensor: Tensor) -> Tensor:
    """``tensor``, its collective waited for where it is the result of one still in flight (a functional
    collective's ``AsyncCollectiveTensor``, as a tensor-parallel layer's local output may be): its memory is
    only there then."""
    wait = getattr(tensor, "wait", None) if type(tensor) is not Tensor else None
    return wait() if callable(wait) else tensor


def _code(placement: Any) -> Tuple[int, int]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(placement, Shard):
        return _SHARD, int(placement.dim)
    if isinstance(placement, Replicate):
        return _REPLICATE, 0
    if isinstance(placement, Partial) and placement.reduce_op in ("sum", "avg"):
        return (_PARTIAL_SUM if placement.reduce_op == "sum" else _PARTIAL_AVG), 0
    raise ValueError(
        f"a DTensor placed {placement!r} cannot cross between stages: only Shard, Replicate and Partial sums or "
        "averages do; redistribute it in the stage (or return its local tensor)"
    )


def _placement(kind: int, dim: int) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if kind == _SHARD:
        return Shard(dim)
    if kind == _REPLICATE:
        return Replicate()
    return Partial("sum" if kind == _PARTIAL_SUM else "avg")


def rebuild(local: Tensor, sharding: Sharding, mesh: Any) -> Tensor:
    """The DTensor of ``local`` laid as ``sharding`` says, on ``mesh`` (the receiving stage's tp mesh)."""
    from torch.distributed.tensor import DTensor

    if mesh is None:
        raise ValueError("a DTensor came from another stage, but this rank's pipeline has no 'tp' mesh to put it "
                         "on: every stage's ranks must be on the same mesh")
    placements = [_placement(kind, dim) for kind, dim in sharding.placements]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(sharding.shape),
                              stride=_contiguous(sharding.shape))


def _contiguous(shape: Sequence[int]) -> Tuple[int, ...]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(shape[d + 1]), 1)
    return tuple(strides)
