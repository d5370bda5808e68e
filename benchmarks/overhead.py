"""Overhead and CPU speed-up of GPipe against the plain module (issue 2's micro-benchmark).

For a 32-layer 512-wide Linear+ReLU MLP, batch 1024, on CPU, prints the train
step time (forward, ``sum().backward()``) of each configuration as a ratio to
the plain module's, with 1 intra-op thread per partition. Each ratio is the
median over rounds in which the plain step and the pipelined step alternate,
so machine drift cancels. If ``torchgpipe`` is importable its ratios are
printed beside ours, measured in the same run.

    python benchmarks/overhead.py [--rounds 15] [--json out.json]
"""
import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import torchpipe  # noqa: E402
from benchmarks import common, models  # noqa: E402

CONFIGS: List[Tuple[str, List[int], int, str]] = [
    ("1 partition, chunks=1, never", [32 * 2], 1, "never"),
    ("1 partition, chunks=8, never", [32 * 2], 8, "never"),
    ("2 partitions, chunks=8, never", [32, 32], 8, "never"),
    ("2 partitions, chunks=8, except_last", [32, 32], 8, "except_last"),
]
GOALS = {0: 1.02, 1: 1.10, 2: 0.70, 3: 0.90}


def train_step(model: nn.Module, x: torch.Tensor) -> common.Step:
    """Forward, ``sum().backward()``, drop the grads (the issue's step)."""

    def step() -> None:
        model(x).sum().backward()
        for p in model.parameters():
            p.grad = None

    return step


def ratio(plain: common.Step, other: common.Step, rounds: int, warmup: int = 2) -> Tuple[float, float]:
    """(median of the interleaved pairs' ratios, median plain step time) via :func:`common.compare`."""
    [result] = common.compare(common.Variant("plain", plain), [common.Variant("other", other)], rounds=rounds,
                              warmup=warmup, quiet=True)
    return result.ratio, result.plain_seconds


def build(kind: str, balance: List[int], chunks: int, checkpoint: str) -> Optional[nn.Module]:
    model = models.mlp()
    devices = ["cpu"] * len(balance)
    if kind == "torchpipe":
        return torchpipe.GPipe(model, balance, devices=devices, chunks=chunks, checkpoint=checkpoint)
    try:
        import torchgpipe
    except ImportError:
        return None
    return torchgpipe.GPipe(model, balance, devices=devices, chunks=chunks, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.batch, 512)
    plain = train_step(models.mlp(), x)
    print(f"machine: {common.machine_description()}; {torch.get_num_threads()} intra-op thread")
    results: Dict[str, Dict[str, float]] = {}
    header = f"{'configuration':40s} {'torchpipe':>10s} {'goal':>6s} {'torchgpipe':>11s}"
    print(header)
    print("-" * len(header))
    for index, (name, balance, chunks, checkpoint) in enumerate(CONFIGS):
        row: Dict[str, float] = {}
        ours = build("torchpipe", balance, chunks, checkpoint)
        assert ours is not None
        row["torchpipe"], row["plain_s"] = ratio(plain, train_step(ours, x), args.rounds)
        theirs = build("torchgpipe", balance, chunks, checkpoint)
        if theirs is not None:
            row["torchgpipe"], _ = ratio(plain, train_step(theirs, x), args.rounds)
        results[name] = row
        tg = f"{row['torchgpipe']:11.3f}" if "torchgpipe" in row else f"{'n/a':>11s}"
        print(f"{name:40s} {row['torchpipe']:10.3f} {GOALS[index]:6.2f} {tg}", flush=True)
        del ours, theirs
    plain_ms = results[CONFIGS[0][0]]["plain_s"] * 1e3
    print(f"(ratios: median step time / plain step time; plain step median {plain_ms:.0f} ms)")
    if args.json:
        common.save_json(args.json, {"ratios": results, "goals": {CONFIGS[i][0]: g for i, g in GOALS.items()}})


if __name__ == "__main__":
    main()
