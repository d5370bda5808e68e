"""Checkpointing: which micro-batches are checkpointed, and the checkpoint modes.

A checkpointed stage runs its first forward under ``no_grad`` and keeps only
(a copy of) its input; in backward it runs the forward again (the
recomputation) with grad enabled, just before its backward. Dropout and other
random layers draw the same numbers both times: see [Note: random streams] in
:mod:`torchpipe.rng`.
"""
from typing import Any

from torchpipe.context import is_checkpointing, is_recomputing  # where torchgpipe users look for them

__all__ = ["CHECKPOINT_MODES", "checkpoint_stop", "verify_checkpoint", "is_checkpointing", "is_recomputing"]

CHECKPOINT_MODES = ("always", "except_last", "never")


def verify_checkpoint(mode: Any) -> str:
    """The checkpoint mode as a string; anything whose ``str()`` is a mode is accepted, as torchgpipe does.

    Raises:
        ValueError: it is not ``'always'``, ``'except_last'`` or ``'never'``.
    """
    text = str(mode)
    if text not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))}, got {mode!r}")
    return text


def checkpoint_stop(mode: str, microbatches: int, enabled: bool) -> int:
    """Micro-batches ``i < checkpoint_stop(...)`` are checkpointed.

    ``'always'`` checkpoints every micro-batch, ``'except_last'`` all but the
    last (whose backward starts at once, so recomputing it would only cost
    time), ``'never'`` none; nothing is checkpointed when ``enabled`` is false
    (no grad, or eval mode).
    """
    if not enabled:
        return 0
    return {"always": microbatches, "except_last": microbatches - 1, "never": 0}[mode]
