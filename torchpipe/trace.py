"""The pipeline timeline: an opt-in recorder of every task the runner executes, and its exports.

Recording is off unless a :func:`record_timeline` block is active; then every
forward, recompute and backward task is recorded with its start and end time
and the thread that ran it. Off, :func:`span` costs the runner one truthiness
check of a module-level list and a shared do-nothing context manager per task.

A recorded :class:`Timeline` exports as a Chrome trace
(:meth:`Timeline.save_chrome_trace`, for ``chrome://tracing`` and
https://ui.perfetto.dev) and as a Gantt chart (:meth:`Timeline.save_png`,
needs matplotlib), both with one row per partition.

Example::

    with torchpipe.trace.record_timeline() as timeline:
        model(x).sum().backward()
    timeline.save_chrome_trace("timeline.json")   # chrome://tracing or ui.perfetto.dev
    timeline.save_png("timeline.png")             # forward, recompute, backward per partition
"""
import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, ContextManager, Dict, Generator, Iterator, List, Optional, Sequence, Tuple, Type, Union

from torchpipe.schedule import Action, Kind, dependencies

__all__ = ["Span", "Timeline", "record_timeline", "span", "mark_start", "mark_end", "active", "NOTHING"]

#: The kinds of task, in the order the exports list them: the schedule's actions, and copies between devices.
KINDS = tuple(kind.label for kind in Kind) + ("copy",)

#: The Gantt chart's colour per kind (colour-blind-safe palette).
COLORS = {
    "forward": "#4477AA",
    "recompute": "#EE7733",
    "backward": "#228833",
    "backward-input": "#66CCEE",
    "backward-weight": "#AA3377",
    "copy": "#BBBBBB",
}

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class Span:
    """One recorded task."""

    #: An action's :attr:`~torchpipe.schedule.Kind.label` (``'forward'``, ``'backward-input'``, …) or ``'copy'``.
    kind: str
    partition: int
    microbatch: int
    #: Seconds from :func:`time.perf_counter`.
    start: float
    end: float
    #: The name of the thread that ran the task.
    thread: str
    #: The rank that ran it (a merged multi-process timeline), or None.
    rank: Optional[int] = None

    @property
    def duration(self) -> float:
        """``end - start``, in seconds."""
        return self.end - self.start

    @property
    def label(self) -> str:
        """The task as a schedule writes it: ``1F0`` is partition 1's forward of micro-batch 0 (``1C0`` a copy)."""
        action = self.action
        return str(action) if action is not None else f"{self.partition}C{self.microbatch}"

    @property
    def action(self) -> Optional[Action]:
        """The schedule's action this span ran (None for a copy)."""
        try:
            return Action(self.partition, Kind.from_label(self.kind), self.microbatch)
        except ValueError:
            return None


@dataclass
class Timeline:
    """The spans recorded inside one :func:`record_timeline` block, in the order they ended."""

    spans: List[Span] = field(default_factory=list)
    #: When the block began, in :func:`time.perf_counter` seconds: time zero of the exports.
    started: float = field(default_factory=time.perf_counter)
    #: When the block began, in :func:`time.time` seconds (to line up the timelines of several processes).
    wall: float = field(default_factory=time.time)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, span: Span) -> None:
        """Appends ``span`` (thread-safe)."""
        with self._lock:
            self.spans.append(span)

    def __iter__(self) -> Iterator[Span]:
        return iter(list(self.spans))

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def partitions(self) -> int:
        """One more than the highest partition (stage) recorded."""
        return max((s.partition for s in self), default=-1) + 1

    def rows(self) -> List[Tuple[Optional[int], int]]:
        """The rows the exports draw, in order: one per partition (stage), per rank in a merged timeline."""
        if not any(s.rank is not None for s in self):
            return [(None, j) for j in range(max(self.partitions, 1))]
        return sorted({(s.rank, s.partition) for s in self}, key=lambda row: (row[0] or 0, row[1]))

    @staticmethod
    def merge(timelines: Sequence[Tuple[int, "Timeline"]]) -> "Timeline":
        """One timeline of several processes' (``(rank, timeline)`` pairs), on the first one's clock.

        Each span is tagged with its rank; clocks are lined up by the wall
        time at which each timeline began (the same clock on one host; across
        hosts, as good as their synchronisation).
        """
        if not timelines:
            return Timeline()
        _, base = timelines[0]
        merged = Timeline(started=base.started, wall=base.wall)
        for rank, timeline in timelines:
            shift = (timeline.wall - base.wall) - (timeline.started - base.started)
            for s in timeline:
                merged.add(replace(s, start=s.start + shift, end=s.end + shift, rank=rank))
        merged.spans.sort(key=lambda s: s.end)
        return merged

    def to_json(self) -> str:
        """The spans and clocks as JSON (what :meth:`from_json` reads back)."""
        return json.dumps({"started": self.started, "wall": self.wall,
                           "spans": [list(vars(s).values()) for s in self]})

    @staticmethod
    def from_json(text: str) -> "Timeline":
        data = json.loads(text)
        return Timeline([Span(*values) for values in data["spans"]], data["started"], data["wall"])

    def tasks(self) -> List[Span]:
        """The spans as the exports draw them: each starting when its input was there, sorted by start.

        A span runs from the moment its worker reaches the task, or from
        :func:`mark_start` if the runner marked when the input arrived. Where
        it was not marked, a worker that reached a forward before the previous
        partition handed over the activation (or a backward before the next
        partition handed back the gradient) waited inside the span, and drawn
        as recorded that wait would look like work. So each task here starts
        no earlier than the end of the tasks of other partitions it depends on
        (:func:`torchpipe.schedule.dependencies`: ``jFi`` on ``(j-1)Fi``,
        ``jBi`` on ``(j+1)Bi`` or ``(j+1)Ii``), when those ended first.
        :attr:`spans` keeps what was recorded.
        """
        return [drawn for drawn, _ in self._tasks()]

    def _tasks(self) -> List[Tuple[Span, Span]]:
        """:meth:`tasks`, each with the span it was made from."""
        spans = list(self)
        by_key: Dict[Tuple[str, int, int], List[Span]] = {}
        for s in sorted(spans, key=lambda s: s.start):
            by_key.setdefault((s.kind, s.partition, s.microbatch), []).append(s)
        partitions = self.partitions
        present = frozenset(a for a in (s.action for s in spans) if a is not None)
        result: List[Tuple[Span, Span]] = []
        for s in spans:
            action = s.action
            start = s.start
            needs = [] if action is None else dependencies(action, partitions, present)
            for dependency in needs:
                if dependency.stage == s.partition:  # its own worker ran it before anyway
                    continue
                # The same task of the same step: the latest one that began before this one ended
                # (a timeline may hold several steps, whose micro-batch numbers repeat).
                key = (dependency.kind.label, dependency.stage, dependency.microbatch)
                candidates = [d for d in by_key.get(key, ()) if d.start <= s.end]
                if candidates and candidates[-1].end <= s.end:
                    start = max(start, candidates[-1].end)
            result.append((s if start == s.start else replace(s, start=start), s))
        result.sort(key=lambda pair: (pair[0].start, pair[0].partition))
        return result

    # --- Chrome trace --------------------------------------------------------------------------

    def to_chrome_trace(self) -> Dict[str, Any]:
        """The timeline in the Chrome trace event format, one row ("thread") per partition.

        Each task is a complete event (``"ph": "X"``) named like a schedule
        action (``1F0``), with its kind as the category and time in
        microseconds from the start of the :func:`record_timeline` block.
        A merged multi-process timeline has one "process" per rank, with a
        row per stage. ``json.dump`` the result, or use :meth:`save_chrome_trace`;
        both ``chrome://tracing`` and https://ui.perfetto.dev load it.
        """
        events: List[Dict[str, Any]] = []
        for rank in sorted({r for r, _ in self.rows()}, key=lambda r: r or 0):
            pid = rank or 0
            name = "torchpipe pipeline" if rank is None else f"rank {rank}"
            events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for rank, j in self.rows():
            row = "partition" if rank is None else "stage"
            pid = rank or 0
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": j, "args": {"name": f"{row} {j}"}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": j, "args": {"sort_index": j}})
        for s, recorded in self._tasks():
            events.append({
                "name": s.label,
                "cat": s.kind,
                "ph": "X",
                "pid": s.rank or 0,
                "tid": s.partition,
                "ts": round((s.start - self.started) * 1e6, 3),
                "dur": round(s.duration * 1e6, 3),
                "args": {
                    "partition": s.partition,
                    "microbatch": s.microbatch,
                    "kind": s.kind,
                    "thread": s.thread,
                    "waited for input (us)": round((s.start - recorded.start) * 1e6, 3),
                },
            })
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: PathLike) -> None:
        """Writes :meth:`to_chrome_trace` as JSON to ``path`` (its folder is created if missing)."""
        _make_parent(path)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome_trace(), f)

    # --- Gantt chart ---------------------------------------------------------------------------

    def save_png(self, path: PathLike, *, title: Optional[str] = None, dpi: int = 120) -> None:
        """Draws the timeline as a Gantt chart and saves it to ``path`` (PNG; its folder is created).

        One row per partition (partition 0 on top; per rank and stage for a
        merged multi-process timeline), one box per task coloured
        by kind (forward, recompute, backward, …), the micro-batch number in each
        box that is wide enough to hold it (boxes from :meth:`tasks`); the x axis is
        milliseconds from the first task.

        Raises:
            ImportError: matplotlib is not installed (``pip install matplotlib``).
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "Timeline.save_png needs matplotlib, which is not installed: pip install matplotlib "
                "(or use Timeline.save_chrome_trace, which needs nothing)"
            ) from exc

        spans = self.tasks()
        labels = self.rows()
        row_of = {row: k for k, row in enumerate(labels)}
        rows = max(len(labels), 1)
        origin = min((s.start for s in spans), default=self.started)
        finish = max((s.end for s in spans), default=origin)
        width_ms = max((finish - origin) * 1e3, 1e-3)

        # Pyplot-free (Figure + Agg canvas): no global state, no GUI backend, safe in worker threads.
        figure = Figure(figsize=(max(9.0, min(24.0, 3.0 + 0.25 * len(spans) / rows)), 1.4 + 0.5 * rows))
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        renderer_width_px = figure.get_figwidth() * dpi * 0.8
        for s in spans:
            left = (s.start - origin) * 1e3
            width = s.duration * 1e3
            row = row_of.get((s.rank, s.partition), 0)
            axes.broken_barh([(left, width)], (row - 0.4, 0.8),
                             facecolors=COLORS.get(s.kind, "#777777"), edgecolor="white", linewidth=0.5)
            if width / width_ms * renderer_width_px >= 7 * len(str(s.microbatch)):
                axes.text(left + width / 2, row, str(s.microbatch), ha="center", va="center",
                          fontsize=7, color="white")
        axes.set_ylim(rows - 0.5, -0.5)
        axes.set_yticks(range(rows))
        axes.set_yticklabels([f"partition {j}" if rank is None else f"rank {rank}, stage {j}" for rank, j in labels])
        axes.set_xlim(0, width_ms)
        axes.set_xlabel("time (ms)")
        kinds = [k for k in KINDS if any(s.kind == k for s in spans)]
        if kinds:
            axes.legend(handles=[Patch(facecolor=COLORS[k], label=k) for k in kinds],
                        loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        axes.set_title(title if title is not None else "torchpipe timeline (number: micro-batch)")
        figure.tight_layout()
        _make_parent(path)
        figure.savefig(path, dpi=dpi, format="png")


def _make_parent(path: PathLike) -> None:
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)


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
