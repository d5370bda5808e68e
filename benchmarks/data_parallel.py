"""Benchmark: torchpipe.parallel.DataParallel on CPU, 2 replicas with 1 intra-op thread each.

Prints, from one run with the modes interleaved (medians of ``--repeats``):

1. the train-step time of DataParallel over 2 'cpu' replicas divided by that of
   the plain module with 1 intra-op thread (the goal is <= 0.6: a real
   two-core speed-up);
2. the time saved by chaining ``DataParallel(a, gather_to_one_device=False)``
   into ``DataParallel(b, inputs_are_scattered=True)`` versus gathering a's
   output and scattering it again for b.

Run: ``python benchmarks/data_parallel.py [--width 1024 --depth 8 --batch 256]``.
"""
import argparse
import os
import platform
import statistics
import threading
import time
from typing import Callable, Dict, List

import torch
from torch import nn

from torchpipe.parallel import DataParallel


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical cores, torch {torch.__version__}"


def mlp(width: int, depth: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


def timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    torch.manual_seed(0)
    # One intra-op thread everywhere: the plain module uses one core; each of the two replica
    # workers takes its share (max(1, 1 // 2) = 1) and the caller's own thread does little
    # (a caller with 2 OpenMP threads would spin on the cores the replicas compute on).
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.width)

    plain = mlp(args.width, args.depth)
    dp = DataParallel(plain, ["cpu", "cpu"])

    feature = mlp(args.width, args.depth // 2)
    head = mlp(args.width, args.depth - args.depth // 2)
    chain_a = DataParallel(feature, ["cpu", "cpu"], gather_to_one_device=False)
    chain_b = DataParallel(head, ["cpu", "cpu"], inputs_are_scattered=True)
    gather_a = DataParallel(feature, ["cpu", "cpu"])
    gather_b = DataParallel(head, ["cpu", "cpu"])

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        plain(x).pow(2).mean().backward()

    def dp_step() -> None:
        plain.zero_grad(set_to_none=True)
        dp(x).pow(2).mean().backward()

    halves = list(x.chunk(2))

    def by_hand_step() -> None:  # the micro-batched ideal's yardstick: the replicas' halves, one after another
        plain.zero_grad(set_to_none=True)
        for half in halves:
            (plain(half).pow(2).mean() / 2).backward()

    def chained_step() -> None:
        feature.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        out = chain_b(chain_a(x))
        out.pow(2).mean().backward()

    def regathered_step() -> None:
        feature.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        out = gather_b(gather_a(x))
        out.pow(2).mean().backward()

    # Calibration: the same two half-batch train steps on two bare threads (1 intra-op thread
    # each) versus one after the other. Their ratio is what this machine allows right now
    # (shared or throttled vCPUs show here, not only in DataParallel).

    def half_step(chunk: torch.Tensor) -> None:
        torch.set_num_threads(1)
        with torch.no_grad():
            plain(chunk)

    def bare_sequential() -> None:
        for chunk in halves:
            half_step(chunk)

    def bare_threads() -> None:
        threads = [threading.Thread(target=half_step, args=(c,)) for c in halves]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    steps: Dict[str, Callable[[], None]] = {
        "calibration: 2 half forwards, in sequence": bare_sequential,
        "calibration: 2 half forwards, 2 threads": bare_threads,
        "plain, 1 thread": plain_step,
        "2 half batches by hand, 1 thread": by_hand_step,
        "DataParallel, 2 cpu replicas x 1 thread": dp_step,
        "chained a -> b (no gather)": chained_step,
        "gather a, re-scatter into b": regathered_step,
    }
    for step in steps.values():  # warm up: workers start, allocator settles
        step()
        step()
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(timed(step))
    median = {name: statistics.median(t) for name, t in times.items()}

    print(f"machine: {machine()}")
    print(f"model: {args.depth} x Linear({args.width}) + Tanh, batch {args.batch}, train step (forward + backward)")
    for name, value in median.items():
        print(f"  {name:42s} {value * 1e3:8.1f} ms (median of {args.repeats}, interleaved)")
    ceiling = median["calibration: 2 half forwards, 2 threads"] / median["calibration: 2 half forwards, in sequence"]
    print(f"machine's two-thread ratio (bare threads, same work): {ceiling:.2f} (1.0 = no parallelism available)")
    ratio = median["DataParallel, 2 cpu replicas x 1 thread"] / median["plain, 1 thread"]
    print(f"DataParallel / plain (1 thread) time ratio: {ratio:.2f} (goal <= 0.6)")
    by_hand = median["2 half batches by hand, 1 thread"]
    print(f"DataParallel / the same 2 half batches by hand (the micro-batched ideal's yardstick): "
          f"{median['DataParallel, 2 cpu replicas x 1 thread'] / by_hand:.2f} (ideal 0.50; by hand / plain: "
          f"{by_hand / median['plain, 1 thread']:.2f})")
    saved = median["gather a, re-scatter into b"] - median["chained a -> b (no gather)"]
    share = saved / median["gather a, re-scatter into b"]
    print(f"chaining saves {saved * 1e3:.1f} ms per step ({share:.1%}) versus gather and re-scatter")


if __name__ == "__main__":
    main()


