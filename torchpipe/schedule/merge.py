"""Whole backwards where a split one buys nothing: :func:`merge_backwards`.

A split backward (``I`` now, ``W`` later) pays only where ``W`` fills time
the worker would otherwise idle. Elsewhere it costs: the two halves run two
passes of the autograd engine over a kept graph, and on a CPU they can take
longer than the whole backward. The zero-bubble generators split every
backward, because they place the weight gradients before they know which
ones will fill a bubble; this pass makes whole again (``B`` where the ``I``
was, its ``W`` gone) each one that need not be split.

[Note: merging backwards] The test is the simulation's, in one forward pass.
First the schedule is simulated with the given costs (step ``T``), and each
action's latest start that keeps the step within ``T`` is found backwards
(``deadline``: a longest-path pass over the same dependencies and worker
orders). Then the schedule is played again in virtual time, and when an
``I`` starts, at ``begin``, it is made whole if its ``B`` would end, at
``begin + cost(B)``, in time:

- for each action that waits for its input gradient (by that action's
  latest start, less a message where it runs on another worker), and for
  the step's end ``T``;
- for the worker's actions between the ``I`` and its ``W``, which now come
  right after the ``B`` and lose the ``W``'s place. Their latest starts are
  found again without the ``W`` (back from the action after it), and each
  must start by its new one, counting that it starts when the one before it
  ends or, at the latest, at its old latest start (if what it waits for is
  late); the last of them must end by the latest start of the action after
  the ``W``.

A whole backward then plays for ``cost(B)`` and its ``W`` for nothing, and
the actions between keep their new, later latest starts.

Why this never lengthens the step: every action of the new schedule starts
by its latest start (as the pass leaves it), by induction in the order the
play starts them: an action starts when the last of what it waits for (its
worker's previous action, and its dependencies, plus messages) has ended,
and each of those ends in time for it: by the latest starts' definition for
the pairs the pass left alone, by the test for each whole backward and the
actions it moved, and since latest starts only grow. So every action ends
by ``T``. And never more memory: a ``W`` only moves earlier in its worker's
list, so each (stage, micro-batch) is held until an earlier point of the
same order (:attr:`~torchpipe.schedule.Simulation.peak_activations`).

With the default costs, where ``B`` costs ``I + W``, a backward is merged
only where the split bought nothing in the model, and the merged schedule's
step is the same; where the machine's ``B`` costs less than ``I + W``, the
step is shorter by the difference, for every merged one.
"""
from typing import Callable, Dict, List, Optional, Set

from torchpipe.schedule.actions import Action, Kind, Schedule
from torchpipe.schedule.check import Costs, cost_function, dependencies, play, simulate

__all__ = ["merge_backwards"]

#: A little room for floating-point sums of costs compared to each other.
_EPSILON = 1e-9


def merge_backwards(schedule: Schedule, costs: Optional[Costs] = None, *, communication: float = 0.0) -> Schedule:
    """``schedule`` with each split backward made whole where that delays nothing (see [Note: merging backwards]).

    Each ``sIi`` whose whole backward ``sBi`` would still end in time for
    every action after it becomes ``sBi`` in its place, and ``sWi`` goes.
    With ``costs`` and ``communication`` as for :func:`simulate` (default:
    :data:`DEFAULT_COSTS`, where ``B`` costs ``I + W``), the result's
    simulated step is never longer than the schedule's and no worker's
    :attr:`~Simulation.peak_activations` higher. Given ``costs``, the test
    is made with them and with the default ones, and the result is the one
    whose step is shorter at ``costs`` (the test is greedy: it may merge
    more, and better, with ``B`` at ``I + W``). A schedule with no split
    backward is returned as it is; the name stays. Pure: the same schedule
    and costs give the same result, on every rank.

    Example: zero-bubble's first worker has no gap for a ``W`` to fill; the
    second keeps the splits whose ``W`` fills one, or whose ``I`` hands the
    first worker its gradient sooner::

        >>> from torchpipe.schedule import zero_bubble
        >>> print(zero_bubble(4, 2))
        worker 0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3
        worker 1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3
        >>> print(merge_backwards(zero_bubble(4, 2)))
        worker 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
        worker 1: 1F0 1I0 1F1 1B1 1W0 1F2 1I2 1F3 1I3 1W2 1W3
    """
    if not any(a.kind is Kind.BACKWARD_INPUT for a in schedule.actions()):
        return schedule
    merged = _merge(schedule, cost_function(costs), communication)
    if costs is None:
        return merged
    # Both tests are greedy, and the default costs' (B = I + W) may merge more, to a shorter step at these
    # costs too: whichever is shorter at these costs (so never longer than the schedule's).
    other = _merge(schedule, cost_function(None), communication)
    if simulate(other, costs, communication=communication).step_time < simulate(
            merged, costs, communication=communication).step_time - _EPSILON:
        return other
    return merged


def _merge(schedule: Schedule, cost: Callable[[Action], float], communication: float) -> Schedule:
    step = simulate(schedule, cost, communication=communication).step_time
    worker_of = schedule.stage_workers
    position = {a: k for actions in schedule.workers for k, a in enumerate(actions)}
    waiting = _waiting(schedule)

    def message_time(a: Action, b: Action) -> float:
        return communication if worker_of[a.stage] != worker_of[b.stage] else 0.0

    deadline = _latest_starts(schedule, step, cost, message_time, waiting)
    whole: Set[Action] = set()

    def gone(action: Action) -> bool:
        return action.kind is Kind.BACKWARD_WEIGHT and _input_half(action) in whole

    def duration(action: Action, begin: float) -> float:
        if action.kind is not Kind.BACKWARD_INPUT:
            return 0.0 if gone(action) else cost(action)
        merged, weight = Action(action.stage, Kind.BACKWARD, action.microbatch), _weight_half(action)
        end = begin + cost(merged)
        if end > step + _EPSILON or any(end + message_time(action, b) > deadline[b] + _EPSILON
                                        for b in waiting[action] if b != weight):
            return cost(action)
        actions = schedule.workers[worker_of[action.stage]]
        between = [a for a in actions[position[action] + 1 : position[weight]] if not gone(a)]
        beyond = next((a for a in actions[position[weight] + 1 :] if not gone(a)), None)
        # The latest starts of the actions between, now that they run before the W's time is gone.
        last = later = step if beyond is None else deadline[beyond]
        found: Dict[Action, float] = {}  # an action between may wait for one after it: its new latest start
        for a in reversed(between):
            later = min([later] + [found.get(b, deadline[b]) - message_time(a, b) for b in waiting[a]]) - cost(a)
            found[a] = later
        relaxed = [found[a] for a in between]
        # Each starts after the whole backward, or when what it waits for is ready: by its old latest start.
        at = end
        for a, bound in zip(between, relaxed):
            at = max(at, deadline[a])
            if at > bound + _EPSILON:
                return cost(action)
            at += cost(a)
        if at > last + _EPSILON:
            return cost(action)
        whole.add(action)
        for a, bound in zip(between, relaxed):
            deadline[a] = max(deadline[a], bound)
        return cost(merged)

    play(schedule, duration, communication)
    return made_whole(schedule, whole.__contains__)


def made_whole(schedule: Schedule, whole: Callable[[Action], bool]) -> Schedule:
    """``schedule`` with the backward of each input half ``whole`` picks run whole: ``sBi`` in the place of its
    ``sIi``, its ``sWi`` gone (the other actions and the name as they were)."""
    lists = [[Action(a.stage, Kind.BACKWARD, a.microbatch) if a.kind is Kind.BACKWARD_INPUT and whole(a) else a
              for a in actions if not (a.kind is Kind.BACKWARD_WEIGHT and whole(_input_half(a)))]
             for actions in schedule.workers]
    return Schedule(tuple(tuple(a) for a in lists), schedule.stage_workers, schedule.microbatches, schedule.name)


def _input_half(weight: Action) -> Action:
    return Action(weight.stage, Kind.BACKWARD_INPUT, weight.microbatch)


def _weight_half(inputs: Action) -> Action:
    return Action(inputs.stage, Kind.BACKWARD_WEIGHT, inputs.microbatch)


def _waiting(schedule: Schedule) -> Dict[Action, List[Action]]:
    """Per action, the actions that wait for it (its :func:`dependencies` turned around)."""
    present = frozenset(schedule.actions())
    waiting: Dict[Action, List[Action]] = {a: [] for a in present}
    for b in present:
        for a in dependencies(b, schedule.stages, present):
            if a in present:
                waiting[a].append(b)
    return waiting


def _latest_starts(
    schedule: Schedule, step: float, cost: Callable[[Action], float], message_time: Callable[[Action, Action], float],
    waiting: Dict[Action, List[Action]],
) -> Dict[Action, float]:
    """Each action's latest start for which the schedule, with the same worker orders and dependencies, still
    ends by ``step``: from the last actions back (the reverse of a topological order)."""
    edges: Dict[Action, List[Action]] = {a: list(waiting[a]) for a in waiting}
    for actions in schedule.workers:
        for a, b in zip(actions, actions[1:]):
            edges[a].append(b)
    unresolved = {a: len(out) for a, out in edges.items()}
    before: Dict[Action, List[Action]] = {a: [] for a in edges}
    for a, out in edges.items():
        for b in out:
            before[b].append(a)
    latest: Dict[Action, float] = {}
    ready = [a for a, count in unresolved.items() if count == 0]
    while ready:
        a = ready.pop()
        latest[a] = min([step] + [latest[b] - message_time(a, b) for b in edges[a]]) - cost(a)
        for p in before[a]:
            unresolved[p] -= 1
            if unresolved[p] == 0:
                ready.append(p)
    return latest
