"""A Pipeline step in one process: the mini-batch split into micro-batches, the schedule run on the workers."""
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor

from torchpipe import microbatch
from torchpipe.runtime.loss import Loss, LossSpec, check_target, loss_weights, shares, split_target, target_weights
from torchpipe.runtime.runner import Runner
from torchpipe.schedule.measured import Exchange, Timings
from torchpipe.trace import Timeline
from torchpipe.types import TensorOrTensors

__all__ = ["LocalBackend"]


class LocalBackend:
    """A Pipeline in one process: its steps run on the workers' threads (see :class:`~torchpipe.runtime.backend.
    Backend`)."""

    rank: Optional[int] = None
    exchange: Optional[Exchange] = None

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
        """Runs one mini-batch, forward and (when ``training``) backward; returns the loss, without graph.
        ``timings``: measure each action into it (see [Note: zero-bubble split])."""
        if input is None:
            raise ValueError("step() needs the mini-batch's input (a tensor or a tuple of tensors)")
        stages = runner.stages
        inputs, batches = microbatch.split_input(input, stages.devices[0], chunks)
        sizes = [b.values[0].size(0) for b in batches]
        check_target(loss, target, "the step")
        targets = split_target(target, stages.devices[-1], sizes)
        if loss.weight is not None and loss.reduction == "mean":  # see [Note: token weights]
            weights = target_weights(loss.weight, targets)
            weights = shares(weights, sum(weights))
        else:
            weights = loss_weights(sizes, loss.reduction)
        step_loss = Loss(loss.fn, targets, weights, scale=loss.scale)
        step = runner.new_step(
            batches, grad_enabled=training, training=module_training, checkpoint_stop=checkpoint_stop(len(batches)),
            loss=step_loss,
        )
        step.timings = timings
        if training:
            runner.run(step)
            step.backward_input(inputs)
        else:
            runner.run_forward(step)
        losses = step_loss.weighted()
        assert losses, "a step with a loss weighed none of its micro-batches' losses"
        return torch.stack(losses).sum() if len(losses) > 1 else losses[0]

    def forward(
        self, runner: Runner, input: Optional[TensorOrTensors], *, chunks: int, module_training: bool
    ) -> Optional[TensorOrTensors]:
        """Runs the forward alone, without grad; returns the module's output on the last stage's device."""
        if input is None:
            raise ValueError("a Pipeline's forward needs the input")
        _, batches = microbatch.split_input(input, runner.stages.devices[0], chunks)
        with torch.no_grad():
            step = runner.new_step(batches, grad_enabled=False, training=module_training, checkpoint_stop=0)
            return microbatch.gather(runner.run_forward(step))

    def gather_state(self, state: Dict[str, Any], first: int) -> Optional[Dict[str, Any]]:
        return dict(state)

    def gather_timeline(self, timeline: Timeline, first: int) -> Optional[Timeline]:
        return timeline
