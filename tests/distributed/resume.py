"""A training job that one of its ranks kills (SIGKILL) in its first attempt, for torchrun --max-restarts to restart:
run by tests/distributed/test_restart.py.

Every rank: ``torchpipe.distributed.init_process_group``, a float64 MLP as a Pipeline (``group=`` the world, or a
``--dp`` x pp mesh), SGD with momentum, a :class:`torchpipe.Checkpointer`; it resumes from the newest complete
checkpoint and trains to ``--steps``. In attempt 0, rank ``--kill-rank`` kills itself in the forward of its second
micro-batch of step ``--kill-step`` (``--kill-in`` ``step``), or while its save of step ``--kill-step`` is written
(``save``: its write is under way, it has not counted itself done). Rank 0 appends one JSON line per attempt to
``--out``: the attempt, the step it resumed from, when (``time.time()``), the losses, and at the end the path of
the whole model's state dict (plain keys).
"""
import argparse
import json
import os
import signal
import time
from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchpipe
import torchpipe.distributed

WIDTH = 12


def model(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(5, WIDTH), nn.Tanh()]
    for _ in range(stages - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 3)).double()


def batch(step: int, size: int = 12) -> Tuple[Tensor, Tensor]:
    """The whole (global) batch of ``step``: the same on every rank and in every attempt."""
    generator = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(size, 5, generator=generator, dtype=torch.float64), torch.randint(0, 3, (size,),
                                                                                        generator=generator)


def optimizer_of(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def kill(out: str) -> None:
    """Dies at once, after writing when (for the restart's time)."""
    with open(f"{out}.killed", "w") as file:
        file.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-in", choices=["step", "save"], default="step")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--data-parallel", default="replicate")
    args = parser.parse_args()

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    started = time.time()
    import datetime

    torchpipe.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = world // args.dp
    options: Any = {"group": dist.group.WORLD}
    replica = 0
    if args.dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (args.dp, pp), mesh_dim_names=("dp", "pp"))
        replica = mesh.get_local_rank("dp")
        options = {"mesh": mesh, "data_parallel": args.data_parallel}
    pipe = torchpipe.Pipeline(model(pp), [2] * (pp - 1) + [3], chunks=3, loss_fn=F.cross_entropy, **options)
    first, last = pipe.schedule.stage_workers[0], pipe.schedule.stage_workers[-1]
    optimizer = optimizer_of(pipe.parameters())
    ckpt = torchpipe.Checkpointer(args.dir, pipe, optimizer, every=args.every, keep=2)
    start = ckpt.restore()
    assert start == 0 or ckpt.extra == {"step": start}, (start, ckpt.extra)
    resumed = time.time()
    dying = attempt == 0 and rank == args.kill_rank
    if dying and args.kill_in == "step":
        layer = next(iter(pipe.children()))
        calls = [0]

        def pre_hook(*_: Any) -> None:  # the second micro-batch's forward of step kill_step
            calls[0] += 1
            if calls[0] == 3 * (args.kill_step - start) + 2:
                kill(args.out)

        layer.register_forward_pre_hook(pre_hook)
    losses = []
    for step in range(start, args.steps):
        x, y = batch(step)
        share = len(x) // args.dp
        x, y = x[replica * share:(replica + 1) * share], y[replica * share:(replica + 1) * share]
        loss = pipe.step(x if pipe.rank == first else None, y if pipe.rank == last else None)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if dying and args.kill_in == "save" and step + 1 == args.kill_step:
            # Its write under way (DCP's thread), the rank dies before it counts itself done.
            ckpt._finish = lambda *_: kill(args.out)  # type: ignore[method-assign]
        ckpt.step(step + 1, extra={"step": step + 1})
    ckpt.close()
    state = pipe.full_state_dict()
    if rank == 0:
        path = f"{args.out}.attempt{attempt}.pt"
        torch.save(state, path)
        with open(args.out, "a") as file:
            file.write(json.dumps({"attempt": attempt, "start": start, "started": started, "resumed": resumed,
                                   "losses": losses, "state": path}) + "\n")
        print(f"attempt {attempt}: resumed from step {start}, trained to step {args.steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
