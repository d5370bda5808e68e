"""Long-lived worker threads: one per pipeline partition (or data-parallel replica).

Workers are long-lived, not made per step: creating threads on every
forward costs page faults (glibc's per-thread arenas) and leaves each new
thread with PyTorch's default intra-op thread count, which
``torch.set_num_threads`` in the caller's thread does not change. A worker
sets its own intra-op thread count once, when it starts.

A task's exception is carried back to the caller through its future, with
its own type, message and traceback; the worker goes on serving the next task.
Workers are daemon threads, stopped by :meth:`WorkerGroup.close` or when their
:class:`WorkerGroup` is garbage collected (a sentinel is queued; nothing joins
threads in ``__del__``).

[Note: worker lifetime] A group lives as long as anything that may still
submit to it: the module that made it, and every step in flight (a step holds
its group, and the autograd graph of a pipelined output holds its step). So a
backward that runs after the user dropped the module still finds its workers.
Submitting to a worker that stopped raises at once; nothing queues work for a
thread that will never run it.

[Note: fork] A child process made by ``os.fork`` (a ``DataLoader`` worker, say)
inherits the parent's objects but none of its threads, and locks held by
those threads at the fork stay held. :func:`fork_generation` changes in every
child, so an owner of workers or locks can tell it is in a new process and make
fresh ones; a worker made in another process refuses tasks.

[Note: workers at exit] A worker thread still winding down while the
interpreter destroys PyTorch's static state can end the process with
"terminate called without an active exception" (when a wrapper is
collected just before exit, say). So at exit every live worker is told to stop,
and each is waited for, briefly; they are idle by then.
"""
import atexit
import contextlib
import os
import queue
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Generator, List, Optional, Sequence, Tuple, TypeVar

import torch

from torchpipe import waits

__all__ = ["Worker", "WorkerGroup", "ThreadContext", "default_intra_op_threads", "fork_generation"]

R = TypeVar("R")

_STOP = object()

_live: "weakref.WeakSet[Worker]" = weakref.WeakSet()
_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


_generation = 0


def _forked() -> None:
    global _generation
    _generation += 1
    _live.clear()  # the parent's workers have no thread here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def fork_generation() -> int:
    """A number that changes in every child process made by ``os.fork`` (see [Note: fork])."""
    return _generation


@atexit.register
def _stop_all_at_exit() -> None:
    for worker in list(_live):
        worker.close()
    for thread in list(_threads):
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=1.0)


_AUTOCAST_TYPES = ("cpu", "cuda")


def _autocast_enabled(kind: str) -> bool:
    try:
        return torch.is_autocast_enabled(kind)
    except TypeError:  # torch < 2.4 has one function per device type
        return torch.is_autocast_enabled() if kind == "cuda" else torch.is_autocast_cpu_enabled()


def _autocast_dtype(kind: str) -> torch.dtype:
    try:
        return torch.get_autocast_dtype(kind)
    except (AttributeError, TypeError):  # torch < 2.4 has one function per device type
        return torch.get_autocast_gpu_dtype() if kind == "cuda" else torch.get_autocast_cpu_dtype()


@dataclass(frozen=True)
class ThreadContext:
    """The caller's thread-local autograd state (grad mode, inference mode, autocast), for a worker.

    PyTorch keeps these per thread, so a task run on a worker sees none of the
    caller's unless it is captured and re-entered there.
    """

    grad_enabled: bool
    inference_mode: bool
    autocast: Tuple[Tuple[str, bool, torch.dtype], ...]
    #: No inference mode, no autocast: the state is the grad mode alone (known at capture; read per action).
    plain: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plain", not self.inference_mode and not any(on for _, on, _ in self.autocast))

    @staticmethod
    def capture() -> "ThreadContext":
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        enabled = tuple(map(_autocast_enabled, _AUTOCAST_TYPES))
        if not inference and not any(enabled):
            # The common case, captured once per step and worker task: one object per grad mode.
            plain = _PLAIN.get(grad)
            if plain is None:
                plain = _PLAIN[grad] = ThreadContext._of(grad, False, enabled)
            return plain
        return ThreadContext._of(grad, inference, enabled)

    @staticmethod
    def _of(grad: bool, inference: bool, enabled: Tuple[bool, ...]) -> "ThreadContext":
        autocast = tuple((kind, on, _autocast_dtype(kind)) for kind, on in zip(_AUTOCAST_TYPES, enabled))
        return ThreadContext(grad, inference, autocast)

    def entered(self, *, grad_enabled: Optional[bool] = None) -> ContextManager[None]:
        """Runs the block in this state (``grad_enabled`` overrides the captured grad mode).

        The common case, no inference mode and no autocast, costs one grad-mode switch.
        """
        grad = self.grad_enabled if grad_enabled is None else grad_enabled
        if self.plain:
            if torch.is_grad_enabled() == grad:  # a worker or the caller's own thread, already so: nothing to do
                return contextlib.nullcontext()
            return torch.enable_grad() if grad else torch.no_grad()
        return self._entered(grad)

    @contextlib.contextmanager
    def _entered(self, grad: bool) -> Generator[None, None, None]:
        with contextlib.ExitStack() as stack:
            if self.inference_mode:
                stack.enter_context(torch.inference_mode(True))
            stack.enter_context(torch.set_grad_enabled(grad))
            for kind, enabled, dtype in self.autocast:
                if enabled:
                    stack.enter_context(torch.autocast(kind, dtype=dtype))
            yield


#: The captured state without inference mode or autocast, by grad mode (see ThreadContext.capture).
_PLAIN: Dict[bool, ThreadContext] = {}


def default_intra_op_threads(devices: Sequence[torch.device]) -> List[int]:
    """How many intra-op threads each worker should use so that CPU workers share the cores.

    CPU workers split the caller's ``torch.get_num_threads()`` evenly (at least
    one each): two CPU partitions in a process that uses 2 threads get 1 each.
    Workers of CUDA devices keep the caller's count.
    """
    total = torch.get_num_threads()
    cpu_workers = sum(1 for d in devices if d.type == "cpu")
    share = max(1, total // max(1, cpu_workers))
    return [share if d.type == "cpu" else total for d in devices]


def _serve(tasks: "queue.SimpleQueue[Any]", num_threads: int, device: torch.device) -> None:
    torch.set_num_threads(num_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    while True:
        item = tasks.get()
        if item is _STOP:
            return
        fn, future, passes = item
        if not future.set_running_or_notify_cancel():
            continue
        waits.work_for(passes)  # see [Note: waits]
        try:
            result = fn()
        except BaseException as exc:  # noqa: B036 - carried back to the caller, never swallowed
            future.set_exception(exc)
            del exc
        else:
            future.set_result(result)
        waits.work_for(())
        del fn, future, item


class Worker:
    """One daemon thread that runs submitted callables in order."""

    def __init__(self, name: str, device: torch.device, num_threads: int) -> None:
        self.name = name
        self.device = device
        self.num_threads = num_threads
        self.generation = _generation
        self._closed = False
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_serve, args=(self._tasks, num_threads, device), name=name, daemon=True
        )
        self._thread.start()
        _live.add(self)
        _threads.add(self._thread)

    def submit(self, fn: Callable[[], R]) -> "Future[R]":
        """Queues ``fn``; its result (or exception) arrives through the returned future. ``fn`` runs for the
        backward passes the calling thread works for (see [Note: waits]).

        Raises:
            RuntimeError: the worker was stopped, or belongs to the parent of
                this (forked) process; its thread would never run ``fn``.
        """
        if not self.alive:
            why = "was made before this process was forked" if self.generation != _generation else "was stopped"
            raise RuntimeError(f"torchpipe worker {self.name} {why}; it cannot run tasks")
        future: Future[R] = Future()
        self._tasks.put((fn, future, waits.behalf()))
        return future

    @property
    def alive(self) -> bool:
        """Whether the worker takes tasks: not stopped, and its thread exists in this process."""
        return not self._closed and self.generation == _generation and self._thread.is_alive()

    def close(self) -> None:
        """Lets the thread finish its queued tasks and exit (does not wait for it)."""
        self._closed = True
        self._tasks.put(_STOP)

    @property
    def thread(self) -> threading.Thread:
        return self._thread


class WorkerGroup:
    """Workers for a set of devices, stopped when the group is garbage collected (see [Note: worker lifetime]).

    Args:
        devices: one worker per entry, in order.
        name: a prefix for the thread names (``torchpipe-<name>-<index>``).
        num_threads: intra-op threads per worker; default
            :func:`default_intra_op_threads`.
    """

    def __init__(
        self,
        devices: Sequence[torch.device],
        name: str,
        num_threads: Optional[Sequence[int]] = None,
    ) -> None:
        threads = list(num_threads) if num_threads is not None else default_intra_op_threads(devices)
        self.workers = [
            Worker(f"torchpipe-{name}-{i}", device, n) for i, (device, n) in enumerate(zip(devices, threads))
        ]
        # The workers' threads hold no reference to the group, so it can be collected; then they stop.
        self._finalizer = weakref.finalize(self, WorkerGroup._close_all, list(self.workers))

    @staticmethod
    def _close_all(workers: List[Worker]) -> None:
        for worker in workers:
            worker.close()

    def __len__(self) -> int:
        return len(self.workers)

    def __getitem__(self, index: int) -> Worker:
        return self.workers[index]

    @property
    def alive(self) -> bool:
        """Whether every worker takes tasks (false in a forked child, or after :meth:`close`)."""
        return all(w.alive for w in self.workers)

    def close(self) -> None:
        """Stops every worker (idempotent)."""
        self._finalizer()
