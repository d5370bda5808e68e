"""A timeline as a Chrome trace: one process per rank, one row per stage, one complete event per task."""
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torchpipe.trace.span import Span

__all__ = ["chrome_trace"]


def chrome_trace(
    rows: Sequence[Tuple[Optional[int], int]], tasks: Sequence[Tuple[Span, Span]], started: float
) -> Dict[str, Any]:
    """A timeline's tasks in the Chrome trace event format, one row ("thread") per partition: ``rows`` are its
    (rank, partition) rows, ``tasks`` each task as drawn with the span it was recorded as, ``started`` the start
    of its :func:`record_timeline` block.

    Each task is a complete event (``"ph": "X"``) named like a schedule
    action (``1F0``), with its kind as the category and time in
    microseconds from the start of the :func:`record_timeline` block.
    A merged multi-process timeline has one "process" per rank, with a
    row per stage. ``json.dump`` the result, or use :meth:`~torchpipe.trace.Timeline.save_chrome_trace`;
    both ``chrome://tracing`` and https://ui.perfetto.dev load it.
    """
    events: List[Dict[str, Any]] = []
    for rank in sorted({r for r, _ in rows}, key=lambda r: r or 0):
        pid = rank or 0
        name = "torchpipe pipeline" if rank is None else f"rank {rank}"
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for rank, j in rows:
        row = "partition" if rank is None else "stage"
        pid = rank or 0
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": j, "args": {"name": f"{row} {j}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": j, "args": {"sort_index": j}})
    for s, recorded in tasks:
        events.append({
            "name": s.label,
            "cat": s.kind,
            "ph": "X",
            "pid": s.rank or 0,
            "tid": s.partition,
            "ts": round((s.start - started) * 1e6, 3),
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
