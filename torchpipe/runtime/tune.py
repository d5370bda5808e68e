"""Zero-bubble placement from measured costs: which stages split their backward, decided on the first steps.

[Note: zero-bubble placement] A zero-bubble schedule splits each backward into
``I`` (the inputs' gradients, which the previous stage waits for) and ``W``
(the weights', placed where the worker would idle). That removes most of the
bubble only if ``I`` and ``W`` together cost about what ``B`` costs. On a CPU
they may cost much more (``W`` restarts the autograd engine at each layer,
on gradients that left the cache long ago): then splitting makes the step
longer than 1F1B's. So, as the zero-bubble paper's schedules do, the
placement follows profiled times: the first training step runs every stage
whole (1F1B) and measures each stage's ``F`` and ``B``, the second runs every
stage split and measures ``I`` and ``W`` (each action's thread CPU time, so a
wait for a message does not count), and from then on a stage splits only
where that shortens the simulated step (:func:`torchpipe.schedule.choose_split`).
So ``'zero_bubble'`` is never slower than ``'1f1b'`` after two steps. Across
processes every rank's measurements are exchanged and every rank makes the
same decision. Splitting or not changes only the order in which gradients of
one step are summed, so results may differ from one placement to the other
in the last bits; ``pipe.schedule`` shows the placement in use.
"""
import statistics
from typing import Callable, Dict, List, Optional, Tuple

from torchpipe.schedule import Kind, choose_split

__all__ = ["SplitTuner", "Timings"]

#: An action's measured durations, by (stage, kind).
Timings = Dict[Tuple[int, Kind], List[float]]

_MEASURED = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)


class SplitTuner:
    """Decides a zero-bubble schedule's split per stage from the costs measured on its first training steps."""

    def __init__(self, stages: int) -> None:
        self.stages = stages
        #: The split in use: none while the backward is measured whole, all while it is measured split.
        self.split: List[bool] = [False] * stages
        self.decided = False
        self.costs: Dict[Tuple[int, Kind], float] = {}

    @property
    def measuring(self) -> bool:
        return not self.decided

    def record(self, timings: Timings, exchange: Optional[Callable[[List[float]], List[List[float]]]] = None,
               microbatches: int = 1) -> bool:
        """Takes a training step's timings (this rank's stages); returns whether the split changed.

        ``exchange`` gathers every rank's measurements (across processes); it is called on every rank at
        the same step.
        """
        mine = [(s, kind, statistics.median(values)) for (s, kind), values in sorted(timings.items(),
                key=lambda item: (item[0][0], _MEASURED.index(item[0][1]) if item[0][1] in _MEASURED else 9))
                if kind in _MEASURED and values]
        flat = [float(v) for s, kind, cost in mine for v in (s, _MEASURED.index(kind), cost)]
        every = [flat] if exchange is None else exchange(flat)
        for values in every:
            for k in range(0, len(values) - 2, 3):
                self.costs[(int(values[k]), _MEASURED[int(values[k + 1])])] = values[k + 2]
        if not any(self.split):  # the whole backward measured: now measure it split
            self.split = [True] * self.stages
            return True
        self.decided = True
        before = self.split
        self.split = choose_split(max(1, microbatches), self.stages, self._cost)
        return self.split != before

    def _cost(self, stage: int, kind: Kind) -> float:
        cost = self.costs.get((stage, kind))
        if cost is not None:
            return cost
        # A stage not measured (none of its actions ran): a backward is about twice a forward.
        forward = self.costs.get((stage, Kind.FORWARD), 1.0)
        return forward * (2.0 if kind is Kind.BACKWARD else 1.0)
