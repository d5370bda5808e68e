"""What a measured step tells :func:`~torchpipe.schedule.simulate` (see [Note: auto schedule] in ``auto.py``): a
stage's typical cost of a kind, the first step's relayouts for its messages, and what the measured actions leave
out of the step's span, as a time per action (what ``schedule='auto'`` charges)."""
import statistics
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple

from torchpipe.schedule.actions import Action, Kind, Schedule
from torchpipe.schedule.check import dependencies, simulate

__all__ = ["calibrate_overhead", "with_relayouts", "typical", "Timings", "Measurements", "KINDS", "Tuner",
           "Exchange", "exchanged"]

#: The kinds of action a measured step times, in the order a :class:`Measurements` record lists them.
KINDS = (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT, Kind.RECOMPUTE)

#: Every rank's values (a list of floats per rank, in rank order) for this rank's: a collective across processes.
Exchange = Callable[[List[float]], List[List[float]]]


class Timings(Dict[Tuple[int, Kind], List[float]]):
    """A measured step on this rank: each action's duration (its thread's CPU time, not its waits for messages),
    by (stage, kind), and each action's wall-clock start and end on this rank's clock (see [Note: zero-bubble
    split], [Note: auto schedule])."""

    def __init__(self) -> None:
        super().__init__()
        #: (start, end) of each action, seconds of ``time.perf_counter`` (appended by the workers' threads).
        self.spans: List[Tuple[float, float]] = []

    @property
    def window(self) -> float:
        """From this rank's first action's start to its last one's end, in seconds (0 with none)."""
        return max(end for _, end in self.spans) - min(start for start, _ in self.spans) if self.spans else 0.0


class Measurements(NamedTuple):
    """What one rank measured on a step, as the ranks exchange it: the one place that packs it into floats and
    reads it back."""

    #: Each action's durations (seconds), by (stage, kind); kinds outside :data:`KINDS` are left out.
    durations: Dict[Tuple[int, Kind], List[float]]
    #: From the rank's first action's start to its last one's end (seconds; 0 unknown).
    window: float = 0.0
    #: Across processes, per message whose layout the rank did not expect (every message of a pipeline's first
    #: step), the seconds it waited after its header for its tensors.
    relayouts: Tuple[float, ...] = ()

    @classmethod
    def of(cls, timings: Mapping[Tuple[int, Kind], Sequence[float]], relayouts: Sequence[float] = ()) -> "Measurements":
        """The measurements of ``timings`` (a :class:`Timings`, or any mapping of durations: no window)."""
        durations = {key: list(values) for key, values in timings.items() if key[1] in KINDS and values}
        window = timings.window if isinstance(timings, Timings) else 0.0
        return cls(durations, float(window), tuple(float(r) for r in relayouts))

    def pack(self) -> List[float]:
        """``[window, sum of relayouts, number of relayouts]``, then per (stage, kind) in order: the stage, the
        kind's index in :data:`KINDS`, the number of durations, and each duration."""
        values = [self.window, float(sum(self.relayouts)), float(len(self.relayouts))]
        for (stage, kind), durations in sorted(self.durations.items(), key=lambda item: (item[0][0],
                                                                                          KINDS.index(item[0][1]))):
            values += [float(stage), float(KINDS.index(kind)), float(len(durations))] + [float(v) for v in durations]
        return values

    @classmethod
    def unpack(cls, values: Sequence[float]) -> "Measurements":
        """A record :meth:`pack` wrote (its relayouts as their mean, as many times as there were)."""
        count = int(values[2])
        relayouts = (values[1] / count,) * count if count else ()
        durations: Dict[Tuple[int, Kind], List[float]] = {}
        k = 3
        while k + 2 < len(values):
            key, n = (int(values[k]), KINDS[int(values[k + 1])]), int(values[k + 2])
            durations[key] = list(values[k + 3 : k + 3 + n])
            k += 3 + n
        return cls(durations, values[0], relayouts)


def exchanged(mine: "Measurements", exchange: Optional[Exchange]) -> List["Measurements"]:
    """Every rank's measurements (``mine`` alone in one process)."""
    if exchange is None:
        return [mine]
    return [Measurements.unpack(values) for values in exchange(mine.pack())]


class Tuner(Protocol):
    """What a Pipeline's schedule tuners do (a zero-bubble split, ``'auto'``): plan each step's schedule, and learn
    from the first training steps until they decide. Every rank's tuner takes the same measurements (exchanged)
    and decides alike."""

    @property
    def decided(self) -> bool:
        """Whether the schedule is settled: no step is measured or tried any more."""

    @property
    def measuring(self) -> bool:
        """Whether the next training step's actions are to be timed (:meth:`record`); else, until decided, the
        step's time is taken (:meth:`record_trial`)."""

    def plan(self, microbatches: int) -> Schedule:
        """The schedule of a step of ``microbatches``."""

    def record(self, timings: Mapping[Tuple[int, Kind], Sequence[float]], exchange: Optional[Exchange] = None,
               microbatches: int = 1, *, relayouts: Sequence[float] = ()) -> bool:
        """Takes a measured training step (this rank's); returns whether the schedule changed."""

    def record_trial(self, seconds: float, exchange: Optional[Exchange] = None, rows: int = 0) -> bool:
        """Takes a tried training step's time; returns whether the schedule changed."""


def calibrate_overhead(schedule: Schedule, costs: Callable[[Action], float], span: float) -> float:
    """The time a worker spends around each action that ``costs`` (each action's measured time) leave out: the
    overhead (at least 0) which, added to every action's cost, has :func:`simulate` run ``schedule`` in ``span``,
    the measured step's span from its first action's start to its last one's end (0 where the actions alone take
    as long). The span holds one overhead less than the simulated step: the one around its last action. See
    [Note: auto schedule] for why this, not a message time, is what ``'auto'`` charges.

    Example::

        >>> from torchpipe.schedule import Kind, one_f_one_b, simulate
        >>> cost = lambda action: 2.0 if action.kind is Kind.BACKWARD else 1.0
        >>> measured = simulate(one_f_one_b(4, 2), lambda action: cost(action) + 0.125).step_time - 0.125
        >>> round(calibrate_overhead(one_f_one_b(4, 2), cost, measured), 6)
        0.125
    """
    return _solve(lambda overhead: simulate(schedule, lambda action: costs(action) + overhead).step_time - overhead,
                  span)


def _solve(step: Callable[[float], float], span: float) -> float:
    """The charge (at least 0, at most ``span``) for which ``step(charge)``, which grows with it, is ``span``; 0
    where nothing is left to charge (``step(0)`` already takes ``span``, or no charge reaches it)."""
    if span <= step(0.0):
        return 0.0
    low, high = 0.0, span
    if step(high) < span:  # nothing on the way that the charge lengthens
        return 0.0
    for _ in range(50):  # bisection
        middle = (low + high) / 2
        if step(middle) < span:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def with_relayouts(schedule: Schedule, costs: Callable[[Action], float], relayout: float) -> Callable[[Action], float]:
    """``costs`` with ``relayout`` more for every message from another worker that each action of ``schedule`` waits
    for (see [Note: auto schedule]).

    A message whose layout its receiver did not know (every message of a first step across processes) waits for a
    relayout: its tensors' receives are posted once its header was read, and the header is read when the
    receiving action asks for it, so the action pays the relayout even where the message came early, which a
    message time would not. Not so exactly: each peer's first message of a step is taken by a receiving thread as it
    arrives (an early one hides its relayout), and an action that asks for a message takes the ones its peer sent
    before it first; the extra messages of skips and tied copies are not counted here (their relayouts stay in
    what :func:`calibrate_overhead` spreads over every action).

    Args:
        schedule: the measuring step as it ran.
        costs: each action's own measured time.
        relayout: the mean relayout of a message (0 in one process: ``costs`` as they are).

    Returns:
        Each action's cost with its messages' relayouts.

    Example::

        >>> from torchpipe.schedule import Action, Kind, one_f_one_b
        >>> charged = with_relayouts(one_f_one_b(2, 2), lambda action: 1.0, 0.5)
        >>> [charged(Action(s, kind, 0)) for s, kind in [(0, Kind.FORWARD), (1, Kind.FORWARD), (0, Kind.BACKWARD)]]
        [1.0, 1.5, 1.5]
    """
    if not relayout:
        return costs
    present = frozenset(schedule.actions())
    worker_of = {action: w for w, actions in enumerate(schedule.workers) for action in actions}
    messages = {action: sum(worker_of[need] != worker_of[action] for need in dependencies(
        action, schedule.stages, present) if need in present) for action in present}

    def cost(action: Action) -> float:
        return costs(action) + relayout * messages.get(action, 0)

    return cost


def typical(times: Sequence[float]) -> float:
    """A stage's cost of a kind from its actions' times on the measuring step, in the order they ran: the median
    of those after the first, or the only one. The first of a kind on a first step pays for what runs once (the
    autograd engine's start, first allocations), many times a later one's cost; the least of the others
    would be a lucky one's, and a simulation from such costs predicts steps shorter than they run."""
    if not times:
        raise ValueError("typical() needs at least one time")
    return statistics.median(times[1:]) if len(times) > 1 else times[0]
