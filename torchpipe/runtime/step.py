"""One mini-batch in the pipeline: its plan, and the state its actions share while it runs."""
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from torchpipe.context import MicroBatch
from torchpipe.microbatch import Batch
from torchpipe.rng import may_draw, step_seed, task_seed
from torchpipe.runtime.boundary import takes_leaves
from torchpipe.runtime.loss import Loss
from torchpipe.runtime.transport import Edge, LocalTransport, Transport, sends
from torchpipe.schedule import Action, Kind, Schedule
from torchpipe.skip.layout import SkipLayout
from torchpipe.skip.registry import SkipRegistry
from torchpipe.stream import current_stream
from torchpipe.worker import ThreadContext

if TYPE_CHECKING:
    from torchpipe.runtime.driver import StageHooks
    from torchpipe.runtime.runner import Runner
    from torchpipe.runtime.tune import Timings
    from torchpipe.runtime.weight_grad import WeightGradient

__all__ = ["Plan", "Step", "StageState"]


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

    __slots__ = ("leaves", "outputs", "versions", "weight")

    def __init__(self, leaves: Batch) -> None:
        #: The tensors the stage's graph starts from (a copy, when the forward was checkpointed).
        self.leaves = leaves
        #: The stage's outputs with their graph (after a forward with grad, or a recomputation).
        self.outputs: Optional[Batch] = None
        #: For a checkpointed forward of stage 0: the caller's input tensors and their versions then.
        self.versions: Optional[List[Tuple[Tensor, int]]] = None
        #: After a backward-input action: what the backward-weight action needs.
        self.weight: Optional[WeightGradient] = None


class Step:
    """One mini-batch in the pipeline: its plan and the state its actions share.

    A step holds its :class:`Runner` (and so its workers: see [Note: worker
    lifetime]); GPipe's autograd function holds the step until its backward.
    """

    def __init__(
        self,
        runner: "Runner",
        batches: Sequence[Optional[Batch]],
        *,
        grad_enabled: bool,
        training: bool,
        checkpoint_stop: int,
        loss: Optional[Loss] = None,
        watch_inputs: bool = False,
        sequence: Optional[int] = None,
    ) -> None:
        self.runner = runner
        #: When measuring (see [Note: zero-bubble placement]): each action's duration, by (stage, kind).
        self.timings: Optional[Timings] = None
        #: The step's number across processes (the same on every rank); None in one process.
        self.sequence = sequence
        #: The micro-batches' inputs (on the first stage's rank; None elsewhere across processes).
        self.batches: Optional[List[Optional[Batch]]] = list(batches)
        self.microbatches = len(batches)
        self.grad_enabled = grad_enabled
        self.training = training
        self.checkpoint_stop = checkpoint_stop
        self.loss = loss
        #: Whether the caller may change the input between the forward and backward phases (GPipe): then a
        #: checkpointed micro-batch checks, before its recomputation, that its input was not modified.
        self.watch_inputs = watch_inputs
        #: Per stage: whether it may draw random numbers (see [Note: random streams]) and whether it has
        #: parameters a backward would differentiate.
        self.draws = [stage is not None and may_draw(stage) for stage in runner.stages]
        self.trainable = [
            grad_enabled and stage is not None and any(p.requires_grad for p in stage.parameters())
            for stage in runner.stages
        ]
        #: Per stage: whether its forward takes its input leaves as they are, without an alias (see takes_leaves).
        self.bare_leaves = [takes_leaves(stage) for stage in runner.stages]
        self.seed = step_seed() if any(self.draws) else None
        self.context = ThreadContext.capture()
        self.plan = runner.plan(self.microbatches, checkpoint_stop)
        #: The stage hooks of the step (see [Note: stage lifecycle]): all of a Pipeline's training step, those
        #: that run without grad (``StageHooks.without_grad``) for other steps.
        trains = grad_enabled and loss is not None
        self.hooks: Sequence[StageHooks] = [h for h in runner.hooks if trains or h.without_grad]
        self.keys: List[Optional[MicroBatch]] = [MicroBatch(i) for i in range(self.microbatches)]
        self.streams = [current_stream(d) for d in runner.devices]
        self.transport: Transport = LocalTransport(runner, self.streams)
        self.states: Dict[Tuple[int, int], StageState] = {}
        self.skips = SkipRegistry()
        #: The last stage's output per micro-batch (GPipe, and forward-only steps).
        self.results: List[Optional[Batch]] = [None] * self.microbatches
        #: Per micro-batch: whether each output tensor requires grad (as recorded by the last stage).
        self.output_flags: List[Optional[Tuple[bool, ...]]] = [None] * self.microbatches
        #: The loss of each micro-batch, without graph (a Pipeline step): see :meth:`weighted_losses`.
        self.losses: List[Optional[Tensor]] = [None] * self.microbatches
        #: GPipe's backward: the gradients of stage 0's inputs, per micro-batch.
        self.input_grads: List[Optional[List[Optional[Tensor]]]] = [None] * self.microbatches
        #: GPipe: per stage, its parameters that require grad (inputs of the autograd function, in order).
        self.stage_params: List[List[Tensor]] = [[] for _ in runner.stages]
        #: GPipe's backward: per stage, which of its parameters' gradients the caller's backward needs, and
        #: their sums over micro-batches. None: a Pipeline step, whose backward accumulates into .grad.
        self.needed: Optional[List[List[bool]]] = None
        self.param_grads: Optional[List[List[Optional[Tensor]]]] = None
        #: GPipe's backward when a layer kept a tensor by hand under current_microbatch(): graphs of several
        #: stages may be joined, so gradients accumulate into .grad directly (see stage.backward).
        self.direct = False
        self.backward_done = False

    def seed_for(self, stage: int, microbatch: int) -> Optional[int]:
        """The seed of the random stream of ``stage``'s forward of ``microbatch`` (None: it draws nothing)."""
        if self.seed is None or not self.draws[stage]:
            return None
        return task_seed(self.seed, stage, microbatch)

    def weighted_losses(self) -> List[Tensor]:
        """The loss of each micro-batch this step computed, times its weight (see [Note: loss weights]): 0-dim
        tensors without graph, whose sum is the step's loss. Weighted once the step's actions are over: a
        micro-batch's multiplication and reshape sat between its forward and its backward, on the last stage
        where every micro-batch waits for them."""
        assert self.loss is not None, "a step without a loss has no losses"
        weighted = []
        for value, weight in zip(self.losses, self.loss.weights):
            if value is not None:
                product = value * weight
                weighted.append(product.reshape(()) if product.dim() else product)
        return weighted

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

    def accumulate(self, stage: int, sums: Sequence[Optional[Tensor]]) -> None:
        """Keeps the step's gradient sums of ``stage``'s parameters after one more micro-batch (GPipe), where the
        caller's backward needs them (see :func:`~torchpipe.runtime.boundary.own_gradients`)."""
        assert self.param_grads is not None and self.needed is not None
        self.param_grads[stage] = [total if needed else None for total, needed in zip(sums, self.needed[stage])]
