"""Replicas of a module, one per device, that share the original module's parameters.

[Note: replicas] Replica 0 is the module itself: it lives on ``device_ids[0]``,
so its buffers (BatchNorm running statistics) are the module's own and what it
updates in place sticks, as with ``torch.nn.DataParallel``. Every other replica
is a shallow copy of the module tree with its own ``__dict__``:

- on the module's device (several ``'cpu'`` replicas, or two on one GPU) it
  uses the original :class:`~torch.nn.Parameter` objects, so gradients meet in
  them directly; its buffers are copies taken before any replica runs, so
  their updates are dropped, as torch's DataParallel drops the updates of
  replicas 1..n-1;
- on another device its parameters are differentiable copies made by
  :func:`torchpipe.transfer.move` (the backward of a copy sends the gradient
  back to the original, like torch's ``Broadcast``), and its buffers are
  plain copies.
"""
from typing import Dict, List, NamedTuple, Sequence

import torch
from torch import Tensor, nn

from torchpipe.transfer import move

__all__ = ["Replica", "replicate", "module_device_error"]


class Replica(NamedTuple):
    """One copy of a module placed on one device."""

    #: The module to call (the original itself for replica 0).
    module: nn.Module
    #: Where it computes.
    device: torch.device
    #: The tensors it computes with in place of ``module.parameters()``, in
    #: the same order: the original parameters, or their copies on ``device``.
    parameters: List[Tensor]


def module_device_error(module: nn.Module, device: torch.device) -> str:
    """A message naming the device of a parameter or buffer of ``module`` not on ``device``; '' if none."""
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.device != device:
            return (
                f"module must have its parameters and buffers on device {device} (device_ids[0]) "
                f"but found one of them ({name!r}) on device {tensor.device}; "
                f"move the module first: module.to({str(device)!r})"
            )
    return ""


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> List[Replica]:
    """One :class:`Replica` of ``module`` per entry of ``devices`` (see [Note: replicas]).

    ``module`` must live on ``devices[0]``. Copies of parameters to other
    devices are made in the caller's gradient mode, so they are differentiable
    when gradients are being recorded.

    Example::

        replicas = replicate(model, [torch.device('cpu'), torch.device('cpu')])
        assert replicas[0].module is model
    """
    if not devices:
        raise ValueError("cannot replicate a module on zero devices")
    source = devices[0]
    parameters: List[Tensor] = list(module.parameters())
    replicas = [Replica(module, source, parameters)]
    for device in devices[1:]:
        if device == source:
            replicas.append(Replica(_shared_copy(module, device), device, parameters))
        else:
            copies: List[Tensor] = move(list(parameters), device)
            replicas.append(Replica(_placed_copy(module, parameters, copies, device), device, copies))
    return replicas


def _tree_copy(module: nn.Module) -> Dict[int, nn.Module]:
    """Shallow copies of every module of the tree (shared submodules stay shared), keyed by original id."""
    copies: Dict[int, nn.Module] = {}

    def copy(m: nn.Module) -> nn.Module:
        if id(m) in copies:
            return copies[id(m)]
        replica = m.__new__(type(m))
        replica.__dict__ = m.__dict__.copy()
        replica._parameters = dict(m._parameters)
        replica._buffers = dict(m._buffers)
        copies[id(m)] = replica
        replica._modules = {name: None if child is None else copy(child) for name, child in m._modules.items()}
        return replica

    copy(module)
    return copies


def _copy_buffers(module: nn.Module, copies: Dict[int, nn.Module], device: torch.device) -> None:
    moved: Dict[int, Tensor] = {}
    for m in module.modules():
        replica = copies[id(m)]
        for name, buffer in m._buffers.items():
            if buffer is None:
                continue
            if id(buffer) not in moved:
                source = buffer if buffer.requires_grad else buffer.detach()
                moved[id(buffer)] = source.clone() if buffer.device == device else move(source, device)
            replica._buffers[name] = moved[id(buffer)]


def _shared_copy(module: nn.Module, device: torch.device) -> nn.Module:
    copies = _tree_copy(module)
    _copy_buffers(module, copies, device)
    return copies[id(module)]


def _placed_copy(
    module: nn.Module, parameters: List[Tensor], placed: List[Tensor], device: torch.device
) -> nn.Module:
    copies = _tree_copy(module)
    by_id = {id(p): c for p, c in zip(parameters, placed)}
    for m in module.modules():
        replica = copies[id(m)]
        for name, param in m._parameters.items():
            if param is None:
                continue
            del replica._parameters[name]
            # Copies are not leaves: set them as plain attributes, as torch's replicate does.
            object.__setattr__(replica, name, by_id[id(param)])
    _copy_buffers(module, copies, device)
    return copies[id(module)]

