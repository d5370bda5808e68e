"""Pipeline schedules as data: per-partition lists of forward / recompute / backward actions.

An :class:`Action` is ``(partition, kind, microbatch)`` and prints as PyTorch
writes it: ``1F0`` is partition 1's forward of micro-batch 0, ``1R0`` its
recomputation, ``1B0`` its backward. A schedule is one ordered list of actions
per partition; each partition's worker executes its list in order, waiting
for what an action needs (the activation from the previous partition, the
gradient from the next). A pure function builds the schedule, :func:`validate`
checks it (every action once, forward before recompute before backward, no
deadlock), and :func:`clock_cycles` simulates it, so the order can be tested
by literal equality before anything runs.

The GPipe fill-drain schedule of ``m`` micro-batches over ``n`` partitions::

    clock:   0    1    2    3    4          (forward phase; backward runs it in reverse)
    part 0:  0F0  0F1  0F2
    part 1:       1F0  1F1  1F2
    part 2:            2F0  2F1  2F2

Micro-batch ``i`` runs on partition ``j`` at clock cycle ``i + j``.
"""
import enum
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

__all__ = [
    "Kind",
    "Action",
    "Schedule",
    "fill_drain",
    "parse",
    "phase",
    "dependencies",
    "validate",
    "clock_cycles",
]


class Kind(str, enum.Enum):
    """What an action does."""

    FORWARD = "F"
    RECOMPUTE = "R"
    BACKWARD = "B"


@dataclass(frozen=True, order=True)
class Action:
    """One task of a schedule: partition ``partition`` does ``kind`` for micro-batch ``microbatch``."""

    partition: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.partition}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"


#: One ordered list of actions per partition.
Schedule = List[List[Action]]

_ACTION = re.compile(r"^(\d+)([FRB])(\d+)$")


def parse(text: str) -> Action:
    """``parse('1F0') == Action(1, Kind.FORWARD, 0)``."""
    match = _ACTION.match(text.strip())
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected partition, F/R/B, micro-batch, e.g. '1F0')")
    return Action(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))


def fill_drain(microbatches: int, partitions: int, checkpoint_stop: int = 0) -> Schedule:
    """The GPipe schedule: every forward, then every backward in reverse micro-batch order.

    Micro-batches ``i < checkpoint_stop`` are checkpointed: their recomputation
    ``jRi`` comes right after ``jB(i+1)`` (or first, for the last micro-batch),
    so a partition recomputes while it waits for the gradient from the next
    partition, overlapping recomputation with the backward of other partitions.
    """
    if microbatches < 1 or partitions < 1:
        raise ValueError(f"need at least one micro-batch and partition, got {microbatches} and {partitions}")
    schedule: Schedule = []
    for j in range(partitions):
        actions = [Action(j, Kind.FORWARD, i) for i in range(microbatches)]
        for i in reversed(range(microbatches)):
            if i < checkpoint_stop:
                actions.append(Action(j, Kind.RECOMPUTE, i))
            actions.append(Action(j, Kind.BACKWARD, i))
        schedule.append(actions)
    return schedule


def phase(schedule: Schedule, kinds: Sequence[Kind]) -> Schedule:
    """The sub-schedule of the given kinds, order kept (``phase(s, [Kind.FORWARD])`` is the forward pass)."""
    return [[a for a in actions if a.kind in kinds] for actions in schedule]


def dependencies(action: Action, partitions: int, recomputed: Set[Tuple[int, int]]) -> List[Action]:
    """The actions whose results ``action`` needs.

    ``recomputed`` holds the ``(partition, microbatch)`` pairs that have a
    recompute action, whose backward must wait for it.
    """
    j, i = action.partition, action.microbatch
    if action.kind is Kind.FORWARD:
        return [Action(j - 1, Kind.FORWARD, i)] if j > 0 else []
    if action.kind is Kind.RECOMPUTE:
        return [Action(j, Kind.FORWARD, i)]
    needs = [Action(j, Kind.FORWARD, i)]
    if (j, i) in recomputed:
        needs.append(Action(j, Kind.RECOMPUTE, i))
    if j < partitions - 1:
        needs.append(Action(j + 1, Kind.BACKWARD, i))
    return needs


def _recomputed(schedule: Schedule) -> Set[Tuple[int, int]]:
    return {(a.partition, a.microbatch) for actions in schedule for a in actions if a.kind is Kind.RECOMPUTE}


def validate(schedule: Schedule, microbatches: int, *, backward: bool = True) -> None:
    """Checks that ``schedule`` can run: raises ``ValueError`` listing every problem.

    Each partition's list holds only its own actions; every forward (and, with
    ``backward``, every backward) appears exactly once; recomputations are
    unique and sit between their forward and backward; and executing the lists
    in order, each action waiting for its :func:`dependencies`, finishes
    (no deadlock).
    """
    problems: List[str] = []
    for j, actions in enumerate(schedule):
        position: Dict[Action, int] = {}
        for k, action in enumerate(actions):
            if action.partition != j:
                problems.append(f"{action} is in the list of partition {j}")
            if action.microbatch < 0 or action.microbatch >= microbatches:
                problems.append(f"{action} names a micro-batch outside 0..{microbatches - 1}")
            if action in position:
                problems.append(f"{action} appears twice")
            position[action] = k
        kinds = (Kind.FORWARD, Kind.BACKWARD) if backward else (Kind.FORWARD,)
        for i in range(microbatches):
            for kind in kinds:
                if Action(j, kind, i) not in position:
                    problems.append(f"{Action(j, kind, i)} is missing")
            f, r, b = (position.get(Action(j, kind, i)) for kind in Kind)
            if r is not None and (f is None or r < f):
                problems.append(f"{Action(j, Kind.RECOMPUTE, i)} comes before its forward")
            if b is not None and (r is not None and b < r):
                problems.append(f"{Action(j, Kind.BACKWARD, i)} comes before its recomputation")
            if b is not None and f is not None and b < f:
                problems.append(f"{Action(j, Kind.BACKWARD, i)} comes before its forward")
    if not problems:
        try:
            clock_cycles(schedule)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError("invalid schedule:\n  " + "\n  ".join(problems))


def clock_cycles(schedule: Schedule, recomputed: Optional[Set[Tuple[int, int]]] = None) -> List[List[Action]]:
    """Simulates ``schedule`` with unit-time actions: the actions that run at each clock cycle.

    Each partition runs its next action as soon as the actions it depends on
    ran at an earlier cycle. Raises ``ValueError`` if the schedule deadlocks.
    """
    if recomputed is None:
        recomputed = _recomputed(schedule)
    partitions = len(schedule)
    present = {a for actions in schedule for a in actions}
    done: Set[Action] = set()
    cursor = [0] * partitions
    cycles: List[List[Action]] = []
    while any(cursor[j] < len(schedule[j]) for j in range(partitions)):
        ready = []
        for j in range(partitions):
            if cursor[j] == len(schedule[j]):
                continue
            action = schedule[j][cursor[j]]
            needs = [d for d in dependencies(action, partitions, recomputed) if d in present]
            if all(d in done for d in needs):
                ready.append(action)
        if not ready:
            stuck = ", ".join(str(schedule[j][cursor[j]]) for j in range(partitions) if cursor[j] < len(schedule[j]))
            raise ValueError(f"schedule deadlocks: no partition can run its next action ({stuck})")
        for action in ready:
            cursor[action.partition] += 1
        done.update(ready)
        cycles.append(ready)
    return cycles
