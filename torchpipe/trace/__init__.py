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
from torchpipe.trace.recorder import NOTHING, active, mark_end, mark_start, record, record_timeline, span
from torchpipe.trace.timeline import Span, Timeline

__all__ = ["Span", "Timeline", "record_timeline", "span", "record", "mark_start", "mark_end", "active", "NOTHING"]
