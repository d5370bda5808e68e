"""Micro-batches: a mini-batch (a tensor or a tuple of tensors) cut along dim 0, and joined back."""
import numbers
from typing import Any, List, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor

from torchpipe import transfer
from torchpipe.types import TensorOrTensors, Tensors

__all__ = ["Batch", "check_input", "verify_chunks", "scatter", "gather"]


class Batch:
    """What one partition takes or returns for one micro-batch: a tensor, or a tuple of tensors.

    ``values`` is always a tuple; ``atomic`` remembers whether it was a single tensor.
    """

    __slots__ = ("values", "atomic")

    def __init__(self, value: TensorOrTensors) -> None:
        if isinstance(value, Tensor):
            self.values: Tensors = (value,)
            self.atomic = True
        else:
            self.values = tuple(value)
            self.atomic = False

    @classmethod
    def of(cls, values: Sequence[Tensor], atomic: bool) -> "Batch":
        batch = cls.__new__(cls)
        batch.values = tuple(values)
        batch.atomic = atomic
        return batch

    @property
    def value(self) -> TensorOrTensors:
        """The tensor (when atomic) or the tuple of tensors."""
        return self.values[0] if self.atomic else self.values

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        shapes = ", ".join(str(tuple(v.shape)) for v in self.values)
        return f"Batch({shapes}{', atomic' if self.atomic else ''})"


def check_input(input: object, what: str = "input") -> None:
    """Raises ``TypeError`` unless ``input`` is a tensor or a non-empty tuple of tensors."""
    if isinstance(input, Tensor):
        return
    if isinstance(input, tuple) and input and all(isinstance(x, Tensor) for x in input):
        return
    if isinstance(input, tuple) and input:
        kinds = ", ".join(type(x).__name__ for x in input)
        raise TypeError(f"{what} must be a Tensor or a tuple of Tensors, got a tuple of ({kinds})")
    raise TypeError(f"{what} must be a Tensor or a non-empty tuple of Tensors, got {type(input).__name__}")


def verify_chunks(chunks: Any) -> int:
    """The number of micro-batches as an int: a positive integer, or a float equal to one (as torchgpipe takes).

    Raises:
        ValueError: ``chunks`` is not a positive whole number.
    """
    whole: Optional[int] = None
    if isinstance(chunks, (numbers.Integral, float)) and not isinstance(chunks, bool):
        try:
            whole = int(chunks)
        except (ValueError, OverflowError):  # nan, inf
            whole = None
    if whole is None or whole != chunks or whole <= 0:
        raise ValueError(f"number of chunks must be a positive int, got {chunks!r}")
    return whole


def scatter(input: TensorOrTensors, chunks: int) -> List[Batch]:
    """Cuts ``input`` into at most ``chunks`` micro-batches along dim 0, like ``torch.chunk``.

    An empty batch is one (empty) micro-batch, so an empty input gives an
    empty output, as with the plain module.
    """
    atomic = isinstance(input, Tensor)
    values: Tuple[Tensor, ...] = (input,) if isinstance(input, Tensor) else tuple(input)
    for value in values:
        if value.dim() == 0:
            raise ValueError("cannot split a 0-dimensional tensor into micro-batches; give it a batch dimension")
    return [Batch.of(part, atomic) for part in transfer.split(values, chunks, 0)]


def split_input(input: object, device: torch.device, chunks: int) -> Tuple[Tuple[Tensor, ...], List[Batch]]:
    """The prologue of every pipelined step: checks ``input``, moves it to the first stage's ``device`` and cuts
    it into micro-batches; returns the moved input's tensors and the micro-batches.

    Raises:
        TypeError: ``input`` is not a tensor or a non-empty tuple of tensors.
        ValueError: a tensor has no batch dimension.
    """
    check_input(input)
    moved = transfer.move(cast(TensorOrTensors, input), device)
    return ((moved,) if isinstance(moved, Tensor) else tuple(moved)), scatter(moved, chunks)


def gather(batches: Sequence[Batch]) -> TensorOrTensors:
    """Joins micro-batches back into one mini-batch along dim 0."""
    joined = transfer.join([b.values for b in batches], 0)
    return joined[0] if batches[0].atomic else joined


