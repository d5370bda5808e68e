"""A Pipeline's schedule argument resolved: a name or a custom schedule, checked, for any number of micro-batches."""
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from torchpipe.schedule.actions import ActionLike, Kind, Schedule
from torchpipe.schedule.check import validate
from torchpipe.schedule.generate import NAMES, build
from torchpipe.types import Device

__all__ = ["ScheduleLike", "resolve"]

#: What ``schedule=`` takes: a name, a :class:`~torchpipe.schedule.Schedule`, or one list of actions per worker.
ScheduleLike = Union[str, Schedule, Sequence[Sequence[ActionLike]]]


def resolve(
    schedule: ScheduleLike, chunks: int, stages: int, devices: Optional[Sequence[Device]], ranks: Optional[int]
) -> Tuple[Callable[[int], Schedule], int]:
    """The schedule for each number of micro-batches, and the number of workers; validated for ``chunks``.

    The workers of ``'interleaved_1f1b'``: one per rank across processes (``ranks``), else one per entry
    of ``devices``, else one per two stages.
    """
    if isinstance(schedule, str):
        if schedule not in NAMES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(map(repr, NAMES))} or build one")
        workers = stages
        if schedule == "interleaved_1f1b":
            if ranks is not None:
                workers = ranks
            elif devices is not None and not isinstance(devices, (str, int, torch.device)):
                workers = len(list(devices))
            else:
                workers = max(1, stages // 2)
            if workers < 1 or stages % workers or stages // workers < 2:
                raise ValueError(
                    f"interleaved_1f1b needs a number of stages that is a multiple (at least 2) of the workers; "
                    f"got {stages} stages for {workers} workers (one per entry of devices, default: one per two "
                    "stages)"
                )
        name = schedule

        def plan(microbatches: int) -> Schedule:
            return build(name, microbatches, stages, workers)

        validate(plan(chunks))
        return plan, workers
    custom = schedule if isinstance(schedule, Schedule) else Schedule.from_lists(schedule, microbatches=chunks)
    problems = []
    if custom.stages != stages:
        problems.append(f"it has {custom.stages} stages but balance has {stages}")
    if custom.microbatches != chunks:
        problems.append(f"it is for {custom.microbatches} micro-batches but chunks={chunks}")
    if any(a.kind is Kind.RECOMPUTE for a in custom.actions()):
        problems.append("it has recomputations (R); leave them out: checkpoint= places them")
    if problems:
        raise ValueError("the schedule does not fit this Pipeline: " + "; ".join(problems))
    validate(custom)

    def restricted(microbatches: int) -> Schedule:
        return custom.restricted(microbatches)

    return restricted, custom.num_workers
