"""Actions and schedules: what each worker of a pipeline does for one mini-batch, in order, as data.

An :class:`Action` is ``(stage, kind, microbatch)`` and prints as PyTorch's
pipelining writes it: ``1F0`` is stage 1's forward of micro-batch 0, ``1R0``
its recomputation (checkpointing), ``1B0`` its backward, and a backward split
in two for zero-bubble schedules is ``1I0`` (the gradient of the stage's
inputs) followed later by ``1W0`` (the gradient of its weights). A
:class:`Schedule` is one ordered list of actions per worker, with the map
from stage to worker (several stages per worker in interleaved schedules).
"""
import enum
import re
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

__all__ = ["Kind", "Action", "Schedule", "parse", "ActionLike"]


class Kind(str, enum.Enum):
    """What an action does."""

    #: The stage's forward of a micro-batch.
    FORWARD = "F"
    #: The forward again, with grad, just before the backward of a checkpointed micro-batch.
    RECOMPUTE = "R"
    #: The whole backward: the gradients of the stage's inputs and of its parameters.
    BACKWARD = "B"
    #: The first half of a split backward: the gradients of the stage's inputs only (graph kept).
    BACKWARD_INPUT = "I"
    #: The second half: the gradients of the stage's parameters (graph freed).
    BACKWARD_WEIGHT = "W"

    @property
    def label(self) -> str:
        """The kind's name on timelines and profiler labels: ``'forward'``, ``'backward-input'``, …"""
        return _LABELS[self]

    @staticmethod
    def from_label(label: str) -> "Kind":
        """The kind whose :attr:`label` is ``label`` (``ValueError`` if none)."""
        for kind, name in _LABELS.items():
            if name == label:
                return kind
        raise ValueError(f"no action kind is called {label!r}")


_LABELS = {
    Kind.FORWARD: "forward",
    Kind.RECOMPUTE: "recompute",
    Kind.BACKWARD: "backward",
    Kind.BACKWARD_INPUT: "backward-input",
    Kind.BACKWARD_WEIGHT: "backward-weight",
}


@dataclass(frozen=True, order=True)
class Action:
    """One task of a schedule: stage ``stage`` does ``kind`` for micro-batch ``microbatch``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def partition(self) -> int:
        """The stage, in GPipe's word for it."""
        return self.stage


#: An action or its string form (``'1F0'``).
ActionLike = Union[Action, str]

_ACTION = re.compile(r"^(\d+)([FRBIW])(\d+)$")


def parse(text: ActionLike) -> Action:
    """``parse('1F0') == Action(1, Kind.FORWARD, 0)``; an :class:`Action` is returned as it is."""
    if isinstance(text, Action):
        return text
    match = _ACTION.match(str(text).strip())
    if match is None:
        raise ValueError(
            f"not an action: {text!r} (expected stage, one of F R B I W, micro-batch, e.g. '1F0')"
        )
    return Action(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """What every worker does for one mini-batch: an ordered tuple of actions per worker.

    Attributes:
        workers: ``workers[w]`` is the ordered actions of worker ``w``.
        stage_workers: ``stage_workers[s]`` is the worker that runs stage ``s``.
        microbatches: the number of micro-batches the schedule is for.
        name: the generator's name (``'1f1b'``), or ``'custom'``.

    Example::

        >>> s = Schedule.from_lists([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]])
        >>> print(s)
        worker 0: 0F0 0F1 0B0 0B1
        worker 1: 1F0 1B0 1F1 1B1
    """

    workers: Tuple[Tuple[Action, ...], ...]
    stage_workers: Tuple[int, ...]
    microbatches: int
    name: str = "custom"

    @classmethod
    def from_lists(
        cls,
        lists: Sequence[Iterable[ActionLike]],
        *,
        microbatches: Optional[int] = None,
        stage_workers: Optional[Sequence[int]] = None,
        name: str = "custom",
    ) -> "Schedule":
        """A schedule from one list of actions (or their strings) per worker.

        Which worker runs which stage is read off the lists (a stage's actions
        are all on one worker) unless ``stage_workers`` gives it; the number of
        micro-batches is one more than the highest one named, unless given.
        The result is not validated: see :func:`torchpipe.schedule.validate`.
        """
        lists = [lists] if isinstance(lists, str) else list(lists)
        flat = [item for item in lists if isinstance(item, (str, Action))]
        if flat:
            raise ValueError(
                f"a schedule is one list of actions per worker, got the action {flat[0]!r} where a worker's list "
                f"belongs: write [[{', '.join(map(repr, map(str, flat[:3])))}{', ...' if len(flat) > 3 else ''}]] "
                "for one worker, or one inner list per worker"
            )
        workers = tuple(tuple(parse(a) for a in actions) for actions in lists)
        if stage_workers is None:
            found: Dict[int, int] = {}
            for w, actions in enumerate(workers):
                for action in actions:
                    found.setdefault(action.stage, w)
            stages = max(found, default=-1) + 1
            # A stage no list names is left on worker 0; validate() reports its missing actions.
            stage_workers = [found.get(s, 0) for s in range(stages)]
        if microbatches is None:
            microbatches = max((a.microbatch for actions in workers for a in actions), default=-1) + 1
        return cls(workers, tuple(stage_workers), microbatches, name)

    @property
    def stages(self) -> int:
        return len(self.stage_workers)

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def stages_of(self, worker: int) -> List[int]:
        """The stages worker ``worker`` runs, in order."""
        return [s for s, w in enumerate(self.stage_workers) if w == worker]

    def actions(self) -> Iterator[Action]:
        """Every action, worker by worker."""
        for actions in self.workers:
            yield from actions

    def only(self, kinds: Sequence[Kind]) -> "Schedule":
        """The sub-schedule of the given kinds, order kept (``s.only([Kind.FORWARD])`` is the forward pass)."""
        chosen = frozenset(kinds)
        return Schedule(
            tuple(tuple(a for a in actions if a.kind in chosen) for actions in self.workers),
            self.stage_workers,
            self.microbatches,
            self.name,
        )

    def restricted(self, microbatches: int) -> "Schedule":
        """The schedule for the first ``microbatches`` micro-batches only (the others' actions dropped).

        Dependencies only join actions of one micro-batch, so what stays is as
        valid as the whole.
        """
        if microbatches >= self.microbatches:
            return self
        return Schedule(
            tuple(tuple(a for a in actions if a.microbatch < microbatches) for actions in self.workers),
            self.stage_workers,
            microbatches,
            self.name,
        )

    def __str__(self) -> str:
        return "\n".join(f"worker {w}: {' '.join(map(str, actions))}" for w, actions in enumerate(self.workers))

    def as_lists(self) -> List[List[str]]:
        """Each worker's actions as strings: ``[['0F0', '0B0'], ['1F0', '1B0']]``."""
        return [[str(a) for a in actions] for actions in self.workers]
