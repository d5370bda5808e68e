"""Where a Pipeline's steps run: in one process, or on one rank of several; the one interface of both.

``Pipeline`` holds one backend and calls it the same way in both cases:
:class:`~torchpipe.runtime.local.LocalBackend` runs a step on the workers'
threads, :class:`~torchpipe.distributed.backend.DistributedBackend` runs this
rank's actions and exchanges messages and the control plane with the others.
"""
from typing import Any, Callable, Dict, List, Optional, Protocol

from torch import Tensor

from torchpipe.runtime.loss import LossSpec
from torchpipe.runtime.runner import Runner
from torchpipe.schedule.measured import Exchange, Timings
from torchpipe.trace import Timeline
from torchpipe.types import TensorOrTensors

__all__ = ["Backend"]


class Backend(Protocol):
    """What a Pipeline needs of where its steps run."""

    #: This process's rank in the pipeline's group (None in one process).
    rank: Optional[int]
    #: Every rank's values for this one's (None in one process): what tuners and clipping combine.
    exchange: Optional[Exchange]

    def step(
        self,
        runner: Runner,
        input: Optional[TensorOrTensors],
        target: Optional[TensorOrTensors],
        *,
        chunks: int,
        loss: LossSpec,
        training: bool,
        module_training: bool,
        checkpoint_stop: Callable[[int], int],
        timings: Optional[Timings],
        relayouts: List[float],
    ) -> Tensor:
        """Runs one mini-batch, forward and (when ``training``) backward; returns its loss, without graph.
        ``timings``: measure each action into it; ``relayouts``: where the first step's messages add their
        relayouts (across processes)."""

    def forward(
        self, runner: Runner, input: Optional[TensorOrTensors], *, chunks: int, module_training: bool
    ) -> Optional[TensorOrTensors]:
        """Runs the forward alone, without grad; the module's output where it ends (None on other ranks)."""

    def gather_state(self, state: Dict[str, Any], first: int) -> Optional[Dict[str, Any]]:
        """Every rank's ``state`` merged on the first stage's rank ``first`` (None on the others); a collective."""

    def gather_timeline(self, timeline: Timeline, first: int) -> Optional[Timeline]:
        """Every rank's timeline merged on rank ``first`` (None on the others); a collective."""
