"""Partitioning: check the module and the balance, resolve devices, and split the Sequential."""
import numbers
import warnings
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from torchpipe.stream import as_device
from torchpipe.types import Device

__all__ = [
    "BalanceError", "verify_module", "verify_balance", "resolve_devices", "cut", "place",
    "names_a_device", "moving_denied",
]


class BalanceError(ValueError):
    """The balance does not fit the module: wrong sum, or a non-positive entry."""


def verify_module(module: nn.Module) -> None:
    """Checks that ``module`` can be partitioned.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: it holds the same child twice, or children share a buffer.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"non-sequential module cannot be partitioned: GPipe and Pipeline take an nn.Sequential, got "
            f"{type(module).__name__}; torchpipe.as_sequential(model, example_input) makes one of any traceable "
            "model (a Hugging Face model included)"
        )
    names_by_child: Dict[int, List[str]] = {}
    for name, child in module._modules.items():
        if child is not None:
            names_by_child.setdefault(id(child), []).append(name)
    repeated = [names for names in names_by_child.values() if len(names) > 1]
    if repeated:
        where = "; ".join(", ".join(names) for names in repeated)
        raise ValueError(f"module with duplicate children is not supported (the same layer at positions {where})")
    # Layers may share a parameter (see [Note: tied parameters]), not a buffer: a buffer's updates (BatchNorm's
    # running statistics) could not be kept equal between copies on different devices or ranks.
    owners: Dict[int, str] = {}
    for name, child in module._modules.items():
        if child is None:
            continue
        for buffer in child.buffers():
            if id(buffer) in owners and owners[id(buffer)] != name:
                raise ValueError(
                    f"module with a buffer shared by distinct children is not supported (layers "
                    f"{owners[id(buffer)]} and {name} share a buffer of shape {tuple(buffer.shape)}); give each "
                    "layer its own (layers may share parameters)"
                )
            owners[id(buffer)] = name


def verify_balance(module: nn.Sequential, balance: Optional[Sequence[int]]) -> List[int]:
    """Checks ``balance`` against ``module`` and returns it as a list.

    Raises:
        ValueError: ``balance`` is missing.
        BalanceError: it does not sum to ``len(module)`` or has a non-positive entry.
    """
    if balance is None:
        raise ValueError(
            "balance is required: a list of layer counts per partition summing to "
            f"{len(module)}; torchpipe_balancing.balance_by_time or balance_by_size can find one"
        )
    if isinstance(balance, (numbers.Number, str)):
        raise BalanceError(f"balance must be a list of positive ints, got {balance!r}")
    try:
        entries = list(balance)
    except TypeError:
        raise BalanceError(f"balance must be a list of positive ints, got {balance!r}") from None
    if not entries and len(module) > 0:
        raise BalanceError("balance is empty; give at least one partition")
    bad = [b for b in entries if not isinstance(b, numbers.Integral) or isinstance(b, bool) or b <= 0]
    if bad:
        raise BalanceError(f"every entry of balance must be a positive int (balance: {entries}; bad: {bad})")
    balance = [int(b) for b in entries]  # NumPy and other integral types become plain ints
    if sum(balance) != len(module):
        raise BalanceError(
            f"module has {len(module)} layers but balance sums to {sum(balance)} (balance: {balance}); "
            "torchpipe_balancing.balance_by_time can find one"
        )
    return balance


def resolve_devices(devices: Optional[Sequence[Device]], partitions: int) -> List[torch.device]:
    """One device per partition: the given ones (extra ones ignored), or the defaults.

    The default is ``cuda:0 … cuda:n-1`` when CUDA has at least ``n`` devices,
    and ``'cpu'`` for every partition when CUDA is not available.

    Raises:
        IndexError: fewer devices than partitions, given or available.
    """
    if devices is None:
        if not torch.cuda.is_available():
            return [torch.device("cpu")] * partitions
        count = torch.cuda.device_count()
        if count < partitions:
            raise IndexError(
                f"{partitions} partitions need {partitions} devices but CUDA has {count}; "
                "pass devices=[...] (devices may repeat, e.g. devices=['cuda:0'] * n)"
            )
        return [torch.device("cuda", i) for i in range(partitions)]
    if isinstance(devices, (str, int, torch.device)):
        raise TypeError(f"devices must be a list with one device per partition, got {devices!r}")
    devices = list(devices)
    if len(devices) < partitions:
        raise IndexError(
            f"too few devices for {partitions} partitions: got {len(devices)} ({devices}); give one per partition"
        )
    return [as_device(d) for d in devices[:partitions]]


def cut(module: nn.Sequential, balance: Sequence[int]) -> List[nn.Sequential]:
    """Cuts ``module`` into ``len(balance)`` Sequentials of consecutive layers, where they are.

    Layers keep their names, so ``stages[j].<name>`` is the original layer.
    """
    layers = list(module._modules.items())
    stages: List[nn.Sequential] = []
    start = 0
    for count in balance:
        chunk: OrderedDict[str, nn.Module] = OrderedDict()
        for name, layer in layers[start : start + count]:
            assert layer is not None, f"layer {name} is None"
            chunk[name] = layer
        stages.append(nn.Sequential(chunk))
        start += count
    return stages


def place(stage: nn.Module, device: torch.device) -> nn.Module:
    """Moves ``stage`` to ``device``; a stage built on the ``meta`` device is materialised there instead.

    Materialising allocates the stage's parameters and buffers on ``device``
    (``to_empty``) and initialises them with each submodule's
    ``reset_parameters()``, so no process ever holds the weights of stages it
    does not run. A submodule with parameters but no ``reset_parameters`` is
    left uninitialised (a warning names it): load a state dict. Its
    non-persistent buffers (a rotary embedding's frequencies), which no state
    dict holds, are named in a warning of their own: set them.
    """
    tensors = list(stage.parameters()) + list(stage.buffers())
    if not any(t.is_meta for t in tensors):
        return stage.to(device)
    stage.to_empty(device=device)
    left, lost = [], []
    with torch.no_grad():
        for name, sub in stage.named_modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
                continue
            if any(True for _ in sub.parameters(recurse=False)):
                left.append(name or type(sub).__name__)
            lost += [f"{name}.{b}" if name else b for b in sorted(sub._non_persistent_buffers_set)
                     if sub._buffers.get(b) is not None]
    if left:
        warnings.warn(
            f"materialised on {device} without initialising {', '.join(left)} (no reset_parameters()); "
            "load a state dict before training",
            stacklevel=3,
        )
    if lost:
        warnings.warn(
            f"materialised on {device} without initialising the buffers {', '.join(lost)}, which no state dict "
            "holds (they are not persistent): their values are garbage until you set them, or build the model "
            "on a device instead of 'meta'",
            stacklevel=3,
        )
    return stage


def names_a_device(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether ``Module.to(*args, **kwargs)`` names a device: a device, a string, an index, or a tensor to match."""
    return any(isinstance(a, (torch.device, str, int, Tensor)) for a in args) or any(
        kwargs.get(k) is not None for k in ("device", "tensor")
    )


def moving_denied(owner: str, parts: str, handle: str) -> TypeError:
    """The error of moving a pipeline's ``parts`` by hand (a new one per raise: a raised instance keeps its
    traceback, and with it the frames it was raised from)."""
    return TypeError(
        f"denied to move the {parts} of a {owner}: they are placed on their devices by {owner}; "
        f"choose devices with {owner}(..., devices=[...]) ({handle}.to(dtype) works)"
    )
