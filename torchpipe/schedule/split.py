"""A zero-bubble schedule's split from measured costs: which stages split their backward, decided on the first steps.

[Note: zero-bubble split] A zero-bubble schedule splits each backward into
``I`` (the inputs' gradients, which the previous stage waits for) and ``W``
(the weights', placed where the worker would idle). That removes most of the
bubble only if ``I`` and ``W`` together cost about what ``B`` costs. On a CPU
they may cost much more (``W`` restarts the autograd engine at each layer,
on gradients that left the cache long ago): then splitting makes the step
longer than 1F1B's. So, as the zero-bubble paper's schedules do, the
split follows profiled times: the first training step runs every stage
whole (1F1B) and measures each stage's ``F`` and ``B``, the second runs every
stage split and measures ``I`` and ``W`` (each action's thread CPU time, so a
wait for a message does not count), and a stage is chosen to split only where
that shortens the simulated step (:func:`torchpipe.schedule.choose_split`).
The simulation does not see everything: split graphs live longer (more memory
in use, colder caches), a ``W`` wants the GIL more often per unit of work than
a ``B``, and thread CPU time misses a wait for the GIL, so a split the costs
chose may still run slower than 1F1B. So it is tried: the next training steps run
it and 1F1B in turn, :data:`TRIAL_STEPS` each, and it stays only if its median
step time is :data:`TRIAL_MARGIN` below 1F1B's (a split that only matches 1F1B
keeps its graphs longer for nothing); else the pipeline runs 1F1B from then
on. Only steps of one batch size are compared: a smaller one (an epoch's short
last batch) is left out of the trial, a larger one starts it again. So
``'zero_bubble'`` is never slower than ``'1f1b'`` once placed (after
:data:`TUNING_STEPS` training steps of one batch size), as measured on its own
steps.
Across processes every rank's measurements are exchanged (a trial step takes
as long as its slowest rank says) and every rank makes the same decision.
Splitting or not changes only the order in which gradients of one step are
summed, so results may differ from one split to another in the last
bits; ``pipe.schedule`` shows the split in use.
"""
import statistics
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from torchpipe.schedule.actions import Kind, Schedule
from torchpipe.schedule.generate import choose_split, zero_bubble
from torchpipe.schedule.measured import Exchange, Measurements, Timings, exchanged
from torchpipe.schedule.merge import merge_backwards

__all__ = ["SplitTuner", "Timings", "TRIAL_STEPS", "TRIAL_MARGIN", "TUNING_STEPS"]

#: The training steps each split runs in the trial of a split the costs chose.
TRIAL_STEPS = 3
#: How much faster than 1F1B's (median step time) a split's steps must be for it to stay.
TRIAL_MARGIN = 0.02
#: The most training steps a zero-bubble pipeline takes to place its split (of one batch size): two measured, then
#: the trial.
TUNING_STEPS = 2 + 2 * TRIAL_STEPS


class SplitTuner:
    """Decides a zero-bubble schedule's split per stage from the costs measured on its first training steps."""

    def __init__(self, stages: int) -> None:
        self.stages = stages
        #: The split in use: none while the backward is measured whole, all while it is measured split, then in
        #: turn the candidate and none while they are tried, then the decision.
        self.split: List[bool] = [False] * stages
        self.decided = False
        self.costs: Dict[Tuple[int, Kind], float] = {}
        #: The split the measured costs chose, while it is tried against none (1F1B).
        self.candidate: Optional[List[bool]] = None
        #: The trial's step times (s), by whether the step ran the candidate.
        self.trial: Dict[bool, List[float]] = {True: [], False: []}
        #: The batch size (rows) of the trial's steps: a step of fewer rows is not compared (an epoch's short
        #: last batch would favour the split that ran it), one of more starts the trial again.
        self.trial_rows: Optional[int] = None

    @property
    def measuring(self) -> bool:
        """Whether the next training step's actions are to be timed (:meth:`record`); else, until decided, the
        step's time is to be taken (:meth:`record_trial`)."""
        return not self.decided and self.candidate is None

    def record(self, timings: Mapping[Tuple[int, Kind], Sequence[float]], exchange: Optional[Exchange] = None,
               microbatches: int = 1, *, relayouts: Sequence[float] = ()) -> bool:
        """Takes a training step's timings (this rank's stages); returns whether the split changed.

        ``exchange`` gathers every rank's measurements (across processes); it is called on every rank at
        the same step. ``relayouts`` are not needed here (see :class:`~torchpipe.schedule.measured.Measurements`).
        """
        for measured in exchanged(Measurements.of(timings), exchange):
            for key, values in measured.durations.items():
                if key[1] is not Kind.RECOMPUTE:
                    self.costs[key] = statistics.median(values)
        if not any(self.split):  # the whole backward measured: now measure it split
            self.split = [True] * self.stages
            return True
        before = self.split
        chosen = choose_split(max(1, microbatches), self.stages, self._cost)
        if any(chosen):
            self.candidate = chosen  # tried first (see record_trial)
        else:
            self.decided = True
        self.split = chosen
        return self.split != before

    def record_trial(self, seconds: float, exchange: Optional[Exchange] = None, rows: int = 0) -> bool:
        """Takes a trial step's time (this rank's, in seconds) and its batch size (``rows``; 0 on a rank that
        reads no input); returns whether the split changed.

        ``exchange`` gathers every rank's values (across processes); it is called on every rank at the same step.
        Only steps of the same batch size are compared: a step of fewer rows than the trial's is left out (the
        split stays for the next step), one of more starts the trial again at its size.
        """
        assert self.candidate is not None and not self.decided, "no split is being tried"
        every = [[seconds, rows]] if exchange is None else exchange([float(seconds), float(rows)])
        size = max(int(values[1]) for values in every)
        if self.trial_rows is None or size > self.trial_rows:
            self.trial_rows = size
            self.trial = {True: [], False: []}
        elif size < self.trial_rows:
            return False
        self.trial[self.split == self.candidate].append(max(values[0] for values in every))
        before = self.split
        none = [False] * self.stages
        if min(len(times) for times in self.trial.values()) >= TRIAL_STEPS:
            self.decided = True
            faster = statistics.median(self.trial[True]) < statistics.median(self.trial[False]) * (1 - TRIAL_MARGIN)
            self.split = self.candidate if faster else none
        else:
            self.split = none if self.split == self.candidate else self.candidate
        return self.split != before

    def plan(self, microbatches: int) -> Schedule:
        """The schedule of a step of ``microbatches`` with the split in use; once the costs are measured, each
        split backward whose ``W`` fills no gap at those costs made whole
        (:func:`~torchpipe.schedule.merge_backwards`); while they are measured, as it is."""
        schedule = zero_bubble(microbatches, self.stages, self.split)
        if self.measuring:
            return schedule
        return merge_backwards(schedule, lambda action: self._cost(action.stage, action.kind))

    def _cost(self, stage: int, kind: Kind) -> float:
        cost = self.costs.get((stage, kind))
        if cost is not None:
            return cost
        # A stage not measured (none of its actions ran): a backward is about twice a forward.
        forward = self.costs.get((stage, Kind.FORWARD), 1.0)
        return forward * (2.0 if kind is Kind.BACKWARD else 1.0)
