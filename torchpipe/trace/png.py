"""A timeline drawn as a Gantt chart (PNG, with matplotlib): one row per stage, one box per task."""
import os
from typing import List, Optional, Sequence, Tuple, Union

from torchpipe.schedule import Kind
from torchpipe.trace.span import Span

__all__ = ["save_png", "KINDS", "COLORS", "PathLike"]

#: The kinds of task, in the order the exports list them: the schedule's actions, copies between devices, and
#: a stage's gradient reduction across data-parallel replicas or tied copies.
KINDS = tuple(kind.label for kind in Kind) + ("copy", "reduce")

#: The Gantt chart's colour per kind (colour-blind-safe palette).
COLORS = {
    "forward": "#4477AA",
    "recompute": "#EE7733",
    "backward": "#228833",
    "backward-input": "#66CCEE",
    "backward-weight": "#AA3377",
    "copy": "#BBBBBB",
    "reduce": "#CCBB44",
}

PathLike = Union[str, "os.PathLike[str]"]


def save_png(
    spans: List[Span],
    labels: Sequence[Tuple[Optional[int], int]],
    started: float,
    path: PathLike,
    *,
    title: Optional[str] = None,
    dpi: int = 120,
) -> None:
    """Draws a timeline's tasks (``spans``, as drawn, on the (rank, partition) rows ``labels``; ``started``: the
    start of its recording) as a Gantt chart and saves it to ``path`` (PNG, in a folder that exists).

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

    row_of = {row: k for k, row in enumerate(labels)}
    rows = max(len(labels), 1)
    origin = min((s.start for s in spans), default=started)
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
    figure.savefig(path, dpi=dpi, format="png")
