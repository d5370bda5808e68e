"""A Pipeline's steps on this rank of several: its actions run here, the others' on their ranks (see
:class:`~torchpipe.runtime.backend.Backend`)."""
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from torchpipe import microbatch
from torchpipe.distributed.channel import Channel
from torchpipe.distributed.state import gather_bytes
from torchpipe.distributed.state import gather_state as gather_states
from torchpipe.distributed.step import distributed_step
from torchpipe.runtime.loss import LossSpec
from torchpipe.runtime.runner import Runner
from torchpipe.schedule.measured import Exchange, Timings
from torchpipe.trace import Timeline
from torchpipe.types import TensorOrTensors

__all__ = ["DistributedBackend"]


class DistributedBackend:
    """This rank's part of a multi-process Pipeline, over its :class:`~torchpipe.distributed.channel.Channel`."""

    def __init__(self, channel: Channel, devices: Sequence[torch.device]) -> None:
        self.channel = channel
        #: Each stage's device (this rank's device for all).
        self.devices = list(devices)
        self.rank: Optional[int] = channel.rank
        self.exchange: Optional[Exchange] = channel.exchange

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
        value, _ = distributed_step(
            runner, self.channel, self.devices, chunks, input, training=training, module_training=module_training,
            checkpoint_stop=checkpoint_stop, loss=loss, target=target, timings=timings, relayouts=relayouts,
        )
        assert value is not None, "a step with a loss returns it on every rank"
        return value

    def forward(
        self, runner: Runner, input: Optional[TensorOrTensors], *, chunks: int, module_training: bool
    ) -> Optional[TensorOrTensors]:
        with torch.no_grad():
            _, outputs = distributed_step(
                runner, self.channel, self.devices, chunks, input, training=False, module_training=module_training,
                checkpoint_stop=lambda microbatches: 0, loss=None,
            )
        return None if outputs is None else microbatch.gather(outputs)

    def gather_state(self, state: Dict[str, Any], first: int) -> Optional[Dict[str, Any]]:
        # A sharded tensor's whole value is gathered over the replicas (a collective: every replica holds the
        # same stages, so they gather the same keys in the same order).
        whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
        merged = gather_states(self.channel, whole, first)
        return None if self.channel.replica or self.channel.lane or self.channel.rank != first else merged

    def gather_timeline(self, timeline: Timeline, first: int) -> Optional[Timeline]:
        parts = gather_bytes(self.channel, timeline.to_json().encode(), first)
        if self.channel.rank != first:
            return None
        return Timeline.merge([(rank, Timeline.from_json(parts[rank].decode())) for rank in sorted(parts)])
