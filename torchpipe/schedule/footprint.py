"""Memory in the planner: what a step holds in bytes, and the peaks it predicts for a schedule (see [Note: held
bytes] in ``runtime/held.py``, where a Pipeline measures it)."""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from torchpipe.schedule.actions import Kind, Schedule
from torchpipe.schedule.check import simulate
from torchpipe.schedule.generate import with_recomputation
from torchpipe.schedule.measured import Exchange

__all__ = ["Footprint", "exchanged_footprint", "verify_memory_limit"]

#: In the exchange of footprints, the micro-batch that marks a stage's gradients and a worker's buffers.
_GRADIENTS, _BUFFERS = -1.0, -2.0


@dataclass(frozen=True)
class Footprint:
    """What a step holds, in bytes (see [Note: held bytes] in ``runtime/held.py``): per (stage, micro-batch), per
    stage and per worker."""

    #: Per (stage, micro-batch): the bytes from its ``F`` to its ``B`` (or ``W``).
    held: Mapping[Tuple[int, int], float]
    #: Per recomputed (stage, micro-batch): the bytes its recomputation's graph adds until its ``B``.
    recomputed: Mapping[Tuple[int, int], float] = field(default_factory=dict)
    #: Per (stage, micro-batch) whose backward was split: the bytes its ``I`` left for its ``W``.
    deferred: Mapping[Tuple[int, int], float] = field(default_factory=dict)
    #: Per stage: the bytes of the parameter gradients its backward made (none where they existed before).
    gradients: Mapping[int, float] = field(default_factory=dict)
    #: Per worker: the most bytes its transport held at once in receives posted for messages not taken yet.
    buffers: Mapping[int, float] = field(default_factory=dict)
    #: Per (stage, micro-batch): the most bytes of gradients its backward made and had not yet taken at once.
    temporaries: Mapping[Tuple[int, int], float] = field(default_factory=dict)

    def sizes(self, stages: int, microbatches: int) -> Tuple[List[List[float]], ...]:
        """``sizes``, ``recomputed``, ``deferred`` and ``temporaries`` for :func:`~torchpipe.schedule.simulate`:
        per stage, per micro-batch (one not measured as the stage's largest; 0 for a stage with none)."""

        def rows(table: Mapping[Tuple[int, int], float]) -> List[List[float]]:
            most: Dict[int, float] = {}
            for (s, _), v in table.items():
                most[s] = max(most.get(s, 0.0), v)
            return [[float(table.get((s, i), most.get(s, 0.0))) for i in range(microbatches)] for s in range(stages)]

        return rows(self.held), rows(self.recomputed), rows(self.deferred), rows(self.temporaries)

    def peaks(self, schedule: Schedule) -> Tuple[float, ...]:
        """Per worker, the predicted peak bytes under ``schedule`` (given without recomputations: those of the
        recomputed pairs are added): activations and gradients as they come and go, and the worker's message
        buffers (their most, as measured, whenever it comes)."""
        recomputing = with_recomputation(schedule, lambda s, i: (s, i) in self.recomputed)
        held, again, deferred, temporaries = self.sizes(schedule.stages, schedule.microbatches)
        gradients = [float(self.gradients.get(s, 0.0)) for s in range(schedule.stages)]
        peaks = simulate(recomputing, {kind: 1.0 for kind in Kind}, sizes=held, recomputed=again,
                         deferred=deferred, gradients=gradients, temporaries=temporaries).peak_bytes
        return tuple(peak + float(self.buffers.get(w, 0.0)) for w, peak in enumerate(peaks))

    def peak(self, schedule: Schedule) -> float:
        """The busiest worker's predicted peak bytes under ``schedule`` (:meth:`peaks`)."""
        return max(self.peaks(schedule), default=0.0)


def exchanged_footprint(mine: Optional[Footprint], exchange: Optional[Exchange]) -> Footprint:
    """Every rank's measured bytes (``mine``: this rank's; per (stage, micro-batch), per stage and per worker) as
    one footprint: a collective across ranks where ``exchange`` is given.

    Raises:
        ValueError: no rank measured anything (the first training step had no backward).
    """
    # sixes: (stage, micro-batch, held, recomputed, deferred, temporaries), -1 for none
    values: List[float] = []
    if mine is not None:
        for (s, i), held in mine.held.items():
            values += [float(s), float(i), float(held), float(mine.recomputed.get((s, i), -1.0)),
                       float(mine.deferred.get((s, i), -1.0)), float(mine.temporaries.get((s, i), -1.0))]
        for s, made in mine.gradients.items():
            values += [float(s), _GRADIENTS, float(made), -1.0, -1.0, -1.0]
        for w, most in mine.buffers.items():
            values += [float(w), _BUFFERS, float(most), -1.0, -1.0, -1.0]
    held_by: Dict[Tuple[int, int], float] = {}
    recomputed: Dict[Tuple[int, int], float] = {}
    deferred: Dict[Tuple[int, int], float] = {}
    temporaries: Dict[Tuple[int, int], float] = {}
    gradients: Dict[int, float] = {}
    buffers: Dict[int, float] = {}
    for record in (exchange(values) if exchange is not None else [values]):
        for k in range(0, len(record) - 5, 6):
            where, what, figure = int(record[k]), record[k + 1], record[k + 2]
            if what == _GRADIENTS:
                gradients[where] = figure
            elif what == _BUFFERS:
                buffers[where] = max(buffers.get(where, 0.0), figure)
            else:
                pair = (where, int(what))
                held_by[pair] = figure
                for table, value in ((recomputed, record[k + 3]), (deferred, record[k + 4]),
                                     (temporaries, record[k + 5])):
                    if value >= 0:
                        table[pair] = value
    if not held_by:
        raise ValueError("memory_limit= chooses by the bytes the first training step measured, and it measured "
                         "none: a step with a backward measures them")
    return Footprint(held_by, recomputed, deferred, gradients, buffers, temporaries)


def verify_memory_limit(memory_limit: Any, schedule: Any) -> Optional[float]:
    """``memory_limit=`` of a Pipeline as bytes (None: not given).

    Raises:
        TypeError: it is not a number.
        ValueError: it is not positive, or the schedule is not ``'auto'`` (a named or custom schedule holds what
            it holds: the limit is what ``'auto'`` chooses within).
    """
    if memory_limit is None:
        return None
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)):
        raise TypeError(f"memory_limit must be a number of bytes, got {memory_limit!r}")
    if not memory_limit > 0:
        raise ValueError(f"memory_limit must be a positive number of bytes, got {memory_limit!r}")
    if schedule != "auto":
        raise ValueError(f"memory_limit= is what schedule='auto' chooses a schedule within; schedule={schedule!r} "
                         "holds what it holds (pipe.memory() predicts it after a step): use schedule='auto'")
    return float(memory_limit)
