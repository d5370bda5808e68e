"""A pipeline's stages in this process: their modules, devices and workers, and what they share.

What the stages *are* (this module), apart from how a step runs over them
(:mod:`torchpipe.runtime.runner`, :mod:`torchpipe.runtime.step`). Each stage
runs on a worker (several stages may share one: ``'interleaved_1f1b'``), each
worker on a device; across processes the stages of other ranks are ``None``.
The worker threads are made on first use, so that the caller's thread
settings apply, and made anew in a process forked from ours (see [Note: fork]).
"""
import itertools
import threading
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence

import torch
from torch import nn

from torchpipe.skip.layout import SkipLayout
from torchpipe.stream import AbstractStream, new_stream
from torchpipe.worker import WorkerGroup, fork_generation

__all__ = ["Stages"]

#: Numbers the pipelines of this process, so that messages tell them apart.
_numbers = itertools.count(1)


class Stages:
    """A pipeline's stages on their devices and workers.

    Args:
        modules: the stages' modules, in order (None for the stages of other ranks).
        devices: the device of each stage.
        stage_workers: the worker of each stage.
        worker_devices: the device of each worker.
        skip_layout: where each skip connection starts and ends.
        noun: what messages call a stage (GPipe says ``'partition'``, its public name for one).
        name: what messages call the pipeline (``'GPipe(balance=[2, 2])'``); a number is
            added that tells pipelines apart.
    """

    def __init__(
        self,
        modules: Sequence[Optional[nn.Module]],
        devices: Sequence[torch.device],
        stage_workers: Sequence[int],
        worker_devices: Sequence[torch.device],
        skip_layout: SkipLayout,
        *,
        noun: str = "stage",
        name: str = "a pipeline",
    ) -> None:
        self.modules = list(modules)
        self.count = len(self.modules)
        self.devices = list(devices)
        self.stage_workers = list(stage_workers)
        self.worker_devices = list(worker_devices)
        self.skip_layout = skip_layout
        self.noun = noun
        #: The pipeline as messages name it: ``name`` and a number of its own (see [Note: waits]).
        self.label = f"{name} #{next(_numbers)}"
        #: Per stage: the locks of its parameters that a stage of another worker shares, in one global order
        #: (GPipe's backward holds them, see [Note: tied parameters]).
        self.shared_locks: List[List[threading.Lock]] = [[] for _ in self.modules]
        #: Per tied parameter with copies on several devices of this process: the copies.
        self.tied_copies: List[List[nn.Parameter]] = []
        #: What every action of a stage runs under (None: nothing), such as DTensor's implicit replication for
        #: a tensor-parallel stage of traced layers (see [Note: tensor parallel stages]).
        self.action_context: Optional[Callable[[], ContextManager[Any]]] = None
        #: ``policy(op)``: what a checkpointed micro-batch keeps of its forward (None: nothing but its input; see
        #: [Note: selective recomputation]).
        self.recompute: Optional[Callable[[Any], bool]] = None
        #: The latest training step's measurement of what its forwards held (see [Note: held bytes]).
        self.measured: Optional[Any] = None
        self._shared: List[List[int]] = []
        self._workers: Optional[WorkerGroup] = None
        self._copy_streams: Optional[List[AbstractStream]] = None
        self._generation = -1
        self._renew()

    def share(self, ties: Sequence[Sequence[int]]) -> None:
        """Locks for the parameters that several workers' stages share: ``ties[k]`` lists the stages that hold
        shared parameter ``k`` (one tensor on one device)."""
        self._shared = [list(stages) for stages in ties]
        self.shared_locks = [[] for _ in self.modules]
        for stages in self._shared:
            if len({self.stage_workers[s] for s in stages}) > 1:
                lock = threading.Lock()
                for s in stages:
                    self.shared_locks[s].append(lock)

    def _renew(self) -> None:
        """Fresh locks (and, on first use, workers): at construction, and in a process forked from ours."""
        self._generation = fork_generation()
        self._lock = threading.Lock()
        self._workers = None
        self.share(self._shared)

    def check_fork(self) -> bool:
        """Renews the locks in a process forked from ours (see [Note: fork]); True when it did."""
        if self._generation == fork_generation():
            return False
        self._renew()
        return True

    def __getstate__(self) -> Dict[str, Any]:
        # Copies (deepcopy, pickle) get their own workers, streams and locks.
        state = self.__dict__.copy()
        for name in ("_lock", "_workers", "_copy_streams", "shared_locks"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._copy_streams = None
        self._renew()

    def workers(self) -> WorkerGroup:
        """The worker threads, made on first use (so that the caller's thread settings apply)."""
        self.check_fork()
        with self._lock:
            if self._workers is None or not self._workers.alive:
                self._workers = WorkerGroup(self.worker_devices, "stage")
            return self._workers

    def copy_streams(self) -> List[AbstractStream]:
        """One copy stream per stage's device (CPU stand-ins on CPU)."""
        if self._copy_streams is None:
            self._copy_streams = [new_stream(d) for d in self.devices]
        return self._copy_streams

    def layer_names(self, stage: int) -> str:
        """The first and last layer names of ``stage`` (for messages)."""
        module = self.modules[stage]
        names = list(module._modules) if module is not None else []
        if not names:
            return "none"
        return f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0]
