"""What a measured step tells :func:`~torchpipe.schedule.simulate` (see [Note: auto schedule] in ``auto.py``): a
stage's typical cost of a kind, the first step's trips for its messages' layouts, and what the measured actions
leave out of the step's span, as a time per action (what ``schedule='auto'`` charges) or per message between
workers."""
import statistics
from typing import Callable, Sequence

from torchpipe.schedule.actions import Action, Schedule
from torchpipe.schedule.check import dependencies, simulate

__all__ = ["calibrate", "calibrate_overhead", "with_trips", "typical"]


def calibrate(schedule: Schedule, costs: Callable[[Action], float], span: float) -> float:
    """The time a message between workers takes, as measured: the ``communication`` (at least 0) for which
    :func:`simulate` runs ``schedule`` with ``costs`` (each action's measured time) in ``span``, the measured
    step's span (0 where the actions alone take as long, or where none waits for another worker's). A
    Pipeline's ``'auto'`` charges what its actions leave out to each action instead (:func:`calibrate_overhead`,
    see [Note: auto schedule]).

    Example::

        >>> from torchpipe.schedule import Kind, one_f_one_b, simulate
        >>> cost = lambda action: 2.0 if action.kind is Kind.BACKWARD else 1.0
        >>> measured = simulate(one_f_one_b(4, 2), cost, communication=0.25).step_time
        >>> round(calibrate(one_f_one_b(4, 2), cost, measured), 6)
        0.25
    """
    return _solve(lambda communication: simulate(schedule, costs, communication=communication).step_time, span)


def calibrate_overhead(schedule: Schedule, costs: Callable[[Action], float], span: float) -> float:
    """The time a worker spends around each action that ``costs`` (each action's measured time) leave out: the
    overhead (at least 0) which, added to every action's cost, has :func:`simulate` run ``schedule`` in ``span``,
    the measured step's span from its first action's start to its last one's end (0 where the actions alone take
    as long). The span holds one overhead less than the simulated step: the one around its last action. See
    [Note: auto schedule] for why this, not a message's time (:func:`calibrate`), is what ``'auto'`` charges.

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


def with_trips(schedule: Schedule, costs: Callable[[Action], float], trip: float) -> Callable[[Action], float]:
    """``costs`` with ``trip`` more for every message from another worker that each action of ``schedule`` waits
    for (see [Note: auto schedule]).

    A message whose layout its receiver did not know (every message of a first step across processes) crosses in
    a trip more: its tensors' receives are posted once its header was read, and the header is read when the
    receiving action asks for it, so the action pays the trip even where the message came early, which a hop's
    own time would not. Not so exactly: each peer's first message of a step is taken by a receiving thread as it
    arrives (an early one hides its trip), and an action that asks for a message takes the ones its peer sent
    before it first; the extra messages of skips and tied copies are not counted here (their trips stay in what
    :func:`calibrate_overhead` spreads over every action).

    Args:
        schedule: the measuring step as it ran.
        costs: each action's own measured time.
        trip: the mean trip of a message (0 in one process: ``costs`` as they are).

    Returns:
        Each action's cost with its messages' trips.

    Example::

        >>> from torchpipe.schedule import Action, Kind, one_f_one_b
        >>> charged = with_trips(one_f_one_b(2, 2), lambda action: 1.0, 0.5)
        >>> [charged(Action(s, kind, 0)) for s, kind in [(0, Kind.FORWARD), (1, Kind.FORWARD), (0, Kind.BACKWARD)]]
        [1.0, 1.5, 1.5]
    """
    if not trip:
        return costs
    present = frozenset(schedule.actions())
    worker_of = {action: w for w, actions in enumerate(schedule.workers) for action in actions}
    messages = {action: sum(worker_of[need] != worker_of[action] for need in dependencies(
        action, schedule.stages, present) if need in present) for action in present}

    def cost(action: Action) -> float:
        return costs(action) + trip * messages.get(action, 0)

    return cost


def typical(times: Sequence[float]) -> float:
    """A stage's cost of a kind from its actions' times on the measuring step, in the order they ran: the median
    of those after the first, or the only one. The first of a kind on a first step pays for what runs once (the
    autograd engine's start, first allocations), many times a later one's cost; the least of the others
    would be a lucky one's, and a simulation from such costs predicts steps shorter than they run."""
    if not times:
        raise ValueError("typical() needs at least one time")
    return statistics.median(times[1:]) if len(times) > 1 else times[0]
