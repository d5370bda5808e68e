"""What each rank runs in the tests of activation memory across processes: a step's peak resident set."""
import copy
import gc
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.memory import large_blocks_from_mmap, proc_status_bytes, reset_peak_rss
from torchpipe import Pipeline

MiB = 1 << 20


def step_peaks(rank: int, world: int, schedule: str, chunks: int, checkpoint: str, rows: int = 2048,
               width: int = 4096) -> Dict[str, Any]:
    """The peak resident set a training step adds on each rank, in MiB (the median of three steps after a warm-up
    one): a first stage whose output is ``rows x width`` floats per micro-batch (32 MiB by default) and keeps
    little for its backward (a linear layer's input), a last stage that reduces it to a loss."""
    # Large blocks from mmap, each returned to the system when freed: the resident set then follows the tensors.
    if not large_blocks_from_mmap() or not reset_peak_rss():  # another C library, or no clear_refs
        return {"skip": "no peak resident set to measure here (glibc's mallopt and /proc/self/clear_refs)"}
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
        reset_peak_rss()
        start = proc_status_bytes("VmHWM")
        pipe.step(x if first else None, y if not first else None)
        torch.distributed.barrier()
        if step > 0:
            peaks.append((proc_status_bytes("VmHWM") - start) / MiB)
        pipe.zero_grad()
    return {"peak": sorted(peaks)[len(peaks) // 2], "output": rows * width * 4 / MiB}


def planned(rank: int, world: int, memory_limit: float, recompute: str = "full") -> Dict[str, Any]:
    """A Pipeline of ``schedule='auto'`` within ``memory_limit`` bytes: what each rank chose and measured, its
    loss and gradients against the plain module's (or the error of its first step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8), nn.Linear(8, 64), nn.Tanh(),
                          nn.Linear(64, 8)).double()
    plain = copy.deepcopy(model)
    x, y = torch.randn(32, 8, dtype=torch.float64), torch.randn(32, 8, dtype=torch.float64)
    pipe = Pipeline(model, [3, 3], chunks=8, schedule="auto", memory_limit=memory_limit, loss_fn=F.mse_loss,
                    checkpoint="never" if recompute == "full" else "always", recompute=recompute,
                    group=torch.distributed.group.WORLD)
    before = str(pipe.memory())
    first = rank == pipe.schedule.stage_workers[0]
    try:
        loss = pipe.step(x if first else None, y if not first else None)
    except ValueError as error:
        return {"error": str(error)}
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    grads = {name: (p.grad - dict(plain.named_parameters())[name].grad).abs().max().item()
             for name, p in pipe.named_parameters()}
    report = pipe.memory()
    return {"before": before, "schedule": pipe.schedule_name, "held": report.held, "peak": report.predicted_peak,
            "gradients": report.gradients, "buffers": report.buffers, "temporaries": report.temporaries,
            "loss": abs(loss.item() - expected.item()), "grads": max(grads.values())}
