"""The runtime every pipeline runs on: stages, steps, actions, the transport between stages, the executor.

The story of one step: a :class:`~torchpipe.runtime.step.Step` is made for a
mini-batch cut into micro-batches, with the :class:`~torchpipe.runtime.step.Plan`
(the schedule as data) the :class:`~torchpipe.runtime.runner.Runner` holds for
its shape; the executor (:mod:`torchpipe.runtime.executor`) runs each worker's
actions in order; each action (:mod:`torchpipe.runtime.stage`) is one stage's
forward, recomputation or backward of one micro-batch, exchanging tensors with
other stages through the transport (:mod:`torchpipe.runtime.transport`).
"""
from torchpipe.runtime.driver import StageHooks
from torchpipe.runtime.loss import Loss
from torchpipe.runtime.runner import Runner
from torchpipe.runtime.step import Plan, Step

__all__ = ["Runner", "Step", "Plan", "Loss", "StageHooks"]
