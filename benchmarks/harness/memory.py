"""A process's memory: its resident set now and at its peak (Linux's ``/proc/self/status``), the peak reset, and
the peak a step adds, on the CPU or on CUDA."""
import sys
from typing import Optional

import torch

from benchmarks.harness.steps import Step

__all__ = ["proc_status_bytes", "reset_peak_rss", "large_blocks_from_mmap", "cpu_peak_rss_bytes", "step_peak_bytes"]


def proc_status_bytes(field: str) -> int:
    """A size line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``...), in bytes.

    Raises:
        RuntimeError: there is no such line (the memory figures need Linux).
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line (the memory figures need Linux)")


def reset_peak_rss() -> bool:
    """Resets this process's peak resident set size (``VmHWM``) to the current one, through
    ``/proc/self/clear_refs`` (Linux 4.0+); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def large_blocks_from_mmap(threshold: int = 1 << 16) -> bool:
    """Makes glibc's malloc take every block of ``threshold`` bytes or more from ``mmap``, so that a freed tensor
    leaves the resident set at once and the resident set follows the tensors; False without glibc."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def cpu_peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes.

    On Linux this is ``VmHWM`` from ``/proc/self/status``, the peak of this
    process's own address space. ``getrusage``'s ``ru_maxrss`` is not used
    there: Linux carries it over fork and exec, so a child of a large parent
    would report at least the parent's size. Elsewhere, ``ru_maxrss``.
    """
    try:
        return proc_status_bytes("VmHWM")
    except (OSError, RuntimeError):
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def step_peak_bytes(step: Step, device: Optional[torch.device] = None) -> Optional[int]:
    """Runs ``step``; the bytes it added at its peak to what was held before it.

    On CUDA: ``torch.cuda.max_memory_allocated`` (reset before the step) minus ``memory_allocated`` before it. On
    the CPU: the process's peak resident set size (reset through ``/proc/self/clear_refs``) above its size
    before, a coarse figure; None where the peak cannot be reset (the step still runs).
    """
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    reset = reset_peak_rss()
    before = proc_status_bytes("VmRSS")
    step()
    return max(0, proc_status_bytes("VmHWM") - before) if reset else None
