"""Checking and simulating schedules: the dependencies of each action, validate, and a timed simulation.

Dependencies are the same for every schedule (and every transport, threads or
processes): a forward needs the previous stage's forward of the same
micro-batch; a recomputation needs the stage's forward; a backward (``B``, or
the input half ``I`` of a split one) needs the stage's forward, its
recomputation if it has one, and the next stage's backward (its ``B`` or its
``I``); the weight half ``W`` needs the stage's ``I``. Skip connections add no
dependency of their own: a skip goes from an earlier stage to a later one, and
the chain of forwards (and of backwards, in reverse) already orders both ends.

:func:`simulate` runs a schedule in virtual time: each worker executes its
list in order, starting an action as soon as the worker is free and the
actions it depends on have ended (plus a communication delay between
workers). It gives the step time, each worker's busy time and the bubble
fraction, and finds deadlocks.
"""
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, Union

from torchpipe.schedule.actions import Action, Kind, Schedule

__all__ = [
    "dependencies",
    "validate",
    "simulate",
    "Simulation",
    "clock_cycles",
    "DEFAULT_COSTS",
    "Costs",
    "Sizes",
]

#: Per-action costs for :func:`simulate`: a cost per kind, or a function of the action.
Costs = Union[Mapping[Kind, float], Callable[[Action], float]]

#: Per stage, the bytes it holds for a micro-batch: one figure for all its micro-batches, or one per micro-batch.
Sizes = Sequence[Union[float, Sequence[float]]]

#: A backward costs about twice a forward; its two halves about a forward each.
DEFAULT_COSTS: Mapping[Kind, float] = {
    Kind.FORWARD: 1.0,
    Kind.RECOMPUTE: 1.0,
    Kind.BACKWARD: 2.0,
    Kind.BACKWARD_INPUT: 1.0,
    Kind.BACKWARD_WEIGHT: 1.0,
}

_BACKWARDS = (Kind.BACKWARD, Kind.BACKWARD_INPUT)


def dependencies(action: Action, stages: int, present: FrozenSet[Action]) -> List[Action]:
    """The actions whose results ``action`` needs, among those ``present`` in the schedule.

    Args:
        action: the action.
        stages: the number of stages of the pipeline.
        present: every action of the schedule (a stage's backward is ``B`` or
            ``I``, whichever it has; a recomputation is waited for only if the
            schedule has one).
    """
    s, i = action.stage, action.microbatch
    if action.kind is Kind.FORWARD:
        return [Action(s - 1, Kind.FORWARD, i)] if s > 0 else []
    if action.kind is Kind.RECOMPUTE:
        return [Action(s, Kind.FORWARD, i)]
    if action.kind is Kind.BACKWARD_WEIGHT:
        return [Action(s, Kind.BACKWARD_INPUT, i)]
    needs = [Action(s, Kind.FORWARD, i)]
    recompute = Action(s, Kind.RECOMPUTE, i)
    if recompute in present:
        needs.append(recompute)
    if s + 1 < stages:
        whole = Action(s + 1, Kind.BACKWARD, i)
        needs.append(whole if whole in present else Action(s + 1, Kind.BACKWARD_INPUT, i))
    return needs


def validate(schedule: Schedule, *, backward: bool = True) -> None:
    """Checks that ``schedule`` can run; raises ``ValueError`` listing every problem.

    A problem is an action in the list of a worker that does not run its
    stage; a stage or micro-batch out of range; an action that appears twice;
    a missing forward or (with ``backward``) a stage and micro-batch with no
    backward (``B``, or ``I`` and ``W``), or with both kinds; a recomputation,
    backward or weight gradient placed before what it needs on its own worker;
    and a deadlock (executing the lists in order, each action waiting for its
    :func:`dependencies`, cannot finish).
    """
    problems: List[str] = []
    stages, m = schedule.stages, schedule.microbatches
    if m < 1:
        problems.append(f"a schedule needs at least one micro-batch, got {m}")
    if stages < 1:
        problems.append("a schedule needs at least one stage")
    for s, w in enumerate(schedule.stage_workers):
        if not 0 <= w < schedule.num_workers:
            problems.append(f"stage {s} is mapped to worker {w}, but there are {schedule.num_workers} workers")
    position: Dict[Action, Tuple[int, int]] = {}
    for w, actions in enumerate(schedule.workers):
        for k, action in enumerate(actions):
            if not 0 <= action.stage < stages:
                problems.append(f"{action} names a stage outside 0..{stages - 1}")
            elif schedule.stage_workers[action.stage] != w:
                problems.append(
                    f"{action} is in the list of worker {w}, but stage {action.stage} runs on worker "
                    f"{schedule.stage_workers[action.stage]}"
                )
            if not 0 <= action.microbatch < m:
                problems.append(f"{action} names a micro-batch outside 0..{m - 1}")
            if action in position:
                problems.append(f"{action} appears twice")
            else:
                position[action] = (w, k)

    def at(stage: int, kind: Kind, i: int) -> Optional[int]:
        found = position.get(Action(stage, kind, i))
        return None if found is None else found[1]

    for s in range(stages):
        for i in range(m):
            f, r, b = at(s, Kind.FORWARD, i), at(s, Kind.RECOMPUTE, i), at(s, Kind.BACKWARD, i)
            bi, bw = at(s, Kind.BACKWARD_INPUT, i), at(s, Kind.BACKWARD_WEIGHT, i)
            if f is None:
                problems.append(f"{Action(s, Kind.FORWARD, i)} is missing")
            if backward:
                if b is None and bi is None and bw is None:
                    problems.append(
                        f"{Action(s, Kind.BACKWARD, i)} is missing "
                        f"(or {Action(s, Kind.BACKWARD_INPUT, i)} and {Action(s, Kind.BACKWARD_WEIGHT, i)})"
                    )
                elif b is not None and (bi is not None or bw is not None):
                    problems.append(f"stage {s} has both a whole and a split backward of micro-batch {i}")
                elif b is None and (bi is None) != (bw is None):
                    have, lack = (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT) if bw is None else (
                        Kind.BACKWARD_WEIGHT, Kind.BACKWARD_INPUT)
                    problems.append(f"{Action(s, have, i)} has no {Action(s, lack, i)}")
            first_backward = b if b is not None else bi
            if r is not None:
                if f is not None and r < f:
                    problems.append(f"{Action(s, Kind.RECOMPUTE, i)} comes before its forward")
                if first_backward is not None and first_backward < r:
                    problems.append(f"{Action(s, Kind.RECOMPUTE, i)} comes after its backward")
                if backward and first_backward is None:
                    problems.append(f"{Action(s, Kind.RECOMPUTE, i)} has no backward to recompute for")
            if first_backward is not None and f is not None and first_backward < f:
                kind = Kind.BACKWARD if b is not None else Kind.BACKWARD_INPUT
                problems.append(f"{Action(s, kind, i)} comes before its forward")
            if bi is not None and bw is not None and bw < bi:
                weight, inputs = Action(s, Kind.BACKWARD_WEIGHT, i), Action(s, Kind.BACKWARD_INPUT, i)
                problems.append(f"{weight} comes before its {inputs}")
    try:
        simulate(schedule, {kind: 1.0 for kind in Kind})
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise ValueError(f"invalid schedule ({count}):\n  - " + "\n  - ".join(problems) + f"\nschedule:\n{schedule}")


@dataclass(frozen=True)
class Simulation:
    """The result of :func:`simulate`."""

    #: When the last action ends.
    step_time: float
    #: Per worker, the total cost of its actions.
    busy: Tuple[float, ...]
    #: Start and end of every action.
    start: Dict[Action, float] = field(repr=False)
    end: Dict[Action, float] = field(repr=False)
    #: The schedule's map from stage to worker.
    stage_workers: Tuple[int, ...] = field(default=(), repr=False)
    #: Each action's place in its worker's list: the order of actions that take no time at one instant.
    position: Dict[Action, int] = field(default_factory=dict, repr=False)

    @property
    def bubble(self) -> float:
        """The fraction of worker time spent idle: ``1 - sum(busy) / (workers * step_time)``."""
        if self.step_time <= 0 or not self.busy:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step_time)

    #: Per stage, the bytes it holds per micro-batch from its ``F`` to its ``B`` or ``W`` (``sizes=`` of
    #: :func:`simulate`; empty: not given).
    sizes: Tuple[Tuple[float, ...], ...] = field(default=(), repr=False)
    #: Per stage, the bytes a recomputation's graph adds from its ``R`` to its ``B`` or ``W`` (``recomputed=``).
    recomputed: Tuple[Tuple[float, ...], ...] = field(default=(), repr=False)
    #: Per stage, the bytes a split backward keeps from its ``I`` to its ``W``: the gradients its ``W`` starts
    #: from (``deferred=``).
    deferred: Tuple[Tuple[float, ...], ...] = field(default=(), repr=False)
    #: Per stage, the bytes of the parameters' gradients its backward makes, held from the start of its first
    #: ``B`` or ``W`` to the step's end (``gradients=``; empty: not given).
    gradients: Tuple[float, ...] = field(default=(), repr=False)
    #: Per stage, the bytes each backward action (``B``, ``I`` or ``W``) adds while it runs: the gradients it
    #: makes on the way (``temporaries=``).
    temporaries: Tuple[Tuple[float, ...], ...] = field(default=(), repr=False)

    @property
    def peak_activations(self) -> Tuple[int, ...]:
        """Per worker, the most (stage, micro-batch) pairs whose activations it holds at once, in virtual time.

        A pair is held from its ``F``'s start to the end of its ``B`` (or of its
        ``W`` where the backward is split; to the step's end if it has neither):
        1F1B's worker ``w`` of ``p`` holds ``min(m, p - w)``, GPipe's every
        worker ``m``. A pair held until an instant and one held from it do not
        overlap; at one instant the worker's actions count in their order, so a
        pair held for no time (by actions that cost nothing) still counts.
        Stages of different sizes count alike: :attr:`peak_bytes` weighs them.
        """
        return tuple(int(peak) for peak in self._peaks({Kind.FORWARD: lambda s, i: 1.0}))

    @property
    def peak_bytes(self) -> Tuple[float, ...]:
        """Per worker, the most bytes it holds at once: each pair held as in :attr:`peak_activations`, weighed
        by its stage's size for the micro-batch (``sizes=``), a recomputed pair's graph from its ``R`` on
        (``recomputed=``), what a split backward keeps for its ``W`` from its ``I`` on (``deferred=``), each
        stage's parameter gradients from its first ``B`` or ``W`` to the step's end (``gradients=``), and what
        each backward action makes on its way, while it runs (``temporaries=``; a stage's first ``B`` or ``W``
        holds at least its gradients while it runs).

        Raises:
            ValueError: :func:`simulate` was given no ``sizes``.
        """
        if not self.sizes:
            raise ValueError("peak_bytes needs the bytes each stage holds per micro-batch: simulate(..., sizes=[...])")

        def size(table: Tuple[Tuple[float, ...], ...], s: int, i: int) -> float:
            row = table[s] if s < len(table) else ()
            return row[0] if len(row) == 1 else row[i]

        weights: Dict[Kind, Callable[[int, int], float]] = {Kind.FORWARD: lambda s, i: size(self.sizes, s, i)}
        if self.recomputed:
            weights[Kind.RECOMPUTE] = lambda s, i: size(self.recomputed, s, i)
        if self.deferred:
            weights[Kind.BACKWARD_INPUT] = lambda s, i: size(self.deferred, s, i)
        during: Optional[Callable[[int, int], float]] = None
        if self.temporaries:
            during = lambda s, i: size(self.temporaries, s, i)  # noqa: E731
        return self._peaks(weights, self.gradients, during)

    def _peaks(self, weights: Mapping[Kind, Callable[[int, int], float]], gradients: Sequence[float] = (),
               during: Optional[Callable[[int, int], float]] = None) -> Tuple[float, ...]:
        # Each action of a kind in ``weights`` holds its weight from its start to its pair's end. Each backward
        # action holds ``during`` while it runs, on top of what its pair holds until it ends (its own events just
        # before and just after the others at its place in the worker's list); a stage's first B or W, which makes
        # its parameter gradients, holds at least them while it runs, and they stay from its end to the step's end.
        # Each pair's end, and where its worker's list runs what ends it: at one instant (actions that take no
        # time), what ends and starts goes in the worker's order, so a pair held until an action ends before one
        # that a later action starts, and one held for no time still counts.
        position = self.position or {action: i for i, action in enumerate(self.order())}
        ends: Dict[Tuple[int, int], Tuple[float, int]] = {}
        first: Dict[int, Action] = {}  # per stage, its first action that makes its gradients
        for action, finish in self.end.items():
            if action.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
                ends[(action.stage, action.microbatch)] = (finish, position[action])
                known = first.get(action.stage)
                if known is None or (self.start[action], position[action]) < (self.start[known], position[known]):
                    first[action.stage] = action
        events: List[List[Tuple[float, float, float]]] = [[] for _ in self.busy]
        for action, begin in self.start.items():
            pair, at, on = (action.stage, action.microbatch), position[action], self.stage_workers[action.stage]
            if action.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT):
                made = during(*pair) if during is not None else 0.0
                if first.get(action.stage) == action and action.stage < len(gradients) and gradients[action.stage]:
                    kept = gradients[action.stage]
                    made = max(made, kept)
                    events[on] += [(self.end[action], at + 0.5, kept), (self.step_time, len(position), -kept)]
                if made:
                    events[on] += [(begin, at - 0.5, made), (self.end[action], at + 0.5, -made)]
            of = weights.get(action.kind)
            if of is None:
                continue
            weight = of(*pair)
            until, last = ends.get(pair, (self.step_time, len(position)))
            events[on] += [(begin, at, weight), (until, last, -weight)]
        peaks = []
        for worker in events:
            held_now = most = 0.0
            for _, _, change in sorted(worker):
                held_now += change
                most = max(most, held_now)
            peaks.append(most)
        return tuple(peaks)

    def order(self) -> List[Action]:
        """Every action, by start time (ties: the one that ends first)."""
        return sorted(self.start, key=lambda a: (self.start[a], self.end[a]))


def shorter(step: float, than: float) -> bool:
    """Whether the simulated ``step`` is shorter than ``than`` by more than rounding: two schedules whose steps
    sum the same costs in two orders (1F1B and GPipe on as many stages as micro-batches) take one time."""
    return step < than * (1 - 1e-9)


def simulate(schedule: Schedule, costs: Optional[Costs] = None, *, communication: float = 0.0,
             sizes: Optional[Sizes] = None, recomputed: Optional[Sizes] = None,
             deferred: Optional[Sizes] = None, gradients: Optional[Sequence[float]] = None,
             temporaries: Optional[Sizes] = None) -> Simulation:
    """Runs ``schedule`` in virtual time; raises ``ValueError`` naming the stuck actions if it deadlocks.

    Args:
        schedule: the schedule.
        costs: each action's duration: a cost per :class:`Kind` (default
            :data:`DEFAULT_COSTS`: forward 1, backward 2, its halves 1 each,
            recomputation 1), or a function of the action.
        communication: added to a dependency's end when it ran on another worker.
        sizes: one entry per stage: the bytes it holds per micro-batch from its ``F`` to its ``B`` (or ``W``),
            one figure, or one per micro-batch; gives :attr:`Simulation.peak_bytes`.
        recomputed: as ``sizes``, what a recomputed micro-batch's graph adds from its ``R`` to its ``B``.
        deferred: as ``sizes``, what a split backward adds from its ``I`` to its ``W``: the gradients at the
            graph's weight operations that its ``W`` starts from.
        gradients: one figure per stage: the bytes of the gradients its backward makes for its parameters, held
            from its first ``B`` (or ``W``) to the step's end (0 where they exist before the step).
        temporaries: as ``sizes``, what each backward action (``B``, ``I`` or ``W``) adds while it runs: the
            gradients it makes on its way (of the activations it passes through, of the weights before they
            reach ``.grad``, which the stage's first one makes for good: it holds at least ``gradients``
            while it runs). One figure for all of a micro-batch's backward actions: of a split backward, the
            most its ``I`` or its ``W`` made (a bound for the other).

    Example::

        >>> from torchpipe.schedule import Kind, gpipe, simulate
        >>> round(simulate(gpipe(8, 4), {Kind.FORWARD: 1, Kind.BACKWARD: 1}).bubble, 4)  # (p-1)/(m+p-1)
        0.2727
    """
    cost = cost_function(costs)
    run = play(schedule, lambda action, begin: cost(action), communication)
    if sizes is None and recomputed is None and deferred is None and gradients is None and temporaries is None:
        return run
    microbatches = max((a.microbatch + 1 for a in schedule.actions()), default=0)
    return replace(run, sizes=_sizes(sizes or [0.0] * schedule.stages, schedule.stages, microbatches, "sizes"),
                   recomputed=(_sizes(recomputed, schedule.stages, microbatches, "recomputed")
                               if recomputed is not None else ()),
                   deferred=(_sizes(deferred, schedule.stages, microbatches, "deferred")
                             if deferred is not None else ()),
                   gradients=(tuple(row[0] for row in _sizes(list(gradients), schedule.stages, 1, "gradients"))
                              if gradients is not None else ()),
                   temporaries=(_sizes(temporaries, schedule.stages, microbatches, "temporaries")
                                if temporaries is not None else ()))


def _sizes(sizes: Sizes, stages: int, microbatches: int, name: str) -> Tuple[Tuple[float, ...], ...]:
    """``sizes`` as one tuple of bytes per stage; ``ValueError`` for another number of stages or micro-batches,
    or a bad figure."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or len(sizes) != stages:
        raise ValueError(f"{name} needs one entry per stage ({stages}), got {sizes!r}")
    rows: List[Tuple[float, ...]] = []
    for s, entry in enumerate(sizes):
        row = tuple(entry) if isinstance(entry, Sequence) else (entry,)
        if not row or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 for v in row):
            raise ValueError(f"{name}[{s}] must be bytes (a number >= 0, or one per micro-batch), got {entry!r}")
        if len(row) not in (1, microbatches):
            raise ValueError(f"{name}[{s}] has {len(row)} figures for the schedule's {microbatches} micro-batches: "
                             "give one for all, or one per micro-batch")
        rows.append(tuple(float(v) for v in row))
    return tuple(rows)


def cost_function(costs: Optional[Costs]) -> Callable[[Action], float]:
    """``costs`` as a function of the action (:data:`DEFAULT_COSTS` for None; a kind a mapping lacks costs 1)."""
    if costs is None:
        costs = DEFAULT_COSTS
    if callable(costs):
        return costs
    table = dict(costs)

    def cost(action: Action) -> float:
        return float(table.get(action.kind, 1.0))

    return cost


def play(schedule: Schedule, duration_of: Callable[[Action, float], float], communication: float = 0.0) -> Simulation:
    """:func:`simulate`'s list scheduling, each action's duration asked for as it starts: ``duration_of(action,
    begin)``, called once per action, in an order where each action comes after every action it waits for
    (the same action's worker predecessor and its :func:`dependencies`)."""
    present = frozenset(schedule.actions())
    worker_of = {a: w for w, actions in enumerate(schedule.workers) for a in actions}
    start: Dict[Action, float] = {}
    end: Dict[Action, float] = {}
    free = [0.0] * schedule.num_workers
    busy = [0.0] * schedule.num_workers
    cursor = [0] * schedule.num_workers
    needs = {a: [d for d in dependencies(a, schedule.stages, present) if d in present] for a in present}
    remaining = len(present)
    while remaining:
        progressed = False
        for w, actions in enumerate(schedule.workers):
            while cursor[w] < len(actions):
                action = actions[cursor[w]]
                if action in end:  # a duplicate (validate reports it): nothing more to run
                    cursor[w] += 1
                    continue
                deps = needs[action]
                if not all(d in end for d in deps):
                    break
                ready = max((end[d] + (communication if worker_of[d] != w else 0.0) for d in deps), default=0.0)
                begin = max(free[w], ready)
                duration = float(duration_of(action, begin))
                start[action], end[action] = begin, begin + duration
                free[w] = begin + duration
                busy[w] += duration
                cursor[w] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(actions[cursor[w]]) for w, actions in enumerate(schedule.workers) if cursor[w] < len(actions)]
            waits = []
            for w, actions in enumerate(schedule.workers):
                if cursor[w] < len(actions):
                    action = actions[cursor[w]]
                    missing = [str(d) for d in needs[action] if d not in end]
                    waits.append(f"{action} waits for {', '.join(missing)}")
            raise ValueError(
                f"schedule deadlocks: no worker can run its next action ({', '.join(stuck)}): " + "; ".join(waits)
            )
    position = {action: i for actions in schedule.workers for i, action in enumerate(actions)}
    return Simulation(max(end.values(), default=0.0), tuple(busy), start, end, schedule.stage_workers, position)


def clock_cycles(schedule: Schedule) -> List[List[Action]]:
    """The actions that run at each clock cycle when every action takes one cycle.

    Raises ``ValueError`` if the schedule deadlocks.
    """
    result = simulate(schedule, {kind: 1.0 for kind in Kind})
    cycles: List[List[Action]] = [[] for _ in range(int(result.step_time))]
    for actions in schedule.workers:
        for action in actions:
            cycles[int(result.start[action])].append(action)
    return [sorted(c, key=lambda a: (schedule.stage_workers[a.stage], a.stage)) for c in cycles]
