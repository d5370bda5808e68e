"""Train a model pipelined over processes, one stage per rank: the README's ``make run-distributed``.

Launch it with torchrun, on one host (CPU ranks talk over gloo, GPUs over NCCL)::

    torchrun --standalone --nproc-per-node 2 examples/train_distributed.py

or on several (the same command on each host, with ``--nnodes``, ``--node-rank``
and ``--rdzv-endpoint``; see docs/distributed.md). Every rank runs this
script; the rank of the first stage reads the inputs, the rank of the last
stage the targets, and every rank gets the loss. Rank 0 prints the progress,
the throughput, and writes the merged timeline of one step (a row per rank
and stage) and the trained model's state dict (plain keys).

Flags: ``--epochs``, ``--chunks``, ``--schedule`` (``1f1b``, ``gpipe``,
``zero_bubble``, ``interleaved_1f1b``), ``--batch``, ``--timeline out.json``,
``--save model.pt``.
"""
import argparse
import os
import time
from pathlib import Path
from typing import List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import torchpipe
from torchpipe import trace

CLASSES = 10


def model(stages: int, width: int = 256) -> nn.Sequential:
    """An MLP classifier, a Linear and a ReLU per stage and the output layer last: the same on every rank."""
    torch.manual_seed(0)
    layers: List[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(stages - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, CLASSES))


def data(batches: int, batch: int) -> List[Tuple[Tensor, Tensor]]:
    """Noisy copies of one random template per class (the same on every rank: seeded)."""
    generator = torch.Generator().manual_seed(1)
    templates = torch.randn(CLASSES, 64, generator=generator)
    out = []
    for _ in range(batches):
        labels = torch.randint(0, CLASSES, (batch,), generator=generator)
        inputs = templates[labels] + 0.8 * torch.randn(batch, 64, generator=generator)
        out.append((inputs, labels))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zero_bubble", "interleaved_1f1b"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=16, help="batches per epoch")
    parser.add_argument("--timeline", default="out/timeline-distributed.json")
    parser.add_argument("--save", default=None, help="write the trained state dict (plain keys) here")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    stages = world * (2 if args.schedule == "interleaved_1f1b" else 1)
    net = model(stages)
    balance = [2] * (stages - 1) + [3]
    pipe = torchpipe.Pipeline(net, balance, chunks=args.chunks, schedule=args.schedule, loss_fn=F.cross_entropy,
                              group=dist.group.WORLD)
    first, last = pipe.schedule.stage_workers[0], pipe.schedule.stage_workers[-1]
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    batches = data(args.batches, args.batch)
    if rank == 0:
        print(f"{world} ranks ({'NCCL' if cuda else 'gloo'}), {stages} stages, schedule {args.schedule}, "
              f"chunks {args.chunks}, batch {args.batch}; this rank holds layers "
              f"{sorted({n.split('.')[0] for n, _ in pipe.named_parameters()}, key=int)}", flush=True)

    for epoch in range(args.epochs):
        start, losses = time.perf_counter(), []
        for x, y in batches:
            loss = pipe.step(x if rank == first else None, y if rank == last else None)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        seconds = time.perf_counter() - start
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                  f"{len(batches) * args.batch / seconds:.0f} samples/s", flush=True)

    with trace.record_timeline() as timeline:
        x, y = batches[0]
        pipe.step(x if rank == first else None, y if rank == last else None)
        optimizer.zero_grad()
    merged = pipe.gather_timeline(timeline)
    if merged is not None and args.timeline:
        merged.save_chrome_trace(args.timeline)
        picture = str(Path(args.timeline).with_suffix(".png"))
        try:
            merged.save_png(picture, title=f"{args.schedule}, {world} ranks (number: micro-batch)")
        except ImportError:
            picture = "no PNG: matplotlib is not installed"
        print(f"timeline of one step: {args.timeline} (chrome://tracing, ui.perfetto.dev), {picture}", flush=True)
    state = pipe.full_state_dict()
    if rank == first and args.save:
        torch.save(state, args.save)
        print(f"state dict ({len(state)} tensors, plain keys) saved to {args.save}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
