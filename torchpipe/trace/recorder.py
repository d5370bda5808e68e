"""Recording: an opt-in recorder of every task the runner executes, from any thread, into active timelines."""
import threading
import time
from contextlib import contextmanager
from types import TracebackType
from typing import ContextManager, Generator, List, Optional, Type

from torchpipe.trace.timeline import Span, Timeline

__all__ = ["record_timeline", "span", "record", "mark_start", "mark_end", "active", "NOTHING"]


_timelines: List[Timeline] = []
_timelines_lock = threading.Lock()


def active() -> bool:
    """Whether any timeline is recording."""
    return bool(_timelines)


@contextmanager
def record_timeline() -> Generator[Timeline, None, None]:
    """Records every pipeline task run inside the block (from any thread) into the yielded timeline.

    Blocks may nest or overlap (from different threads); each gets every task
    that ran while it was active.
    """
    timeline = Timeline()
    with _timelines_lock:
        _timelines.append(timeline)
    try:
        yield timeline
    finally:
        with _timelines_lock:
            _timelines.remove(timeline)


class _Nothing:
    """The context manager :func:`span` hands out when nothing records: one shared instance."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        return None


#: A do-nothing context manager (what :func:`span` returns when nothing records).
NOTHING = _Nothing()


class _Open(threading.local):
    """The spans open on this thread, innermost last (see :func:`mark_start`)."""

    def __init__(self) -> None:
        self.stack: List[_Recording] = []


_open = _Open()


class _Recording:
    """Times its block and adds it to every timeline active when the block ends."""

    __slots__ = ("kind", "partition", "microbatch", "start", "end")

    def __init__(self, kind: str, partition: int, microbatch: int) -> None:
        self.kind = kind
        self.partition = partition
        self.microbatch = microbatch
        self.start = 0.0
        self.end: Optional[float] = None

    def __enter__(self) -> None:
        _open.stack.append(self)
        self.start = time.perf_counter()

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        now = time.perf_counter()
        stack = _open.stack
        if stack and stack[-1] is self:
            stack.pop()
        end = now if self.end is None else self.end
        record = Span(self.kind, self.partition, self.microbatch, self.start, end, threading.current_thread().name)
        with _timelines_lock:
            targets = list(_timelines)
        for timeline in targets:
            timeline.add(record)


def span(kind: str, partition: int, microbatch: int) -> ContextManager[None]:
    """Records the block as one task in every active timeline.

    With no :func:`record_timeline` block active this returns a shared
    do-nothing context manager: one list check, no allocation, no clock read.
    """
    if not _timelines:
        return NOTHING
    return _Recording(kind, partition, microbatch)


def mark_start() -> None:
    """Moves the start of the span open on this thread to now: the task's input has arrived.

    The runner calls it right after a task has received what it waited for
    (the previous partition's activation, the next partition's gradient), so
    the span covers the task's work, not its wait. Free when nothing records.
    """
    if not _timelines:
        return
    stack = _open.stack
    if stack:
        stack[-1].start = time.perf_counter()


def mark_end() -> None:
    """Ends the span open on this thread now (it is recorded when its block exits).

    The runner calls it right before handing a task's output on, so that the
    task that takes it starts after this one ended. Free when nothing records.
    """
    if not _timelines:
        return
    stack = _open.stack
    if stack and stack[-1].end is None:
        stack[-1].end = time.perf_counter()


def record(kind: str, partition: int, microbatch: int, start: float, end: float) -> None:
    """Adds a span that was timed elsewhere (``time.perf_counter`` seconds) to every active timeline: work that
    runs in the background, such as a gradient reduction, from when it was started to when it was seen done."""
    if not _timelines:
        return
    spanned = Span(kind, partition, microbatch, start, end, threading.current_thread().name)
    with _timelines_lock:
        targets = list(_timelines)
    for timeline in targets:
        timeline.add(spanned)
