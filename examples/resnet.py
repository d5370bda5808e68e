"""Pipeline a ResNet-50 that is not a Sequential: ``as_sequential``, ``balance_by_time``, GPipe (CPU, seconds).

The model is torchvision's ``resnet50`` when torchvision works here, else
``benchmarks.models.ResNet``: the same architecture (bottleneck blocks, the
stride on the 3x3 convolution, a strided 1x1 convolution and BatchNorm as
downsample, blocks 3, 4, 6, 3) and the same attribute names, written as an
ordinary module with its own ``forward``, as torchvision writes it. Neither
is an ``nn.Sequential``, and neither needs rewriting:

1. ``as_sequential`` traces the model with ``torch.fx`` and cuts it into one
   layer per convolution, BatchNorm and the classifier; each block's
   residual input travels as a ``torchpipe.skip`` stash/pop;
2. ``balance_by_time`` balances those layers over the partitions;
3. GPipe trains them, and the optimizer updates the model's own parameters.

The script checks that the Sequential computes what the model computes, and
that the pipelined gradients are the model's.

Run: ``python examples/resnet.py [--width 64 --image-size 224]``; the
defaults are small enough for a CPU (``--width 16``, 64x64 images).
``--no-torchvision`` uses the model of this repository even when
torchvision imports.
"""
import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for benchmarks.models, the repository's ResNet

import torchpipe  # noqa: E402
from benchmarks.models import ResNet, torchvision_module  # noqa: E402
from torchpipe_balancing import balance_by_time  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--width", type=int, default=16, help="stem channels (torchvision's ResNet-50: 64)")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--balance-timeout", type=float, default=0.5)
    parser.add_argument("--no-torchvision", action="store_true", help="use the repository's ResNet-50")
    args = parser.parse_args(argv)
    if args.width < 1 or args.image_size < 32 or args.batch_size < 2 or args.partitions < 1 or args.chunks < 1:
        parser.error("--width, --partitions and --chunks must be positive, --image-size at least 32, "
                     "--batch-size at least 2")
    return args


def resnet50(args: argparse.Namespace) -> Tuple[nn.Module, str]:
    torchvision = None if args.no_torchvision else torchvision_module()
    if torchvision is not None and args.width == 64:
        return torchvision.models.resnet50(num_classes=args.classes), "torchvision.models.resnet50"
    if torchvision is not None:
        print(f"(torchvision's ResNet-50 has width 64; --width {args.width} uses the repository's model)")
    return ResNet((3, 4, 6, 3), args.width, args.classes), f"benchmarks.models.ResNet (width {args.width})"


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    model, source = resnet50(args)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(0, args.classes, (args.batch_size,))
    reference = copy.deepcopy(model)  # the same weights, trained without a pipeline, to compare with

    # 1. One layer per call of a submodule that holds parameters; the residual skips become stash/pop.
    started = time.perf_counter()
    sequential = torchpipe.as_sequential(model, images[:2])
    skips = sum(len(layer.stashed()) for layer in sequential)
    print(f"{source}: as_sequential made {len(sequential)} layers and {skips} skips "
          f"in {time.perf_counter() - started:.1f} s")
    print("  the first layers: " + ", ".join(layer.name for layer in sequential[:6]) + ", ...")
    add = next(layer for layer in sequential if layer.name == "layer1.0.bn3")
    print("  the first block's last layer pops its residual and adds it:")
    print("  " + repr(add).replace("\n", "\n  "))
    model.eval()
    with torch.no_grad():
        same = torch.allclose(sequential(images), model(images), atol=1e-5)
    model.train()
    print(f"the Sequential computes what the model computes: {same}")
    assert same

    # 2. A balance by each layer's forward and backward time.
    balance = balance_by_time(args.partitions, sequential, images, timeout=args.balance_timeout)
    print(f"balance_by_time over {args.partitions} partitions: {balance}")

    # 3. GPipe, on the default devices (cuda:0, cuda:1, ... or all 'cpu').
    devices = None if torch.cuda.device_count() >= args.partitions else ["cpu"] * args.partitions
    pipe = torchpipe.GPipe(sequential, balance, devices=devices, chunks=args.chunks)
    if torch.cuda.device_count() >= args.partitions:
        reference.cuda()
    # The optimizer gets the pipeline's parameters: they are the model's own.
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    for step in range(args.steps):
        optimizer.zero_grad()
        started = time.perf_counter()
        output = pipe(images)
        loss = F.cross_entropy(output, labels.to(output.device))
        loss.backward()
        if step == 0:
            check_gradients(model, reference, images, labels, args.chunks)
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f} ({time.perf_counter() - started:.2f} s)")
    print(f"trained: model.state_dict() holds the new weights ({len(model.state_dict())} entries)")


def check_gradients(model: nn.Module, reference: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                    chunks: int) -> None:
    """The first step's gradients against the model trained plainly on the same micro-batches.

    BatchNorm normalises each micro-batch by its own statistics, so the
    reference runs the micro-batches one by one, as GPipe does.
    """
    total = None
    for part, target in zip(images.chunk(chunks), labels.chunk(chunks)):
        output = reference(part.to(next(reference.parameters()).device))
        loss = F.cross_entropy(output, target.to(output.device), reduction="sum") / len(images)
        total = loss if total is None else total + loss
    assert total is not None
    total.backward()
    worst = max(
        float((p.grad - q.grad.to(p.grad.device)).abs().max() / (q.grad.abs().max() + 1e-12))
        for p, q in zip(model.parameters(), reference.parameters())
        if p.grad is not None and q.grad is not None
    )
    print(f"pipelined gradients against the model's: largest relative difference {worst:.1e}")
    assert worst < 1e-3


if __name__ == "__main__":
    main()
