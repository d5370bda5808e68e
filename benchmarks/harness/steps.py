"""The training steps a benchmark times: the plain module's, and the same micro-batches run by hand.

The micro-batched ideal's yardstick, :func:`microbatched_train_step`, is the plain module's training step on
the mini-batch cut into micro-batches, run one after another on the calling thread. A pipeline can at best
overlap these micro-batches (:func:`pipeline_ideal`); cutting the batch alone already costs what smaller
kernels lose. Both steps take the same loss argument:

- no ``loss_fn``: the output's mean (summed over a tuple's outputs);
- ``loss_fn`` alone: ``loss_fn(output)``;
- ``target`` and ``loss_fn``: ``loss_fn(output, target)``, with the target cut like the input for the
  micro-batches.

Each micro-batch's loss is weighed by its share of the batch, as a ``'mean'``-reduced loss weighs its rows, so
the micro-batches' gradients add up to the whole batch's.
"""
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    import torchpipe

__all__ = ["Step", "Loss", "output_mean", "drop_grads", "train_step", "microbatched_train_step", "pipeline_step",
           "pipeline_ideal"]

#: A callable that runs one step and returns nothing.
Step = Callable[[], None]
#: ``loss_fn(output)``, or ``loss_fn(output, target)`` where there is a target.
Loss = Callable[..., Tensor]
Input = Union[Tensor, Tuple[Tensor, ...]]


def output_mean(output: Any) -> Tensor:
    """The default loss: the output's mean in float32 (summed over a tuple's outputs)."""
    if isinstance(output, Tensor):
        return output.float().mean()
    return sum((output_mean(o) for o in output), torch.zeros((), device=_first_tensor(output).device))


def _first_tensor(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    return _first_tensor(output[0])


def _loss(output: Any, target: Optional[Tensor], loss_fn: Optional[Loss]) -> Tensor:
    if loss_fn is None:
        assert target is None, "a target needs its loss_fn"
        return output_mean(output)
    return loss_fn(output) if target is None else loss_fn(output, target)


def drop_grads(module: nn.Module) -> None:
    """Sets every parameter's ``.grad`` to None (what ``zero_grad()`` does)."""
    for p in module.parameters():
        p.grad = None


def train_step(model: nn.Module, input: Input, *, target: Optional[Tensor] = None, loss_fn: Optional[Loss] = None,
               keep_grads: bool = False) -> Step:
    """A training step: forward, the loss (see the module's docstring), backward, and the gradients dropped
    (``keep_grads``: left for an optimizer)."""

    def step() -> None:
        _loss(model(input), target, loss_fn).backward()  # type: ignore[no-untyped-call]
        if not keep_grads:
            drop_grads(model)

    return step


def microbatched_train_step(
    model: nn.Module, input: Input, chunks: int, *, target: Optional[Tensor] = None, loss_fn: Optional[Loss] = None,
    keep_grads: bool = False,
) -> Step:
    """The micro-batched ideal's yardstick: :func:`train_step` on the mini-batch cut into ``chunks``
    micro-batches (and the target with it), run one after another on the calling thread, each micro-batch's
    loss weighed by its share of the batch (so the gradients are the whole batch's)."""
    inputs = (input,) if isinstance(input, Tensor) else tuple(input)
    parts = list(zip(*(x.chunk(chunks) for x in inputs)))
    targets: List[Optional[Tensor]] = list(target.chunk(chunks)) if target is not None else [None] * len(parts)
    total = inputs[0].size(0)

    def step() -> None:
        for part, part_target in zip(parts, targets):
            output = model(part[0] if isinstance(input, Tensor) else part)
            (_loss(output, part_target, loss_fn) * (part[0].size(0) / total)).backward()
        if not keep_grads:
            drop_grads(model)

    return step


def pipeline_step(pipe: "torchpipe.Pipeline", input: Optional[Tensor], target: Optional[Tensor]) -> Step:
    """A ``torchpipe.Pipeline``'s training step (``pipe.step(input, target)``), its gradients dropped."""

    def step() -> None:
        pipe.step(input, target)
        drop_grads(pipe)

    return step


def pipeline_ideal(partitions: int, chunks: int) -> float:
    """The best step time of a pipeline of ``partitions`` stages on as many cores, over the same ``chunks``
    micro-batches run by hand on one: (m + p - 1) / (m p) (the bubble of m micro-batches over p stages)."""
    return (chunks + partitions - 1) / (chunks * partitions)
