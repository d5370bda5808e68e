"""Who works for whom and who waits for whom, so that no wait in torchpipe is a wait for itself.

[Note: waits] torchpipe's runtime blocks in a few places: a pipeline's
caller waits for its workers to run a phase, a thread waits for a pipeline's
running phase to end, a backward waits for the gradient lease (see [Note:
gradient lease]), a data-parallel module waits for its replicas. Each such
wait says what it waits for, and on which threads, with :func:`waiting`; a
wait that would close a circle (a thread waiting, through others, for
itself) raises a ``RuntimeError`` that names every thread and pipeline of the
circle instead of blocking for ever. The caller's wait for its workers is
said before the tasks are handed to them, so the thread that closes a circle
is always one that can give up (a worker, whose failure ends the step).

Waiting for the lease is avoided altogether where a thread works *for* the
pass that holds it: a task handed to a worker carries the backward passes it
runs on behalf of (:func:`behalf`: those of the thread that handed it over,
and that thread's running pass), at any depth. A GPipe nested in a GPipe, or
in a ``DataParallel`` inside a GPipe, runs its backward as a pass of its own
on the outer pipeline's worker, for the outer pass: it must not wait for it.
"""
import threading
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["running_pass", "behalf", "work_for", "waiting", "Behalf", "RECHECK"]

_current_graph_task: Optional[Callable[[], int]] = getattr(torch._C, "_current_graph_task_id", None)

#: The backward passes (graph task ids) a task was handed over for: see [Note: waits].
Behalf = Tuple[int, ...]


def running_pass() -> Optional[int]:
    """The backward pass (autograd graph task) running on this thread; None outside one, or where this PyTorch
    does not say."""
    if _current_graph_task is None:
        return None
    task = _current_graph_task()
    return task if task >= 0 else None


class _Working(threading.local):
    passes: Behalf = ()


_working = _Working()


def behalf() -> Behalf:
    """The backward passes the calling thread works for: those its task was handed over for, at any depth, and
    the pass running on it."""
    passes = _working.passes
    task = running_pass()
    return passes if task is None or task in passes else passes + (task,)


def work_for(passes: Behalf) -> Behalf:
    """Sets the passes the calling thread works for (a worker, as it starts a task); returns the previous ones."""
    previous, _working.passes = _working.passes, passes
    return previous


#: How often a thread that waits for a holder that may change (a lock's, the lease's) looks again for a circle.
RECHECK = 0.5

#: What a wait waits for (its words, or a function that says them now), and a function that says which threads
#: must move for it to end (a lock's holder changes while the wait goes on).
Words = Union[str, Callable[[], str]]
Threads = Callable[[], Sequence[threading.Thread]]

_lock = threading.Lock()
#: For each thread that is waiting: what for, and the threads that must move for the wait (and any wait it is
#: nested in) to end.
_waits: Dict[int, Tuple[Words, Tuple[Threads, ...]]] = {}


@contextmanager
def waiting(what: Words, threads: Union[Sequence[threading.Thread], Threads]) -> Iterator[Callable[[], None]]:
    """Says, for the block, that the calling thread waits for ``what``, which ``threads`` must bring about (a
    function that says which, where that changes while the wait goes on). Yields a function that looks again
    for a circle: a wait whose holder may change calls it every :data:`RECHECK` seconds.

    Raises:
        RuntimeError: the wait would never end: one of ``threads`` is this
            one, or waits (through others) for it. The message names each
            thread of the circle and what it waits for.
    """
    me = threading.current_thread()
    key = me.ident or 0
    targets: Threads = threads if callable(threads) else _fixed(tuple(threads))

    def check() -> None:
        with _lock:
            circle = _circle(me, targets())
            if circle is not None:
                raise RuntimeError(_describe(me, what, circle))

    with _lock:
        circle = _circle(me, targets())
        if circle is not None:
            raise RuntimeError(_describe(me, what, circle))
        outer = _waits.get(key)
        # A wait said inside another (a nested pipeline's, on the thread that runs actions inline): the thread
        # still waits for the outer one's threads once the inner wait is over.
        _waits[key] = (what, (targets,) + (outer[1] if outer is not None else ()))
    try:
        yield check
    finally:
        with _lock:
            if outer is None:
                _waits.pop(key, None)
            else:
                _waits[key] = outer


def _fixed(threads: Tuple[threading.Thread, ...]) -> Threads:
    return lambda: threads


def _circle(me: threading.Thread, threads: Sequence[threading.Thread]) -> Optional[List[threading.Thread]]:
    """The threads from one of ``threads`` back to ``me`` along the waits (``[me]`` when ``me`` is among them);
    None when no wait leads back."""
    seen = set()
    stack: List[Tuple[threading.Thread, List[threading.Thread]]] = [(t, [t]) for t in threads]
    while stack:
        thread, path = stack.pop()
        if thread is me:
            return path
        if thread.ident in seen:
            continue
        seen.add(thread.ident)
        edge = _waits.get(thread.ident or 0)
        if edge is not None:
            stack.extend((t, path + [t]) for targets in edge[1] for t in targets())
    return None


def _words(what: Words) -> str:
    return what if isinstance(what, str) else what()


def _describe(me: threading.Thread, what: Words, circle: List[threading.Thread]) -> str:
    links = [f"thread {me.name!r} would wait for {_words(what)}"]
    for thread in circle[:-1]:
        links.append(f"thread {thread.name!r} waits for {_words(_waits[thread.ident or 0][0])}")
    closing = "itself" if len(circle) == 1 else f"thread {me.name!r}"
    return (
        "torchpipe: a wait that would never end: " + "; ".join(links) + f", which needs {closing}. "
        "A pipeline used inside itself, or a pipeline's backward run on a thread that torchpipe does not know "
        "works for the backward pass it waits for, makes such a circle: run the inner module outside the outer "
        "one's phase, or on the outer pipeline's own workers."
    )
