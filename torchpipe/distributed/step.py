"""One step of a multi-process pipeline on this rank: agree on its shape, run this rank's actions, end together.

The first stage's rank splits the input and publishes the micro-batch sizes
(see [Note: control plane]); every rank makes the same :class:`Step` and runs
its own worker's list of actions on the calling thread, exchanging messages
over :class:`~torchpipe.distributed.transport.DistributedTransport`; the last
stage's rank tells every rank the loss as it ends; every rank returns when all are done. If an
action fails, its rank records the failure (rank, action, error) and raises the
original exception; every other rank raises :class:`PipelineError` with that
record.
"""
from typing import Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor

from torchpipe import microbatch
from torchpipe.distributed.channel import Channel, PipelineError
from torchpipe.distributed.failure import error_text
from torchpipe.distributed.records import ReplicaLoss, StepStart
from torchpipe.distributed.transport import DistributedTransport
from torchpipe.microbatch import Batch
from torchpipe.runtime import Plan, Runner
from torchpipe.runtime.driver import Progress, abort, begin, drive, end
from torchpipe.runtime.loss import Loss, LossSpec, check_target, loss_weights, shares, split_target, target_weights
from torchpipe.runtime.step import Timings
from torchpipe.runtime.transport import Aborted
from torchpipe.types import TensorOrTensors

__all__ = ["distributed_step"]


def _describe(training: bool) -> str:
    return "a training step (forward and backward)" if training else "a step without backward (no_grad or eval)"


def distributed_step(
    runner: Runner,
    channel: Channel,
    devices: Sequence[torch.device],
    chunks: int,
    input: Optional[TensorOrTensors],
    *,
    training: bool,
    module_training: bool,
    checkpoint_stop: Callable[[int], int],
    loss: Optional[LossSpec],
    target: Optional[TensorOrTensors] = None,
    timings: Optional[Timings] = None,
    relayouts: Optional[List[float]] = None,
) -> Tuple[Optional[Tensor], Optional[List[Batch]]]:
    """Runs one step on this rank; returns the loss (with a loss) and, on the last stage's rank, the outputs.

    Args:
        runner: the pipeline's runner (this rank's stages; the others None).
        channel: this rank's channel.
        devices: each stage's device (this rank's device for all).
        chunks: the number of micro-batches.
        input: the mini-batch (read on the first stage's rank only).
        training: whether the step runs backward.
        module_training: the module's train/eval mode.
        checkpoint_stop: the checkpointed micro-batches for a number of micro-batches.
        loss: what the step's loss is made of (None: a step without one).
        target: the mini-batch's target, read on the last stage's rank only.
        timings: measure each action into it.
        relayouts: where to add, per message whose layout this rank did not expect (every message of a
            pipeline's first step: [Note: expected layouts]), the seconds it waited after its header for its
            tensors (a relayout, which later steps' messages do not wait for).

    With data-parallel replicas (a mesh), each replica's first stage reads its
    own mini-batch; a ``'mean'`` loss weighs every sample of every replica
    equally, and every rank returns the loss over all replicas' samples.
    """
    sequence = channel.next_sequence()
    rank = channel.rank
    last = runner.stages.stage_workers[-1]
    step_loss: Optional[Loss] = None
    making_transport = False
    try:
        split, inputs, shapes = _start(runner, channel, sequence, devices, chunks, input, training)
        # The start is known everywhere: the other ranks are in the step, in the mode its first stage's rank
        # runs, waiting for this one's messages (see _failed_before_actions).
        _check_modes(channel, sequence, runner.stages.stage_workers[0], shapes, training)
        counts = shapes[channel.replica].sizes
        batches: List[Optional[Batch]] = list(split) if split is not None else [None] * len(counts)
        if loss is not None:
            total = sum(n for start in shapes.values() for n in start.sizes)
            step_loss = Loss(loss.fn, [None] * len(counts), loss_weights(counts, loss.reduction, total),
                             scale=loss.scale)

        def transport_for(made: Plan) -> DistributedTransport:
            nonlocal making_transport
            making_transport = True  # a second one beside it would post the receives twice: _failed_before_actions
            return DistributedTransport(channel, sequence, made.schedule if training else made.forward, made.sends,
                                        devices)

        step = runner.new_step(
            batches, grad_enabled=training, training=module_training,
            checkpoint_stop=checkpoint_stop(len(batches)), loss=step_loss, sequence=sequence,
            transport=transport_for,
        )
        step.timings = timings
        plan = step.plan.schedule if training else step.plan.forward
        transport = cast(DistributedTransport, step.transport)
    except BaseException as exc:
        _failed_before_actions(runner, channel, sequence, devices, checkpoint_stop, exc, making_transport)
        raise
    progress = Progress()
    committed = False
    mine: List[float] = []  # what this rank tells every rank as it ends: the last stage's rank, the loss
    read = False
    try:
        if loss is not None and step_loss is not None and rank == last:
            _split_target(channel, sequence, loss, step_loss, target, devices[-1], counts)
        if channel.collectives_without_grad or (channel.collectives and training and step_loss is not None):
            # The stage hooks start collectives between ranks (replicas, tied copies): every rank must run the
            # step to its end, or none (see [Note: stage lifecycle]).
            channel.commit(sequence)
        committed = True
        begin(step)
        drive(step, plan.workers[rank], progress)
        transport.finish()
        if relayouts is not None:
            relayouts += transport.relayouts
        end(step)
        if step.memory is not None:  # the gradients as the stage hooks left them (reduced, sharded)
            step.memory.end(transport.most_posted)
        own: List[float] = []
        if rank == last and step_loss is not None:
            weighted = step_loss.weighted()
            dtype = next((v.dtype for v in weighted), torch.float32)
            own = ReplicaLoss(float(sum(float(v) for v in weighted)), dtype).pack()
            # Every lane's last stage has its replica's loss: the first lane's tells it.
            mine = own if channel.lane == 0 else []
        # The loss of every replica, but the last stage's rank of a lone pipeline knows the only one.
        read = step_loss is not None and not (rank == last and channel.replicas == 1)
        told = channel.done(sequence, mine, read=read)
        if training and inputs:
            step.backward_input(inputs)
    except BaseException as exc:
        if not isinstance(exc, (PipelineError, Aborted)):  # this rank's own failure: the others learn it first
            where = f"action {progress.current}" if progress.current is not None else "its step"
            channel.fail(sequence, f"rank {channel.who} failed in {where}: {error_text(exc)}")
        transport.fail()
        if committed:
            abort(step)  # the collectives this rank still owes, before it leaves the step
        record = channel.failure(sequence)
        channel.leave_failed(sequence)  # the failure read: rank 0, the store's host, may go
        if isinstance(exc, Aborted) and record is not None:
            raise PipelineError(record) from None
        raise
    result: Optional[Tensor] = None
    if step_loss is not None:
        losses = [ReplicaLoss.unpack(values) for values in (told if read else [own]) if values]
        assert len(losses) == channel.replicas, f"{len(losses)} losses told for {channel.replicas} replicas"
        result = torch.scalar_tensor(sum(told.value for told in losses), dtype=losses[0].dtype,
                                     device=devices[-1] if rank == last else devices[0])
    outputs = step.take_results() if rank == last and step_loss is None else None
    return result, outputs


def _split_target(
    channel: Channel,
    sequence: int,
    spec: LossSpec,
    loss: Loss,
    target: Optional[TensorOrTensors],
    device: torch.device,
    counts: List[int],
) -> None:
    """On the last stage's rank: the target split into the micro-batches, and with ``loss_weight`` their weights
    (over every replica's total: this replica's published, the others' read at the first backward that needs
    them; see [Note: token weights])."""
    check_target(spec, target, f"rank {channel.who}, the last stage's,")
    loss.targets = split_target(target, device, counts)
    if spec.weight is None or spec.reduction != "mean":
        return
    weights = target_weights(spec.weight, loss.targets)
    if channel.replicas == 1:
        loss.weights = shares(weights, sum(weights))
        return
    channel.publish(sequence, "weight", [sum(weights)])

    def total() -> float:
        return sum(values[0] for values in channel.wait_for_replicas(sequence, "weight"))

    loss.divide_later(weights, total)


def _failed_before_actions(
    runner: Runner,
    channel: Channel,
    sequence: int,
    devices: Sequence[torch.device],
    checkpoint_stop: Callable[[int], int],
    error: BaseException,
    making_transport: bool,
) -> None:
    """This rank failed before its first action: waiting for the step's start (the wait outlived the timeout or
    was interrupted, or another replica's start failed), or once it knew it (a mode other than the first
    stage's, the step's state or transport could not be made). Records the failure, unless another rank's
    caused it, so that no rank waits for this one. Where its replica's first stage published the start, the
    peers are in the step, or will be, waiting for this rank's messages: it takes part as a rank that failed
    does (:func:`_abandon`), unless its transport was being made (a second one beside it would post the step's
    receives twice). Then it leaves the store (see [Note: leaving the store])."""
    if not isinstance(error, PipelineError):  # the first record stands (a disagreement on the mode's, say)
        channel.fail(sequence, f"rank {channel.who} failed to begin its step: {error_text(error)}")
    # After the failure's marks the start is there for good: the replica's start, or the mark, written first.
    published = None if making_transport else channel.published(sequence, "start")
    if published is not None:
        start = StepStart.unpack(published)
        _abandon(runner, channel, sequence, devices, start.training, start.microbatches, checkpoint_stop)
    channel.leave_failed(sequence)


def _abandon(
    runner: Runner,
    channel: Channel,
    sequence: int,
    devices: Sequence[torch.device],
    training: bool,
    microbatches: int,
    checkpoint_stop: Callable[[int], int],
) -> None:
    """After this rank failed before it made the step's transport, while its replica's start was published (see
    :func:`_failed_before_actions`): makes one and does what a failed step's transport does (see [Note: abort
    messages]), so that the peers, which are in the step, stop waiting for this rank's messages and their pairs
    with it stay in step for the next one. (Its recomputations send nothing: the messages' order does not
    depend on ``checkpoint_stop``.)"""
    try:
        plan = runner.plan(microbatches, checkpoint_stop(microbatches))
        schedule = plan.schedule if training else plan.forward
        DistributedTransport(channel, sequence, schedule, plan.sends, devices).fail()
    except Exception:  # noqa: BLE001 - the step's own error is raised; the peers learn it from the store
        pass  # and their sends to this rank time out: then the pairs are out of step (as after a death)


def _start(
    runner: Runner,
    channel: Channel,
    sequence: int,
    devices: Sequence[torch.device],
    chunks: int,
    input: Optional[TensorOrTensors],
    training: bool,
) -> Tuple[Optional[List[Batch]], Tuple[Tensor, ...], Dict[int, StepStart]]:
    """Agrees on step ``sequence``'s shape: on the first stage's rank its micro-batches (None elsewhere) and
    input tensors; every replica's published start (its number of micro-batches, whether it trains, and each
    micro-batch's size), by replica (this one's only, with a single replica)."""
    rank = channel.rank
    first = runner.stages.stage_workers[0]
    inputs: Tuple[Tensor, ...] = ()
    split: Optional[List[Batch]] = None
    mine: Optional[StepStart] = None
    if rank == first:
        try:
            if input is None:
                raise ValueError(f"rank {channel.who} runs the first stage: it must pass the mini-batch's input")
            inputs, split = microbatch.split_input(input, devices[0], chunks)
        except BaseException as exc:
            channel.fail(sequence, f"rank {channel.who} could not split its input: {error_text(exc)}")
            raise
        mine = StepStart(training, [int(b.values[0].size(0)) if b.values[0].dim() > 0 else 1 for b in split])
        channel.publish(sequence, "start", mine.pack())
        if channel.lane:
            _check_lanes(channel, sequence, mine)
    # Every replica's shape: this one's to run, the others' for the total number of samples (what this rank
    # published it knows without a trip to the store).
    replicas = range(channel.replicas) if channel.replicas > 1 else [channel.replica]
    shapes = {
        r: mine if mine is not None and r == channel.replica
        else StepStart.unpack(channel.wait_for(sequence, "start", replica=r))
        for r in replicas
    }
    return split, inputs, shapes


def _check_lanes(channel: Channel, sequence: int, mine: StepStart) -> None:
    """Raises ``ValueError`` (recorded as the step's failure) if this first stage's rank of a lane other than the
    first split another mini-batch than its replica's first lane: a stage's tp ranks compute on one input."""
    first = StepStart.unpack(channel.wait_for(sequence, "start", lane=0))
    if first != mine:
        message = (
            f"rank {channel.who}, a first stage's, split its input into micro-batches of {mine.sizes} but tp rank "
            f"0 of its stage into {first.sizes}: every tp rank of the first stage must pass the same mini-batch"
        )
        channel.fail(sequence, message)
        raise ValueError(message)


def _check_modes(
    channel: Channel, sequence: int, first: int, shapes: Dict[int, StepStart], training: bool
) -> None:
    """Raises ``ValueError`` (recorded as the step's failure) if a replica's first stage runs the step in another
    mode than this rank."""
    for r, start in shapes.items():
        if start.training != training:
            where = f"rank {first}, the first stage's" + (f", of replica {r}" if channel.replicas > 1 else "")
            message = (
                f"rank {channel.who} runs {_describe(training)} but {where}, runs {_describe(start.training)}: "
                "call step() in the same mode (train/eval, grad enabled) everywhere"
            )
            channel.fail(sequence, message)
            raise ValueError(message)
