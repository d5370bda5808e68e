"""Pipeline a transformer encoder with a padding mask, as written: ``as_sequential`` then GPipe (CPU, seconds).

The model is what one writes for a sequence classifier: an embedding, an
``nn.TransformerEncoder`` stack called with ``src_key_padding_mask``, a masked
mean over positions and a linear head; its ``forward`` takes two tensors, the
token ids and the mask. ``torchpipe.as_sequential(model, tokens, mask)`` makes
it a Sequential with one layer per encoder layer; the Sequential takes the
tuple ``(tokens, mask)``. The mask (a bool tensor, no gradient) rides along
with the activations to the next layer, and reaches every later layer that
uses it as a ``torchpipe.skip`` stash/pop, straight, not through the layers
in between. GPipe splits both inputs into micro-batches along the batch
dimension.

The task is synthetic but learnable (does the sequence contain token 1?), so
the loss falls.

Run: ``python examples/transformer.py [--layers 6 --width 64 --steps 30]``.
"""
import argparse
import time
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchpipe
from torchpipe_balancing import balance_by_size


class Classifier(nn.Module):
    """Embedding, a transformer encoder stack with a padding mask, a masked mean and a head."""

    def __init__(self, vocabulary: int, width: int, heads: int, layers: int, classes: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.zeros(1, 64, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: Tensor, padding: Tensor) -> Tensor:
        x = self.embedding(tokens) + self.position[:, : tokens.size(1)]
        x = self.encoder(x, src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1).clamp(min=1.0))


def batch_of(size: int, length: int, vocabulary: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Token ids, the padding mask (True where padded) and the label: whether token 1 is in the sequence."""
    tokens = torch.randint(2, vocabulary, (size, length))
    lengths = torch.randint(length // 2, length + 1, (size,))
    padding = torch.arange(length).unsqueeze(0) >= lengths.unsqueeze(1)
    labels = torch.randint(0, 2, (size,))
    where = (torch.rand(size) * lengths.float()).long()
    tokens[labels == 1, where[labels == 1]] = 1
    return tokens.masked_fill(padding, 0), padding, labels


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if min(args.layers, args.width, args.heads, args.partitions, args.chunks, args.steps) < 1:
        parser.error("every count must be positive")
    if args.length > 64 or args.length < 2:
        parser.error("--length must be from 2 to 64")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    vocabulary = 50
    model = Classifier(vocabulary, args.width, args.heads, args.layers, classes=2)
    tokens, padding, labels = batch_of(args.batch_size, args.length, vocabulary)

    # The example call fixes nothing but the arguments that are not tensors (there are none here).
    sequential = torchpipe.as_sequential(model, tokens, padding)
    print(f"as_sequential: {len(sequential)} layers: " + ", ".join(layer.name for layer in sequential))
    print(sequential[3])  # pops the mask
    with torch.no_grad():
        assert torch.allclose(sequential((tokens, padding)), model(tokens, padding), atol=1e-5)

    # Balanced by memory this time: activations saved for backward plus parameters (Adam: x4).
    balance = balance_by_size(args.partitions, sequential, (tokens, padding), chunks=args.chunks, param_scale=4.0)
    pipe = torchpipe.GPipe(sequential, balance, devices=["cpu"] * args.partitions, chunks=args.chunks)
    print(f"balance_by_size: {balance}")

    optimizer = torch.optim.Adam(pipe.parameters(), lr=3e-3)
    started = time.perf_counter()
    losses = []
    for step in range(args.steps):
        tokens, padding, labels = batch_of(args.batch_size, args.length, vocabulary)
        optimizer.zero_grad()
        loss = F.cross_entropy(pipe((tokens, padding)), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.4f}")
    print(f"{args.steps} steps in {time.perf_counter() - started:.1f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
