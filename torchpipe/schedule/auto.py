"""``schedule='auto'``: the built-in schedule that :func:`simulate` finds fastest for measured costs, within 1F1B's
memory.

[Note: auto schedule] *Measure.* A Pipeline made with ``schedule='auto'`` runs its first training step on a
measuring schedule of its placement (:func:`measuring_schedule`: the split schedule with every other micro-batch's
backward whole), which times each stage's ``F``, ``B``, ``I`` and ``W`` as thread CPU time; a stage's cost of a
kind is :func:`typical` of its times. *Calibrate.* What the actions' times leave out of the step's span (handing
messages on, being woken for them, waiting for a core) becomes one overhead added to every action, the one for
which :func:`simulate` replays the measuring step in that span (:func:`calibrate_overhead`): it goes with the
actions, not the messages, since a worker pays it around each action. Across processes the relayout each first-step
message waits for, its layout unknown ([Note: expected layouts]), is charged first, to the actions that receive such
messages (:func:`with_relayouts`). *Choose.* :func:`choose` simulates every built-in schedule of the placement at
these costs, as it would run (:func:`~torchpipe.schedule.merge_backwards`), and keeps the fastest whose busiest
worker holds no more (stage, micro-batch) activations than 1F1B's would: as many as there are stages. Every rank
exchanges its costs first, so every rank chooses alike. With ``memory_limit=``, the bound is in bytes instead: the
fastest whose busiest worker's predicted peak (:class:`Footprint`, from every rank's bytes measured on the first
step: [Note: held bytes] in ``runtime/held.py``) fits, and a ``ValueError`` on every rank if none does. *Fall
back.* Without it, if none fits (three or more stages per worker), the one that holds the fewest. *Limits.* One
cost per (stage, kind) cannot say a message's time by its size, nor an action's by what ran before it
(``looped_bfs``'s runs of one kind; where they are long, it holds more than the others anyway); a network's own
message time (``communication=``) is not measured. Loss and gradients are the plain module's at every step, the
measuring one included.
"""
import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from torchpipe.schedule.actions import Action, Kind, Schedule
from torchpipe.schedule.check import cost_function, shorter, simulate
from torchpipe.schedule.footprint import Footprint, exchanged_footprint
from torchpipe.schedule.generate import (
    NAMES,
    SPLITTING,
    V_SHAPED,
    build,
    choose_split,
    interleaved_zero_bubble,
    with_recomputation,
    zero_bubble,
)
from torchpipe.schedule.measured import (
    Exchange,
    Measurements,
    calibrate_overhead,
    exchanged,
    typical,
    with_relayouts,
)
from torchpipe.schedule.merge import made_whole, merge_backwards
from torchpipe.schedule.vshape import zbv

__all__ = ["Choice", "choose", "calibrate_overhead", "candidates",
           "placement_names", "one_map",
           "measuring_schedule", "typical", "with_relayouts", "AutoTuner"]

logger = logging.getLogger("torchpipe")



def placement_names(stages: int, workers: int) -> List[str]:
    """The built-in schedules that run ``stages`` on ``workers`` with one stage-to-worker map, in the order a tie
    in step time prefers: one stage per worker; the V for two per worker (the loop's schedules, on another map,
    hold more than 1F1B there); else the loop."""
    names: List[str] = []
    if stages == workers:
        names += ["1f1b", "zero_bubble", "gpipe"]
    if stages == 2 * workers:
        names += ["zbv", "dualpipev"]
    if workers >= 1 and stages % workers == 0 and stages // workers >= 2 and (stages != 2 * workers or workers == 1):
        names += ["interleaved_zero_bubble", "interleaved_1f1b", "looped_bfs"]
    if not names:
        raise ValueError(
            f"schedule='auto' has no built-in schedule for {stages} stages on {workers} workers: it needs one stage "
            f"per worker, or a multiple (at least 2) of the workers ({2 * workers}, {3 * workers}, ... stages)"
        )
    return names


def one_map(names: Iterable[str], stages: int, workers: int) -> List[str]:
    """Checks that the built-in schedules ``names`` all place ``stages`` on ``workers`` with one stage-to-worker
    map, as ``'auto'`` chooses among (:func:`placement_names`; for two stages per worker, also the loop's, which
    ``'auto'`` leaves out there, since they hold more than 1F1B).

    Args:
        names: names of :data:`~torchpipe.schedule.NAMES`, each once.
        stages: the number of stages.
        workers: the number of workers (or ranks).

    Returns:
        ``names`` as a list.

    Raises:
        TypeError: ``names`` is one string.
        ValueError: every problem at once (none named, a repeat, an unknown name, one that does not fit or runs
            on another number of workers, two maps), with the built-in schedules of each map that fits.

    Example::

        >>> one_map(["interleaved_zero_bubble", "looped_bfs"], 4, 2)
        ['interleaved_zero_bubble', 'looped_bfs']
    """
    if isinstance(names, str):
        raise TypeError(f"names takes a list of schedule names, got the string {names!r}: write [{names!r}]")
    names = list(names)
    if stages < 1 or workers < 1:
        raise ValueError(f"schedules need at least one stage and one worker, got {stages} stages on {workers} workers")
    problems: List[str] = []
    if not names:
        problems.append("none named")
    repeated = [name for name in dict.fromkeys(names) if names.count(name) > 1]
    if repeated:
        problems.append(f"{', '.join(map(repr, repeated))} named more than once")
    fits = _by_map(stages, workers)
    where = {name: placed for placed, group in fits.items() for name in group}
    maps: Dict[Tuple[int, ...], List[str]] = {}
    for name in dict.fromkeys(names):
        if name not in NAMES:
            problems.append(f"{name!r} is not a built-in schedule ({', '.join(map(repr, NAMES))})")
        elif name not in where:  # why it does not fit here: the generator's error, or another number of workers
            try:
                problems.append(f"{name!r} runs {stages} stages on "
                                f"{build(name, 2 * workers, stages, workers).num_workers} workers, not {workers}")
            except ValueError as exc:
                problems.append(str(exc))
        else:
            maps.setdefault(where[name], []).append(name)
    if len(maps) > 1:
        problems.append("they place the stages on the workers differently: " + "; ".join(
            f"{', '.join(map(repr, placed))} on workers {list(where)}" for where, placed in maps.items()))
    if problems:
        fitting = "; ".join(f"{placed} (workers {list(stage_workers)})" for stage_workers, placed in fits.items())
        raise ValueError(f"names={names!r} for {stages} stages on {workers} workers: " + "; ".join(problems)
                         + f". The built-in schedules of one map here: {fitting or 'none'}")
    return names


def _by_map(stages: int, workers: int) -> Dict[Tuple[int, ...], List[str]]:
    """The built-in schedules that run ``stages`` on ``workers``, grouped by their stage-to-worker map."""
    maps: Dict[Tuple[int, ...], List[str]] = {}
    for name in NAMES:
        try:
            schedule = build(name, 2 * workers, stages, workers)
        except ValueError:
            continue
        if schedule.num_workers == workers:
            maps.setdefault(schedule.stage_workers, []).append(name)
    return maps


def candidates(stages: int, workers: int, *, splitting: bool = True, names: Optional[Iterable[str]] = None
               ) -> List[str]:
    """``names`` (default: :func:`placement_names`; see :func:`one_map`), less those that split backwards without
    ``splitting``; ``ValueError`` if none."""
    placed = placement_names(stages, workers) if names is None else one_map(names, stages, workers)
    kept = [name for name in placed if splitting or name not in SPLITTING]
    if not kept and names is not None:
        whole = [name for name in _by_map(stages, workers).get(build(placed[0], 2 * workers, stages,
                                                                       workers).stage_workers, [])
                 if name not in SPLITTING]
        raise ValueError(
            f"every one of {placed} splits the backward, which needs torch.autograd.graph.GradientEdge (this torch "
            "lacks it); " + (f"name one that does not on the same map ({whole}), or upgrade PyTorch" if whole
                             else "no built-in schedule of that map runs without it: upgrade PyTorch")
        )
    if not kept:
        raise ValueError(
            f"schedule='auto' places {stages} stages on {workers} workers in a V, whose schedules split the "
            "backward, which needs torch.autograd.graph.GradientEdge (this torch lacks it); use one stage per "
            "worker, three or more per worker, or upgrade PyTorch"
        )
    return kept


def _build(name: str, microbatches: int, stages: int, workers: int, split: Optional[List[bool]],
           costs: Callable[[Action], float], communication: float) -> Schedule:
    """The named schedule as it runs: each split backward whose ``W`` fills no gap at ``costs`` made whole."""
    if name == "dualpipev" and microbatches < 2 * workers:
        schedule = build(name, 2 * workers, stages, workers).restricted(microbatches)
    else:
        schedule = build(name, microbatches, stages, workers, split if name == "zero_bubble" else None)
    return merge_backwards(schedule, costs, communication=communication)


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` picked, and why."""

    #: The schedule's name (one of :data:`~torchpipe.schedule.NAMES`).
    name: str
    #: ``'zero_bubble'``'s split per stage (from :func:`choose_split`), else None.
    split: Optional[List[bool]]
    #: Per candidate: name, simulated step time, the busiest worker's peak activations.
    table: Tuple[Tuple[str, float, int], ...]
    #: The most a worker may hold: 1F1B's busiest (the number of stages).
    limit: int
    #: The message time between workers that the simulations charged (``communication=`` of :func:`choose`).
    communication: float = 0.0
    #: The time around each action that the simulations added to its cost (see :func:`calibrate_overhead`).
    overhead: float = 0.0
    #: The costs it chose by, per action, the overhead included (the default costs where None).
    costs: Optional[Callable[[Action], float]] = field(default=None, repr=False, compare=False)
    #: With ``footprint``: per candidate, name and the busiest worker's predicted peak bytes (:meth:`Footprint.peak`).
    peak_bytes: Tuple[Tuple[str, float], ...] = ()
    #: The most bytes a worker may hold (``memory_limit=``; None: the bound is :attr:`limit` activations).
    memory_limit: Optional[float] = None

    def build(self, microbatches: int, stages: int, workers: int) -> Schedule:
        """The chosen schedule for ``microbatches``, as it runs (see :func:`choose`)."""
        return _build(self.name, microbatches, stages, workers, self.split, self.costs or cost_function(None),
                      self.communication)


def choose(
    stages: int, workers: int, microbatches: int, costs: Callable[[int, Kind], float], *, splitting: bool = True,
    communication: float = 0.0, overhead: float = 0.0, names: Optional[Iterable[str]] = None,
    footprint: Optional[Footprint] = None, memory_limit: Optional[float] = None,
) -> Choice:
    """The fastest built-in schedule of the placement for ``costs(stage, kind)`` within 1F1B's memory, or within
    ``memory_limit`` bytes per worker.

    ``splitting`` False leaves out the schedules that split backwards; ``communication`` is added to every
    dependency on another worker's action (a message's time), ``overhead`` to every action's cost (the time a
    worker spends around it: :func:`calibrate_overhead`); ``names`` chooses among those schedules instead of the
    placement's (all on one map: :func:`one_map`). With ``footprint`` and ``memory_limit``, a schedule fits if
    its busiest worker's predicted peak bytes (:meth:`Footprint.peak`) are at most the limit, which replaces the
    bound of 1F1B's activations. Pure: the same costs give the same choice.

    Raises:
        ValueError: with ``memory_limit``, no schedule fits; the message names the smallest prediction.

    Example::

        >>> from torchpipe.schedule import Kind
        >>> paper = {Kind.FORWARD: 1, Kind.BACKWARD: 2, Kind.BACKWARD_INPUT: 1, Kind.BACKWARD_WEIGHT: 1}
        >>> choose(4, 2, 8, lambda stage, kind: paper[kind]).name
        'zbv'
    """
    limit = stages
    table: List[Tuple[str, float, int]] = []
    predicted: List[Tuple[str, float]] = []
    split: Optional[List[bool]] = None

    def charged(stage: int, kind: Kind) -> float:
        return costs(stage, kind) + overhead

    def cost(action: Action) -> float:
        return charged(action.stage, action.kind)

    for name in candidates(stages, workers, splitting=splitting, names=names):
        if name == "zero_bubble":
            split = choose_split(microbatches, stages, charged, communication=communication)
        built = _build(name, microbatches, stages, workers, split, cost, communication)
        run = simulate(built, cost, communication=communication)
        table.append((name, run.step_time, max(run.peak_activations)))
        if footprint is not None:
            predicted.append((name, footprint.peak(built)))
    if memory_limit is not None and footprint is not None:
        fits = {name for name, peak in predicted if peak <= memory_limit}
        if not fits:
            name, peak = min(predicted, key=lambda row: row[1])
            raise ValueError(
                f"schedule='auto' found no schedule within memory_limit={memory_limit:.0f} bytes per worker: the "
                f"smallest predicted peak is {peak:.0f} bytes ({name!r}; every candidate: "
                + ", ".join(f"{n} {b:.0f}" for n, b in predicted)
                + "). Hold less per micro-batch: checkpoint='always' or 'except_last', recompute='full' or "
                "'selective', more chunks, or raise memory_limit"
            )
        fitting = [row for row in table if row[0] in fits]
    else:
        fewest = min(held for _, _, held in table)
        fitting = [row for row in table if row[2] <= max(limit, fewest)]  # if none fits, those that hold the fewest
    fastest = min(step for _, step, _ in fitting)
    best = next(row for row in fitting if not shorter(fastest, row[1]))  # the first of equal steps: the preference
    return Choice(best[0], split if best[0] == "zero_bubble" else None, tuple(table), limit, communication, overhead,
                  cost, tuple(predicted), memory_limit if footprint is not None else None)


def measuring_schedule(stages: int, workers: int, microbatches: int, *, splitting: bool = True,
                       names: Optional[Iterable[str]] = None) -> Schedule:
    """The first step's schedule, named ``'auto'``: the placement's split schedule with the backward of every
    even micro-batch whole (``B`` where its ``I`` was, no ``W``), so that one step times ``F``, ``B``, ``I`` and
    ``W`` of every stage (only ``F`` and ``B`` without ``splitting``, or with one micro-batch). With ``names``
    (see :func:`one_map`), on their map: the loop's, say, for two stages per worker."""
    names = placement_names(stages, workers) if names is None else one_map(names, stages, workers)
    if names[0] in ("1f1b", "zero_bubble", "gpipe"):
        base = zero_bubble(microbatches, stages)
    elif names[0] in V_SHAPED:
        base = zbv(microbatches, workers)
    else:
        base = interleaved_zero_bubble(microbatches, stages, workers)

    measuring = made_whole(base, lambda inputs: not splitting or inputs.microbatch % 2 == 0)
    return replace(measuring, name="auto")


class AutoTuner:
    """``schedule='auto'`` in a Pipeline: the measuring schedule for the first training step, then the choice
    (see [Note: auto schedule])."""

    def __init__(self, stages: int, workers: int, chunks: int, *, splitting: bool = True,
                 names: Optional[Iterable[str]] = None, memory_limit: Optional[float] = None) -> None:
        #: The schedules it measures on the map of and chooses among (None: the placement's, see
        #: :func:`placement_names`).
        self.names: Optional[List[str]] = None if names is None else one_map(names, stages, workers)
        # A placement with no built-in schedule, or none without splitting: ValueError now.
        candidates(stages, workers, splitting=splitting, names=self.names)
        self.stages, self.workers, self.chunks, self.splitting = stages, workers, chunks, splitting
        #: The typical measured cost of each (stage, kind), every rank's (:func:`typical`).
        self.costs: Dict[Tuple[int, Kind], float] = {}
        #: The seconds a message of the measuring step waited, after its header, for its relayout (its layout
        #: unknown) (the mean over every rank's; 0 in one process), charged to the actions that received such messages
        #: (:func:`with_relayouts`), not to every action.
        self.relayout = 0.0
        self.choice: Optional[Choice] = None
        #: The most bytes a worker may hold (None: no more activations than 1F1B's).
        self.memory_limit = memory_limit
        #: What this rank held on the measuring step, as a :class:`Footprint`, read as it ends (set by the
        #: Pipeline: see [Note: held bytes]).
        self.footprint_source: Optional[Callable[[], Optional[Footprint]]] = None

    @property
    def decided(self) -> bool:
        return self.choice is not None

    @property
    def measuring(self) -> bool:
        """Whether the next training step's actions are to be timed: until the choice is made."""
        return self.choice is None

    def plan(self, microbatches: int) -> Schedule:
        """The schedule of a step of ``microbatches``: the measuring one, then the choice."""
        if self.choice is None:
            return measuring_schedule(self.stages, self.workers, microbatches, splitting=self.splitting,
                                      names=self.names)
        return self.choice.build(microbatches, self.stages, self.workers)

    def record(self, timings: Mapping[Tuple[int, Kind], Sequence[float]], exchange: Optional[Exchange] = None,
               microbatches: int = 1, *, relayouts: Sequence[float] = ()) -> bool:
        """Takes the measuring step's timings (this rank's stages; with the span of its actions where ``timings``
        is a :class:`~torchpipe.schedule.measured.Timings`) and its messages' relayouts
        (``relayouts``, across processes), and chooses; returns True (the schedule changed).
        ``exchange`` gathers every rank's measurements (across processes; called on every rank)."""
        del microbatches  # the choice is for the Pipeline's chunks, whatever the first batch's size
        spans: List[float] = []
        relayouts_measured: List[float] = []
        durations: Dict[Tuple[int, Kind], List[float]] = {}
        for measured in exchanged(Measurements.of(timings, relayouts), exchange):
            spans.append(measured.window)
            relayouts_measured += measured.relayouts
            durations.update(measured.durations)
        self.costs = {key: typical(values) for key, values in durations.items() if key[1] is not Kind.RECOMPUTE}
        # Each message of the measuring step, its layout unknown, waited for a relayout, measured (none in one
        # process): later steps' messages wait for none. What is left of the span the workers spent around each action.
        self.relayout = relayout = (sum(relayouts_measured) / len(relayouts_measured)
                                   if relayouts_measured else 0.0)
        schedule, own = self._measured_step(durations)
        overhead = calibrate_overhead(schedule, with_relayouts(schedule, own, relayout), max(spans, default=0.0))
        footprint = self._footprint(exchange) if self.memory_limit is not None else None
        choice = self.choice = choose(self.stages, self.workers, self.chunks, self.cost, splitting=self.splitting,
                                      overhead=overhead, names=self.names, footprint=footprint,
                                      memory_limit=self.memory_limit)
        if choice.memory_limit is not None:
            bytes_of = dict(choice.peak_bytes)
            steps = ", ".join(f"{name} {step:.3g} ({bytes_of[name]:.0f} bytes)" for name, step, _ in choice.table)
        else:
            steps = ", ".join(f"{name} {step:.3g}{'' if peak <= choice.limit else ' (holds ' + str(peak) + ')'}"
                              for name, step, peak in choice.table)
        logger.info("schedule='auto' chose %r for %d stages on %d workers and %d micro-batches (simulated steps "
                    "from the measured costs and %.3g around each action, the first step's relayout of %.3g a message "
                    "aside: %s; at most %s per worker)", choice.name, self.stages, self.workers, self.chunks,
                    overhead, relayout, steps, f"{choice.limit} activations" if choice.memory_limit is None
                    else f"{choice.memory_limit:.0f} bytes")
        return True

    def _footprint(self, exchange: Optional[Exchange]) -> Footprint:
        """Every rank's measured bytes, as one footprint (a collective across ranks)."""
        return exchanged_footprint(self.footprint_source() if self.footprint_source is not None else None, exchange)

    def record_trial(self, seconds: float, exchange: Optional[Exchange] = None, rows: int = 0) -> bool:
        """Never called: ``'auto'`` measures until it decides, and tries nothing."""
        raise AssertionError("schedule='auto' measures its first step and decides: it tries no step")

    def _measured_step(
        self, durations: Mapping[Tuple[int, Kind], Sequence[float]]
    ) -> Tuple[Schedule, Callable[[Action], float]]:
        """The measuring step as it ran (its micro-batches and recomputations, from what was timed), and each
        of its actions' own measured time (a stage's actions of a kind ran in the schedule's order)."""
        microbatches = max((len(v) for (_, kind), v in durations.items() if kind is Kind.FORWARD), default=0)
        recomputed = {s: len(v) for (s, kind), v in durations.items() if kind is Kind.RECOMPUTE}
        schedule = with_recomputation(
            measuring_schedule(self.stages, self.workers, microbatches or self.chunks, splitting=self.splitting,
                               names=self.names),
            lambda s, i: i < recomputed.get(s, 0),
        )
        own: Dict[Action, float] = {}
        seen: Dict[Tuple[int, Kind], int] = {}
        for actions in schedule.workers:
            for action in actions:
                key = (action.stage, action.kind)
                k = seen[key] = seen.get(key, -1) + 1
                times = durations.get(key, ())
                if k < len(times):
                    own[action] = times[k]

        def cost(action: Action) -> float:
            found = own.get(action)
            return found if found is not None else self.cost(action.stage, action.kind)

        return schedule, cost

    def cost(self, stage: int, kind: Kind) -> float:
        """A measured cost; one not measured from those that were (``B`` as ``I + W``, ``I`` and ``W`` as half
        ``B``, a stage none of whose actions ran as a forward of 1 and a backward of 2)."""
        found = self.costs.get((stage, kind))
        if found is not None:
            return found
        forward = self.costs.get((stage, Kind.FORWARD), 1.0)
        inputs, weights = self.costs.get((stage, Kind.BACKWARD_INPUT)), self.costs.get((stage, Kind.BACKWARD_WEIGHT))
        if kind is Kind.BACKWARD:
            return inputs + weights if inputs is not None and weights is not None else 2.0 * forward
        whole = self.costs.get((stage, Kind.BACKWARD))
        if kind in (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT):
            return whole / 2.0 if whole is not None else forward
        return forward
