"""Long skip connections with ``torchpipe.skip``: a small U-Net-style encoder/decoder (CPU, seconds).

The first layers ``stash`` their activations and the matching decoder layers
``pop`` them, like a U-Net's skips. Inside GPipe each skip tensor travels
straight from the partition that stashed it to the partition that pops it,
never through the partitions in between; the script checks that with
``torchpipe.transfer.record_transfers`` and that outputs and gradients equal
the plain ``nn.Sequential``'s (skippable layers work there too).

The same ``Down``/``Up`` classes appear at two depths, so each pair gets its
own :class:`~torchpipe.skip.Namespace` with ``.isolate(ns)``.

Run: ``python examples/skip_connections.py [--checkpoint always]``.
"""
import argparse
import copy
import sys
from typing import Generator, List, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchpipe
from torchpipe.skip import Namespace, pop, skippable, stash, verify_skippables
from torchpipe.transfer import record_transfers

# What a skippable forward yields (stash or pop requests) and receives (popped tensors).
Skippy = Generator[Union[stash, pop], Tensor, Tensor]


@skippable(stash=["skip"])
class Down(nn.Module):
    """Keeps its input for the matching ``Up``, then halves the resolution and doubles the channels."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels * 2, 3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Skippy:
        yield stash("skip", x)
        return F.relu(self.conv(x))


@skippable(pop=["skip"])
class Up(nn.Module):
    """Doubles the resolution, halves the channels and adds the tensor its ``Down`` stashed."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose2d(channels * 2, channels, 4, stride=2, padding=1)

    def forward(self, x: Tensor) -> Skippy:
        skip = yield pop("skip")
        return F.relu(self.conv(x)) + skip


def unet(channels: int = 8) -> nn.Sequential:
    outer, inner = Namespace(), Namespace()
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),          # 0
        Down(channels).isolate(outer),                 # 1  stashes (outer)
        Down(channels * 2).isolate(inner),             # 2  stashes (inner)
        nn.Conv2d(channels * 4, channels * 4, 3, padding=1),  # 3  the bottom
        nn.ReLU(),                                     # 4
        Up(channels * 2).isolate(inner),               # 5  pops (inner)
        Up(channels).isolate(outer),                   # 6  pops (outer)
        nn.Conv2d(channels, 1, 1),                     # 7
    )


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description="long skip connections with torchpipe.skip")
    parser.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    model = unet()
    verify_skippables(model)  # GPipe runs it too; it names every unmatched stash or pop at once
    plain = copy.deepcopy(model)
    balance = [2, 2, 2, 2]  # partition 0 stashes "outer", partition 3 pops it
    pipe = torchpipe.GPipe(model, balance, devices=["cpu"] * 4, chunks=args.chunks, checkpoint=args.checkpoint)

    x = torch.randn(8, 3, 16, 16)
    with record_transfers() as log:
        output = pipe(x)
        output.square().mean().backward()
    expected = plain(x)
    expected.square().mean().backward()
    assert torch.allclose(output, expected, atol=1e-5), "GPipe's output differs from the plain model's"
    for (name, p), q in zip(plain.named_parameters(), pipe.parameters()):
        assert q.grad is not None and p.grad is not None and torch.allclose(q.grad, p.grad, atol=1e-5), name
    print(f"output {tuple(output.shape)} and every gradient equal the plain nn.Sequential's "
          f"(checkpoint={args.checkpoint!r}, chunks={args.chunks})")

    skips = sorted({(r.kind, r.source, r.target) for r in log if r.kind.startswith("skip")})
    for kind, source, target in skips:
        print(f"  {kind}: partition {source} -> partition {target}")
    direct: List[bool] = [abs(target - source) > 1 for kind, source, target in skips if kind == "skip"]
    assert any(direct), "the outer skip should go from partition 0 straight to partition 3"

    # And it trains.
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05)
    target = x.mean(dim=1, keepdim=True)
    for step in range(5):
        optimizer.zero_grad()
        loss = F.mse_loss(pipe(x), target)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
