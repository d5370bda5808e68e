"""Profile a module in place and put everything back: device, modes, ``requires_grad``, ``.grad``, buffers.

[Note: sandbox] The profilers run the user's own layers (no copies, so layers
that cannot be deep-copied still profile, and nothing doubles in memory), so
this module records every piece of state that profiling could disturb and
restores it on the way out, also when a layer raises:

* every submodule's ``training`` flag (profiling runs in training mode, the
  mode the balance is for);
* every parameter object, its data (so its device), ``requires_grad`` and
  ``.grad`` (the very tensor, or ``None``); ``.grad`` is cleared while
  profiling so that the profiling backward passes never add into it;
* every buffer: profiling runs on copies, so BatchNorm's ``running_mean``,
  ``running_var`` and ``num_batches_tracked`` never change;
* the global RNG state of the CPU and the profiling device (dropout draws
  during profiling do not shift the user's random stream).
"""
from contextlib import contextmanager
from typing import Iterator, List, NamedTuple, Optional

import torch
from torch import Tensor, nn

__all__ = ["sandbox"]


class _ParameterState(NamedTuple):
    owner: nn.Module
    name: str
    parameter: nn.Parameter
    data: Tensor
    requires_grad: bool
    grad: Optional[Tensor]


class _BufferState(NamedTuple):
    owner: nn.Module
    name: str
    buffer: Tensor


@contextmanager
def sandbox(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Moves ``module`` to ``device`` in training mode for the block, then restores it exactly.

    See [Note: sandbox] for what is restored.
    """
    submodules = list(module.modules())
    modes = [(m, m.training) for m in submodules]
    parameters: List[_ParameterState] = []
    buffers: List[_BufferState] = []
    for owner in submodules:
        for name, p in owner._parameters.items():
            if p is not None:
                parameters.append(_ParameterState(owner, name, p, p.data, p.requires_grad, p.grad))
        for name, b in owner._buffers.items():
            if b is not None:
                buffers.append(_BufferState(owner, name, b))

    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        moved: set[int] = set()
        for state in parameters:
            if id(state.parameter) in moved:
                continue  # shared between submodules: move it once
            moved.add(id(state.parameter))
            state.parameter.grad = None
            if state.data.device != device:
                state.parameter.data = state.data.to(device)
        for owner, name, buffer in buffers:
            owner._buffers[name] = buffer.detach().to(device, copy=True)
        module.train()
        with torch.random.fork_rng(devices=rng_devices, device_type=device.type if rng_devices else "cuda"):
            yield
    finally:
        for m, training in modes:
            m.training = training
        for state in parameters:
            state.owner._parameters[state.name] = state.parameter
            state.parameter.grad = None  # drop profiling grads before the data may change device
        for state in parameters:
            state.parameter.data = state.data
            state.parameter.grad = state.grad
            state.parameter.requires_grad_(state.requires_grad)
        for owner, name, buffer in buffers:
            owner._buffers[name] = buffer
