"""Where skip tensors wait between their stash and their pop.

A :class:`Tracker` serves the stash and pop requests of skippable layers.
Outside GPipe, :class:`PlainTracker` keeps tensors per thread, keyed by
namespace and name, until they are popped. Inside GPipe the runner installs a
tracker per (micro-batch, partition) task (see ``torchpipe.runner``) that
keeps them in the step's :class:`SkipRegistry`, keyed by micro-batch,
namespace and name, and moves them between partitions.
"""
import threading
from typing import Any, Dict, Optional, Protocol, Tuple

from torch import Tensor

from torchpipe.skip.namespace import Namespace

__all__ = ["Tracker", "PlainTracker", "SkipRegistry", "SkipKey"]

#: (micro-batch index, namespace, name)
SkipKey = Tuple[int, Namespace, str]


class Tracker(Protocol):
    def save(self, layer: Any, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None: ...

    def load(self, layer: Any, ns: Namespace, name: str) -> Optional[Tensor]: ...


class PlainTracker:
    """Skip tensors of a plain (not pipelined) forward, per thread."""

    _local = threading.local()

    def __init__(self) -> None:
        self.tensors: Dict[Tuple[Namespace, str], Optional[Tensor]] = {}

    @classmethod
    def for_thread(cls) -> "PlainTracker":
        tracker: Optional[PlainTracker] = getattr(cls._local, "tracker", None)
        if tracker is None:
            tracker = cls._local.tracker = cls()
        return tracker

    def save(self, layer: Any, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        self.tensors[(ns, name)] = tensor

    def load(self, layer: Any, ns: Namespace, name: str) -> Optional[Tensor]:
        try:
            return self.tensors.pop((ns, name))
        except KeyError:
            raise RuntimeError(
                f"{type(layer).__name__} popped {name!r} ({ns}) but no earlier layer stashed it in this forward"
            ) from None


class SkipRegistry:
    """The skip tensors of one pipelined step that are in flight, keyed by micro-batch, namespace and name.

    ``stashed`` holds the stashing side (with its graph, for the stashing
    partition's backward), ``popped`` the leaves the popping partition received
    (whose ``.grad`` goes back to the stashing side), ``local`` the skips whose
    stash and pop are in the same partition. Entries leave as soon as they are
    used; after a micro-batch's backward nothing of it remains.
    """

    def __init__(self) -> None:
        self.stashed: Dict[SkipKey, Optional[Tensor]] = {}
        self.popped: Dict[SkipKey, Optional[Tensor]] = {}
        self.local: Dict[SkipKey, Optional[Tensor]] = {}

    def __len__(self) -> int:
        return len(self.stashed) + len(self.popped) + len(self.local)
