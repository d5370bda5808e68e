"""The recorded timeline: spans of the pipeline's tasks, merged across ranks, and the tasks as exports draw them."""
import json
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from torchpipe.schedule import dependencies
from torchpipe.trace.chrome import chrome_trace
from torchpipe.trace.png import PathLike, save_png
from torchpipe.trace.span import Span

__all__ = ["Span", "Timeline"]

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

    # --- exports -----------------------------------------------------------------------------------

    def to_chrome_trace(self) -> Dict[str, Any]:
        """The timeline in the Chrome trace event format, one row ("thread") per partition.

        Each task is a complete event (``"ph": "X"``) named like a schedule
        action (``1F0``), with its kind as the category and time in
        microseconds from the start of the :func:`~torchpipe.trace.record_timeline` block.
        A merged multi-process timeline has one "process" per rank, with a
        row per stage. ``json.dump`` the result, or use :meth:`save_chrome_trace`;
        both ``chrome://tracing`` and https://ui.perfetto.dev load it.
        """
        return chrome_trace(self.rows(), self._tasks(), self.started)

    def save_chrome_trace(self, path: PathLike) -> None:
        """Writes :meth:`to_chrome_trace` as JSON to ``path`` (its folder is created if missing)."""
        make_parent(path)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome_trace(), f)

    def save_png(self, path: PathLike, *, title: Optional[str] = None, dpi: int = 120) -> None:
        """Draws the timeline as a Gantt chart and saves it to ``path`` (PNG; its folder is created): one row
        per partition (per rank and stage for a merged multi-process timeline), one box per task of
        :meth:`tasks` coloured by kind, as :func:`torchpipe.trace.png.save_png` draws it.

        Raises:
            ImportError: matplotlib is not installed (``pip install matplotlib``).
        """
        make_parent(path)
        save_png(self.tasks(), self.rows(), self.started, path, title=title, dpi=dpi)


def make_parent(path: PathLike) -> None:
    """Creates the folder ``path`` is in, if missing (the exports' own job, done here for both)."""
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)
