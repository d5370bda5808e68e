"""What each rank runs in the tests of activation memory across processes: a step's peak resident set."""
import ctypes
import gc
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from torchpipe import Pipeline

MiB = 1 << 20


def _peak_rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def step_peaks(rank: int, world: int, schedule: str, chunks: int, checkpoint: str, rows: int = 2048,
               width: int = 4096) -> Dict[str, Any]:
    """The peak resident set a training step adds on each rank, in MiB (the median of three steps after a warm-up
    one): a first stage whose output is ``rows x width`` floats per micro-batch (32 MiB by default) and keeps
    little for its backward (a linear layer's input), a last stage that reduces it to a loss."""
    # Large blocks from mmap, each returned to the system when freed: the resident set then follows the tensors.
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
        _reset_peak()
    except OSError as exc:  # another C library, or /proc/self/clear_refs not writable here
        return {"skip": f"no peak resident set to measure: {exc}"}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, width), nn.Linear(width, 1))
    pipe = Pipeline(model, [1, 1], chunks=chunks, schedule=schedule, checkpoint=checkpoint, loss_fn=F.mse_loss,
                    group=torch.distributed.group.WORLD)
    x, y = torch.randn(rows * chunks, 16), torch.randn(rows * chunks, 1)
    first = rank == pipe.schedule.stage_workers[0]
    peaks: List[float] = []
    for step in range(4):
        gc.collect()
        torch.distributed.barrier()
        _reset_peak()
        start = _peak_rss()
        pipe.step(x if first else None, y if not first else None)
        torch.distributed.barrier()
        if step > 0:
            peaks.append((_peak_rss() - start) / MiB)
        pipe.zero_grad()
    return {"peak": sorted(peaks)[len(peaks) // 2], "output": rows * width * 4 / MiB}
