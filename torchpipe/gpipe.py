"""The GPipe module: arguments, the container protocol, and the forward entry of a pipelined step."""
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor, nn

from torchpipe import microbatch
from torchpipe.checkpoint import checkpoint_stop, verify_checkpoint
from torchpipe.compiling import CompileOptions, compile_layers, compile_options
from torchpipe.microbatch import Batch
from torchpipe.partition import BalanceError, cut, place, resolve_devices, verify_balance, verify_module
from torchpipe.pipelined import Pipelined
from torchpipe.recompute import RecomputeLike, describe_recompute, verify_recompute
from torchpipe.runtime import Runner, Stages, Step
from torchpipe.runtime.boundary import is_differentiable
from torchpipe.runtime.function import Layout, PipelineFunction
from torchpipe.runtime.step import ParamGrads
from torchpipe.runtime.ties import find_ties, retie, shared_stages, untie_devices
from torchpipe.schedule import gpipe
from torchpipe.skip.layout import inspect_skip_layout, verify_skippables
from torchpipe.state_dict import PlainKeys
from torchpipe.types import Device, TensorOrTensors

__all__ = ["GPipe", "BalanceError"]


class GPipe(Pipelined):
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
        recompute: what a checkpointed micro-batch recomputes: ``'full'`` (its
            whole partition), ``'selective'`` (all but the outputs of matrix
            multiplications, attention and collectives, which its forward
            keeps), or ``policy(op) -> bool`` (keep that operator's output);
            see [Note: selective recomputation].
        deferred_batch_norm: update BatchNorm running statistics once per
            mini-batch, as the plain module would, not once per micro-batch.
        compile: True, or a dict of ``torch.compile`` keyword arguments: each
            layer of each partition is compiled in place (regional
            compilation; :func:`torchpipe.compiling.compile_layers`); the
            state dict keys stay the module's. False: eager.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: bad ``chunks``, ``checkpoint`` or ``recompute`` (other than
            ``'full'`` with ``checkpoint='never'``), a missing ``balance``, or
            a module that repeats a layer or shares a parameter between layers.
        BalanceError: ``balance`` does not fit ``module``.
        IndexError: fewer devices than partitions.

    Example::

        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        model = GPipe(model, balance=[2, 1], devices=['cpu', 'cpu'], chunks=4)
        output = model(torch.rand(64, 16))   # on model.devices[-1]
        output.sum().backward()
    """

    partitions: nn.ModuleList
    _parts = "partitions"
    _handle = "g"

    def __init__(
        self,
        module: nn.Sequential,
        balance: Optional[Sequence[int]] = None,
        *,
        devices: Optional[Sequence[Device]] = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        compile: CompileOptions = False,
        recompute: RecomputeLike = "full",
    ) -> None:
        super().__init__()
        chunks = microbatch.verify_chunks(chunks)
        compiled = compile_options(compile)
        checkpoint = verify_checkpoint(checkpoint)
        policy = verify_recompute(recompute, checkpoint)
        verify_module(module)
        balance = verify_balance(module, balance)
        resolved = resolve_devices(devices, len(balance))
        verify_skippables(module)
        module = self._keep_arguments(module, balance, resolved, chunks, checkpoint, deferred_batch_norm)
        # Layers may share a parameter across partitions (see [Note: tied parameters]).
        ties = find_ties(module, balance)
        cuts = cut(module, balance)
        untie_devices(cuts, resolved, ties)
        self.partitions = nn.ModuleList([place(stage, device) for stage, device in zip(cuts, resolved)])
        copies = retie(list(self.partitions), ties)
        if compiled is not None:  # each layer in place: the keys stay the module's
            for partition in self.partitions:
                compile_layers(cast(nn.Sequential, partition), compiled)
        stages = self._sequentials()
        placed = Stages(
            stages, resolved, list(range(len(stages))), resolved, inspect_skip_layout(stages),
            noun="partition", name=f"GPipe(balance={balance})",
        )
        placed.share(shared_stages(stages, ties))
        placed.tied_copies = [group for group in copies if len(group) > 1]
        placed.recompute = policy
        self.recompute = recompute
        self._runner = Runner(placed, lambda microbatches: gpipe(microbatches, len(stages)), inline_backward=True)

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

    # --- gradients -------------------------------------------------------------------------------

    def _counted(self, params: List[nn.Parameter]) -> List[nn.Parameter]:
        # A tied parameter with copies on several devices counts once (its copies hold the same gradient).
        copies = {id(c) for group in self._runner.stages.tied_copies for c in group[1:]}
        return [p for p in params if id(p) not in copies]

    # --- state dicts -----------------------------------------------------------------------------

    def _keys(self) -> PlainKeys:
        return PlainKeys({name: f"partitions.{j}." for j, p in enumerate(self._sequentials()) for name in p._modules})

    def full_state_dict(self) -> Dict[str, Any]:
        """The state dict of the plain module (keys like ``'3.weight'``), whatever the balance.

        ``nn.Sequential(...).load_state_dict(g.full_state_dict())`` loads it
        into the unpartitioned module, and so does a GPipe of any balance.
        """
        return self._keys().to_plain(self.state_dict())

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Loads a GPipe's state dict (of any balance) or the plain module's (keys like ``'3.weight'``)."""
        own = self._keys().to_own(state_dict)
        if assign:
            return super().load_state_dict(own, strict=strict, assign=True)
        return super().load_state_dict(own, strict=strict)

    # --- forward -------------------------------------------------------------------------------

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Runs the pipelined forward of one mini-batch.

        ``input`` (a tensor or a tuple of tensors sharing dim 0) may live on
        any device; it is moved to ``devices[0]``. The output has the structure
        the plain module returns and lives on ``devices[-1]``.
        """
        if not self.partitions:  # an empty Sequential is the identity, as in torchgpipe
            microbatch.check_input(input)
            return input
        tensors, batches = microbatch.split_input(input, self.devices[0], self.chunks)
        grad_enabled = torch.is_grad_enabled()
        stop = checkpoint_stop(self.checkpoint, len(batches), grad_enabled and self.training)
        step = self._runner.new_step(
            batches, grad_enabled=grad_enabled, training=self.training, checkpoint_stop=stop, watch_inputs=True,
        )
        with self._batch_norm_statistics(self._sequentials()):
            results = self._runner.run_forward(step)
            return self._output(step, results, tensors)

    def _output(self, step: Step, results: List[Batch], tensors: Tuple[Tensor, ...]) -> TensorOrTensors:
        """Joins the micro-batches' outputs; with grad, ties them into the caller's graph."""
        flags = _output_flags(step, results)
        if not step.grad_enabled or not any(flags):
            return microbatch.gather(results)
        step.param_grads = kept = ParamGrads(
            [[p for p in stage.parameters() if p.requires_grad] for stage in self._sequentials()]
        )
        views = [p.view_as(p) for params in kept.params for p in params]
        positions = tuple(k for k, t in enumerate(tensors) if t.requires_grad)
        inputs = [tensors[k] for k in positions]
        # The outputs require grad through something that is neither an input nor a parameter (a layer using a
        # global tensor that requires grad): an empty tensor that requires grad makes them require it too.
        phony = [] if inputs or views else [torch.empty(0, device=self.devices[0], requires_grad=True)]
        layout = Layout(len(phony), positions, len(views))
        outputs = PipelineFunction.apply(self._runner, step, results, flags, layout, *phony, *inputs, *views)  # type: ignore[no-untyped-call]
        return cast(Tensor, outputs[0]) if results[0].atomic else tuple(outputs)

    def extra_repr(self) -> str:
        return f"balance={self.balance}, devices={[str(d) for d in self.devices]}, chunks={self.chunks}, " \
            f"checkpoint={self.checkpoint!r}" + (f", recompute={describe_recompute(self.recompute)!r}"
                                                 if self.recompute != "full" else "")


def _output_flags(step: Step, results: List[Batch]) -> Tuple[bool, ...]:
    """Whether each output tensor requires grad, as the plain module's would.

    Read off the micro-batches the last stage ran with grad; if every one was
    checkpointed (computed without grad), every differentiable output is taken
    to require grad (a checkpointed micro-batch had something requiring grad).
    """
    recorded = [f for f in step.output_flags if f is not None]
    if recorded:
        return tuple(any(column) for column in zip(*recorded))
    if not step.checkpoint_stop:
        return tuple(False for _ in results[0].values)
    return tuple(is_differentiable(t) for t in results[0].values)
