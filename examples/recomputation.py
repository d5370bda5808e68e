"""Detecting recomputation: a layer that counts its forward passes once per micro-batch (CPU, seconds).

With checkpointing, GPipe runs a checkpointed partition's forward twice: once
without keeping activations, and again (the *recomputation*) just before its
backward. A layer with side effects, such as a counter or BatchNorm's running
statistics, must not repeat them in the recomputation;
``torchpipe.is_recomputing()`` tells them apart.

Run: ``python examples/recomputation.py``.
"""
import argparse
import sys
from typing import List, Sequence, Tuple

import torch
from torch import Tensor, nn

import torchpipe
from torchpipe import is_checkpointing, is_recomputing


class Counter(nn.Module):
    """Counts the micro-batches it has seen, and records which kind of pass each call was."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.calls: List[Tuple[str, int]] = []

    def forward(self, input: Tensor) -> Tensor:
        if is_recomputing():
            self.calls.append(("recompute", input.size(0)))
        else:
            # The first forward: checkpointed (activations dropped) or not.
            self.calls.append(("checkpointing" if is_checkpointing() else "forward", input.size(0)))
            self.count += 1  # a side effect: only once per micro-batch
        return input


def run(checkpoint: str, chunks: int) -> Counter:
    counter = Counter()
    model = nn.Sequential(nn.Linear(8, 8), counter, nn.ReLU(), nn.Linear(8, 8))
    pipe = torchpipe.GPipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=chunks, checkpoint=checkpoint)
    pipe(torch.randn(16, 8)).sum().backward()
    return counter


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description="detecting recomputation with is_recomputing()")
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"outside GPipe: is_recomputing()={is_recomputing()}, is_checkpointing()={is_checkpointing()}")
    for checkpoint in ("always", "except_last", "never"):
        counter = run(checkpoint, args.chunks)
        kinds = [kind for kind, _ in counter.calls]
        print(f"checkpoint={checkpoint!r:14} calls: {kinds.count('checkpointing')} checkpointed first passes, "
              f"{kinds.count('forward')} plain first passes, {kinds.count('recompute')} recomputations; "
              f"count={counter.count}")
        assert counter.count == args.chunks, "the side effect ran once per micro-batch"
    print("The counter counted every micro-batch exactly once, whatever the checkpoint mode.")
    print("For BatchNorm, GPipe(..., deferred_batch_norm=True) does this for you.")


if __name__ == "__main__":
    main(sys.argv[1:])
