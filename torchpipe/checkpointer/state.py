"""What a checkpoint holds beside the model's and optimizer's state: every rank's random number generators, and
the comparison of a checkpoint's keys with the model's (a clear error, nothing loaded, for another model's)."""
import random
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["flat_keys", "mismatch", "some", "without_grads", "put_grads", "cuda_devices", "rng_states",
           "set_rng_states"]


def flat_keys(state: Dict[str, Any]) -> Dict[str, Optional[Tuple[int, ...]]]:
    """The keys DCP writes ``state`` under (a nested dict's keys joined by dots), with each tensor's (global)
    shape; None for other values (DCP may flatten a container of tensors further, under the key as prefix)."""
    flat: Dict[str, Optional[Tuple[int, ...]]] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                visit(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = tuple(value.shape)
        else:
            flat[prefix] = None

    visit("", state)
    return flat


def mismatch(
    state: Dict[str, Any], metadata: Dict[str, Any], every_rank: Sequence[Sequence[str]]
) -> Optional[Tuple[str, str]]:
    """What makes the checkpoint (``metadata``: DCP's key -> storage) not this model's: this rank's keys it
    lacks, shapes that differ, and model keys it has that no rank (``every_rank``'s keys) holds."""
    mine = flat_keys(state)
    held = set(metadata)

    def there(key: str) -> bool:
        return key in held or any(k.startswith(key + ".") for k in held)

    missing = sorted(k for k in mine if not there(k))
    shapes = []
    for key, shape in sorted(mine.items()):
        size = getattr(metadata.get(key), "size", None)
        if shape is not None and size is not None and tuple(size) != shape:
            shapes.append(f"{key!r}: {tuple(size)} in the checkpoint, {shape} here")
    known = {k for keys in every_rank for k in keys}
    unknown = sorted(k for k in held if k.startswith("model.") and k not in known)
    if not (missing or shapes or unknown):
        return None
    parts = []
    if missing:
        parts.append(f"keys it lacks: {some([repr(k) for k in missing])}")
    if unknown:
        parts.append(f"model keys no rank here holds: {some([repr(k) for k in unknown])}")
    if shapes:
        parts.append(f"shapes that differ: {some(shapes)}")
    return "ValueError", ("the checkpoint is not of this model (or optimizer): " + "; ".join(parts)
                          + ". Nothing was loaded: pass the directory of this model's checkpoints, or build the "
                            "model (and optimizer) that saved it")


def some(items: Sequence[str], most: int = 12) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def without_grads(optimizer: torch.optim.Optimizer) -> List[Optional[torch.Tensor]]:
    """Takes every parameter's ``.grad`` away (DCP makes an empty optimizer state only where there is none)."""
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grads.append(param.grad)
            param.grad = None
    return grads


def put_grads(optimizer: torch.optim.Optimizer, grads: List[Optional[torch.Tensor]]) -> None:
    values = iter(grads)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = next(values)


def cuda_devices(pipe: nn.Module) -> List[int]:
    """The CUDA devices whose generators this rank's random numbers come from: the pipeline's, and the current."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return []
    devices = {torch.cuda.current_device()}
    for device in getattr(pipe, "devices", None) or ():
        if isinstance(device, torch.device) and device.type == "cuda":
            devices.add(device.index if device.index is not None else torch.cuda.current_device())
    return sorted(devices)


def rng_states(pipe: nn.Module) -> Dict[str, Any]:
    """This process's RNG states: torch's CPU generator, the CUDA generators it uses, Python's ``random``,
    NumPy's global one (if NumPy is installed)."""
    states: Dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate(),
                              "cuda": {d: torch.cuda.get_rng_state(d) for d in cuda_devices(pipe)}}
    try:
        import numpy
    except ImportError:
        return states
    states["numpy"] = numpy.random.get_state()
    return states


def set_rng_states(states: Dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["random"])
    cuda = states.get("cuda") or {}
    if cuda and torch.cuda.is_available():
        for device, state in cuda.items():
            if device < torch.cuda.device_count():
                torch.cuda.set_rng_state(state, device)
    if "numpy" in states:
        try:
            import numpy
        except ImportError:
            warnings.warn("the checkpoint holds NumPy's RNG state, but NumPy is not installed: not restored",
                          stacklevel=3)
            return
        numpy.random.set_state(states["numpy"])
