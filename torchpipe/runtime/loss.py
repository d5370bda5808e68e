"""The loss of a Pipeline step: the target split like the input, and each micro-batch's weight in the total.

Written once for both transports: in one process the step's caller splits the
target; across processes the last stage's rank does, from the micro-batch
sizes the first stage's rank published.
"""
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import Tensor

from torchpipe import microbatch, transfer
from torchpipe.types import TensorOrTensors

__all__ = ["Loss", "split_target", "loss_weights"]


class Loss:
    """How the last stage turns a micro-batch's output into its share of a ``Pipeline`` step's loss, and the
    micro-batches' losses as they are computed."""

    __slots__ = ("fn", "targets", "weights", "values")

    def __init__(self, fn: Optional[Callable[..., Tensor]], targets: List[Any], weights: List[float]) -> None:
        #: ``loss_fn(output, target)``, or None when the module's output is the loss.
        self.fn = fn
        #: Per micro-batch: its target (None when there is none; across processes, until the last stage's rank
        #: has split its target) and its weight in the total.
        self.targets = targets
        self.weights = weights
        #: Per micro-batch: its loss, unweighted and without graph, once the last stage computed it.
        self.values: List[Optional[Tensor]] = [None] * len(weights)

    def weighted(self) -> List[Tensor]:
        """The loss of each micro-batch computed, times its weight (see [Note: loss weights]): 0-dim tensors
        without graph, whose sum is the step's loss. Weighted once the step's actions are over: a micro-batch's
        multiplication and reshape sat between its forward and its backward, on the last stage where every
        micro-batch waits for them."""
        weighted = []
        for value, weight in zip(self.values, self.weights):
            if value is not None:
                product = value * weight
                weighted.append(product.reshape(()) if product.dim() else product)
        return weighted


def split_target(target: Optional[TensorOrTensors], device: torch.device, sizes: Sequence[int]) -> List[Any]:
    """The target moved to ``device`` and split like the input was (micro-batches of ``sizes`` samples);
    None per micro-batch when there is no target.

    Raises:
        TypeError: the target is not a tensor or a tuple of tensors.
        ValueError: its tensors do not share the input's batch dimension.
    """
    if target is None:
        return [None] * len(sizes)
    microbatch.check_input(target, "target")
    target = transfer.move(target, device)
    values = (target,) if isinstance(target, Tensor) else tuple(target)
    size = int(sum(sizes))
    wrong = [tuple(t.shape) for t in values if t.dim() == 0 or t.size(0) != size]
    if wrong:
        raise ValueError(
            f"the target must share the input's batch dimension (size {size} along dim 0); got shapes {wrong}"
        )
    pieces = [torch.split(t, [int(n) for n in sizes]) for t in values]
    if isinstance(target, Tensor):
        return list(pieces[0])
    return [tuple(parts) for parts in zip(*pieces)]


def loss_weights(sizes: Sequence[int], reduction: str, total: Optional[int] = None) -> List[float]:
    """Each micro-batch's weight in the step's loss.

    ``'mean'``: its share of the samples, of ``total`` samples (default: the
    micro-batches' own sum; across data-parallel replicas, every replica's),
    so the weighted sum is the mean over all samples even when micro-batches
    (or replicas' batches) are uneven. ``'sum'``: 1 each.
    """
    if reduction != "mean":
        return [1.0] * len(sizes)
    total = int(sum(sizes)) if total is None else total
    return [n / total if total else 1.0 for n in sizes]
