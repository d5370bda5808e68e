"""Random numbers in pipelined and data-parallel steps: reproducible whatever the threads' timing.

[Note: random streams] PyTorch's layers draw from one generator per device:
all CPU work shares the CPU generator, all work on one GPU shares that GPU's.
Partitions (and data-parallel replicas) run concurrently on worker threads, so
if two of them drew from one generator, each one's numbers would depend on the
other's timing: runs from the same seed would differ, and a recomputation
replaying "the state before the forward" would draw different numbers than
the forward did.

So each task that may draw runs on a stream of its own. At the start of a
step, one 63-bit seed is drawn from the caller's CPU generator (only when some
partition may draw, so a pipeline without random layers leaves the caller's
generator as it was). A task that may draw — the forward of stage ``s`` for
micro-batch ``i``, its recomputation, replica ``r``'s forward — takes its
device's generator lock, seeds the generator with a seed derived from the
step's seed and ``(s, i)`` (or ``r``), runs, and puts the generator back as it
found it. The numbers a task draws then depend only on the seed and on the
task, never on which thread ran first, and a recomputation draws exactly what
its forward drew. Tasks of partitions that cannot draw take no lock and run
concurrently.

What equals what: two runs from the same ``torch.manual_seed`` give the same
outputs and gradients; a recomputation draws what its first forward drew; the
dropout masks are not those of the unpartitioned module (which draws for the
whole batch in one go), nor those of another ``chunks``.

Whether a module may draw is decided from its class (:func:`may_draw`): torch's
own layers by rule (``nn.Dropout`` with ``p > 0`` in training draws, ``nn.Linear``
never does), any other ``forward`` is assumed to draw, unless its module says
otherwise with ``torchpipe_draws_random = False`` (a class or instance
attribute: "my own ``forward`` draws no random numbers"; its submodules are
judged on their own). A CUDA partition's task seeds its GPU's generator only;
CPU random numbers drawn inside a CUDA partition are not replayed.
"""
import os
import threading
from contextlib import contextmanager
from typing import Dict, FrozenSet, Generator, Optional, Tuple, Type

import torch
from torch import nn

__all__ = ["may_draw", "step_seed", "task_seed", "seeded", "DRAWS_RANDOM"]

#: The attribute a module sets to say whether its own ``forward`` draws random numbers.
DRAWS_RANDOM = "torchpipe_draws_random"


def _classes(*names: str) -> FrozenSet[Type[nn.Module]]:
    found = [getattr(nn, name, None) for name in names]
    return frozenset(c for c in found if isinstance(c, type))


#: torch.nn layers whose own forward never draws random numbers.
_NEVER = _classes(
    "Module", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict", "Identity",
    "Linear", "Bilinear", "LazyLinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
    "ConvTranspose3d", "LazyConv1d", "LazyConv2d", "LazyConv3d", "LazyConvTranspose1d", "LazyConvTranspose2d",
    "LazyConvTranspose3d", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LazyBatchNorm1d", "LazyBatchNorm2d",
    "LazyBatchNorm3d", "SyncBatchNorm", "GroupNorm", "LayerNorm", "RMSNorm", "InstanceNorm1d", "InstanceNorm2d",
    "InstanceNorm3d", "LazyInstanceNorm1d", "LazyInstanceNorm2d", "LazyInstanceNorm3d", "LocalResponseNorm",
    "CrossMapLRN2d", "Embedding", "EmbeddingBag", "ReLU", "ReLU6", "LeakyReLU", "PReLU", "ELU", "SELU", "CELU",
    "GELU", "SiLU", "Mish", "Sigmoid", "Tanh", "Softplus", "Softsign", "Hardtanh", "Hardswish", "Hardsigmoid",
    "Hardshrink", "Softshrink", "Tanhshrink", "Threshold", "LogSigmoid", "Softmax", "Softmin", "LogSoftmax",
    "Softmax2d", "GLU", "MaxPool1d", "MaxPool2d", "MaxPool3d", "MaxUnpool1d", "MaxUnpool2d", "MaxUnpool3d",
    "AvgPool1d", "AvgPool2d", "AvgPool3d", "LPPool1d", "LPPool2d", "LPPool3d", "AdaptiveMaxPool1d",
    "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "Flatten", "Unflatten", "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d", "PixelShuffle",
    "PixelUnshuffle", "ChannelShuffle", "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d",
    "ConstantPad3d", "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d", "ReplicationPad1d",
    "ReplicationPad2d", "ReplicationPad3d", "CircularPad1d", "CircularPad2d", "CircularPad3d", "Fold", "Unfold",
    "CosineSimilarity", "PairwiseDistance", "TransformerEncoder", "TransformerDecoder", "TransformerEncoderLayer",
    "TransformerDecoderLayer", "Transformer",
)

#: torch.nn layers that draw in training when their dropout probability is positive.
_DROPOUT = _classes("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout")


def _own_draws(module: nn.Module) -> bool:
    """Whether ``module``'s own ``forward`` (not its submodules') may draw random numbers."""
    declared = getattr(module, DRAWS_RANDOM, None)
    if isinstance(declared, bool):
        return declared
    # The class whose forward runs: a subclass that keeps its base's forward is judged as the base.
    owner = next((c for c in type(module).__mro__ if "forward" in c.__dict__), nn.Module)
    if owner in _NEVER:
        return False
    if owner in _DROPOUT:
        return module.training and float(getattr(module, "p", 0.0)) > 0.0
    if owner is nn.RReLU:
        return module.training
    if owner is nn.MultiheadAttention:
        return module.training and float(getattr(module, "dropout", 0.0)) > 0.0
    if isinstance(module, nn.RNNBase) and owner in (nn.RNN, nn.LSTM, nn.GRU, nn.RNNBase):
        return module.training and float(module.dropout) > 0.0 and module.num_layers > 1
    return True


def may_draw(module: nn.Module) -> bool:
    """Whether running ``module`` may draw random numbers (from its class and state; see the module notes).

    Example::

        >>> may_draw(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        False
        >>> may_draw(nn.Dropout(0.1))
        True
        >>> may_draw(nn.Dropout(0.1).eval())
        False
    """
    return any(_own_draws(m) for m in module.modules())


def step_seed() -> int:
    """A seed for one step's random streams, drawn from the caller's CPU generator."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())


_MASK = (1 << 64) - 1


def task_seed(seed: int, *keys: int) -> int:
    """A seed for one task, mixed from the step's ``seed`` and the task's keys (SplitMix64)."""
    value = seed & _MASK
    for key in keys:
        value = (value + 0x9E3779B97F4A7C15 + (key & _MASK)) & _MASK
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
        value ^= value >> 31
    return value & ((1 << 63) - 1)


_locks: Dict[str, threading.Lock] = {}
_locks_lock = threading.Lock()


def _reset_after_fork() -> None:
    # A lock held by a thread of the parent stays held forever in the child, where that thread does not exist.
    global _locks_lock
    _locks.clear()
    _locks_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _generator(device: torch.device) -> Tuple[str, torch.Generator]:
    if device.type == "cuda":
        torch.cuda.init()  # type: ignore[no-untyped-call]
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}", torch.cuda.default_generators[index]
    return "cpu", torch.default_generator


@contextmanager
def seeded(device: torch.device, seed: Optional[int]) -> Generator[None, None, None]:
    """Runs the block on its own random stream: ``device``'s generator seeded with ``seed``, then put back.

    Holds the generator's lock for the block, so no other task draws from it
    meanwhile. ``seed=None`` runs the block as it is (no lock, no seeding).
    """
    if seed is None:
        yield
        return
    name, generator = _generator(device)
    with _locks_lock:
        lock = _locks.setdefault(name, threading.Lock())
    with lock:
        saved = generator.get_state()
        generator.manual_seed(seed)
        try:
            yield
        finally:
            generator.set_state(saved)
