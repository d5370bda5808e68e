"""Benchmark: torchpipe.parallel.DataParallel on CPU, 2 replicas with 1 intra-op thread each.

Prints, from one run with the modes interleaved (medians of ``--repeats``):

1. the train-step time of DataParallel over 2 'cpu' replicas divided by that of
   the plain module with 1 intra-op thread (the goal is <= 0.6: a real
   two-core speed-up);
2. the time saved by chaining ``DataParallel(a, gather_to_one_device=False)``
   into ``DataParallel(b, inputs_are_scattered=True)`` versus gathering a's
   output and scattering it again for b.

Run: ``python benchmarks/data_parallel.py [--width 1024 --depth 6 --batch 256] [--repeats 9] [--json out.json]``.
"""
import argparse
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.output import Summary, save_json  # noqa: E402
from benchmarks.harness.steps import microbatched_train_step, train_step  # noqa: E402
from benchmarks.harness.timing import Variant, at_once, round_robin  # noqa: E402
from torchpipe.parallel import DataParallel  # noqa: E402


def mlp(width: int, depth: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


def squared_mean(output: torch.Tensor) -> torch.Tensor:
    """The benchmark's loss: the output's squares' mean."""
    return output.pow(2).mean()


def half_forward(module: nn.Module, chunk: torch.Tensor) -> None:
    """A forward without autograd, on one intra-op thread (the calibration's work)."""
    torch.set_num_threads(1)
    with torch.no_grad():
        module(chunk)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

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

    halves = list(x.chunk(2))
    # Calibration: the same two half-batch forwards on two bare threads (1 intra-op thread each) versus one
    # after the other. Their ratio is what this machine allows right now (shared or throttled vCPUs show here,
    # not only in DataParallel).
    first, second = (partial(half_forward, plain, half) for half in halves)

    def bare_sequential() -> None:
        first()
        second()

    steps = {
        "calibration: 2 half forwards, in sequence": bare_sequential,
        "calibration: 2 half forwards, 2 threads": at_once(first, second),
        "plain, 1 thread": train_step(plain, x, loss_fn=squared_mean),
        # The micro-batched ideal's yardstick: the replicas' halves, one after another.
        "2 half batches by hand, 1 thread": microbatched_train_step(plain, x, 2, loss_fn=squared_mean),
        "DataParallel, 2 cpu replicas x 1 thread": train_step(dp, x, loss_fn=squared_mean),
        "chained a -> b (no gather)": train_step(nn.Sequential(chain_a, chain_b), x, loss_fn=squared_mean),
        "gather a, re-scatter into b": train_step(nn.Sequential(gather_a, gather_b), x, loss_fn=squared_mean),
    }
    # Two warm-up rounds (workers start, allocator settles), then every step once a round, in this order.
    times = round_robin([Variant(name, step) for name, step in steps.items()], rounds=args.repeats, warmup=2,
                        quiet=True, rotate=False)
    median = {name: statistics.median(t) for name, t in times.items()}

    print(f"machine: {machine_description()}")
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
    results = {"median_ms": {name: value * 1e3 for name, value in median.items()}, "two_threads": ceiling,
               "vs_plain": ratio, "vs_by_hand": median["DataParallel, 2 cpu replicas x 1 thread"] / by_hand,
               "chaining_saves": share, "goal": 0.6, "args": vars(args)}
    if args.json:
        save_json(args.json, results)
    return results


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): each step's median time, then the ratios."""
    rows = [[name, ms] for name, ms in results["median_ms"].items()]
    return Summary(["step", "median ms"], rows, [
        f"DataParallel / plain: {results['vs_plain']:.3f} (goal <= {results['goal']}); DataParallel / the same 2 half "
        f"batches by hand: {results['vs_by_hand']:.3f} (ideal 0.500); two bare threads / in sequence: "
        f"{results['two_threads']:.3f}; chaining without a gather saves {results['chaining_saves']:.1%} of the "
        "gathered step."])


if __name__ == "__main__":
    main()


