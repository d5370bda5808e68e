"""The GPipe module: arguments, the container protocol, and the forward entry of a pipelined step."""
import numbers
from typing import Any, Iterator, List, Optional, Sequence, Union, cast

import torch
from torch import Tensor, nn

from torchpipe import microbatch, transfer
from torchpipe.batchnorm import DeferredBatchNorm, commit, discard
from torchpipe.checkpoint import CHECKPOINT_MODES, checkpoint_stop
from torchpipe.partition import BalanceError, resolve_devices, split_module, verify_balance, verify_module
from torchpipe.runner import Pipeline, PipelineFunction, Step
from torchpipe.skip.layout import inspect_skip_layout, verify_skippables
from torchpipe.types import Device, TensorOrTensors

__all__ = ["GPipe", "BalanceError"]

MOVING_DENIED = TypeError(
    "denied to move the partitions of a GPipe: they are placed on their devices by GPipe; "
    "choose devices with GPipe(..., devices=[...]) (g.to(dtype) works)"
)


class GPipe(nn.Module):
    """Wraps an ``nn.Sequential`` to train it with GPipe pipeline parallelism.

    The module is cut into partitions of consecutive layers (``balance[j]``
    layers for partition j), each placed on ``devices[j]``. Each mini-batch is
    cut into ``chunks`` micro-batches that flow through the partitions
    concurrently, forward and backward. With checkpointing, a partition keeps
    only its input during forward and recomputes its activations in backward.
    Outputs and gradients are those of the plain module.

    Args:
        module: the ``nn.Sequential`` to pipeline. Its layers take and return
            a tensor or a tuple of tensors.
        balance: layers per partition, summing to ``len(module)``;
            :mod:`torchpipe_balancing` can find one.
        devices: one device per partition (ints, strings or ``torch.device``;
            repeats allowed, e.g. ``['cpu', 'cpu']``). Default:
            ``cuda:0 … cuda:n-1``, or all ``'cpu'`` without CUDA.
        chunks: the number of micro-batches.
        checkpoint: ``'always'``, ``'except_last'`` (every micro-batch but the
            last) or ``'never'``.
        deferred_batch_norm: update BatchNorm running statistics once per
            mini-batch, as the plain module would, not once per micro-batch.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: bad ``chunks`` or ``checkpoint``, a missing ``balance``, or
            a module that repeats a layer or shares a parameter between layers.
        BalanceError: ``balance`` does not fit ``module``.
        IndexError: fewer devices than partitions.

    Example::

        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        model = GPipe(model, balance=[2, 1], devices=['cpu', 'cpu'], chunks=4)
        output = model(torch.rand(64, 16))   # on model.devices[-1]
        output.sum().backward()
    """

    balance: List[int]
    devices: List[torch.device]
    chunks: int
    checkpoint: str
    partitions: nn.ModuleList

    def __init__(
        self,
        module: nn.Sequential,
        balance: Optional[Sequence[int]] = None,
        *,
        devices: Optional[Sequence[Device]] = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(chunks, numbers.Integral) or isinstance(chunks, bool) or chunks <= 0:
            raise ValueError(f"number of chunks must be a positive int, got {chunks!r}")
        chunks = int(chunks)
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))}, got {checkpoint!r}")
        verify_module(module)
        balance = verify_balance(module, balance)
        resolved = resolve_devices(devices, len(balance))
        verify_skippables(module)
        if deferred_batch_norm:
            module = cast(nn.Sequential, DeferredBatchNorm.convert(module))

        self.balance = balance
        self.devices = resolved
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm: bool = deferred_batch_norm
        self.partitions, self._offsets = split_module(module, balance, resolved)
        self._pipeline: Pipeline = Pipeline(self, list(self.partitions), resolved)
        self._pipeline.skip_layout = inspect_skip_layout([cast(nn.Sequential, p) for p in self.partitions])

    # --- container protocol over the original layers ---------------------------------------------

    def _sequentials(self) -> List[nn.Sequential]:
        return [cast(nn.Sequential, p) for p in self.partitions]

    def __len__(self) -> int:
        return sum(len(p) for p in self._sequentials())

    def __getitem__(self, index: int) -> nn.Module:
        length = len(self)
        if not -length <= index < length:
            raise IndexError(f"layer index {index} is out of range for a GPipe of {length} layers")
        index %= length
        for partition in self._sequentials():
            if index < len(partition):
                return partition[index]
            index -= len(partition)
        raise AssertionError("unreachable")

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self._sequentials():
            yield from partition

    # --- moving is GPipe's job -----------------------------------------------------------------

    def cuda(self, device: Optional[Union[int, torch.device]] = None) -> "GPipe":
        raise MOVING_DENIED

    def cpu(self) -> "GPipe":
        raise MOVING_DENIED

    def to(self, *args: Any, **kwargs: Any) -> "GPipe":
        # Anything naming a device (a device, a string, an index, a tensor to match) is denied.
        if any(isinstance(a, (torch.device, str, int, Tensor)) for a in args) or kwargs.get("device") is not None:
            raise MOVING_DENIED
        super().to(*args, **kwargs)
        return self

    # --- forward -------------------------------------------------------------------------------

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Runs the pipelined forward of one mini-batch.

        ``input`` (a tensor or a tuple of tensors sharing dim 0) may live on
        any device; it is moved to ``devices[0]``. The output has the structure
        the plain module returns and lives on ``devices[-1]``.
        """
        microbatch.check_input(input)
        input = transfer.move(input, self.devices[0])
        tensors = (input,) if isinstance(input, Tensor) else tuple(input)
        grad_enabled = torch.is_grad_enabled()
        needs_grad = grad_enabled and (
            any(t.requires_grad for t in tensors) or any(p.requires_grad for p in self.parameters())
        )
        batches = microbatch.scatter(input, self.chunks)
        stop = checkpoint_stop(self.checkpoint, len(batches), needs_grad and self.training)
        step = Step(self._pipeline, batches, grad_enabled=needs_grad, checkpoint_stop=stop, training=self.training)
        try:
            if not needs_grad:
                output = microbatch.gather(self._pipeline.run_forward(step))
            else:
                phony = torch.empty(0, device=self.devices[0], requires_grad=True)
                outputs = PipelineFunction.apply(step, phony, *tensors)  # type: ignore[no-untyped-call]
                output = cast(Tensor, outputs[0]) if step.output_atomic else tuple(outputs)
        except BaseException:
            if self.deferred_batch_norm:
                for partition in self.partitions:
                    discard(partition)
            raise
        if self.deferred_batch_norm and self.training:
            for partition in self.partitions:
                commit(partition)
        return output

    def extra_repr(self) -> str:
        return f"balance={self.balance}, devices={[str(d) for d in self.devices]}, chunks={self.chunks}, " \
            f"checkpoint={self.checkpoint!r}"

