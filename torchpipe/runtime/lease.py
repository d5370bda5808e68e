"""Which backward may set GPipe's parameter gradients aside: one backward pass (graph task) at a time.

[Note: gradient lease] GPipe's backward sets each parameter's ``.grad`` and
hooks aside on the stage workers while a micro-batch's backward runs (see
[Note: parameter gradients]), then returns the sums to the autograd engine,
which accumulates them into ``.grad`` after the function returns. Within one
backward pass that is safe: the engine runs a parameter's accumulator once,
after every node that sends it a gradient, so after every GPipe call of the
pass has finished setting aside; and a pipeline runs one phase at a time.
Two passes in two threads (one GPipe trained from several threads) are not:
one thread's engine may add into ``.grad``, or run the hooks, after its
GPipe's phase, while a worker has them set aside for the other thread's
step: a gradient is lost, or the accumulator finds its ``.grad`` gone in the
middle of its in-place add ("Bad in-place call", "bump_version() on
undefined tensor").

So the right to set aside is lent to one backward pass at a time (one lease
for the process: a lease per GPipe, taken in different orders by two threads'
passes, could make each wait for the other), from its first GPipe backward
until the engine has finished the pass (a callback the engine runs at the end
of the pass, or, when the pass fails, the callback being freed with it).
Another pass's GPipe backward waits for it where waiting is safe: on a thread
of Python's own that called its backward (a CPU output's backward runs
there), which the holder's pass never needs. A backward the engine runs on a
device's thread may not wait (the holder may need that thread to finish), nor
may one nested in the holder's pass on the same thread (a reentrant
checkpoint); those accumulate into ``.grad`` directly, as [Note: joined
graphs] does: correct sums, but each micro-batch's gradient reaches ``.grad``
(and the parameters' hooks) on its own, and ``torch.autograd.grad`` with
respect to the parameters finds none.

A pass that works *for* the holder takes part in its lease: a GPipe nested
in a GPipe (or in a ``DataParallel`` replica inside one) runs its backward
as a pass of its own on the outer pipeline's worker, inside the outer pass's
phase, which waits for it (see [Note: waits]). It sets its gradients aside
as the outer pass's own GPipe does, within the outer worker's own setting
aside; waiting would wait for ever. Any other wait here that would close a
circle is a ``RuntimeError`` naming the pipelines, not a hang. What the lease
does not cover: a parameter that also gets a gradient outside the GPipe, from
another thread's pass, and a backward that waits for another thread's (a
barrier in a hook), which may wait for ever beside a pass waiting here.
"""
import threading
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from torchpipe import waits
from torchpipe.worker import fork_generation

__all__ = ["GradientLease", "process_lease", "can_wait"]


def can_wait(grads: Sequence[Optional[Tensor]]) -> bool:
    """Whether the backward of a node that receives ``grads`` may wait for another pass: the engine runs a node
    whose gradients are all on the CPU on the thread that called the backward (a device's on its own thread,
    which Python did not make), unless that backward was itself started on such a thread."""
    on_cpu = all(g is None or g.device.type == "cpu" for g in grads)
    return on_cpu and not isinstance(threading.current_thread(), threading._DummyThread)


class GradientLease:
    """Lends the right to set GPipe's parameter gradients aside to one backward pass at a time
    (see [Note: gradient lease])."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._holder: Optional[object] = None
        self._thread: Optional[threading.Thread] = None
        self._who = ""

    @property
    def held(self) -> bool:
        """Whether a backward pass holds the lease now."""
        return self._holder is not None

    def take(self, *, may_wait: bool, who: str = "a GPipe") -> bool:
        """Takes the lease for the running backward pass (or finds it holds it already, or works for the pass
        that does): True. False when another pass holds it and this one may not wait (``may_wait`` false, or
        the holder is this thread's, so this pass runs nested inside it). ``who`` names the taker's pipeline.

        Raises:
            RuntimeError: the holder's pass waits, through other threads,
                for this one (see [Note: waits]).
        """
        running = waits.running_pass()
        task: object = running if running is not None else object()  # unknown: a pass of its own
        me = threading.current_thread()
        with self._changed:
            if self._holder is not None and self._holder != task:
                if self._holder in waits.behalf():
                    return True  # this pass runs for the holder's, inside its phase: see [Note: gradient lease]
                if not may_wait or self._thread is me:
                    return False
                with waits.waiting(lambda: f"the gradient lease (for {who}'s backward), held by the backward pass "
                                   f"of {self._who}", self._holders) as check:
                    while self._holder is not None and self._holder != task:
                        self._changed.wait(waits.RECHECK)
                        check()
            if self._holder is None:
                # The callback first: if the engine refuses it, nothing is held.
                torch.autograd.Variable._execution_engine.queue_callback(_Release(self, task))
                self._holder, self._thread, self._who = task, me, who
            return True

    def _holders(self) -> List[threading.Thread]:
        """The thread whose backward pass holds the lease now (none when free)."""
        thread = self._thread
        return [thread] if thread is not None else []

    def release(self, task: object) -> None:
        """Ends ``task``'s lease (nothing if another holds it) and wakes the waiting passes."""
        with self._changed:
            if self._holder == task:
                self._holder = self._thread = None
                self._changed.notify_all()


class _Release:
    """The engine's end-of-pass callback: releases the lease when the pass finishes, or, when the pass failed
    and the engine drops its callbacks without running them, when it is freed."""

    def __init__(self, lease: GradientLease, task: object) -> None:
        self._lease: Optional[GradientLease] = lease
        self._task = task

    def __call__(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release(self._task)

    def __del__(self) -> None:
        self()


_lease = GradientLease()
_lease_generation = fork_generation()


def process_lease() -> GradientLease:
    """The process's lease (a fresh one in a process forked from ours: see [Note: fork])."""
    global _lease, _lease_generation
    if _lease_generation != fork_generation():
        _lease, _lease_generation = GradientLease(), fork_generation()
    return _lease
