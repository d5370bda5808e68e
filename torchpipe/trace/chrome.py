"""A timeline as a Chrome trace: one process per rank, one row per stage, one complete event per task."""
from typing import TYPE_CHECKING, Any, Dict, List

if TYPE_CHECKING:
    from torchpipe.trace.timeline import Timeline

__all__ = ["chrome_trace"]


def chrome_trace(timeline: "Timeline") -> Dict[str, Any]:
    """The timeline in the Chrome trace event format, one row ("thread") per partition.

    Each task is a complete event (``"ph": "X"``) named like a schedule
    action (``1F0``), with its kind as the category and time in
    microseconds from the start of the :func:`record_timeline` block.
    A merged multi-process timeline has one "process" per rank, with a
    row per stage. ``json.dump`` the result, or use :meth:`Timeline.save_chrome_trace`;
    both ``chrome://tracing`` and https://ui.perfetto.dev load it.
    """
    events: List[Dict[str, Any]] = []
    for rank in sorted({r for r, _ in timeline.rows()}, key=lambda r: r or 0):
        pid = rank or 0
        name = "torchpipe pipeline" if rank is None else f"rank {rank}"
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for rank, j in timeline.rows():
        row = "partition" if rank is None else "stage"
        pid = rank or 0
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": j, "args": {"name": f"{row} {j}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": j, "args": {"sort_index": j}})
    for s, recorded in timeline._tasks():
        events.append({
            "name": s.label,
            "cat": s.kind,
            "ph": "X",
            "pid": s.rank or 0,
            "tid": s.partition,
            "ts": round((s.start - timeline.started) * 1e6, 3),
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
