"""``torch.distributed.pipelining``'s side of a comparison: this rank's stages of a model under one of its
schedules, and a training step of it."""
from typing import Any, Callable, List, Sequence, Tuple

import torch
from torch import Tensor, nn

__all__ = ["pipelining_schedule", "pipelining_step", "RankRunner"]


def pipelining_schedule(layers: Sequence[nn.Module], mine: Sequence[int], stages: int, schedule: str, chunks: int,
                        loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Tuple[Any, List[nn.Parameter]]:
    """Stages ``mine`` of ``stages`` equal runs of ``layers`` on the CPU, under pipelining's ``schedule`` (a class
    name: ``'Schedule1F1B'``); the schedule and the stages' parameters."""
    from torch.distributed import pipelining

    size = len(layers) // stages
    parts = [nn.Sequential(*layers[size * s: size * (s + 1)]) for s in mine]
    made = [pipelining.PipelineStage(part, s, stages, torch.device("cpu")) for part, s in zip(parts, mine)]
    kind = getattr(pipelining, schedule)
    made_schedule = kind(made if len(made) > 1 else made[0], chunks, loss_fn=loss_fn)
    return made_schedule, [p for part in parts for p in part.parameters()]


def pipelining_step(schedule: Any, first: bool, last: bool, x: Tensor, y: Tensor) -> None:
    """One training step: the input where the first stage is, the target where the last is."""
    losses: List[Tensor] = []
    if first and last:
        schedule.step(x, target=y, losses=losses)
    elif first:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)


class RankRunner:
    """One library's training step on this rank: a subclass sets :attr:`pipe` (torchpipe's Pipeline) or
    :attr:`schedule` (pipelining's), with :attr:`parameters`, :attr:`first` and :attr:`last`, and :attr:`run`
    to :meth:`torchpipe_step` or :meth:`pipelining_step`."""

    pipe: Any = None
    schedule: Any = None
    parameters: List[nn.Parameter]
    #: Whether this rank holds the first stage (it reads the input) and the last (the target).
    first: bool
    last: bool
    run: Callable[[Tensor, Tensor], None]

    def torchpipe_step(self, x: Tensor, y: Tensor) -> None:
        self.pipe.step(x if self.first else None, y if self.last else None)

    def pipelining_step(self, x: Tensor, y: Tensor) -> None:
        pipelining_step(self.schedule, self.first, self.last, x, y)

    def step(self, x: Tensor, y: Tensor) -> None:
        """A step, then the gradients dropped (as an optimizer's ``zero_grad(set_to_none=True)``)."""
        self.run(x, y)
        for p in self.parameters:
            p.grad = None
