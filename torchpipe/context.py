"""The thread-local task context: which micro-batch a worker is on, and whether it checkpoints or recomputes.

:func:`current_microbatch`, :func:`is_checkpointing` and :func:`is_recomputing`
read it. The runner enters a context around every task it runs, on whatever
thread runs it, so layers see the right values in every partition.
"""
import threading
from typing import Any, Optional, Tuple

__all__ = ["MicroBatch", "current_microbatch", "is_checkpointing", "is_recomputing", "task_context", "current"]


class MicroBatch:
    """The identity of one micro-batch of one GPipe call.

    Hashable by identity and weakly referenceable: the pipeline keeps it alive
    until the micro-batch's backward is over (or its forward, without grad),
    so a ``weakref.WeakKeyDictionary`` keyed by it empties itself.
    """

    __slots__ = ("index", "observed", "__weakref__")

    def __init__(self, index: int) -> None:
        self.index = index
        #: Whether a layer asked for it (see the runner's backward: a tensor kept by hand under
        #: this key may join two partitions' graphs).
        self.observed = False

    def __repr__(self) -> str:
        return f"MicroBatch({self.index})"


class _Context(threading.local):
    microbatch: Optional[MicroBatch] = None
    checkpointing: bool = False
    recomputing: bool = False
    #: The skip tracker of the running task (see torchpipe.skip); None outside GPipe.
    skips: Any = None


_context = _Context()


def current() -> _Context:
    """The calling thread's context (for torchpipe's own modules)."""
    return _context


def current_microbatch() -> Optional[MicroBatch]:
    """Identifies the micro-batch being processed inside a GPipe forward, first pass or recomputation.

    Returns the same object in every partition and in the recomputation, or
    ``None`` outside GPipe. Use it as a dict key (or a weak key) to pass
    tensors between layers per micro-batch; see the user guide.
    """
    microbatch = _context.microbatch
    if microbatch is not None:
        microbatch.observed = True
    return microbatch


def is_checkpointing() -> bool:
    """True while a checkpointed partition runs its first forward (under ``no_grad``)."""
    return _context.checkpointing


def is_recomputing() -> bool:
    """True while a checkpointed partition recomputes its forward during backward.

    Example: a layer that counts its calls should not count recomputations::

        def forward(self, input):
            if not torchpipe.is_recomputing():
                self.counter += 1
            return input
    """
    return _context.recomputing


class task_context:
    """Sets the calling thread's context for the duration of one task (a context manager).

    A class rather than a generator: the runner enters one per task.
    """

    __slots__ = ("values", "saved")

    def __init__(
        self,
        microbatch: Optional[MicroBatch],
        *,
        checkpointing: bool = False,
        recomputing: bool = False,
        skips: Any = None,
    ) -> None:
        self.values = (microbatch, checkpointing, recomputing, skips)
        self.saved: Tuple[Optional[MicroBatch], bool, bool, Any] = (None, False, False, None)

    def __enter__(self) -> None:
        self.saved = (_context.microbatch, _context.checkpointing, _context.recomputing, _context.skips)
        _context.microbatch, _context.checkpointing, _context.recomputing, _context.skips = self.values

    def __exit__(self, *exc: object) -> None:
        _context.microbatch, _context.checkpointing, _context.recomputing, _context.skips = self.saved
