"""The pipeline timeline: an opt-in recorder of every task the runner executes.

Recording is off unless a :func:`record_timeline` block is active; then every
forward, recompute and backward task (and every hand-over between partitions)
is recorded with its start and end time and the thread that ran it. Off, the
runner pays one truthiness check of a module-level list per task.

Example::

    with torchpipe.trace.record_timeline() as timeline:
        model(x).sum().backward()
    timeline.save_chrome_trace("timeline.json")   # chrome://tracing or ui.perfetto.dev
"""
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generator, Iterator, List, Optional

__all__ = ["Span", "Timeline", "record_timeline", "span", "active"]


@dataclass(frozen=True)
class Span:
    """One recorded task."""

    #: ``'forward'``, ``'recompute'``, ``'backward'`` or ``'copy'``.
    kind: str
    partition: int
    microbatch: int
    #: Seconds from :func:`time.perf_counter`.
    start: float
    end: float
    thread: str

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """The spans recorded inside one :func:`record_timeline` block, in the order they ended."""

    spans: List[Span] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, span: Span) -> None:
        with self._lock:
            self.spans.append(span)

    def __iter__(self) -> Iterator[Span]:
        return iter(list(self.spans))

    def __len__(self) -> int:
        return len(self.spans)


_timelines: List[Timeline] = []
_timelines_lock = threading.Lock()


def active() -> bool:
    """Whether any timeline is recording."""
    return bool(_timelines)


@contextmanager
def record_timeline() -> Generator[Timeline, None, None]:
    """Records every pipeline task run inside the block (from any thread) into the yielded timeline."""
    timeline = Timeline()
    with _timelines_lock:
        _timelines.append(timeline)
    try:
        yield timeline
    finally:
        with _timelines_lock:
            _timelines.remove(timeline)


@contextmanager
def span(kind: str, partition: int, microbatch: int) -> Generator[None, None, None]:
    """Records the block as one task in every active timeline (cheap when none is active)."""
    if not _timelines:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        record = Span(kind, partition, microbatch, start, time.perf_counter(), threading.current_thread().name)
        with _timelines_lock:
            targets: Optional[List[Timeline]] = list(_timelines)
        for timeline in targets or ():
            timeline.add(record)
