"""Schedule generators: pure functions from (micro-batches, stages, workers) to a :class:`Schedule`.

Each generator returns forward and backward actions only; :func:`with_recomputation`
adds the recomputations of checkpointed micro-batches. Every generator handles
any number of micro-batches, also fewer than stages.

``gpipe`` (fill-drain) over 3 stages and 3 micro-batches::

    worker 0: 0F0 0F1 0F2 0B2 0B1 0B0
    worker 1: 1F0 1F1 1F2 1B2 1B1 1B0
    worker 2: 2F0 2F1 2F2 2B2 2B1 2B0

``1f1b`` over 3 stages and 4 micro-batches: stage ``s`` runs ``stages - s - 1``
forwards, then alternates forward and backward, so it holds the activations
of at most ``stages - s`` micro-batches::

    worker 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
    worker 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
    worker 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3
"""
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from torchpipe.schedule.actions import Action, Kind, Schedule
from torchpipe.schedule.check import dependencies, shorter, simulate
from torchpipe.schedule.merge import merge_backwards
from torchpipe.schedule.vshape import dualpipe_v, zbv

__all__ = [
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zero_bubble",
    "looped_bfs",
    "interleaved_zero_bubble",
    "with_recomputation",
    "NAMES",
    "LOOPED",
    "V_SHAPED",
    "SPLITTING",
    "build",
]

F, B, BI, BW = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


def _check(microbatches: int, stages: int) -> None:
    if microbatches < 1 or stages < 1:
        raise ValueError(f"need at least one micro-batch and one stage, got {microbatches} and {stages}")


def _check_loop(microbatches: int, stages: int, workers: int, name: str) -> None:
    """The loop placement (stage ``s`` on worker ``s % workers``) needs at least two stages per worker, evenly."""
    _check(microbatches, stages)
    if workers < 1 or stages % workers or stages // workers < 2:
        raise ValueError(
            f"{name} needs a number of stages that is a multiple (at least 2) of the workers; "
            f"got {stages} stages and {workers} workers"
            + (f" (for {workers} workers: {2 * workers}, {3 * workers}, ... stages)" if workers >= 1 else "")
        )


def _one_per_worker(lists: List[List[Action]], microbatches: int, name: str) -> Schedule:
    return Schedule(tuple(tuple(a) for a in lists), tuple(range(len(lists))), microbatches, name)


def gpipe(microbatches: int, stages: int) -> Schedule:
    """Fill-drain: every forward, then every backward, the last micro-batch's first.

    The last micro-batch's backward can start as soon as its forward is over
    (with ``'except_last'`` checkpointing it is the one not recomputed).
    """
    _check(microbatches, stages)
    lists = []
    for s in range(stages):
        actions = [Action(s, F, i) for i in range(microbatches)]
        actions += [Action(s, B, i) for i in reversed(range(microbatches))]
        lists.append(actions)
    return _one_per_worker(lists, microbatches, "gpipe")


def one_f_one_b(microbatches: int, stages: int) -> Schedule:
    """1F1B: after a warm-up of ``stages - s - 1`` forwards, stage ``s`` alternates forward and backward."""
    _check(microbatches, stages)
    lists = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        actions = [Action(s, F, i) for i in range(warmup)]
        for k in range(microbatches - warmup):
            actions += [Action(s, F, warmup + k), Action(s, B, k)]
        actions += [Action(s, B, i) for i in range(microbatches - warmup, microbatches)]
        lists.append(actions)
    return _one_per_worker(lists, microbatches, "1f1b")


def interleaved_1f1b(microbatches: int, stages: int, workers: int) -> Schedule:
    """Interleaved 1F1B: ``stages // workers`` stages per worker, stage ``s`` on worker ``s % workers``.

    Micro-batches go through the stages in rounds of ``workers``: a worker runs
    the forward of a round in its first stage, then in its second, and so on,
    so every worker has work early and the bubble shrinks by the number of
    stages per worker. The warm-up is Megatron-LM's. When the micro-batches do
    not divide into rounds, a greedy list schedule (the same orders, each
    worker running a ready backward first, else a ready forward within its
    memory bound) is used when it is shorter or the warm-up rule would
    deadlock.
    """
    _check_loop(microbatches, stages, workers, "interleaved_1f1b")
    chunks = stages // workers
    rounds = [list(range(g, min(g + workers, microbatches))) for g in range(0, microbatches, workers)]
    forwards = [
        [Action(c * workers + r, F, i) for rd in rounds for c in range(chunks) for i in rd] for r in range(workers)
    ]
    backwards = [
        [Action(c * workers + r, B, i) for rd in rounds for c in reversed(range(chunks)) for i in rd]
        for r in range(workers)
    ]
    stage_workers = tuple(s % workers for s in range(stages))
    lists: List[List[Action]] = []
    for r in range(workers):
        warmup = min((workers - r - 1) * 2 + (chunks - 1) * workers, len(forwards[r]))
        actions = forwards[r][:warmup]
        for k in range(len(forwards[r]) - warmup):
            actions += [forwards[r][warmup + k], backwards[r][k]]
        actions += backwards[r][len(forwards[r]) - warmup :]
        lists.append(actions)
    megatron = Schedule(tuple(tuple(a) for a in lists), stage_workers, microbatches, "interleaved_1f1b")
    if microbatches % workers == 0:
        return megatron
    limits = [(workers - r - 1) * 2 + (chunks - 1) * workers + 1 for r in range(workers)]
    greedy = _list_schedule(forwards, backwards, stage_workers, microbatches, limits, "interleaved_1f1b")
    try:
        if simulate(megatron, {F: 1.0, B: 1.0}).step_time <= simulate(greedy, {F: 1.0, B: 1.0}).step_time:
            return megatron
    except ValueError:  # the warm-up rule deadlocks for this uneven shape
        pass
    return greedy


def looped_bfs(microbatches: int, stages: int, workers: int) -> Schedule:
    """Looped BFS (breadth-first, Lamy-Poirier 2022): the loop placement of :func:`interleaved_1f1b`, each worker
    running every micro-batch's forward of its first stage, then of its next, and the backwards likewise from
    its last stage back, the last micro-batch's first.

    Fill-drain per stage: the bubble of :func:`interleaved_1f1b` once the
    micro-batches cover the workers, but a worker holds the activations of
    every micro-batch on every one of its stages at the turn.
    """
    _check_loop(microbatches, stages, workers, "looped_bfs")
    lists = []
    for r in range(workers):
        own = list(range(r, stages, workers))
        actions = [Action(s, F, i) for s in own for i in range(microbatches)]
        actions += [Action(s, B, i) for s in reversed(own) for i in reversed(range(microbatches))]
        lists.append(actions)
    return Schedule(tuple(tuple(a) for a in lists), tuple(s % workers for s in range(stages)), microbatches,
                    "looped_bfs")


def interleaved_zero_bubble(microbatches: int, stages: int, workers: int) -> Schedule:
    """Interleaved zero-bubble: :func:`interleaved_1f1b`'s order with every backward split, ``W`` filling the gaps.

    Each worker runs its forwards and input gradients (``I``) in interleaved
    1F1B's order, and its weight gradients (``W``) wherever it would otherwise
    idle, as :func:`zero_bubble` does for one stage per worker (the zero-bubble
    paper's ZB-1P on the loop placement). A worker holds at most as many
    (stage, micro-batch) activations, until their ``W``, as interleaved 1F1B's
    first worker does until its ``B``.
    """
    _check_loop(microbatches, stages, workers, "interleaved_zero_bubble")
    base = interleaved_1f1b(microbatches, stages, workers)
    limit = 2 * (workers - 1) + (stages // workers - 1) * workers + 1
    filled = _fill_weights(base, [limit] * workers)
    return Schedule(filled.workers, filled.stage_workers, microbatches, "interleaved_zero_bubble")


def _list_schedule(
    forwards: List[List[Action]],
    backwards: List[List[Action]],
    stage_workers: Tuple[int, ...],
    microbatches: int,
    limits: List[int],
    name: str,
) -> Schedule:
    """Unit-time list scheduling of fixed forward and backward orders per worker.

    At each step a free worker runs its next backward if its inputs are ready,
    else its next forward if ready and it holds fewer than ``limits[w]``
    micro-batches' activations.
    """
    stages = len(stage_workers)
    workers = len(forwards)
    done: Dict[Action, int] = {}
    order: List[List[Action]] = [[] for _ in range(workers)]
    fi, bi = [0] * workers, [0] * workers
    live = [0] * workers
    free = [0] * workers
    total = sum(len(f) + len(b) for f, b in zip(forwards, backwards))
    t = 0
    while sum(map(len, order)) < total:
        for w in range(workers):
            if free[w] > t:
                continue
            chosen: Optional[Action] = None
            if bi[w] < len(backwards[w]):
                a = backwards[w][bi[w]]
                if _ready(done, Action(a.stage, F, a.microbatch), t) and (
                    a.stage == stages - 1 or _ready(done, Action(a.stage + 1, B, a.microbatch), t)
                ):
                    chosen, bi[w], live[w] = a, bi[w] + 1, live[w] - 1
            if chosen is None and fi[w] < len(forwards[w]) and live[w] < limits[w]:
                a = forwards[w][fi[w]]
                if a.stage == 0 or _ready(done, Action(a.stage - 1, F, a.microbatch), t):
                    chosen, fi[w], live[w] = a, fi[w] + 1, live[w] + 1
            if chosen is not None:
                done[chosen] = t + 1
                free[w] = t + 1
                order[w].append(chosen)
        t += 1
        if t > 4 * total + 16:  # cannot happen for the orders above; a guard, not a path
            raise AssertionError(f"list scheduling made no progress ({name}, {microbatches} micro-batches)")
    return Schedule(tuple(tuple(a) for a in order), stage_workers, microbatches, name)


def _ready(done: Dict[Action, int], action: Action, t: int) -> bool:
    end = done.get(action)
    return end is not None and end <= t


def zero_bubble(microbatches: int, stages: int, split: Optional[Sequence[bool]] = None) -> Schedule:
    """ZB-H1: 1F1B with each backward split into ``I`` (inputs) and ``W`` (weights), ``W`` filling the bubbles.

    Each stage runs its forwards and input gradients in 1F1B order; its weight
    gradients wait and run whenever the stage would otherwise idle (or must
    free a micro-batch's activations before its next forward). Every stage
    holds the activations of at most ``stages`` micro-batches (until their
    ``W``). With equal costs for ``F``, ``I`` and ``W`` the step takes
    ``3m + p - 1`` units for ``m >= p``, against 1F1B's ``3m + 3(p - 1)``:
    a third of its bubble, the zero-bubble paper's ZB-H1 figure.

    ``split[s]`` False keeps stage ``s``'s backward whole (``B`` where ``I``
    was, no ``W``): splitting pays only where ``I`` and ``W`` cost little more
    than ``B`` (see :func:`torchpipe.schedule.choose_split`). All False is 1F1B.
    """
    if split is not None and len(split) != stages:
        raise ValueError(f"split has {len(split)} entries for {stages} stages")
    schedule = _zero_bubble(microbatches, stages)
    if split is None or all(split):
        return schedule
    lists = [
        [Action(a.stage, B, a.microbatch) if a.kind is BI and not split[a.stage] else a for a in actions
         if split[a.stage] or a.kind is not BW]
        for actions in schedule.workers
    ]
    return Schedule(tuple(tuple(a) for a in lists), schedule.stage_workers, microbatches, "zero_bubble")


def _zero_bubble(microbatches: int, stages: int) -> Schedule:
    _check(microbatches, stages)
    schedule = _fill_weights(one_f_one_b(microbatches, stages), [stages] * stages)
    return Schedule(schedule.workers, schedule.stage_workers, microbatches, "zero_bubble")


def _fill_weights(base: Schedule, limits: Sequence[int]) -> Schedule:
    """``base`` with every ``B`` split: ``I`` where ``B`` was, ``W`` wherever the worker would otherwise idle.

    Unit-time list scheduling: at each step a free worker runs the next action
    of its list (``B`` as ``I``) if what it needs has ended, a forward only
    while the worker holds fewer than ``limits[w]`` micro-batches' activations
    (from ``F`` to ``W``); else its oldest pending ``W``, which frees one.
    """
    sequences = [[Action(a.stage, BI, a.microbatch) if a.kind is B else a for a in actions]
                 for actions in base.workers]
    present = frozenset(a for seq in sequences for a in seq) | frozenset(
        Action(a.stage, BW, a.microbatch) for seq in sequences for a in seq if a.kind is BI)
    workers, stages = len(sequences), base.stages
    done: Dict[Action, int] = {}
    order: List[List[Action]] = [[] for _ in range(workers)]
    cursor = [0] * workers
    pending: List[List[Action]] = [[] for _ in range(workers)]
    live = [0] * workers
    total = len(present)
    t = 0
    while sum(map(len, order)) < total:
        for w in range(workers):
            chosen: Optional[Action] = None
            if cursor[w] < len(sequences[w]):
                a = sequences[w][cursor[w]]
                if (a.kind is not F or live[w] < limits[w]) and all(
                        _ready(done, d, t) for d in dependencies(a, stages, present)):
                    chosen = a
                    cursor[w] += 1
                    if a.kind is F:
                        live[w] += 1
                    else:
                        pending[w].append(Action(a.stage, BW, a.microbatch))
            if chosen is None and pending[w]:
                chosen = pending[w].pop(0)
                live[w] -= 1
            if chosen is not None:
                done[chosen] = t + 1
                order[w].append(chosen)
        t += 1
        if t > 4 * total + 16:  # a limit below the base's own warm-up; a guard, not a path
            raise AssertionError(f"weight filling made no progress ({base.name}, limits {list(limits)})")
    return Schedule(tuple(tuple(a) for a in order), base.stage_workers, base.microbatches, base.name)


def with_recomputation(schedule: Schedule, checkpointed: Callable[[int, int], bool]) -> Schedule:
    """``schedule`` with a recomputation ``sRi`` right before the backward (``B`` or ``I``) of every
    ``(stage, micro-batch)`` for which ``checkpointed(stage, microbatch)`` is true.

    A recomputation placed there runs while the worker waits for the gradient
    from the next stage, and its activations live only until the backward.
    """
    lists: List[List[Action]] = []
    for actions in schedule.workers:
        out: List[Action] = []
        for a in actions:
            if a.kind in (B, BI) and checkpointed(a.stage, a.microbatch):
                out.append(Action(a.stage, Kind.RECOMPUTE, a.microbatch))
            out.append(a)
        lists.append(out)
    return Schedule(tuple(tuple(a) for a in lists), schedule.stage_workers, schedule.microbatches, schedule.name)


#: The schedules :func:`build` knows, by name.
NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "looped_bfs", "interleaved_zero_bubble", "zbv",
         "dualpipev")
#: The names whose stage ``s`` runs on worker ``s % workers`` (several stages per worker).
LOOPED = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")
#: The names whose backwards are split (``I`` and ``W``): they need ``torch.autograd.graph.GradientEdge``.
SPLITTING = ("zero_bubble", "interleaved_zero_bubble", "zbv", "dualpipev")
#: The names whose ``2 * workers`` stages are placed in a V (worker ``w``: stages ``w`` and ``2W - 1 - w``).
V_SHAPED = ("zbv", "dualpipev")


def build(
    name: str, microbatches: int, stages: int, workers: Optional[int] = None, split: Optional[Sequence[bool]] = None
) -> Schedule:
    """The named schedule (one of :data:`NAMES`) for ``microbatches`` over ``stages``.

    ``workers`` is used by the loop-placed names (:data:`LOOPED`; default: one per two stages) and the V-shaped
    ones (:data:`V_SHAPED`; default and only fit: half the stages), ``split`` by ``'zero_bubble'`` only
    (default: every stage splits).
    """
    if name == "gpipe":
        return gpipe(microbatches, stages)
    if name == "1f1b":
        return one_f_one_b(microbatches, stages)
    if name in LOOPED:
        looped = {"interleaved_1f1b": interleaved_1f1b, "looped_bfs": looped_bfs,
                  "interleaved_zero_bubble": interleaved_zero_bubble}[name]
        return looped(microbatches, stages, workers if workers is not None else max(1, stages // 2))
    if name == "zero_bubble":
        return zero_bubble(microbatches, stages, split)
    if name in V_SHAPED:
        count = workers if workers is not None else stages // 2
        if workers is not None and workers < 1:
            raise ValueError(f"{name} needs at least 1 worker, got {workers}")
        if count < 1 or stages != 2 * count:
            near = sorted({2 * max(1, stages // 2), 2 * max(1, stages // 2 + 1)})
            raise ValueError(
                f"{name} places 2 stages per worker in a V, so it needs 2 * workers stages; got {stages} stages"
                + (f" for {workers} workers (use {2 * workers} stages)" if workers is not None
                   else f" (use an even number, at least 2: {' or '.join(map(str, near))})")
            )
        return zbv(microbatches, count) if name == "zbv" else dualpipe_v(microbatches, count)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(map(repr, NAMES))} or build one")


def choose_split(microbatches: int, stages: int, costs: Callable[[int, Kind], float], *,
                 communication: float = 0.0) -> List[bool]:
    """Which stages of a zero-bubble schedule should split their backward, for measured costs.

    Splitting a stage's ``B`` into ``I`` and ``W`` lets ``W`` fill the bubbles,
    but pays where ``I`` and ``W`` together cost more than ``B`` (on CPU they
    may: ``W`` starts the autograd engine anew per weight). ``costs(stage,
    kind)`` gives each action's duration (``F``, ``B``, ``I``, ``W``); the
    answer is the split whose simulated step is shortest, found greedily from
    none (1F1B): a stage is split only if that shortens the step. Each split
    is simulated as it runs, its backwards whose ``W`` fills no gap made
    whole (:func:`~torchpipe.schedule.merge_backwards`), with
    ``communication`` the time a message between stages takes, as in
    :func:`~torchpipe.schedule.simulate`. Pure: the same costs give the same
    answer.
    """
    def step_time(split: List[bool]) -> float:
        cost = lambda a: costs(a.stage, a.kind)  # noqa: E731
        merged = merge_backwards(zero_bubble(microbatches, stages, split), cost, communication=communication)
        return simulate(merged, cost, communication=communication).step_time

    split = [False] * stages
    best = step_time(split)
    improved = True
    while improved:
        improved = False
        for s in range(stages):
            if split[s]:
                continue
            trial = split[:s] + [True] + split[s + 1 :]
            time = step_time(trial)
            if shorter(time, best):
                split, best, improved = trial, time, True
    return split
