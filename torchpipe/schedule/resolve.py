"""A Pipeline's schedule argument resolved: a name or a custom schedule, checked, for any number of micro-batches."""
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from torchpipe.schedule.actions import ActionLike, Kind, Schedule
from torchpipe.schedule.auto import measuring_schedule, placement_names
from torchpipe.schedule.check import validate
from torchpipe.schedule.generate import LOOPED, NAMES, V_SHAPED, build
from torchpipe.schedule.merge import merge_backwards
from torchpipe.types import Device

__all__ = ["ScheduleLike", "resolve"]

#: What ``schedule=`` takes: a name, a :class:`~torchpipe.schedule.Schedule`, or one list of actions per worker.
ScheduleLike = Union[str, Schedule, Sequence[Sequence[ActionLike]]]


def resolve(
    schedule: ScheduleLike, chunks: int, stages: int, devices: Optional[Sequence[Device]], ranks: Optional[int]
) -> Tuple[Callable[[int], Schedule], int]:
    """The schedule for each number of micro-batches, and the number of workers; validated for ``chunks``.

    A named schedule runs with each split backward whose ``W`` fills no gap made whole
    (:func:`~torchpipe.schedule.merge_backwards`, with the default costs); a custom one runs as it is.

    The workers of the loop-placed names (:data:`~torchpipe.schedule.LOOPED`): one per rank across processes
    (``ranks``), else one per entry of ``devices``, else one per two stages; of the V-shaped ones
    (:data:`~torchpipe.schedule.V_SHAPED`): half the stages, one per rank across processes; of ``'auto'``: one
    per rank, else one per entry of ``devices``, else one per stage.
    """
    if schedule == "auto":  # the measuring schedule; the Pipeline's AutoTuner takes over ([Note: auto schedule])
        workers = ranks if ranks is not None else (
            len(list(devices)) if devices is not None and not isinstance(devices, (str, int, torch.device))
            else stages)
        placement_names(stages, workers)

        def measuring(microbatches: int) -> Schedule:
            return measuring_schedule(stages, workers, microbatches)

        validate(measuring(chunks))
        return measuring, workers
    if isinstance(schedule, str):
        if schedule not in NAMES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(map(repr, NAMES))}, 'auto' "
                             "or build one")
        name = schedule
        workers = _workers(name, stages, devices, ranks)
        if name == "dualpipev" and chunks < 2 * workers:
            raise ValueError(
                f"dualpipev needs chunks >= 2 * workers = {2 * workers} ({workers} workers for {stages} stages), got "
                f"chunks={chunks}; use chunks={2 * workers} or more, or schedule='zbv' (the same V, any chunks)"
            )

        def plan(microbatches: int) -> Schedule:
            if name == "dualpipev" and microbatches < 2 * workers:
                # A smaller batch's step: the order for 2W micro-batches without the missing ones' actions.
                return merge_backwards(build(name, 2 * workers, stages, workers).restricted(microbatches))
            # A split backward whose W fills no gap runs whole ([Note: merging backwards]).
            return merge_backwards(build(name, microbatches, stages, workers))

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


def _workers(name: str, stages: int, devices: Optional[Sequence[Device]], ranks: Optional[int]) -> int:
    """How many workers the named schedule runs ``stages`` on; ``ValueError`` saying what fits if none."""
    if name in LOOPED:
        if ranks is not None:
            workers, source = ranks, "one per rank"
        elif devices is not None and not isinstance(devices, (str, int, torch.device)):
            workers, source = len(list(devices)), "one per entry of devices"
        else:
            workers, source = max(1, stages // 2), "one per two stages by default"
        if workers < 1 or stages % workers or stages // workers < 2:
            raise ValueError(
                f"{name} needs a number of stages that is a multiple (at least 2) of the workers; got {stages} "
                f"stages for {workers} workers ({source})"
                + (f"; balance needs {2 * workers}, {3 * workers}, ... entries" if workers >= 1 else "")
            )
        return workers
    if name in V_SHAPED:
        if ranks is not None and stages != 2 * ranks:
            raise ValueError(
                f"{name} places 2 stages per rank in a V (rank r holds stages r and {2 * ranks - 1} - r), so balance "
                f"needs 2 * {ranks} = {2 * ranks} entries for {ranks} ranks; got {stages}"
            )
        if stages < 2 or stages % 2:
            raise ValueError(
                f"{name} places 2 stages per worker in a V (worker w holds stages w and 2 * workers - 1 - w), so "
                f"balance needs an even number of entries, 2 * workers; got {stages}"
            )
        return stages // 2
    return stages
