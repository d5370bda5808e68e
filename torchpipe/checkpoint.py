"""Checkpointing: which micro-batches are checkpointed, and RNG state kept equal for recomputation.

A checkpointed partition runs its first forward under ``no_grad`` and keeps
only its input; in backward it runs the forward again (the recomputation)
with grad enabled, just before its backward. Dropout and other RNG users must
draw the same numbers both times, so the first forward saves the RNG state of
its device and the recomputation restores it.

[Note: shared generators] Partitions on the same device share one generator
(all CPU partitions share the CPU generator; partitions on one GPU share that
GPU's), and partitions run concurrently. If two of them draw at the same time,
a partition's numbers depend on the other's timing, and a recomputation
replaying the saved state would draw different numbers. So while
checkpointing is on, a partition that draws random numbers runs its forward
and recomputation holding its generator's lock. Whether a partition draws is
observed, not guessed: until it is known, the partition runs under the lock
and the generator state is compared before and after; partitions that never
draw then run without the lock, concurrently.
"""
import threading
from contextlib import contextmanager
from typing import Dict, Generator, Optional, Tuple

import torch

from torchpipe.context import is_checkpointing, is_recomputing  # where torchgpipe users look for them

__all__ = ["checkpoint_stop", "RNGState", "RNGGuard", "is_checkpointing", "is_recomputing"]

CHECKPOINT_MODES = ("always", "except_last", "never")


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


class RNGState:
    """The state of the generators a partition on ``device`` may draw from."""

    __slots__ = ("cpu", "cuda")

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda: Optional[torch.Tensor] = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)

    def same_as(self, other: "RNGState") -> bool:
        if not torch.equal(self.cpu, other.cpu):
            return False
        if self.cuda is None or other.cuda is None:
            return self.cuda is other.cuda
        return torch.equal(self.cuda, other.cuda)


class RNGGuard:
    """Per-generator locks and the observed "does partition j draw random numbers" flags."""

    def __init__(self) -> None:
        self._locks: Dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        # (partition, training) -> draws random numbers? Missing: not known yet.
        self._draws: Dict[Tuple[int, bool], bool] = {}

    def _lock(self, device: torch.device) -> threading.Lock:
        key = str(device) if device.type == "cuda" else "cpu"
        with self._locks_lock:
            return self._locks.setdefault(key, threading.Lock())

    def forget(self) -> None:
        """Drops what was observed (call when the partitions change)."""
        self._draws.clear()

    @contextmanager
    def first_forward(
        self, partition: int, device: torch.device, training: bool, checkpointing: bool, save: bool
    ) -> Generator[Optional[RNGState], None, None]:
        """Runs a first forward; yields the RNG state to save if ``save``, else None.

        ``checkpointing`` says whether any micro-batch of this call is
        checkpointed (only then do draws need to be serialised).
        """
        draws = self._draws.get((partition, training))
        if not checkpointing or draws is False:
            yield RNGState(device) if save else None
            return
        with self._lock(device):
            before = RNGState(device)
            yield before if save else None
            if draws is None:
                self._draws[(partition, training)] = not RNGState(device).same_as(before)

    @contextmanager
    def recompute(
        self, partition: int, device: torch.device, training: bool, state: RNGState
    ) -> Generator[None, None, None]:
        """Runs a recomputation with the generators set to ``state``; restores them after."""
        draws = self._draws.get((partition, training))
        if draws is False:
            yield
            return
        with self._lock(device):
            current = RNGState(device)
            state.restore(device)
            try:
                yield
            finally:
                current.restore(device)
