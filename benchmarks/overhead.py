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
import json
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

import torchpipe

CONFIGS: List[Tuple[str, List[int], int, str]] = [
    ("1 partition, chunks=1, never", [32 * 2], 1, "never"),
    ("1 partition, chunks=8, never", [32 * 2], 8, "never"),
    ("2 partitions, chunks=8, never", [32, 32], 8, "never"),
    ("2 partitions, chunks=8, except_last", [32, 32], 8, "except_last"),
]
GOALS = {0: 1.02, 1: 1.10, 2: 0.70, 3: 0.90}


def mlp(layers: int = 32, width: int = 512) -> nn.Sequential:
    torch.manual_seed(0)
    modules: List[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*modules)


def train_step(model: nn.Module, x: torch.Tensor) -> Callable[[], float]:
    def step() -> float:
        start = time.perf_counter()
        model(x).sum().backward()
        elapsed = time.perf_counter() - start
        for p in model.parameters():
            p.grad = None
        return elapsed

    return step


def ratio(plain: Callable[[], float], other: Callable[[], float], rounds: int, warmup: int = 2) -> Tuple[float, float]:
    for _ in range(warmup):
        plain()
        other()
    ratios, plain_times = [], []
    for _ in range(rounds):
        a = plain()
        b = other()
        ratios.append(b / a)
        plain_times.append(a)
    return statistics.median(ratios), statistics.median(plain_times)


def build(kind: str, balance: List[int], chunks: int, checkpoint: str) -> Optional[nn.Module]:
    model = mlp()
    devices = ["cpu"] * len(balance)
    if kind == "torchpipe":
        return torchpipe.GPipe(model, balance, devices=devices, chunks=chunks, checkpoint=checkpoint)
    try:
        import torchgpipe
    except ImportError:
        return None
    return torchgpipe.GPipe(model, balance, devices=devices, chunks=chunks, checkpoint=checkpoint)  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.batch, 512)
    plain = train_step(mlp(), x)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} intra-op thread, "
          f"{__import__('os').cpu_count()} cores, torch {torch.__version__}")
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
    print(f"(ratios: median step time / plain step time; plain step median {results[CONFIGS[0][0]]['plain_s']*1e3:.0f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
