"""One mini-batch in the pipeline: its plan, the state its actions share while it runs, and the stage hooks.

A step knows the pipeline's :class:`~torchpipe.runtime.stages.Stages` and the
transport it is given, and nothing of the runner that made it; what only one
product needs hangs on it as a record of its own: GPipe's parameter gradients
(:class:`ParamGrads`), a Pipeline's loss (:class:`~torchpipe.runtime.loss.Loss`).
"""
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from torchpipe.context import MicroBatch
from torchpipe.microbatch import Batch
from torchpipe.recompute import Selective
from torchpipe.rng import may_draw, step_seed, task_seed
from torchpipe.runtime.boundary import takes_leaves
from torchpipe.runtime.held import Measured
from torchpipe.runtime.loss import Loss
from torchpipe.runtime.stages import Stages
from torchpipe.runtime.transport import Edge, Transport, sends
from torchpipe.schedule import Action, Kind, Schedule
from torchpipe.schedule.measured import Timings
from torchpipe.skip.layout import SkipLayout
from torchpipe.skip.registry import SkipRegistry
from torchpipe.stream import AbstractStream
from torchpipe.worker import ThreadContext

if TYPE_CHECKING:
    from torchpipe.runtime.weight_grad import WeightGradient

__all__ = ["Plan", "Step", "StageState", "StageHooks", "ParamGrads", "Timings", "Loss"]

class Plan(NamedTuple):
    """What the runner executes for one shape of step (micro-batches, checkpointing): pure data.

    ``schedule`` is the whole schedule, recomputations included; ``forward``
    its forward actions (GPipe's first phase, and every forward-only step);
    ``backward`` the rest (GPipe's second phase). ``inline`` lists, in the
    order a single thread can run them, the backward actions of the workers
    that run on the caller's thread (see [Note: backward threads]). ``sends``
    gives each action's messages in the order it sends them (see
    :func:`~torchpipe.runtime.transport.sends`); ``last_backward`` maps each
    stage's last backward action (``B``, or ``W`` of a split backward) to the
    stage (see [Note: stage lifecycle]).
    """

    schedule: Schedule
    forward: Schedule
    backward: Schedule
    inline: Tuple[Action, ...]
    sends: Dict[Action, Tuple[Edge, ...]]
    last_backward: Dict[Action, int]

    @staticmethod
    def of(schedule: Schedule, inline: Tuple[Action, ...], layout: SkipLayout) -> "Plan":
        """The plan of ``schedule`` (recomputations included)."""
        last: Dict[int, Action] = {}
        for action in schedule.actions():
            if action.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
                last[action.stage] = action  # a stage's actions are on one worker, in order
        return Plan(
            schedule,
            schedule.only((Kind.FORWARD,)),
            schedule.only((Kind.RECOMPUTE, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)),
            inline,
            {a: sends(a, schedule.stages, layout) for a in schedule.actions()},
            {a: s for s, a in last.items()},
        )


class StageState:
    """What the actions of one (stage, micro-batch) keep for each other."""

    __slots__ = ("leaves", "outputs", "versions", "weight", "selective")

    def __init__(self, leaves: Batch) -> None:
        #: The tensors the stage's graph starts from (a copy, when the forward was checkpointed).
        self.leaves = leaves
        #: The stage's outputs with their graph (after a forward with grad, or a recomputation).
        self.outputs: Optional[Batch] = None
        #: For a checkpointed forward of stage 0: the caller's input tensors and their versions then.
        self.versions: Optional[List[Tuple[Tensor, int]]] = None
        #: After a backward-input action: what the backward-weight action needs.
        self.weight: Optional[WeightGradient] = None
        #: For a selectively recomputed forward: what it kept, until its recomputation.
        self.selective: Optional[Selective] = None


class StageHooks:
    """What runs at the points of a training step's lifecycle (see [Note: stage lifecycle] in
    :mod:`torchpipe.runtime.driver`); each method is a no-op here, so a hook overrides only what it needs.

    ``before_step`` and ``after_step`` run on the thread that drives the step;
    ``after_last_backward`` on the worker that ran the stage's last backward
    (in one process, several workers may call it at once, for their own stages).
    """

    #: Whether the hook runs for steps without backward too (forward-only, or under ``no_grad``); else only
    #: for training steps.
    without_grad = False

    def before_step(self, step: "Step") -> None:
        """The step starts: no action of it has run."""

    def after_last_backward(self, step: "Step", stage: int) -> None:
        """``stage``'s last backward of the step is done: its parameters' gradients of the step are complete."""

    def after_step(self, step: "Step") -> None:
        """Every action of the step ran, on every worker of this process: finish what the hook started."""

    def abort(self, step: "Step") -> None:
        """The step failed (here or elsewhere): leave nothing half done. Must not raise."""


class ParamGrads:
    """GPipe's backward: the parameters whose gradients it sets aside and returns to the caller's autograd engine
    as sums over micro-batches (see [Note: parameter gradients]), and what its backward decided."""

    __slots__ = ("params", "needed", "sums", "direct", "done")

    def __init__(self, params: List[List[Tensor]]) -> None:
        #: Per stage: its parameters that require grad (inputs of the autograd function, in order).
        self.params = params
        #: Per stage: which of its parameters' gradients the caller's backward needs (set as the backward starts).
        self.needed: Optional[List[List[bool]]] = None
        #: Per stage: its parameters' gradient sums over the micro-batches so far.
        self.sums: Optional[List[List[Optional[Tensor]]]] = None
        #: Gradients accumulate into .grad directly: [Note: joined graphs], [Note: gradient lease].
        self.direct = False
        #: The backward ran (once per forward).
        self.done = False

    def accumulate(self, stage: int, sums: Sequence[Optional[Tensor]]) -> None:
        """Keeps the gradient sums of ``stage``'s parameters after one more micro-batch, where the caller's
        backward needs them (see :func:`~torchpipe.runtime.boundary.own_gradients`)."""
        assert self.sums is not None and self.needed is not None
        self.sums[stage] = [total if needed else None for total, needed in zip(sums, self.needed[stage])]


class Step:
    """One mini-batch in the pipeline: its plan and the state its actions share.

    A step holds its :class:`~torchpipe.runtime.stages.Stages` (and so their
    workers: see [Note: worker lifetime]); GPipe's autograd function holds the
    step until its backward. :meth:`Runner.new_step
    <torchpipe.runtime.runner.Runner.new_step>` makes one, then its transport.
    """

    #: How the step's actions exchange messages: given by its maker, once the step is made.
    transport: Transport

    def __init__(
        self,
        stages: Stages,
        plan: "Plan",
        streams: List[AbstractStream],
        batches: Sequence[Optional[Batch]],
        *,
        hooks: Sequence[StageHooks],
        grad_enabled: bool,
        training: bool,
        checkpoint_stop: int,
        loss: Optional[Loss] = None,
        watch_inputs: bool = False,
        sequence: Optional[int] = None,
    ) -> None:
        self.stages = stages
        self.plan = plan
        #: The stream each stage's actions run on (the caller's current one on its device).
        self.streams = streams
        #: When measuring (see [Note: zero-bubble split]): each action's duration, by (stage, kind).
        self.timings: Optional[Timings] = None
        #: What this step's forwards hold until their backwards, where it is measured (see [Note: held bytes]).
        self.memory: Optional[Measured] = None
        #: The step's number across processes (the same on every rank); None in one process.
        self.sequence = sequence
        #: The micro-batches' inputs (on the first stage's rank; None elsewhere across processes).
        self.batches: Optional[List[Optional[Batch]]] = list(batches)
        self.microbatches = len(batches)
        self.grad_enabled = grad_enabled
        self.training = training
        self.checkpoint_stop = checkpoint_stop
        #: A Pipeline step's loss: how each micro-batch's is computed, and the values (None: GPipe, forward).
        self.loss = loss
        #: Whether the caller may change the input between the forward and backward phases (GPipe): then a
        #: checkpointed micro-batch checks, before its recomputation, that its input was not modified.
        self.watch_inputs = watch_inputs
        modules = stages.modules
        #: Per stage: whether it may draw random numbers (see [Note: random streams]) and whether it has
        #: parameters a backward would differentiate.
        self.draws = [stage is not None and may_draw(stage) for stage in modules]
        self.trainable = [
            grad_enabled and stage is not None and any(p.requires_grad for p in stage.parameters())
            for stage in modules
        ]
        #: Per stage: whether its forward takes its input leaves as they are, without an alias (see takes_leaves).
        self.bare_leaves = [takes_leaves(stage) for stage in modules]
        self.seed = step_seed() if any(self.draws) else None
        self.context = ThreadContext.capture()
        #: The stage hooks of the step (see [Note: stage lifecycle]): all of a Pipeline's training step, those
        #: that run without grad (``StageHooks.without_grad``) for other steps.
        self.hooks = hooks
        self.keys: List[Optional[MicroBatch]] = [MicroBatch(i) for i in range(self.microbatches)]
        self.states: Dict[Tuple[int, int], StageState] = {}
        self.skips = SkipRegistry()
        #: The last stage's output per micro-batch (GPipe, and forward-only steps).
        self.results: List[Optional[Batch]] = [None] * self.microbatches
        #: Per micro-batch: whether each output tensor requires grad (as recorded by the last stage).
        self.output_flags: List[Optional[Tuple[bool, ...]]] = [None] * self.microbatches
        #: The backward: the gradients of stage 0's inputs, per micro-batch.
        self.input_grads: List[Optional[List[Optional[Tensor]]]] = [None] * self.microbatches
        #: GPipe's backward: the parameters' gradients it sets aside (None: gradients accumulate into .grad, as
        #: in a Pipeline step).
        self.param_grads: Optional[ParamGrads] = None

    def seed_for(self, stage: int, microbatch: int) -> Optional[int]:
        """The seed of the random stream of ``stage``'s forward of ``microbatch`` (None: it draws nothing)."""
        if self.seed is None or not self.draws[stage]:
            return None
        return task_seed(self.seed, stage, microbatch)

    def take_results(self) -> List[Batch]:
        """The last stage's outputs, in micro-batch order (each handed out once)."""
        results, self.results = self.results, [None] * self.microbatches
        missing = [i for i, r in enumerate(results) if r is None]
        assert not missing, f"micro-batches {missing} produced no output"
        return [r for r in results if r is not None]

    def backward_input(self, tensors: Sequence[Tensor]) -> None:
        """Hands the gradients of the step's input ``tensors`` (a Pipeline's) to the caller's graph.

        Joined over micro-batches, they go into ``tensors`` as ``loss.backward()``
        would send them: into ``.grad`` of a leaf, and on through the graph of
        a tensor computed from others.
        """
        roots, grads = [], []
        for k, tensor in enumerate(tensors):
            if not tensor.requires_grad:
                continue
            parts = [None if g is None else g[k] for g in self.input_grads]
            if all(p is None for p in parts):
                continue
            pieces = torch.empty(tensor.shape, device="meta").chunk(len(parts)) if tensor.dim() else [tensor]
            filled = [p if p is not None else torch.zeros(c.shape, dtype=tensor.dtype, device=tensor.device)
                      for p, c in zip(parts, pieces)]
            roots.append(tensor)
            grads.append(torch.cat(filled) if len(filled) > 1 else filled[0])
        self.input_grads = [None] * self.microbatches
        if roots:
            torch.autograd.backward(roots, grads)
