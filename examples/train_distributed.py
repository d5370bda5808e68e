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

With ``--checkpoint-dir DIR`` the job saves itself every ``--every`` steps
(:class:`torchpipe.Checkpointer`) and resumes from its newest complete
checkpoint when it starts again: launched with ``torchrun --max-restarts N``,
a job that loses a rank is restarted by torchrun and goes on where it was, at
the cost of the steps since the last checkpoint. ``--die-at-step K`` makes
rank ``--die-rank`` (default 1) kill itself (SIGKILL) at the start of step K,
in torchrun's first attempt only, to show it (``make run-resume``), and
``--result FILE`` writes the final loss and a fingerprint of the weights, which
``--compare A B`` compares (no torchrun needed).

Flags: ``--epochs``, ``--chunks``, ``--schedule`` (``1f1b``, ``gpipe``,
``zero_bubble``, ``interleaved_1f1b``), ``--batch``, ``--dp``,
``--data-parallel``, ``--timeline out.json``, ``--save model.pt``,
``--checkpoint-dir``, ``--every``, ``--die-at-step``, ``--die-rank``, ``--result``, ``--compare``.
"""
import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchpipe
import torchpipe.distributed
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


def fingerprint(state: Dict[str, Tensor]) -> str:
    """A hash of every weight's bytes, by key: equal fingerprints, equal weights, bit for bit."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def compare(first: str, second: str) -> None:
    """Prints whether two runs' ``--result`` files tell the same final loss and weights."""
    a, b = (json.loads(Path(path).read_text()) for path in (first, second))
    resumed = f" (it resumed from step {b['resumed from']})" if b.get("resumed from") else ""
    if a["loss"] == b["loss"] and a["weights"] == b["weights"]:
        print(f"the run of {second}{resumed} ended as the run of {first}: loss {b['loss']!r}, "
              f"weights {b['weights']} (bit for bit)")
        return
    print(f"the runs differ: {first} ended with loss {a['loss']!r}, weights {a['weights']}; {second}{resumed} "
          f"with loss {b['loss']!r}, weights {b['weights']}")
    raise SystemExit(1)


def main() -> None:
    if sys.argv[1:2] == ["--compare"]:
        if len(sys.argv) != 4:
            raise SystemExit("usage: train_distributed.py --compare RESULT_A RESULT_B")
        compare(sys.argv[2], sys.argv[3])
        return
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
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save every --every steps here, and resume from the newest complete checkpoint")
    parser.add_argument("--every", type=int, default=10, help="with --checkpoint-dir: steps between checkpoints")
    parser.add_argument("--die-at-step", type=int, default=None,
                        help="rank --die-rank kills itself (SIGKILL) at the start of this step, in torchrun's first "
                             "attempt only (try it with torchrun --max-restarts 1 and --checkpoint-dir)")
    parser.add_argument("--die-rank", type=int, default=1)
    parser.add_argument("--result", default=None, help="write the final loss and the weights' fingerprint here")
    args = parser.parse_args()
    if args.every < 1:
        parser.error(f"--every must be at least 1, got {args.every}")
    if args.timeline is None:
        args.timeline = "out/timeline-distributed.json" if args.dp is None else "out/timeline-mesh.json"

    cuda = torch.cuda.is_available()
    # torch.distributed.init_process_group, on a store prefix of this torchrun attempt's own: a job that torchrun
    # restarts meets again without reading the dead attempt's keys.
    torchpipe.distributed.init_process_group("nccl" if cuda else "gloo")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
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

    ckpt = None
    start = 0
    if args.checkpoint_dir is not None:
        ckpt = torchpipe.Checkpointer(args.checkpoint_dir, pipe, optimizer, every=args.every, keep=2)
        start = ckpt.restore()  # the step to go on from: 0 without a complete checkpoint
        if rank == 0:
            print(f"attempt {attempt}: " + (f"resumed from step {start}, the newest complete checkpoint in "
                                             f"{args.checkpoint_dir}" if start else
                                             f"no checkpoint in {args.checkpoint_dir}: from the start"), flush=True)
    total = args.epochs * len(batches)
    loss = torch.zeros(())
    for epoch in range(start // len(batches), args.epochs):
        began, losses = time.perf_counter(), []
        first_batch = start % len(batches) if epoch == start // len(batches) else 0
        for index in range(first_batch, len(batches)):
            number = epoch * len(batches) + index  # steps done so far
            if number == args.die_at_step and rank == args.die_rank and attempt == 0:
                print(f"rank {rank}: killing itself (SIGKILL) at step {number} of {total}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batches[index]
            loss = step(x, y)  # every replica's mean: the same on every rank
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if ckpt is not None:
                ckpt.step(number + 1, extra={"step": number + 1})  # saves every --every steps, in the background
        seconds = time.perf_counter() - began
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                  f"{len(losses) * args.batch / seconds:.0f} samples/s", flush=True)
    if ckpt is not None:
        ckpt.close()  # waits for the last save

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
    if rank == 0 and args.result:
        weights = fingerprint(state)
        Path(args.result).write_text(json.dumps({"loss": loss.item(), "weights": weights, "resumed from": start}))
        print(f"final loss {loss.item()!r}, weights {weights}: {args.result}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
