"""The runtime every pipeline runs on, a stack of layers, each importing only those below it::

    runner      the plans of a pipeline's schedule; makes a step and runs its phases
    executor    hands each worker its list of actions, waits for all, ends the step as one
    driver      runs one worker's list in order; the stage hooks of a step's lifecycle
    actions     what one action does: a stage's forward, recomputation, (half) backward
    skips       the skip tensors an action stashes and pops
    step        one mini-batch: its plan and the state its actions share
    transport   the messages between stages (a mailbox in one process)
    stages      the stages on their devices and workers

The story of one step: the :class:`~torchpipe.runtime.runner.Runner` makes a
:class:`~torchpipe.runtime.step.Step` of the micro-batches, with the
:class:`~torchpipe.runtime.step.Plan` (the schedule as data) for its shape; the
executor (:mod:`torchpipe.runtime.executor`) gives each worker its actions; the
driver (:mod:`torchpipe.runtime.driver`) runs them in order on the worker's
thread; each action (:mod:`torchpipe.runtime.actions`) is one stage's work on
one micro-batch, exchanging tensors with other stages through the transport
(:mod:`torchpipe.runtime.transport`). GPipe's autograd function
(:mod:`torchpipe.runtime.function`) and the Pipeline's step in one process
(:mod:`torchpipe.runtime.local`) sit on top.
"""
from torchpipe.runtime.loss import Loss
from torchpipe.runtime.runner import Runner
from torchpipe.runtime.stages import Stages
from torchpipe.runtime.step import Plan, StageHooks, Step

__all__ = ["Runner", "Stages", "Step", "Plan", "Loss", "StageHooks"]
