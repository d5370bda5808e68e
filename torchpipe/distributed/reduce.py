"""Gradient reductions between ranks at the end of a step: data-parallel replicas, and tied copies on other ranks.

[Note: reductions] A training step's gradients are reduced once per step,
never per micro-batch, at two points of the stage lifecycle (see [Note: stage
lifecycle]):

- data parallelism (``data_parallel='replicate'``): right after a stage's
  last backward, one all-reduce (a sum) per stage and dtype over the ranks of
  the other replicas that hold the same stage, started in the background
  while the backward of the other stages goes on; its result is waited for at
  the end of the step. The loss of each micro-batch was weighted by its share
  of every replica's samples, so the sum is the plain module's gradient on all
  replicas' samples together.
- tied parameters whose holders are on several ranks of a pipeline (see
  [Note: tied parameters]): at the end of the step, one all-reduce (a sum)
  over the holders' ranks of the (already data-parallel reduced) gradients.

Both reduce the step's own gradients: what ``.grad`` held before the step
(gradient accumulation over steps) is set aside when the step starts and
added back after, so it is counted once. Each bucket also carries, per
parameter, whether a rank had a gradient for it, so a parameter no replica
used keeps ``.grad`` as it was, as with the plain module.

Every rank issues every reduction it owes in a step, whatever happens: the
ranks agreed on running the step first (:meth:`Channel.commit`), and a rank
whose step fails afterwards (or learns that another's did) still issues the
reductions it has not issued, with zeros, before it raises. So no rank waits
forever for a reduction, and the next step's reductions pair up as they
should. Waits poll the store for failures, as every wait of the pipeline does.
"""
import time
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from torchpipe import trace
from torchpipe.distributed.channel import POLL_SECONDS, Channel, PipelineError
from torchpipe.runtime.step import StageHooks, Step

__all__ = ["GradientReducer", "TiedGroup"]

#: How long a failed step waits for the reductions it still issued (a dead peer's never end).
_ABORT_SECONDS = 10.0


class TiedGroup:
    """A tied parameter whose holders are on several ranks of this pipeline: this rank's copy, and a process
    group of the holders' ranks (the first holder's first)."""

    def __init__(self, param: nn.Parameter, group: Any) -> None:
        self.param = param
        self.group = group


class _Bucket:
    """The gradients of some parameters of one dtype, flat, then one flag per parameter (1: it had a gradient)."""

    def __init__(self, params: List[nn.Parameter]) -> None:
        self.params = params
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.numel = sum(_local(p).numel() for p in params) + len(params)

    def pack(self, grads: Sequence[Optional[Tensor]]) -> Tensor:
        flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        offset = 0
        for k, (param, grad) in enumerate(zip(self.params, grads)):
            size = _local(param).numel()
            if grad is not None:
                flat[offset : offset + size].copy_(_local(grad).reshape(-1))
                flat[self.numel - len(self.params) + k] = 1
            offset += size
        return flat

    def unpack(self, flat: Tensor) -> List[Optional[Tensor]]:
        grads: List[Optional[Tensor]] = []
        offset = 0
        flags = flat[self.numel - len(self.params) :].tolist()
        for param, flag in zip(self.params, flags):
            size = _local(param).numel()
            part = flat[offset : offset + size]
            grads.append(_like(param, part.view_as(_local(param))) if flag else None)
            offset += size
        return grads


class _Pending:
    """A reduction in flight: its bucket, buffer and work, and when it started (for the timeline)."""

    def __init__(self, bucket: _Bucket, flat: Tensor, work: Any, stage: int) -> None:
        self.bucket = bucket
        self.flat = flat
        self.work = work
        self.stage = stage
        self.started = time.perf_counter()


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard (a parameter or gradient sharded over ``'dp'``), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _like(param: Tensor, local: Tensor) -> Tensor:
    """``local`` as a gradient of ``param``: a DTensor laid out as ``param`` is, for a sharded one."""
    if not hasattr(param, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(  # the global shape given: shards may be uneven
        local, param.device_mesh, param.placements, run_check=False,  # type: ignore[attr-defined]
        shape=param.shape, stride=param.stride(),
    )


def _buckets(params: Sequence[nn.Parameter]) -> List[_Bucket]:
    """``params`` that require grad, one bucket per dtype (in order of first appearance)."""
    by_dtype: Dict[torch.dtype, List[nn.Parameter]] = {}
    for param in params:
        if param.requires_grad:
            by_dtype.setdefault(param.dtype, []).append(param)
    return [_Bucket(group) for group in by_dtype.values()]


class GradientReducer(StageHooks):
    """Reduces a step's gradients over data-parallel replicas and tied copies (see [Note: reductions]).

    Args:
        channel: this rank's channel (failures, the step's number).
        stages: this rank's stages, by stage index.
        order: this rank's stages in the order their reductions are issued (the same on every replica).
        replicas: the process group of this rank and the other replicas' ranks of the same stages, or None
            (no data-parallel reduction: one replica, or FSDP reduces).
        ties: this rank's tied parameters whose holders are on several ranks.
    """

    def __init__(
        self,
        channel: Channel,
        stages: Dict[int, nn.Module],
        order: Sequence[int],
        replicas: Any,
        ties: Sequence[TiedGroup],
    ) -> None:
        self.channel = channel
        self.replicas = replicas
        self.ties = list(ties)
        self.order = list(order)
        # A parameter several local stages hold is reduced with the last of them to end its backward: only
        # then is its gradient of the step complete.
        last_holder: Dict[int, int] = {}
        params: Dict[int, nn.Parameter] = {}
        for s in self.order:
            for param in stages[s].parameters():
                last_holder[id(param)] = s
                params[id(param)] = param
        self.stage_params: Dict[int, List[nn.Parameter]] = {s: [] for s in self.order}
        for key, s in last_holder.items():
            self.stage_params[s].append(params[key])
        self._saved: Dict[int, Optional[Tensor]] = {}
        self._held: List[nn.Parameter] = []
        self._pending: List[_Pending] = []
        self._issued: List[int] = []
        self._done: Set[int] = set()
        self._tie_pending: Optional[List[Tuple[_Bucket, Tensor, Any, TiedGroup]]] = None
        #: Whether this step's tied-copy sums were issued (an abort after them owes none).
        self._ties_issued = False
        self._sequence = -1

    # --- the lifecycle ----------------------------------------------------------------------------------

    def before_step(self, step: Step) -> None:
        self._begin(step)
        # The step's own gradients (see [Note: reductions]): what .grad held before is added back at the end.
        held = {id(p): p for ps in self.stage_params.values() for p in ps} if self.replicas is not None else {}
        for tie in self.ties:
            held[id(tie.param)] = tie.param
        self._held = list(held.values())
        for param in self._held:
            self._saved[id(param)] = param.grad
            param.grad = None

    def _begin(self, step: Step) -> None:
        if self._sequence != step.sequence:
            self._sequence = step.sequence if step.sequence is not None else -1
            self._saved = {}
            self._held = []
            self._pending = []
            self._issued = []
            self._done = set()
            self._tie_pending = None
            self._ties_issued = False

    def after_last_backward(self, step: Step, stage: int) -> None:
        if self.replicas is None:
            return
        self._done.add(stage)
        # In one fixed order on every replica, whatever the schedule of each (replicas whose batches differ
        # in size may run different numbers of micro-batches, and so finish their stages in another order).
        while len(self._issued) < len(self.order) and self.order[len(self._issued)] in self._done:
            self._issue(self.order[len(self._issued)], zeros=False)

    def _issue(self, stage: int, zeros: bool) -> None:
        self._issued.append(stage)
        for bucket in _buckets(self.stage_params[stage]):
            flat = bucket.pack([None if zeros else p.grad for p in bucket.params])
            self._pending.append(_Pending(bucket, flat, self.replicas.allreduce([flat]), stage))

    def after_step(self, step: Step) -> None:
        if self.replicas is not None:
            for stage in self.order[len(self._issued) :]:  # stages without a backward in this step
                self._issue(stage, zeros=False)
        for pending in self._pending:
            self._wait(pending.work)
            trace.record("reduce", pending.stage, 0, pending.started, time.perf_counter())
            for param, grad in zip(pending.bucket.params, pending.bucket.unpack(pending.flat)):
                param.grad = grad
        self._pending = []
        if self.ties:
            self._ties_issued = True
            self._tie_pending = [self._start_tie(tie, tie.param.grad) for tie in self.ties]
            for bucket, flat, work, tie in self._tie_pending:
                self._wait(work)
                (tie.param.grad,) = bucket.unpack(flat)
            self._tie_pending = None
        for param in self._held:
            param.grad = _added(self._saved.pop(id(param), None), param.grad)
        self._held = []

    def abort(self, step: Step) -> None:
        """Issues, with zeros, the reductions this rank still owes the step, waits a while for all it issued
        (a dead peer's never end), and puts back the gradients held before the step."""
        self._begin(step)  # (called only for a step every rank committed to: all of it is owed)
        if self.replicas is not None:
            for stage in self.order[len(self._issued) :]:
                self._issue(stage, zeros=True)
        if self.ties and not self._ties_issued:
            # Once per step, whether after_step issued them (and may even have finished them: a peer failed
            # after) or not: one more would pair with the peer's next step's and hang it.
            self._ties_issued = True
            self._tie_pending = [self._start_tie(tie, None) for tie in self.ties]
        works = [p.work for p in self._pending] + [t[2] for t in self._tie_pending or ()]
        deadline = time.monotonic() + _ABORT_SECONDS
        for work in works:
            while time.monotonic() < deadline:
                try:
                    if work.is_completed():
                        break
                except RuntimeError:  # a dead peer
                    break
                time.sleep(0.001)
        self._pending = []
        self._tie_pending = None
        for param in self._held:  # a failed step's gradients are unspecified: keep what was there before
            param.grad = self._saved.pop(id(param), None)
        self._held = []

    # --- helpers ------------------------------------------------------------------------------------------

    def _start_tie(self, tie: TiedGroup, grad: Optional[Tensor]) -> Tuple[_Bucket, Tensor, Any, TiedGroup]:
        bucket = _Bucket([tie.param])
        flat = bucket.pack([grad])
        return bucket, flat, tie.group.allreduce([flat]), tie

    def _wait(self, work: Any) -> None:
        """Waits for ``work``, looking in the store for another rank's failure meanwhile."""
        pause = 0.0001
        last_look = time.monotonic()
        while True:
            try:
                if work.is_completed():
                    work.wait()  # raises if the reduction failed (a dead peer)
                    return
            except RuntimeError as exc:
                message = f"rank {self.channel.rank}'s gradient reduction failed (a peer died?): {exc}"
                self.channel.fail(self._sequence, message)
                raise PipelineError(self.channel.failure(self._sequence) or message) from None
            if time.monotonic() - last_look >= POLL_SECONDS:
                last_look = time.monotonic()
                self.channel.raise_failure(self._sequence)
            time.sleep(pause)
            pause = min(pause * 2, 0.002)


def _added(before: Optional[Tensor], step: Optional[Tensor]) -> Optional[Tensor]:
    """The gradient after the step: what ``.grad`` held before plus the step's (into ``before`` if any)."""
    if step is None:
        return before
    if before is None:
        return step
    return before.add_(step)
