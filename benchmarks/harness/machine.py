"""This machine: the line every benchmark prints first, its cores, the device a benchmark runs on, waiting for
that device, a block's intra-op threads, and whether torchgpipe is here to be measured beside torchpipe."""
import os
import platform
from contextlib import contextmanager
from types import ModuleType
from typing import Iterator, Optional

import torch

__all__ = ["cores", "machine_description", "default_device", "synchronize", "intra_op_threads",
           "torchgpipe_module"]


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(device: Optional[torch.device] = None) -> str:
    """One line naming the machine: CPU model, cores, torch version, and the CUDA device if any."""
    line = f"{_cpu_model()}, {cores()} cores, torch {torch.__version__}, Python {platform.python_version()}"
    if torch.cuda.is_available():
        index = device.index if device is not None and device.type == "cuda" and device.index is not None else 0
        line += f", CUDA {torch.version.cuda}: {torch.cuda.get_device_name(index)} x{torch.cuda.device_count()}"
    else:
        line += ", no CUDA"
    return line


def default_device(requested: Optional[str] = None) -> torch.device:
    """``requested`` if given, else ``cuda`` when available, else ``cpu``."""
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def intra_op_threads(count: Optional[int]) -> Iterator[None]:
    """Sets ``torch.set_num_threads(count)`` in the calling thread for the block (``None``: leave it)."""
    if count is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def torchgpipe_module() -> Optional[ModuleType]:
    """``torchgpipe`` if it is importable (for figures beside ours), else None."""
    try:
        import torchgpipe
    except ImportError:
        return None
    return torchgpipe
