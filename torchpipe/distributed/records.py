"""The control plane's messages, typed: what the ranks tell each other through the store about a step.

The store keeps lists of floats (see [Note: control plane]); each record here
is the one place that packs itself into such a list and reads itself back, so
no caller indexes a list of floats.
"""
from typing import List, NamedTuple, Sequence

import torch

from torchpipe.distributed import wire

__all__ = ["StepStart", "ReplicaLoss"]


class StepStart(NamedTuple):
    """A step's shape, published by a replica's first stage's rank: whether it trains and each micro-batch's
    number of samples (``start/<n>/<replica>``)."""

    training: bool
    sizes: List[int]

    @property
    def microbatches(self) -> int:
        return len(self.sizes)

    def pack(self) -> List[float]:
        return [float(len(self.sizes)), float(self.training)] + [float(n) for n in self.sizes]

    @classmethod
    def unpack(cls, values: Sequence[float]) -> "StepStart":
        count = int(values[0])
        sizes = [int(n) for n in values[2:]]
        assert len(sizes) == count, f"a step's start of {count} micro-batches holds {len(sizes)} sizes"
        return cls(training=bool(values[1]), sizes=sizes)


class ReplicaLoss(NamedTuple):
    """A replica's loss of a step, which its last stage's rank tells every rank as it ends (``done/<n>/<rank>``)."""

    value: float
    dtype: torch.dtype

    def pack(self) -> List[float]:
        return [self.value, float(wire.DTYPES.index(self.dtype))]

    @classmethod
    def unpack(cls, values: Sequence[float]) -> "ReplicaLoss":
        return cls(value=values[0], dtype=wire.DTYPES[int(values[1])])
