"""Train a model pipelined over processes: the README's ``make run-distributed`` and ``make run-mesh``.

Launch it with torchrun, on one host (CPU ranks talk over gloo, GPUs over NCCL)::

    torchrun --standalone --nproc-per-node 2 examples/train_distributed.py           # one stage per rank
    torchrun --standalone --nproc-per-node 4 examples/train_distributed.py --dp 2    # 2 replicas x 2 stages

or on several (the same command on each host, with ``--nnodes``, ``--node-rank``
and ``--rdzv-endpoint``; see docs/distributed.md). Every rank runs this
script; the rank of the first stage reads the inputs, the rank of the last
stage the targets, and every rank gets the loss. Rank 0 prints the progress,
the throughput, and writes the merged timeline of one step (a row per rank
and stage) and the trained model's state dict (plain keys).

With ``--dp N`` the ranks form a 2-D mesh of ``N`` data-parallel replicas
(``'dp'``) of a pipeline over ``world / N`` ranks (``'pp'``): each replica
reads its own share of every batch (a ``DistributedSampler`` over the
replicas), the loss is the mean over all replicas' samples, and gradients are
reduced over ``'dp'`` once per step, all-reduced (``--data-parallel
replicate``) or reduce-scattered onto FSDP2 shards (``--data-parallel shard``).
``--batch`` is the global batch: the replicas together train on the same
samples per step as one pipeline would.

Flags: ``--epochs``, ``--chunks``, ``--schedule`` (``1f1b``, ``gpipe``,
``zero_bubble``, ``interleaved_1f1b``), ``--batch``, ``--dp``,
``--data-parallel``, ``--timeline out.json``, ``--save model.pt``.
"""
import argparse
import os
import time
from pathlib import Path
from typing import Any, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

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


def replica_batches(batches: List[Tuple[Tensor, Tensor]], replica: int, replicas: int) -> List[Tuple[Tensor, Tensor]]:
    """This replica's share of every batch, as a ``DistributedSampler`` over the replicas deals it.

    Without shuffling, the sampler gives replica ``r`` every ``replicas``-th
    sample from ``r`` on, so the ``k``-th batches of all replicas together are
    the ``k``-th batch of one pipeline: the same samples, the same loss, the
    same gradients. (With ``shuffle=True`` call ``sampler.set_epoch(epoch)``
    on every rank, with the same seed: a replica's ranks must read the same
    samples, the first stage's rank the inputs and the last stage's the
    targets.)
    """
    dataset = TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=replica, shuffle=False)
    loader = DataLoader(dataset, batch_size=len(batches[0][0]) // replicas, sampler=sampler)
    return list(loader)  # read once: the synthetic data set is small, and the epochs time the steps alone


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zero_bubble", "interleaved_1f1b"])
    parser.add_argument("--batch", type=int, default=256, help="the global batch (over every replica)")
    parser.add_argument("--batches", type=int, default=16, help="batches per epoch")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel replicas: a dp x pp mesh with pp = world size / dp (default: no mesh, "
                             "one pipeline over every rank)")
    parser.add_argument("--data-parallel", default="replicate", choices=["replicate", "shard"],
                        help="with --dp: whole stages on every replica (gradients all-reduced) or FSDP2 shards")
    parser.add_argument("--timeline", default=None,
                        help="where to write one step's timeline (default: out/timeline-distributed.json, "
                             "with --dp out/timeline-mesh.json; '' for none)")
    parser.add_argument("--save", default=None, help="write the trained state dict (plain keys) here")
    args = parser.parse_args()
    if args.timeline is None:
        args.timeline = "out/timeline-distributed.json" if args.dp is None else "out/timeline-mesh.json"

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    dp = 1 if args.dp is None else args.dp
    if dp < 1 or world % dp or args.batch % dp:
        parser.error(f"--dp {dp} must divide the world size ({world}) and --batch ({args.batch})")
    pp = world // dp
    mesh: Any = None
    replica = 0
    if args.dp is not None:
        from torch.distributed.device_mesh import init_device_mesh

        # Ranks r * pp ... r * pp + pp - 1 are replica r's pipeline: neighbouring ranks (one host's, with torchrun)
        # pass activations to each other, and each replica's gradient reduction spans the hosts.
        mesh = init_device_mesh("cuda" if cuda else "cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
        replica = mesh.get_local_rank("dp")
    stages = pp * (2 if args.schedule == "interleaved_1f1b" else 1)
    net = model(stages)
    balance = [2] * (stages - 1) + [3]
    options: Any = {"group": dist.group.WORLD} if mesh is None else {"mesh": mesh, "data_parallel": args.data_parallel}
    pipe = torchpipe.Pipeline(net, balance, chunks=args.chunks, schedule=args.schedule, loss_fn=F.cross_entropy,
                              **options)
    # The stage ranks within this replica's pipeline: pipe.rank is this rank's position on it.
    first, last = pipe.schedule.stage_workers[0], pipe.schedule.stage_workers[-1]
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    batches = replica_batches(data(args.batches, args.batch), replica, dp)
    if rank == 0:
        on_mesh = f", mesh dp {dp} x pp {pp} ({args.data_parallel})" if mesh is not None else ""
        per_replica = f" ({args.batch // dp} per replica)" if mesh is not None else ""
        print(f"{world} ranks ({'NCCL' if cuda else 'gloo'}){on_mesh}, {stages} stages, schedule {args.schedule}, "
              f"chunks {args.chunks}, batch {args.batch}{per_replica}; this rank holds layers "
              f"{sorted({n.split('.')[0] for n, _ in pipe.named_parameters()}, key=int)}", flush=True)

    def step(x: Tensor, y: Tensor) -> Tensor:
        return pipe.step(x if pipe.rank == first else None, y if pipe.rank == last else None)

    for epoch in range(args.epochs):
        start, losses = time.perf_counter(), []
        for x, y in batches:
            loss = step(x, y)  # every replica's mean: the same on every rank
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        seconds = time.perf_counter() - start
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                  f"{len(batches) * args.batch / seconds:.0f} samples/s", flush=True)

    with trace.record_timeline() as timeline:
        x, y = batches[0]
        step(x, y)
        optimizer.zero_grad()
    # On a mesh each replica's pipeline merges its own ranks' timelines (rows by position on the pipeline); the
    # first replica's shows one step, with its gradient reductions ('reduce'), and is the one saved here.
    merged = pipe.gather_timeline(timeline)
    if merged is not None and replica == 0 and args.timeline:
        merged.save_chrome_trace(args.timeline)
        picture = str(Path(args.timeline).with_suffix(".png"))
        title = f"{args.schedule}, {pp} ranks" + (f", replica 0 of {dp}" if mesh is not None else "")
        try:
            merged.save_png(picture, title=f"{title} (number: micro-batch)")
        except ImportError:
            picture = "no PNG: matplotlib is not installed"
        which = "" if mesh is None else f" of replica 0 (ranks 0 to {pp - 1})"
        print(f"timeline of one step{which}: {args.timeline} (chrome://tracing, ui.perfetto.dev), {picture}",
              flush=True)
    state = pipe.full_state_dict()  # a collective: every rank calls it
    if rank == 0 and args.save:
        torch.save(state, args.save)
        print(f"state dict ({len(state)} tensors, plain keys) saved to {args.save}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
