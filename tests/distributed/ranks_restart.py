"""What each rank runs in the tests of restarts and checkpoints across processes (called by launch.py)."""
import datetime
import os
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import torchpipe
from tests.distributed import resume
from torchpipe.distributed import channel


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            raise ValueError("layer failed on purpose")
        return x


def a_second_attempt_reads_none_of_the_first(rank: int, world: int) -> Dict[str, Any]:
    """Two attempts of a job on one store, as torchrun's restart makes them (the default group made by torch's own
    call): in attempt 0, rank 1's layer fails in step 1 (its record stays in the store, as a dead rank's would).
    Attempt 1's processes number their pipelines from 0 again; its pipeline must build, and its step 1 succeed."""
    fails = Fails()

    def build() -> torchpipe.Pipeline:
        torch.manual_seed(0)
        layers: List[nn.Module] = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), fails]
        return torchpipe.Pipeline(nn.Sequential(*layers), [2, 2], chunks=2, loss_fn=F.mse_loss,
                                  group=dist.group.WORLD)

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"
    first = build()
    fails.armed = rank == 1
    try:
        first.step(x if rank == 0 else None, y if rank == 1 else None)
        raised = ""
    except Exception as exc:  # noqa: BLE001 - the report says what
        raised = type(exc).__name__
    fails.armed = False
    channel._instances.clear()  # a fresh process numbers its pipelines from 0
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    second = build()
    loss = second.step(x if rank == 0 else None, y if rank == 1 else None)
    assert first._channel is not None and second._channel is not None
    return {"raised": raised, "prefixes": [first._channel.prefix, second._channel.prefix], "loss": loss.item()}


def checkpointer_save(rank: int, world: int, directory: str, steps: int) -> bool:
    """Trains resume.py's model on ``world`` ranks (group=), saving every 2 steps with a Checkpointer."""
    pipe = torchpipe.Pipeline(resume.model(world), [2] * (world - 1) + [3], chunks=3, loss_fn=F.cross_entropy,
                              group=dist.group.WORLD)
    optimizer = resume.optimizer_of(pipe.parameters())
    with torchpipe.Checkpointer(directory, pipe, optimizer, every=2) as ckpt:
        assert ckpt.restore() == 0
        for step in range(steps):
            x, y = resume.batch(step)
            pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
            optimizer.step()
            optimizer.zero_grad()
            ckpt.step(step + 1, extra={"rank": rank, "step": step + 1})
    return True


def bad_directory_on_one_rank(rank: int, world: int, folder: str) -> Dict[str, str]:
    """Rank 1 alone finds a file where the directory should be (as on a host whose file system differs): every rank
    raises, before any step."""
    path = Path(folder) / "ckpt"
    if rank == 1:
        path = Path(folder) / "file"
        path.write_text("")
    pipe = torchpipe.Pipeline(resume.model(world), [2] * (world - 1) + [3], chunks=3, loss_fn=F.cross_entropy,
                              group=dist.group.WORLD)
    try:
        torchpipe.Checkpointer(path, pipe, resume.optimizer_of(pipe.parameters()), every=2)
    except (ValueError, OSError) as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": ""}


def dies_outside_a_step(rank: int, world: int, where: str) -> Dict[str, Any]:
    """Global rank 0 hosts the store and idles (as torchrun's agent would: the store outlives the dead rank); ranks
    1 and 2 run a pipeline. After two steps, ``'between steps'``: its first stage's rank (1) dies and rank 2 starts
    a step, waiting for the start that never comes; ``'in a collective'``: rank 2 dies and rank 1 calls
    clip_grad_norm_, which waits in the store for rank 2's norm. What the survivor raised, and when."""
    import signal
    import time

    group = dist.new_group([1, 2])
    if rank == 0:
        store = dist.distributed_c10d._get_default_store()
        store.wait(["survivor"], datetime.timedelta(seconds=120))  # the survivor has reported
        return {}
    torch.manual_seed(0)
    pipe = torchpipe.Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), [2, 1], chunks=2,
                              loss_fn=F.mse_loss, group=group)
    x = torch.randn(4, 4)
    for _ in range(2):
        pipe.step(x if rank == 1 else None, x if rank == 2 else None)
    dying = 1 if where == "between steps" else 2
    if rank == dying:
        time.sleep(0.5)  # the survivor is waiting
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        if where == "between steps":
            pipe.step(None, x)
        else:
            pipe.clip_grad_norm_(1.0)
        report = {"raised": ""}
    except Exception as exc:  # noqa: BLE001 - the report says what
        report = {"raised": type(exc).__name__, "message": str(exc)}
    report["seconds"] = time.monotonic() - started
    dist.distributed_c10d._get_default_store().set("survivor", "1")
    return report
