"""The V shape: ``2 * workers`` stages, worker ``w`` running stages ``w`` and ``2 * workers - 1 - w``.

A micro-batch goes down the workers through the first half of the stages and
back up through the second half, so worker 0 holds the first and the last
stage, and the last worker two consecutive ones (its turn costs no message).
Every backward is split (``I`` then ``W``, as in ``'zero_bubble'``) where the
order says so. Two orders, each written phase by phase:

- :func:`zbv`: ZB-V, the zero-bubble paper's V schedule (Qi et al., 2023,
  Section 6): with ``F``, ``I`` and ``W`` of equal cost it leaves almost no
  bubble, and a worker holds at most ``2 * workers`` half-size stages'
  activations, 1F1B's memory.
- :func:`dualpipe_v`: DeepSeek's DualPipe folded into a V (DualPipeV): after
  the warm-up, each worker alternates a forward of one of its stages with a
  backward of the other, so a forward's messages travel while a backward
  computes; the last backwards are split so that ``W`` fills the cool-down.

``zbv`` over 2 workers and 4 micro-batches (stage 3, the last, is worker 0's)::

    worker 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3
    worker 1: 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3
"""
from typing import Dict, List, Tuple

from torchpipe.schedule.actions import Action, Kind, Schedule

__all__ = ["zbv", "dualpipe_v", "v_stage_workers"]

F, B, BI, BW = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


def v_stage_workers(workers: int) -> Tuple[int, ...]:
    """The V placement: ``v_stage_workers(2) == (0, 1, 1, 0)``."""
    return tuple(min(s, 2 * workers - 1 - s) for s in range(2 * workers))


class _Writer:
    """One worker's list, written action by action: each stage's forwards, backwards and weight gradients take
    its micro-batches in order (a backward, whole or split, takes the next one; a ``W`` the oldest ``I`` left)."""

    def __init__(self) -> None:
        self.actions: List[Action] = []
        self._next: Dict[Tuple[int, str], int] = {}
        self._weights: List[Action] = []  # the pending W's, oldest first, over both stages

    def _take(self, stage: int, what: str) -> int:
        i = self._next.get((stage, what), 0)
        self._next[(stage, what)] = i + 1
        return i

    def forward(self, stage: int) -> None:
        self.actions.append(Action(stage, F, self._take(stage, "F")))

    def backward(self, stage: int, *, split: bool) -> None:
        """The stage's next backward: ``I`` (its ``W`` pending) if ``split``, else the whole ``B``."""
        i = self._take(stage, "B")
        self.actions.append(Action(stage, BI if split else B, i))
        if split:
            self._weights.append(Action(stage, BW, i))

    def weight(self, stage: int) -> None:
        """The oldest pending ``W`` of ``stage``."""
        found = next(a for a in self._weights if a.stage == stage)
        self._weights.remove(found)
        self.actions.append(found)

    def any_weight(self) -> None:
        """The oldest pending ``W`` of either stage, if there is one."""
        if self._weights:
            self.actions.append(self._weights.pop(0))

    def count(self, stage: int, what: str) -> int:
        return self._next.get((stage, what), 0)

    def pending(self, stage: int) -> int:
        return sum(1 for a in self._weights if a.stage == stage)


def _check_workers(microbatches: int, workers: int, name: str) -> None:
    if microbatches < 1 or workers < 1:
        raise ValueError(f"{name} needs at least one micro-batch and one worker, got {microbatches} and {workers}")


def zbv(microbatches: int, workers: int) -> Schedule:
    """ZB-V: ``2 * workers`` stages in a V, every backward split, the zero-bubble paper's order.

    Worker ``w`` (stages ``d = w`` down and ``u = 2W - 1 - w`` up) runs
    ``2(W - w) - 1`` forwards of ``d``, then ``w`` pairs ``uF dF``, then
    ``W - w`` rounds ``uF uI uW``; in the steady state it runs ``dF dI dW uF
    uI uW`` (the next micro-batch's forward, the oldest one's backward, on
    each stage); the cool-down runs ``w`` pairs ``dI uI``, then ``W - w``
    pairs ``dI dW``, then the ``W``'s left. With fewer than ``2W - 1``
    micro-batches it is the order for ``2W - 1`` with the others' actions left
    out. A worker holds at most ``2W`` (stage, micro-batch) activations.
    """
    _check_workers(microbatches, workers, "zbv")
    n = max(microbatches, 2 * workers - 1)
    lists = [_zbv_worker(w, workers, n) for w in range(workers)]
    whole = Schedule(tuple(tuple(a) for a in lists), v_stage_workers(workers), n, "zbv")
    return whole.restricted(microbatches)


def _zbv_worker(w: int, workers: int, n: int) -> List[Action]:
    down, up = w, 2 * workers - 1 - w
    out = _Writer()
    for _ in range(2 * (workers - w) - 1):
        out.forward(down)
    for _ in range(w):
        out.forward(up)
        out.forward(down)
    for _ in range(workers - w):
        out.forward(up)
        out.backward(up, split=True)
        out.weight(up)
    while out.count(up, "F") < out.count(down, "F") or out.count(down, "F") < n:
        if out.count(down, "F") < n:
            out.forward(down)
        out.backward(down, split=True)
        out.weight(down)
        out.forward(up)
        out.backward(up, split=True)
        out.weight(up)
    for _ in range(w):
        out.backward(down, split=True)
        out.backward(up, split=True)
    for _ in range(workers - w):
        out.backward(down, split=True)
        out.weight(down)
    for stage in (up, down):
        while out.pending(stage):
            out.weight(stage)
    return out.actions


def dualpipe_v(microbatches: int, workers: int) -> Schedule:
    """DualPipeV: ``2 * workers`` stages in a V, DeepSeek's DualPipe order folded onto half the workers.

    Worker ``w`` (stages ``d = w`` down and ``u = 2W - 1 - w`` up, ``k = W - w
    - 1`` workers below it) runs ``2k`` forwards of ``d``; ``w + 1`` pairs
    ``dF uF``; ``k`` rounds ``uI W uF`` (zero-bubble: the ``W`` of the ``I``
    before); then the main phase, ``m - 2W + w + 1`` rounds ``dF uB uF dB``,
    a forward of one stage beside a backward of the other (DualPipe overlaps
    each pair; here they run one after the other); ``k`` rounds ``uB uF dB``;
    ``w + 1`` pairs ``uB dB``, split (``I``) from the middle one on; ``k``
    rounds ``W dI``; and the ``w + 1`` ``W``'s left. Needs ``m >= 2W``.
    """
    _check_workers(microbatches, workers, "dualpipe_v")
    if microbatches < 2 * workers:
        raise ValueError(
            f"dualpipe_v needs at least 2 * workers = {2 * workers} micro-batches for {workers} workers, got "
            f"{microbatches}; use at least {2 * workers} micro-batches, or 'zbv' (any number)"
        )
    lists = [_dualpipe_v_worker(w, workers, microbatches) for w in range(workers)]
    return Schedule(tuple(tuple(a) for a in lists), v_stage_workers(workers), microbatches, "dualpipev")


def _dualpipe_v_worker(w: int, workers: int, m: int) -> List[Action]:
    down, up = w, 2 * workers - 1 - w
    below = workers - w - 1
    out = _Writer()
    for _ in range(2 * below):
        out.forward(down)
    for _ in range(w + 1):
        out.forward(down)
        out.forward(up)
    for _ in range(below):
        out.backward(up, split=True)
        out.any_weight()
        out.forward(up)
    for _ in range(m - 2 * workers + w + 1):
        out.forward(down)
        out.backward(up, split=False)
        out.forward(up)
        out.backward(down, split=False)
    for _ in range(below):
        out.backward(up, split=False)
        out.forward(up)
        out.backward(down, split=False)
    # The last w + 1 pairs: whole backwards, then split ones from the middle pair on (an odd worker splits the
    # middle pair's both backwards, an even one its second only), so that w + 1 W's fill the cool-down.
    middle = (w + 1) // 2
    for k in range(w + 1):
        out.backward(up, split=k > middle or (k == middle and w % 2 == 1))
        out.backward(down, split=k >= middle)
    for _ in range(below):
        out.any_weight()
        out.backward(down, split=True)
    for _ in range(w + 1):
        out.any_weight()
    return out.actions
