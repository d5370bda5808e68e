"""One recorded task of a pipeline's timeline."""
from dataclasses import dataclass
from typing import Optional

from torchpipe.schedule import Action, Kind

__all__ = ["Span"]


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
        """The task as a schedule writes it: ``1F0`` is partition 1's forward of micro-batch 0 (``1C0`` a copy,
        ``1reduce`` stage 1's gradient reduction)."""
        action = self.action
        if action is not None:
            return str(action)
        if self.kind == "reduce":
            return f"{self.partition}reduce"
        return f"{self.partition}C{self.microbatch}"

    @property
    def action(self) -> Optional[Action]:
        """The schedule's action this span ran (None for a copy)."""
        try:
            return Action(self.partition, Kind.from_label(self.kind), self.microbatch)
        except ValueError:
            return None
