"""The runner: executes a schedule's actions for one mini-batch on the partitions' workers.

[Note: boundaries] Each partition's input for a micro-batch is a detached leaf
(requiring grad when the tensor it stands for does), and its output keeps its
graph, so every (partition, micro-batch) owns a small autograd graph cut at
the partition boundaries. Backward of partition j for micro-batch i is
``torch.autograd.backward(outputs, grads)`` on that graph, followed by reading
the leaf's ``.grad`` and handing it to partition j-1. This is what lets each
backward run as a task on its partition's worker (on CPU the autograd engine
runs a backward on the thread that calls it, so one big graph would run the
whole backward on one thread), makes checkpointing simple (a recomputation
runs the partition again on the same leaf), and is what a process-per-
partition runner needs.

[Note: backward threads] ``PipelineFunction.backward`` runs on the autograd
engine's thread for the output's device and waits for the workers. A worker's
backward of a CUDA graph is executed by that GPU's engine thread; if that is
the thread blocked in ``PipelineFunction.backward``, nothing moves. So the
actions of partitions on the output's CUDA device run inline, on the calling
thread, in the schedule's clock order; every other partition runs on its worker.

Tensors cross between actions through a :class:`Mailbox`: a worker waits there
for what its next action needs. If any action fails, the mailbox is aborted,
every waiting worker gives up, and the caller re-raises the first failure
with its own type and message.
"""
import contextlib
import functools
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Dict, FrozenSet, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch._C._autograd import _profiler_enabled
from torch.autograd.profiler import record_function

from torchpipe import microbatch, trace, transfer
from torchpipe.checkpoint import RNGGuard, RNGState
from torchpipe.context import MicroBatch, task_context
from torchpipe.microbatch import Batch
from torchpipe.schedule import Action, Kind, Schedule, clock_cycles, fill_drain, phase
from torchpipe.skip.layout import SkipLayout
from torchpipe.skip.namespace import Namespace
from torchpipe.skip.registry import SkipRegistry
from torchpipe.stream import (
    CPU_EVENT,
    AbstractEvent,
    AbstractStream,
    current_stream,
    new_stream,
    record_event,
    use_device,
    use_stream,
)
from torchpipe.worker import ThreadContext, WorkerGroup

__all__ = ["Pipeline", "Step", "PipelineFunction", "Aborted"]

FORWARD_PHASE = (Kind.FORWARD,)
BACKWARD_PHASE = (Kind.RECOMPUTE, Kind.BACKWARD)


class Aborted(Exception):
    """Raised in a task that waited for a tensor another, failed, task was to produce."""


class Mailbox:
    """Where the tasks of one step leave tensors for each other, keyed by what they are."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._slots: Dict[Hashable, Any] = {}
        self._aborted = False

    def put(self, key: Hashable, value: Any) -> None:
        with self._cond:
            self._slots[key] = value
            self._cond.notify_all()

    def take(self, key: Hashable) -> Any:
        with self._cond:
            while key not in self._slots:
                if self._aborted:
                    raise Aborted(f"another pipeline task failed while this one waited for {key}")
                self._cond.wait()
            return self._slots.pop(key)

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class Message(NamedTuple):
    """Tensors handed from one partition to another, with the event that marks their copy."""

    tensors: List[Optional[Tensor]]
    event: AbstractEvent
    requires_grad: Tuple[bool, ...]
    atomic: bool


class Boundary(torch.autograd.Function):
    """The input a partition sees: an alias of its leaves that is not a leaf itself.

    ::

        forward:   leaf ──► alias (same memory)       so an in-place first layer works,
        backward:  leaf.grad ◄── grad                  as on any intermediate tensor
    """

    @staticmethod
    def forward(ctx: Any, *leaves: Tensor) -> Tuple[Tensor, ...]:
        return tuple(leaf.detach() for leaf in leaves)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Tuple[Tensor, ...]:
        return grads


def _is_differentiable(tensor: Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _make_leaves(tensors: Sequence[Tensor], requires_grad: Sequence[bool]) -> Tuple[Tensor, ...]:
    return tuple(
        t.detach().requires_grad_(flag and _is_differentiable(t)) for t, flag in zip(tensors, requires_grad)
    )


def _alias(leaves: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
    """The partition's view of its leaves (see :class:`Boundary`); leaves without grad pass as they are."""
    needing = [k for k, leaf in enumerate(leaves) if leaf.requires_grad]
    if not needing:
        return leaves
    aliases = Boundary.apply(*(leaves[k] for k in needing))  # type: ignore[no-untyped-call]
    result = list(leaves)
    for k, alias in zip(needing, aliases):
        result[k] = alias
    return tuple(result)


class Plan(NamedTuple):
    """What the runner executes for one (micro-batch count, checkpoint stop): the schedule, cut into
    its two phases, and the order in which the caller's thread runs the inline partitions' actions.

    Pure data derived from the schedule; :meth:`Pipeline.plan` computes it once per shape.
    """

    schedule: Schedule
    forward: Schedule
    backward: Schedule
    #: Backward actions of the partitions that run on the caller's thread (see [Note: backward threads]).
    inline_order: Tuple[Action, ...]


class Step:
    """One mini-batch in the pipeline: its schedule and the state its forward keeps for its backward."""

    def __init__(
        self,
        pipeline: "Pipeline",
        batches: List[Batch],
        *,
        grad_enabled: bool,
        checkpoint_stop: int,
        training: bool,
    ) -> None:
        self.pipeline = pipeline
        self.batches: Optional[List[Batch]] = batches
        self.microbatches = len(batches)
        self.grad_enabled = grad_enabled
        self.context = ThreadContext.capture()
        self.checkpoint_stop = checkpoint_stop
        self.training = training
        self.plan = pipeline.plan(self.microbatches, checkpoint_stop)
        self.keys: List[Optional[MicroBatch]] = [MicroBatch(i) for i in range(self.microbatches)]
        self.mailbox = Mailbox()
        # (microbatch, partition) -> leaves, and the outputs (with graph) once there is one.
        self.leaves: Dict[Tuple[int, int], Tuple[Batch, Optional[RNGState]]] = {}
        self.outputs: Dict[Tuple[int, int], Batch] = {}
        self.results: List[Optional[Batch]] = [None] * self.microbatches
        self.input_grads: List[Optional[List[Optional[Tensor]]]] = [None] * self.microbatches
        self.streams: List[AbstractStream] = [current_stream(d) for d in pipeline.devices]
        self.backward_done = False
        self.skips = SkipRegistry()
        self.output_atomic = True


class Pipeline:
    """Runs steps over a fixed list of partitions, one worker thread per partition."""

    def __init__(self, owner: object, partitions: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
        # Weak: the owner (a GPipe) holds this pipeline; its workers stop when it is collected.
        self._owner = weakref.ref(owner)
        self.partitions = list(partitions)
        self.devices = list(devices)
        self.rng = RNGGuard()
        self._workers: Optional[WorkerGroup] = None
        self._copy_streams: Optional[List[AbstractStream]] = None
        self._lock = threading.Lock()
        self._phase_lock = threading.Lock()
        self._plans: Dict[Tuple[int, int], Plan] = {}
        out = self.devices[-1]
        #: [Note: backward threads] partitions whose backward runs on the caller's (engine) thread.
        self.inline: FrozenSet[int] = frozenset(
            j for j, d in enumerate(self.devices) if out.type == "cuda" and d == out
        )
        self.skip_layout: SkipLayout = SkipLayout({}, len(self.partitions))

    def __getstate__(self) -> Dict[str, Any]:
        # Copies (deepcopy, pickle) get their own workers, streams and locks.
        return {"owner": self._owner(), "partitions": self.partitions, "devices": self.devices,
                "skip_layout": self.skip_layout}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["owner"], state["partitions"], state["devices"])  # type: ignore[misc]
        self.skip_layout = state["skip_layout"]

    def plan(self, microbatches: int, checkpoint_stop: int) -> Plan:
        """The :class:`Plan` for a step of this shape (computed on first use, then reused)."""
        key = (microbatches, checkpoint_stop)
        plan = self._plans.get(key)
        if plan is None:
            schedule = fill_drain(microbatches, len(self.partitions), checkpoint_stop)
            backward = phase(schedule, BACKWARD_PHASE)
            order = tuple(a for cycle in clock_cycles(backward) for a in cycle if a.partition in self.inline)
            plan = self._plans[key] = Plan(schedule, phase(schedule, FORWARD_PHASE), backward, order)
        return plan

    # --- resources, created on first use so that the caller's thread settings apply -----------

    def workers(self) -> WorkerGroup:
        with self._lock:
            if self._workers is None:
                owner = self._owner()
                if owner is None:
                    raise RuntimeError("the GPipe that owns this pipeline was garbage collected")
                self._workers = WorkerGroup(owner, self.devices, "partition")
            return self._workers

    def copy_streams(self) -> List[AbstractStream]:
        if self._copy_streams is None:
            self._copy_streams = [new_stream(d) for d in self.devices]
        return self._copy_streams

    # --- phases ----------------------------------------------------------------------------------

    def run_forward(self, step: Step) -> List[Batch]:
        """Runs every forward action of ``step``; returns the last partition's output per micro-batch."""
        self._run_phase(step, step.plan.forward, inline=frozenset(), inline_order=())
        step.batches = None
        if not step.grad_enabled:
            step.keys = [None] * step.microbatches
        results = step.results
        step.results = [None] * step.microbatches
        assert all(r is not None for r in results), "a micro-batch produced no output"
        batches = [r for r in results if r is not None]
        step.output_atomic = batches[0].atomic
        return batches

    def run_backward(self, step: Step, grads: Sequence[List[Optional[Tensor]]]) -> List[List[Optional[Tensor]]]:
        """Runs every recompute and backward action, given each micro-batch's output gradients.

        Returns the gradient of each micro-batch's input tensors (None where
        the input does not require grad).
        """
        last = len(self.partitions) - 1
        event = record_event(step.streams[last])
        for i, grad in enumerate(grads):
            step.mailbox.put(("grad", i, last), Message(list(grad), event, (), False))
        self._run_phase(step, step.plan.backward, inline=self.inline, inline_order=step.plan.inline_order)
        grads_in = step.input_grads
        step.input_grads = [None] * step.microbatches
        assert all(g is not None for g in grads_in), "a micro-batch's backward did not finish"
        return [g for g in grads_in if g is not None]

    def _run_phase(
        self, step: Step, schedule: Schedule, inline: FrozenSet[int], inline_order: Sequence[Action]
    ) -> None:
        # One phase at a time per pipeline: two threads driving the same GPipe would otherwise
        # interleave their action lists on the shared workers, and could wait on each other.
        with self._phase_lock:
            self._run_phase_locked(step, schedule, inline, inline_order)

    def _run_phase_locked(
        self, step: Step, schedule: Schedule, inline: FrozenSet[int], inline_order: Sequence[Action]
    ) -> None:
        futures: List[Future[None]] = []
        errors: List[BaseException] = []
        try:
            workers = self.workers() if len(inline) < len(schedule) else None
            for j, actions in enumerate(schedule):
                if actions and j not in inline:
                    assert workers is not None
                    futures.append(workers[j].submit(functools.partial(self._run_actions, step, actions)))
            if inline:
                try:
                    self._run_actions(step, inline_order)
                except BaseException as exc:  # noqa: B036 - re-raised below, after the workers stop
                    errors.append(exc)
            wait_futures(futures)
        except BaseException:
            # Interrupted while waiting (KeyboardInterrupt, say): let no worker wait forever.
            step.mailbox.abort()
            raise
        for future in futures:
            error = future.exception()
            if error is not None:
                errors.append(error)
        root = next((e for e in errors if not isinstance(e, Aborted)), errors[0] if errors else None)
        if root is not None:
            raise root

    def _run_actions(self, step: Step, actions: Sequence[Action]) -> None:
        try:
            for action in actions:
                self._execute(step, action)
        except BaseException:
            step.mailbox.abort()
            raise

    # --- actions ---------------------------------------------------------------------------------

    def _execute(self, step: Step, action: Action) -> None:
        j, kind = action.partition, action.kind
        # Forward and recomputation run in the caller's grad / inference / autocast state (thread-local
        # in PyTorch, so captured on the caller's thread); a recomputation always with grad.
        context = step.context.entered(grad_enabled=True) if kind is Kind.RECOMPUTE else step.context.entered()
        # record_function costs microseconds even with no profiler: label the task only when one runs.
        profiled = (
            record_function(f"torchpipe/part{j}/mb{action.microbatch}/{_LABELS[kind]}")
            if _profiler_enabled()
            else _NOT_PROFILED
        )
        with use_device(self.devices[j]), use_stream(step.streams[j]), profiled, trace.span(
            _LABELS[kind], j, action.microbatch
        ):
            if kind is Kind.FORWARD:
                with context:
                    self._forward(step, action.microbatch, j)
            elif kind is Kind.RECOMPUTE:
                with context:
                    self._recompute(step, action.microbatch, j)
            else:
                self._backward(step, action.microbatch, j)

    def _receive(self, step: Step, key: Hashable, j: int) -> Message:
        message: Message = step.mailbox.take(key)
        tensors = transfer.receive(message.tensors, message.event, step.streams[j])
        return message._replace(tensors=tensors)

    def _send(
        self, step: Step, kind: str, key: Hashable, i: int, j: int, target: int, batch: Message,
        name: Optional[str] = None,
    ) -> None:
        """Hands ``batch`` from partition ``j`` to partition ``target``, which takes it by ``key``."""
        # A real copy (between devices) is a task of its own on the timeline; on CUDA it shows the
        # time to queue the copy, which then runs on the copy streams.
        copying = trace.span("copy", j, i) if self.devices[target] != self.devices[j] else _NOT_PROFILED
        with copying:
            tensors, event = transfer.send(
                batch.tensors,
                self.devices[target],
                source_stream=step.streams[j],
                source_copy_stream=self.copy_streams()[j],
                target_copy_stream=self.copy_streams()[target],
            )
        transfer.log_transfer(kind, j, target, i, tensors, self.devices[target], name)
        step.mailbox.put(key, batch._replace(tensors=tensors, event=event))

    def _forward(self, step: Step, i: int, j: int) -> None:
        if j == 0:
            assert step.batches is not None
            batch = step.batches[i]
            tensors: Sequence[Tensor] = batch.values
            flags = tuple(t.requires_grad for t in tensors)
            atomic = batch.atomic
        else:
            message = self._receive(step, ("act", i, j), j)
            trace.mark_start()  # the timeline shows the work, not the wait for the input
            tensors = [t for t in message.tensors if t is not None]
            flags, atomic = message.requires_grad, message.atomic
        leaves = _make_leaves(tensors, [f and step.grad_enabled for f in flags])
        partition = self.partitions[j]
        checkpointed = i < step.checkpoint_stop
        key = step.keys[i]
        with self.rng.first_forward(
            j, self.devices[j], step.training, step.checkpoint_stop > 0, save=checkpointed
        ) as rng_state:
            skips = self._tracker(step, i, j, checkpointing=checkpointed, recomputing=False)
            if checkpointed:
                with torch.no_grad(), task_context(key, checkpointing=True, skips=skips):
                    output = partition(Batch.of(leaves, atomic).value)
            else:
                with task_context(key, skips=skips):
                    output = partition(Batch.of(_alias(leaves), atomic).value)
        out = self._as_batch(output, j)
        if step.grad_enabled:
            step.leaves[(i, j)] = (Batch.of(leaves, atomic), rng_state)
            if not checkpointed:
                step.outputs[(i, j)] = out
        if checkpointed:
            # Computed without grad: whether an output will need one is known only at recomputation,
            # after the next partition has run, so every differentiable output is taken to need one.
            flags = tuple(_is_differentiable(t) for t in out.values)
        else:
            flags = tuple(t.requires_grad for t in out.values)
        trace.mark_end()
        self._pass_on(step, i, j, out, flags)

    def _recompute(self, step: Step, i: int, j: int) -> None:
        leaves, rng_state = step.leaves[(i, j)]
        assert rng_state is not None, f"{j}R{i} has no saved RNG state"
        with self.rng.recompute(j, self.devices[j], step.training, rng_state):
            skips = self._tracker(step, i, j, checkpointing=False, recomputing=True)
            with torch.enable_grad(), task_context(step.keys[i], recomputing=True, skips=skips):
                output = self.partitions[j](Batch.of(_alias(leaves.values), leaves.atomic).value)
        step.outputs[(i, j)] = self._as_batch(output, j)

    def _backward(self, step: Step, i: int, j: int) -> None:
        message = self._receive(step, ("grad", i, j), j)
        trace.mark_start()
        leaves, _ = step.leaves.pop((i, j))
        out = step.outputs.pop((i, j))
        roots, grads = [], []
        for tensor, grad in zip(out.values, message.tensors):
            if grad is not None and tensor.requires_grad:
                roots.append(tensor)
                grads.append(grad)
        layout = self.skip_layout
        if layout:
            # [Note: skips] The tensors this partition stashed for later partitions join its backward,
            # with the gradients their popping partitions (whose backward already ran) sent back.
            for ns, name in layout.stashes_for_later[j]:
                skip_grad = self._receive(step, ("skip-grad", i, ns, name), j).tensors[0]
                stashed = step.skips.stashed.pop((i, ns, name), None)
                if stashed is not None and skip_grad is not None and stashed.requires_grad:
                    roots.append(stashed)
                    grads.append(skip_grad)
        if roots:
            # A tensor a layer kept by hand under current_microbatch() (the user guide's skip dict)
            # may join this graph to an earlier partition's, whose own backward then runs through
            # the same nodes again: keep the graph then. Otherwise free it as backward goes, as
            # the plain module does.
            key = step.keys[i]
            torch.autograd.backward(roots, grads, retain_graph=key is not None and key.observed)
        del roots, grads, out
        trace.mark_end()
        if layout:
            for ns, name in layout.pops_from_before[j]:
                leaf = step.skips.popped.pop((i, ns, name), None)
                skip_grad = leaf.grad if leaf is not None and leaf.requires_grad else None
                target = layout.route(ns, name).stash
                self._send(
                    step, "skip-gradient", ("skip-grad", i, ns, name), i, j, target,
                    Message([skip_grad], CPU_EVENT, (), True), name,
                )
        input_grads: List[Optional[Tensor]] = [leaf.grad if leaf.requires_grad else None for leaf in leaves.values]
        if j > 0:
            self._send(step, "gradient", ("grad", i, j - 1), i, j, j - 1, Message(input_grads, CPU_EVENT, (), False))
        else:
            step.input_grads[i] = input_grads
            step.keys[i] = None  # the micro-batch's backward is over: release its identity

    def _tracker(
        self, step: Step, i: int, j: int, *, checkpointing: bool, recomputing: bool
    ) -> Optional["SkipTracker"]:
        if not self.skip_layout:
            return None
        return SkipTracker(self, step, i, j, checkpointing=checkpointing, recomputing=recomputing)

    def _as_batch(self, output: Any, j: int) -> Batch:
        if not isinstance(output, Tensor):
            microbatch.check_input(output, f"the output of partition {j} (layers {self._layer_names(j)})")
        return Batch(output)

    def _layer_names(self, j: int) -> str:
        names = list(self.partitions[j]._modules)
        return f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0]

    def _pass_on(self, step: Step, i: int, j: int, out: Batch, flags: Tuple[bool, ...]) -> None:
        detached: List[Optional[Tensor]] = [t.detach() for t in out.values]
        if j + 1 < len(self.partitions):
            message = Message(detached, CPU_EVENT, flags, out.atomic)
            self._send(step, "activation", ("act", i, j + 1), i, j, j + 1, message)
        else:
            device = self.devices[-1]
            values = [transfer.move(t, device) for t in detached if t is not None]
            step.results[i] = Batch.of(values, out.atomic)


_NOT_PROFILED = contextlib.nullcontext()

_LABELS = {Kind.FORWARD: "forward", Kind.RECOMPUTE: "recompute", Kind.BACKWARD: "backward"}


class SkipTracker:
    """Serves the stash and pop requests of skippable layers in one (micro-batch, partition) task.

    [Note: skips] A skip whose two ends are in the same partition stays in the
    registry's ``local`` table. Otherwise the stashed tensor crosses from the
    stashing partition a straight to the popping partition b, where it becomes
    a leaf (like a partition input); after b's backward the leaf's grad goes
    back to a, whose backward includes the stashed tensor with that grad.
    A recomputation of a re-stashes (the registry keeps the new tensor, with
    its graph; nothing is sent again); a recomputation of b pops the same leaf.
    """

    def __init__(
        self, pipeline: "Pipeline", step: Step, i: int, j: int, *, checkpointing: bool, recomputing: bool
    ) -> None:
        self.pipeline = pipeline
        self.step = step
        self.i = i
        self.j = j
        self.checkpointing = checkpointing
        self.recomputing = recomputing

    def save(self, layer: Any, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        pipeline, step, i, j = self.pipeline, self.step, self.i, self.j
        route = pipeline.skip_layout.route(ns, name)
        key = (i, ns, name)
        if route.pop == j:
            step.skips.local[key] = tensor
            return
        if step.grad_enabled:
            step.skips.stashed[key] = tensor
        if self.recomputing:
            return
        if tensor is None:
            message = Message([None], CPU_EVENT, (False,), True)
        else:
            needs_grad = _is_differentiable(tensor) if self.checkpointing else tensor.requires_grad
            message = Message([tensor.detach()], CPU_EVENT, (needs_grad,), True)
        pipeline._send(step, "skip", ("skip", i, ns, name), i, j, route.pop, message, name)

    def load(self, layer: Any, ns: Namespace, name: str) -> Optional[Tensor]:
        pipeline, step, i, j = self.pipeline, self.step, self.i, self.j
        route = pipeline.skip_layout.route(ns, name)
        key = (i, ns, name)
        if route.stash == j:
            try:
                return step.skips.local.pop(key)
            except KeyError:
                raise RuntimeError(
                    f"{type(layer).__name__} popped {name!r} ({ns}) before any layer stashed it"
                ) from None
        leaf: Optional[Tensor]
        if self.recomputing:
            leaf = step.skips.popped.get(key)
        else:
            message = pipeline._receive(step, ("skip", i, ns, name), j)
            tensor = message.tensors[0]
            leaf = None
            if tensor is not None:
                (leaf,) = _make_leaves([tensor], [message.requires_grad[0] and step.grad_enabled])
            if step.grad_enabled:
                step.skips.popped[key] = leaf
        if leaf is not None and torch.is_grad_enabled() and leaf.requires_grad:
            return _alias((leaf,))[0]
        return leaf


def _split_grads(
    grads: Sequence[Optional[Tensor]], sizes: List[List[Optional[int]]]
) -> List[List[Optional[Tensor]]]:
    """Cuts each output gradient into the micro-batches its output was joined from."""
    per_microbatch: List[List[Optional[Tensor]]] = [[] for _ in sizes]
    for k, grad in enumerate(grads):
        if grad is None:
            for part in per_microbatch:
                part.append(None)
            continue
        if sizes[0][k] is None:
            pieces: Sequence[Tensor] = list(grad.unbind(0))
        else:
            pieces = torch.split(grad, [s[k] or 0 for s in sizes], 0)
        for part, piece in zip(per_microbatch, pieces):
            part.append(piece)
    return per_microbatch


class PipelineFunction(torch.autograd.Function):
    """Ties a pipelined step into the caller's autograd graph.

    ::

        forward:   inputs ──► [workers run every F action] ──► outputs
        backward:  input grads ◄── [workers run every R and B action] ◄── output grads

    ``phony`` is an empty tensor that requires grad, so the outputs require
    grad even when the inputs do not (the parameters, inside the partitions,
    are not inputs of this function).
    """

    @staticmethod
    def forward(ctx: Any, step: Step, phony: Tensor, *inputs: Tensor) -> Tuple[Tensor, ...]:
        results = step.pipeline.run_forward(step)
        joined = microbatch.gather(results)
        outputs = (joined,) if isinstance(joined, Tensor) else tuple(joined)
        ctx.step = step
        # How each output splits back into micro-batches (None: a 0-dim output per micro-batch, stacked).
        ctx.output_sizes = [[t.size(0) if t.dim() > 0 else None for t in r.values] for r in results]
        ctx.input_meta = [(t.shape, t.dtype, t.device, t.requires_grad) for t in inputs]
        ctx.mark_non_differentiable(*(o for o in outputs if not _is_differentiable(o)))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        step: Optional[Step] = ctx.step
        ctx.step = None
        if step is None or step.backward_done:
            raise RuntimeError(
                "GPipe's backward ran twice for one forward; run the forward again "
                "(retain_graph=True is not supported through a GPipe)"
            )
        step.backward_done = True
        per_microbatch = _split_grads(grad_outputs, ctx.output_sizes)
        input_grads = step.pipeline.run_backward(step, per_microbatch)
        joined: List[Optional[Tensor]] = []
        for k, (shape, dtype, device, requires_grad) in enumerate(ctx.input_meta):
            parts = [g[k] for g in input_grads]
            if not requires_grad or all(p is None for p in parts):
                joined.append(None)
                continue
            chunks = torch.empty(shape, device="meta").chunk(step.microbatches)
            filled = [
                p if p is not None else torch.zeros(c.shape, dtype=dtype, device=device) for p, c in zip(parts, chunks)
            ]
            joined.append(torch.cat(filled) if len(filled) > 1 else filled[0])
        return (None, None, *joined)
