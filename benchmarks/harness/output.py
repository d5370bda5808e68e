"""What a benchmark shows and keeps: progress bars on stderr, plain-text tables, JSON results, bar plots, and the
summary of a run that ``run_all.py`` writes to ``RESULTS.md``."""
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Union

from benchmarks.harness.machine import machine_description

__all__ = ["progress", "format_table", "save_json", "bar_plot", "Summary", "cell", "markdown_table"]


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


def progress(total: int, desc: str = "", disable: bool = False) -> Any:
    """A ``tqdm`` progress bar on stderr (a silent stand-in when tqdm is missing or ``disable``)."""
    if disable:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; floats get 3 decimals, the first column is left-aligned."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}"
        return "n/a" if value is None else str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def save_json(path: Union[str, Path], payload: Mapping[str, Any]) -> None:
    """Writes ``payload`` with the machine line added as ``machine`` (its folder is created)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine_description(), **payload}
    target.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


def bar_plot(
    path: Union[str, Path],
    groups: Mapping[str, Mapping[str, float]],
    *,
    title: str,
    ylabel: str,
    reference: Optional[float] = None,
) -> None:
    """A grouped bar chart saved as PNG: one group per outer key, one bar per inner key.

    ``reference`` draws a dashed horizontal line (1.0 for ratios to the plain module).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names: List[str] = []
    for bars in groups.values():
        names += [n for n in bars if n not in names]
    figure = Figure(figsize=(max(6.0, 1.2 + 0.35 * len(names) * len(groups)), 4.2))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    width = 0.8 / max(1, len(names))
    for index, name in enumerate(names):
        xs = [g + (index - (len(names) - 1) / 2) * width for g, bars in enumerate(groups.values()) if name in bars]
        ys = [bars[name] for bars in groups.values() if name in bars]
        axes.bar(xs, ys, width, label=name)
    if reference is not None:
        axes.axhline(reference, color="black", linestyle="--", linewidth=0.8)
    axes.set_xticks(range(len(groups)))
    axes.set_xticklabels(list(groups))
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=110, format="png")


@dataclass
class Summary:
    """What ``RESULTS.md`` shows of one benchmark's run (its ``summary(results)`` builds it from its JSON): one
    table, and the few figures that fit no row of it, one line each."""

    headers: List[str]
    rows: List[List[Any]]
    notes: List[str] = field(default_factory=list)

    def markdown(self) -> str:
        """The table in markdown, then the notes, one paragraph each."""
        return "\n\n".join([markdown_table(self.headers, self.rows)] + list(self.notes))


def cell(value: Any) -> str:
    """A figure as a table shows it: ratios with 3 decimals, larger figures with fewer, ``n/a`` for none."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        size = abs(value)
        return f"{value:.0f}" if size >= 100 else f"{value:.1f}" if size >= 10 else f"{value:.3f}"
    if isinstance(value, (list, tuple)):
        return ", ".join(cell(v) for v in value)
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; every cell through :func:`cell`, ``|`` escaped."""

    def line(values: Sequence[Any]) -> str:
        return "| " + " | ".join(cell(v).replace("|", "\\|") for v in values) + " |"

    return "\n".join([line(headers), "|" + "---|" * len(headers)] + [line(row) for row in rows])
