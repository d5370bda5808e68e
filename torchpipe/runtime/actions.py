"""The work of one action: a stage's forward, recomputation, backward, or half backward of one micro-batch.

Each function takes the step and the (stage, micro-batch) and does what the
action's letter says, receiving what it needs and sending what it makes
through the step's transport:

- ``F`` :func:`forward`: the stage's input (from the step's micro-batch on
  stage 0, else from the previous stage) becomes leaves; the stage runs,
  under ``no_grad`` when checkpointed (keeping a copy of its input), else
  with grad (keeping its graph); the output goes to the next stage, or, on the
  last stage, becomes the micro-batch's result or loss.
- ``R`` :func:`recompute`: the checkpointed forward again, with grad, on the
  same random stream.
- ``B`` :func:`backward`: the backward of the stage's graph given the output's
  gradient; the input's gradient goes to the previous stage.
- ``I`` :func:`backward_input` and ``W`` :func:`backward_weight`: the same,
  split (see [Note: zero-bubble]).
"""
import contextlib
import time
from typing import ContextManager, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch._C._autograd import _profiler_enabled
from torch.autograd.profiler import record_function

from torchpipe import microbatch, trace
from torchpipe.context import task_context
from torchpipe.microbatch import Batch
from torchpipe.recompute import Selective, discarding, mutated
from torchpipe.rng import streams
from torchpipe.runtime.boundary import alias, copy_leaf, is_differentiable, make_leaves, own_gradients, own_version
from torchpipe.runtime.held import Holding, kept_tensors, measuring_time
from torchpipe.runtime.skips import StageSkips, received_skips, stashed_roots
from torchpipe.runtime.step import StageState, Step
from torchpipe.runtime.transport import Edge, EdgeKind, Message
from torchpipe.runtime.weight_grad import backward_input as split_input
from torchpipe.runtime.weight_grad import backward_weight as split_weight
from torchpipe.schedule import Action, Kind
from torchpipe.stream import use_device, use_stream

__all__ = ["run", "forward", "recompute", "backward", "backward_input", "backward_weight"]

_NOT_PROFILED = contextlib.nullcontext()
#: What a forward counts its saved tensors under when nothing is measured (one, reused: see :func:`_counting`).
_NOTHING = contextlib.nullcontext()

#: The actions that run a backward (a forward or recomputation computes its loss under its own context).
_BACKWARDS = (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)


def run(step: Step, action: Action) -> None:
    """Runs ``action`` of ``step`` on the calling thread, under its device, stream and labels."""
    context = step.stages.action_context
    if context is not None:
        with context():
            _run_with_loss(step, action)
        return
    _run_with_loss(step, action)


def _run_with_loss(step: Step, action: Action) -> None:
    s, kind = action.stage, action.kind
    if step.loss is not None and step.loss.parallel and kind in _BACKWARDS and s + 1 == step.stages.count:
        with step.loss.backward_context():  # a loss_parallel() loss: its backward too
            _run(step, action)
        return
    _run(step, action)


def _run(step: Step, action: Action) -> None:
    s, i, kind = action.stage, action.microbatch, action.kind
    recording = step.timings is not None or trace.active() or _profiler_enabled()
    if not recording and step.stages.devices[s].type != "cuda":
        # On CPU with nothing recording, nothing to enter: four do-nothing contexts and a label less, a share of
        # a tiny model's step worth saving.
        _ACTIONS[kind](step, action)
        return
    label = kind.label
    # record_function costs microseconds even with no profiler: label the action only when one runs.
    profiled = record_function(f"torchpipe/part{s}/mb{i}/{label}") if _profiler_enabled() else _NOT_PROFILED
    with use_device(step.stages.devices[s]), use_stream(step.streams[s]), profiled, trace.span(label, s, i):
        if step.timings is None:
            _ACTIONS[kind](step, action)
        else:  # see [Note: zero-bubble split]: this thread's CPU time, not the wait for messages
            began, started, measuring = time.perf_counter(), time.thread_time(), measuring_time()
            _ACTIONS[kind](step, action)
            # Less what counting a backward's temporaries took (see [Note: held bytes]): not the action's cost.
            spent = time.thread_time() - started - (measuring_time() - measuring)
            step.timings.setdefault((s, kind), []).append(max(spent, 0.0))
            step.timings.spans.append((began, time.perf_counter()))


# --- forward and recomputation ----------------------------------------------------------------------------


def forward(step: Step, action: Action) -> None:
    """``sFi``: the first forward of stage ``s`` for micro-batch ``i``."""
    s, i = action.stage, action.microbatch
    stages = step.stages
    if s == 0:
        assert step.batches is not None, "the step's input was released before its forwards ran"
        batch = step.batches[i]
        assert batch is not None, f"micro-batch {i}'s input is not on this rank"
        tensors: Sequence[Tensor] = batch.values
        flags: Tuple[bool, ...] = tuple(t.requires_grad for t in tensors)
        atomic = batch.atomic
    else:
        message = step.transport.recv(Edge(EdgeKind.ACTIVATION, i, s - 1, s))
        trace.mark_start()  # the timeline shows the work, not the wait for the input
        tensors = [t for t in message.tensors if t is not None]
        flags, atomic = message.requires_grad, message.atomic
    given = tensors
    if s == 0 and not step.bare_leaves[0]:
        # See own_version: micro-batches share no version counter. Needless where nothing changes them in place.
        tensors = [own_version(t) for t in tensors]
    leaves = make_leaves(tensors, [f and step.grad_enabled for f in flags])
    # Checkpoint only what a backward will need: with nothing requiring grad there is no graph to save, and
    # the forward runs with grad so that the output requires grad exactly when the plain module's would.
    checkpointed = i < step.checkpoint_stop and (
        step.trainable[s] or any(leaf.requires_grad for leaf in leaves)
    )
    skips = StageSkips(step, s, i, checkpointing=checkpointed, recomputing=False) if stages.skip_layout else None
    holding = step.memory.holding(s, stages.modules[s]) if step.memory is not None and step.grad_enabled else None
    with step.context.entered(), streams(step.seed_for(s, i)):
        if checkpointed:
            # The copy is what the recomputation starts from: a first layer that works in place changes
            # the tensors it is given, not the copy.
            saved = Batch.of([copy_leaf(leaf) for leaf in leaves], atomic)
            selective = Selective(stages.recompute) if stages.recompute is not None else None
            if selective is None:
                with torch.no_grad(), task_context(step.keys[i], checkpointing=True, skips=skips):
                    out, loss = _run_stage(step, s, i, Batch.of(leaves, atomic))
            else:  # with grad, as its recomputation runs (see [Note: selective recomputation]), keeping no graph
                with discarding(), task_context(step.keys[i], checkpointing=True, skips=skips), selective.first:
                    out, loss = _run_stage(step, s, i, Batch.of(_stage_input(step, s, leaves), atomic))
        else:
            saved = Batch.of(leaves, atomic)
            with task_context(step.keys[i], skips=skips), _counting(holding):
                out, loss = _run_stage(step, s, i, Batch.of(_stage_input(step, s, leaves), atomic))
    if step.grad_enabled:
        state = step.states[(s, i)] = StageState(saved)
        if checkpointed:
            state.selective = selective
        else:
            state.outputs = out if loss is None else Batch(loss)
        if holding is not None and step.memory is not None:  # see [Note: held bytes]
            holding.add(saved.values)
            holding.add(state.outputs.values if state.outputs is not None else ())
            holding.add(kept_tensors(state.selective) if state.selective is not None else ())
            step.memory.forwards[(s, i)] = holding
        if s == 0 and step.watch_inputs:
            # The caller's tensors, whose in-place change before the backward the plain module would detect
            # (their versions are read when the forward phase is over: see Runner.run_forward).
            state.versions = [(t, t._version) for t in given]
    if checkpointed:
        # Computed without grad: whether an output will need one is known only at recomputation, so every
        # differentiable output is taken to need one.
        out_flags = tuple(is_differentiable(t) for t in out.values)
    else:
        out_flags = tuple(t.requires_grad for t in out.values)
    trace.mark_end()
    stashed: List[Tensor] = []
    for edge in step.plan.sends[action]:  # the skips stashed for later stages, then the output
        if edge.kind is EdgeKind.SKIP:
            assert skips is not None and edge.skip is not None
            message = skips.message(*edge.skip)
            stashed += [t for t in message.tensors if t is not None]
            step.transport.send(edge, message)
        else:
            step.transport.send(edge, Message([t.detach() for t in out.values], out_flags, out.atomic))
            key = step.keys[i]
            if step.grad_enabled and not checkpointed and not (key is not None and key.observed):
                # Only the graph is needed until the backward (see [Note: released outputs]).
                step.transport.release(edge, out.values, stashed)
    if s + 1 < stages.count:
        return
    if loss is not None:
        assert step.loss is not None, "a loss is computed only in a step with one"
        step.loss.values[i] = loss.detach()  # weighted as the step ends (Loss.weighted), off the way
    else:
        step.results[i] = Batch.of([t.detach() for t in out.values], out.atomic)
        step.output_flags[i] = None if checkpointed else out_flags


def recompute(step: Step, action: Action) -> None:
    """``sRi``: the forward of a checkpointed micro-batch again, with grad, just before its backward."""
    s, i = action.stage, action.microbatch
    state = step.states[(s, i)]
    _check_input_versions(state, i)
    stages = step.stages
    skips = StageSkips(step, s, i, checkpointing=False, recomputing=True) if stages.skip_layout else None
    with step.context.entered(grad_enabled=True), streams(step.seed_for(s, i)):
        with task_context(step.keys[i], recomputing=True, skips=skips):
            inputs = Batch.of(_stage_input(step, s, state.leaves.values), state.leaves.atomic)
            selective, state.selective = state.selective, None  # what it kept goes with the recomputation
            holding = step.memory.holding(s, stages.modules[s]) if step.memory is not None else None
            if selective is None:
                with _counting(holding):
                    out, loss = _run_stage(step, s, i, inputs)
            else:
                try:
                    with selective.again, _counting(holding):
                        out, loss = _run_stage(step, s, i, inputs)
                except RuntimeError as error:
                    if not mutated(error):
                        raise
                    raise RuntimeError(
                        f"{stages.noun} {s} (layers {stages.layer_names(s)}) changed in place an output that "
                        "selective recomputation keeps (a matrix multiplication's, say, followed by "
                        "nn.ReLU(inplace=True)), so its recomputation cannot take it back; make that layer work "
                        "out of place, or use recompute='full'"
                    ) from error
    state.outputs = out if loss is None else Batch(loss)
    if holding is not None and step.memory is not None:
        holding.add(state.outputs.values)
        step.memory.recomputations[(s, i)] = holding


def _counting(holding: Optional[Holding]) -> ContextManager[object]:
    """What autograd saves, counted into ``holding`` (nothing counted without one)."""
    return holding.hooks() if holding is not None else _NOTHING


def _check_input_versions(state: StageState, i: int) -> None:
    """Raises as autograd would if the caller changed micro-batch ``i``'s input in place since the forward."""
    if state.versions is None:
        return
    for tensor, version in state.versions:
        if tensor._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: the input of micro-batch {i} (a {tensor.dtype} tensor of shape {tuple(tensor.shape)}) "
                f"is at version {tensor._version}; expected version {version} instead. The backward of a GPipe "
                "needs its input as it was in the forward: do not modify it in place in between."
            )
    state.versions = None


def _run_stage(step: Step, s: int, i: int, inputs: Batch) -> Tuple[Batch, Optional[Tensor]]:
    """Runs stage ``s`` on ``inputs``; on the last stage of a step with a loss, also the micro-batch's loss."""
    stages = step.stages
    module = stages.modules[s]
    assert module is not None, f"stage {s} is not on this rank"
    output = module(inputs.value)
    if not isinstance(output, Tensor):
        microbatch.check_input(output, f"the output of {stages.noun} {s} (layers {stages.layer_names(s)})")
    out = Batch(output)
    if step.loss is None or s + 1 < stages.count:
        return out, None
    loss = step.loss.compute(i, output)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        source = "loss_fn" if step.loss.fn is not None else "the module (with loss_fn=None its output is the loss)"
        raise ValueError(f"{source} must return a single-element tensor, got {what}")
    return out, loss  # unweighted: see [Note: loss weights]


def _stage_input(step: Step, s: int, leaves: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
    """What stage ``s`` runs on: an alias of its leaves, so that it may change them in place, or the leaves
    themselves where nothing in the stage can (see :func:`~torchpipe.runtime.boundary.takes_leaves`)."""
    return leaves if step.bare_leaves[s] else alias(leaves)


# --- backward -----------------------------------------------------------------------------------------


def _output_roots(step: Step, s: int, i: int, state: StageState) -> Tuple[List[Tensor], List[Tensor]]:
    """The stage's outputs (or loss) that join its backward, with their gradients; then its stashed skips'."""
    assert state.outputs is not None, f"{s}B{i} has no graph: its forward ran without grad or was not recomputed"
    if step.loss is not None and s + 1 == step.stages.count:
        # [Note: loss weights] The step's loss is the sum of the micro-batches' losses, each times its weight
        # (1/8 of a mean over 8 equal micro-batches, 1 for a sum). The weight is the gradient the backward
        # starts from, not a multiplication in the graph: the same bits reach the loss's backward (the
        # gradient of ``loss * w`` by ``loss`` is ``1 * w``, rounded to the loss's dtype once either way)
        # for two operations and their two backward nodes less per micro-batch. The loss told to the caller
        # is ``loss * w`` as before, computed without graph. The gradient is also scaled by the step's
        # ``loss_scale``, and a micro-batch of weight 0 starts no backward (see [Note: token weights]).
        (loss,) = state.outputs.values
        gradient = step.loss.gradient(i)
        started = loss.requires_grad and step.loss.weight(i) != 0
        roots, grads = ([loss], [torch.full_like(loss, gradient)]) if started else ([], [])
    else:
        source = s + 1  # the stage after it, or (after the last) the caller
        message = step.transport.recv(Edge(EdgeKind.GRADIENT, i, source, s))
        roots, grads = [], []
        for tensor, grad in zip(state.outputs.values, message.tensors):
            if grad is not None and tensor.requires_grad:
                roots.append(tensor)
                grads.append(grad)
    trace.mark_start()
    if step.stages.skip_layout:
        skip_roots, skip_grads = stashed_roots(step, s, i)
        roots += skip_roots
        grads += skip_grads
    return roots, grads


def _hand_back(
    step: Step, action: Action, input_grads: List[Optional[Tensor]], skip_grads: List[Optional[Tensor]]
) -> None:
    """Sends the gradients of the popped skips back to their stashing stages, then of the stage's inputs to the
    previous stage (in the one order, :func:`~torchpipe.runtime.transport.sends`)."""
    trace.mark_end()
    popped = iter(skip_grads)  # in the layout's order, as the edges
    for edge in step.plan.sends[action]:
        if edge.kind is EdgeKind.SKIP_GRADIENT:
            step.transport.send(edge, Message([next(popped)]))
        else:
            step.transport.send(edge, Message(input_grads))
    if action.stage == 0:
        step.input_grads[action.microbatch] = input_grads
        step.keys[action.microbatch] = None  # the micro-batch's backward is over: release its identity


def _inputs(step: Step, s: int, i: int, state: StageState) -> Tuple[List[Tensor], List[Optional[Tensor]]]:
    """The leaves whose gradients the stage hands back (its inputs, then the skips it popped), and the popped
    skips' leaves in the layout's order (None where nothing was received)."""
    popped = received_skips(step, s, i) if step.stages.skip_layout else []
    return list(state.leaves.values) + [p for p in popped if p is not None], popped


def _split(
    grads: Sequence[Optional[Tensor]], count: int, popped: List[Optional[Tensor]]
) -> Tuple[List[Optional[Tensor]], List[Optional[Tensor]]]:
    """Cuts the gradients of ``_inputs`` back into the inputs' and the popped skips' (None: not received)."""
    rest = iter(grads[count:])
    return list(grads[:count]), [next(rest) if p is not None else None for p in popped]


def backward(step: Step, action: Action) -> None:
    """``sBi``: the backward of stage ``s``'s graph for micro-batch ``i``."""
    s, i = action.stage, action.microbatch
    if step.memory is not None:
        step.memory.finish(s, i)
    state = step.states.pop((s, i))
    _check_input_versions(state, i)
    roots, grads = _output_roots(step, s, i, state)
    inputs, popped = _inputs(step, s, i, state)
    count = len(state.leaves.values)
    # A tensor a layer kept by hand under current_microbatch() (the user guide's skip dict) may join this
    # graph to an earlier stage's, whose own backward then runs through the same nodes again: keep the graph
    # then. Otherwise free it as the backward goes, as the plain module does.
    key = step.keys[i]
    keep = key is not None and key.observed
    if step.memory is not None:
        step.memory.watch(s, i, roots, grads)
    try:
        found = _run_backward(step, s, roots, grads, inputs, keep)
    finally:
        if step.memory is not None:
            step.memory.settle(s, i)
    del roots, grads, state
    input_grads, skip_grads = _split(found, count, popped)
    _hand_back(step, action, input_grads, skip_grads)


def _run_backward(step: Step, s: int, roots: List[Tensor], grads: List[Tensor], inputs: List[Tensor],
                  keep: bool) -> List[Optional[Tensor]]:
    """A whole backward of stage ``s``'s graph from ``roots``: the gradients of ``inputs`` (None where none)."""
    found: List[Optional[Tensor]]
    if not roots:
        found = [None] * len(inputs)
    elif step.param_grads is None or step.param_grads.needed is None or step.param_grads.direct:
        # A Pipeline step: gradients accumulate into .grad, as loss.backward() on the plain module would (and a
        # GPipe step's that may not set them aside: [Note: joined graphs], [Note: gradient lease]).
        torch.autograd.backward(roots, grads, retain_graph=keep)
        found = [x.grad if x.requires_grad else None for x in inputs]
    elif any(step.param_grads.params) and not any(any(needed) for needed in step.param_grads.needed):
        # The caller asked for no parameter's gradient (torch.autograd.grad(output, input)): touch no .grad.
        wanted = [x for x in inputs if x.requires_grad]
        got = iter(torch.autograd.grad(roots, wanted, grads, allow_unused=True, retain_graph=keep) if wanted else ())
        found = [next(got) if x.requires_grad else None for x in inputs]
    else:
        # GPipe: the module's parameters' gradients go to the caller (see [Note: parameter gradients]); a
        # tensor a layer uses from outside the module gets its gradient in .grad, as without GPipe.
        kept = step.param_grads
        assert kept.sums is not None
        with own_gradients(kept.params[s], kept.sums[s], step.stages.shared_locks[s]) as sums:
            torch.autograd.backward(roots, grads, retain_graph=keep)
        kept.accumulate(s, sums)
        found = [x.grad if x.requires_grad else None for x in inputs]
    return found


def backward_input(step: Step, action: Action) -> None:
    """``sIi``: the gradients of stage ``s``'s inputs (and popped skips) for micro-batch ``i``; graph kept."""
    s, i = action.stage, action.microbatch
    if step.memory is not None:
        step.memory.finish(s, i)
    state = step.states[(s, i)]
    roots, grads = _output_roots(step, s, i, state)
    inputs, popped = _inputs(step, s, i, state)
    if step.memory is not None:
        step.memory.watch(s, i, roots, grads)  # until its W (settled there)
    try:
        found, state.weight = split_input(roots, grads, inputs)
    except BaseException:
        if step.memory is not None:
            step.memory.settle(s, i)
        raise
    if step.memory is not None and state.weight is not None:
        step.memory.defer(s, i, state.weight.seeds())
    state.outputs = None  # the graph lives on in what W needs
    input_grads, skip_grads = _split(found, len(state.leaves.values), popped)
    _hand_back(step, action, input_grads, skip_grads)


def backward_weight(step: Step, action: Action) -> None:
    """``sWi``: the gradients of stage ``s``'s parameters for micro-batch ``i``, into ``.grad``; graph freed."""
    s, i = action.stage, action.microbatch
    state = step.states.pop((s, i))
    if step.memory is not None:
        step.memory.watch(s, i, (), state.weight.seeds() if state.weight is not None else ())
    try:
        if state.weight is not None:
            split_weight(state.weight)
    finally:
        if step.memory is not None:
            step.memory.settle(s, i)


_ACTIONS = {
    Kind.FORWARD: forward,
    Kind.RECOMPUTE: recompute,
    Kind.BACKWARD: backward,
    Kind.BACKWARD_INPUT: backward_input,
    Kind.BACKWARD_WEIGHT: backward_weight,
}
