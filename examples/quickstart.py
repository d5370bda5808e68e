"""Quickstart: wrap an ``nn.Sequential`` in GPipe and train it as usual (CPU, a few seconds).

Run: ``python examples/quickstart.py [--steps 20]``.
"""
import argparse
import sys
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

import torchpipe


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description="GPipe quickstart")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    # 1. A model written as an nn.Sequential: GPipe cuts it into partitions of consecutive layers.
    model = nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(),
        nn.Linear(128, 128), nn.ReLU(),
        nn.Linear(128, 128), nn.ReLU(),
        nn.Linear(128, 4),
    )

    # 2. Two partitions (4 + 3 layers), 4 micro-batches per mini-batch. Without GPUs every
    #    partition is on the CPU, each with its own worker thread; with two GPUs leave out
    #    `devices` and the partitions go to cuda:0 and cuda:1.
    devices = None if torch.cuda.device_count() >= 2 else ["cpu", "cpu"]
    model = torchpipe.GPipe(model, balance=[4, 3], devices=devices, chunks=4)
    print(model)

    # 3. Train as usual: the input goes to the first partition's device, the target to the last's.
    in_device, out_device = model.devices[0], model.devices[-1]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    weights = torch.randn(32, 4)
    for step in range(args.steps):
        x = torch.randn(64, 32)
        target = (x @ weights).argmax(dim=1)
        output = model(x.to(in_device))  # on out_device
        loss = F.cross_entropy(output, target.to(out_device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
