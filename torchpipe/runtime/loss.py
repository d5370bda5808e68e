"""The loss of a Pipeline step: the target split like the input, and each micro-batch's weight in the total.

Written once for both transports: in one process the step's caller splits the
target; across processes the last stage's rank does, from the micro-batch
sizes the first stage's rank published.

[Note: token weights] A ``'mean'`` loss is the mean over the whole
mini-batch. By default a micro-batch counts by its number of samples, which
is the plain module's loss when ``loss_fn`` averages over samples. A
token-level loss (``cross_entropy(..., ignore_index=-100)``) averages over
the micro-batch's non-ignored tokens instead, and those differ between
micro-batches of a padded batch: ``loss_weight(target)`` gives each
micro-batch's count, and the micro-batch counts by its count over the
mini-batch's total (every micro-batch of every data-parallel replica), which
is the plain module's mean over all the mini-batch's tokens. The weights are
known on the last stage's rank once it has split its target; a replica's
total travels through the store (see [Note: control plane]), published as the
step starts and read only at the last stage's first backward, the first
action that needs it. A micro-batch of weight 0 starts no backward (its
loss, the mean of nothing, is NaN, and ``0 * NaN`` would reach every
gradient).
"""
import contextlib
import functools
import inspect
import math
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from torchpipe import microbatch, transfer
from torchpipe.types import TensorOrTensors

__all__ = ["Loss", "LossSpec", "split_target", "loss_weights", "target_weights", "shares", "check_target",
           "without_backward", "StepLoss", "compute_loss"]


class LossSpec(NamedTuple):
    """What a Pipeline step's loss is made of, besides the target: the same on every rank."""

    #: ``loss_fn(output, target)``, or None when the module's output is the loss.
    fn: Optional[Callable[..., Tensor]]
    #: ``'mean'`` or ``'sum'``.
    reduction: str
    #: ``loss_weight(target)``: each micro-batch's weight in a ``'mean'`` (None: its number of samples).
    weight: Optional[Callable[[Any], Any]] = None
    #: What the step's gradients are scaled by (``step(..., loss_scale=)``); the loss returned is not.
    scale: float = 1.0


class Loss:
    """How the last stage turns a micro-batch's output into its share of a ``Pipeline`` step's loss, and the
    micro-batches' losses as they are computed."""

    __slots__ = ("fn", "targets", "weights", "scale", "values", "parallel", "_total")

    def __init__(
        self,
        fn: Optional[Callable[..., Tensor]],
        targets: List[Any],
        weights: List[float],
        *,
        scale: float = 1.0,
    ) -> None:
        #: ``loss_fn(output, target)``, or None when the module's output is the loss.
        self.fn = fn
        #: Per micro-batch: its target (None when there is none; across processes, until the last stage's rank
        #: has split its target) and its weight in the total.
        self.targets = targets
        self.weights = weights
        #: What the gradients are scaled by (the loss told to the caller is not).
        self.scale = scale
        #: Per micro-batch: its loss, unweighted and without graph, once the last stage computed it.
        self.values: List[Optional[Tensor]] = [None] * len(weights)
        #: Whether the loss ran under ``loss_parallel()`` (logits sharded on the class dimension: see
        #: :func:`compute_loss`), so that its backward must too.
        self.parallel = False
        #: The total the weights are still to be divided by, read when first needed (see [Note: token weights]).
        self._total: Optional[Callable[[], float]] = None

    def compute(self, i: int, output: Any) -> Tensor:
        """Micro-batch ``i``'s loss, unweighted (see :func:`compute_loss`)."""
        loss, self.parallel = compute_loss(self.fn, output, self.targets[i])
        return loss

    def backward_context(self) -> Any:
        """What the backward of the last stage runs under: ``loss_parallel()`` where the loss did."""
        if not self.parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def divide_later(self, weights: List[float], total: Callable[[], float]) -> None:
        """Sets the micro-batches' raw weights, to be divided by ``total()`` once a weight is first needed."""
        self.weights = weights
        self._total = total

    def weight(self, i: int) -> float:
        """Micro-batch ``i``'s weight in the step's loss (its share of the total)."""
        if self._total is not None:
            total, self._total = self._total(), None
            self.weights = shares(self.weights, total)
        return self.weights[i]

    def gradient(self, i: int) -> float:
        """The gradient micro-batch ``i``'s backward starts from: its weight times the step's scale."""
        return self.weight(i) * self.scale

    def weighted(self) -> List[Tensor]:
        """The loss of each micro-batch computed, times its weight (see [Note: loss weights]): 0-dim tensors
        without graph, whose sum is the step's loss. Weighted once the step's actions are over: a micro-batch's
        multiplication and reshape sat between its forward and its backward, on the last stage where every
        micro-batch waits for them."""
        weighted = []
        for i, value in enumerate(self.values):
            weight = self.weight(i)
            if value is not None and weight != 0:  # weight 0: its loss may be the NaN of an empty mean
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


def target_weights(fn: Callable[[Any], Any], targets: Sequence[Any]) -> List[float]:
    """``fn(target)`` for each micro-batch's target, checked (see [Note: token weights]).

    Raises:
        ValueError: a weight is not a number or a single-element tensor, or is negative or not finite.
    """
    weights = []
    for i, target in enumerate(targets):
        value = fn(target)
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"loss_weight must return a number or a single-element tensor, got a tensor of shape "
                    f"{tuple(value.shape)} for micro-batch {i}"
                )
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"loss_weight must return a number or a single-element tensor, got {value!r} for "
                             f"micro-batch {i}")
        weight = float(value)
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"loss_weight gave micro-batch {i} the weight {weight}: a weight must be finite and "
                             "not negative")
        weights.append(weight)
    return weights


def shares(weights: Sequence[float], total: float) -> List[float]:
    """Each weight over ``total``, the mini-batch's (all micro-batches, all replicas).

    Raises:
        ValueError: the total is 0 (every micro-batch's weight is 0: nothing to average over).
    """
    if not total > 0:
        raise ValueError(
            f"loss_weight gave the whole mini-batch the weight {total} (its micro-batches: {list(weights)}): a "
            "mean over nothing; every label of the mini-batch is ignored, or loss_weight counts the wrong thing"
        )
    return [w / total for w in weights]


def check_target(spec: LossSpec, target: Optional[TensorOrTensors], where: str) -> None:
    """Raises ``ValueError`` if the step's loss needs a target and ``target`` is None. ``where`` names who must
    pass it ("the step", "rank 1, the last stage's,")."""
    if target is not None:
        return
    if spec.weight is not None:
        raise ValueError(f"loss_weight weighs each micro-batch by its target: {where} must pass the target")
    if spec.fn is not None and not _takes_one_argument(spec.fn):
        raise ValueError(f"{where} must pass the target: loss_fn takes (output, target)")


def compute_loss(fn: Optional[Callable[..., Tensor]], output: Any, target: Any) -> Tuple[Tensor, bool]:
    """``fn(output, target)`` (``fn(output)`` for a None target; ``output`` itself for a None ``fn``), a plain
    tensor; and whether it ran under ``loss_parallel()``.

    A tensor-parallel last stage may leave its output a DTensor (see [Note: tensor parallel stages] in
    ``torchpipe/distributed/tensor_parallel.py``): logits sharded on their last (class) dimension go into ``fn``
    under ``loss_parallel()``, never gathered (and the backward runs under it too: :meth:`Loss.backward_context`);
    any other DTensor output goes in whole (``full_tensor()``). A DTensor loss comes out whole, as a plain
    tensor.
    """
    context: Any = contextlib.nullcontext()
    if fn is None:
        return (output.full_tensor() if _is_dtensor(output) else output), False
    parallel = False
    if _is_dtensor(output):
        if _sharded_on_last(output):
            parallel = True
            from torch.distributed.tensor.parallel import loss_parallel

            context = loss_parallel()
        else:
            output = output.full_tensor()
    with context:
        loss = fn(output) if target is None else fn(output, target)
    return (loss.full_tensor() if _is_dtensor(loss) else loss), parallel  # type: ignore[attr-defined]


def _is_dtensor(value: Any) -> bool:
    return isinstance(value, Tensor) and hasattr(value, "full_tensor") and hasattr(value, "placements")


def _sharded_on_last(value: Any) -> bool:
    return any(p.is_shard() and p.dim in (-1, value.dim() - 1) for p in value.placements)


@functools.lru_cache(maxsize=64)  # asked at every step without a target: read each loss_fn's signature once
def _takes_one_argument(fn: Callable[..., Any]) -> bool:
    """Whether ``fn(output)`` binds (True where the signature cannot be read: a call will tell)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(None)
    except TypeError:
        return False
    return True


class StepLoss(Tensor):
    """The loss a Pipeline training step returns: a tensor without graph (the step ran the backward), whose
    ``backward()``, and that of anything computed from it (``(loss / n).backward()``), raises an error that says
    so and how to accumulate gradients. Saved and printed as a plain tensor."""

    def backward(  # type: ignore[override, unused-ignore]
        self, gradient: Any = None, retain_graph: Any = None, create_graph: bool = False, inputs: Any = None
    ) -> None:
        raise RuntimeError(
            "the loss returned by Pipeline.step has no graph: step() ran the backward already, and the gradients "
            "are in .grad. To accumulate gradients over n steps, call pipe.step(input, target, loss_scale=1 / n) "
            "for each, then optimizer.step()"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.as_subclass(Tensor).__reduce_ex__(protocol)  # type: ignore[no-untyped-call, unused-ignore]

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override, unused-ignore]
        return Tensor.__repr__(self.as_subclass(Tensor))  # type: ignore[no-untyped-call, unused-ignore]


def without_backward(loss: Tensor) -> Tensor:
    """``loss`` as a training step returns it: the same tensor, as a :class:`StepLoss`."""
    return loss.detach().as_subclass(StepLoss)
