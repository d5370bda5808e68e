"""Benchmark of torchpipe_balancing.balance_cost: 10,000 layers into 64 partitions, exactly.

Run: ``python benchmarks/balance_solver.py [--layers 10000] [--json out.json]``. Prints the machine, the median
solve time for integer, float and wide-range float costs, and, on a size the
textbook O(n^2 * partitions) dynamic programme can handle, the speed-up over
it with both answers checked equal.
"""
import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.output import Summary, save_json  # noqa: E402
from torchpipe_balancing import balance_cost  # noqa: E402


def bottleneck(costs: Sequence[float], balance: Sequence[int]) -> float:
    totals, start = [], 0
    for size in balance:
        totals.append(sum(costs[start : start + size]))
        start += size
    return max(totals)


def dynamic_programme(costs: Sequence[float], partitions: int) -> float:
    """The textbook exact solver, O(n^2 * partitions): best[p][i] = optimum for costs[:i] in p parts."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [0.0] + [inf] * n
    for _ in range(partitions):
        new = [inf] * (n + 1)
        for i in range(1, n + 1):
            new[i] = min(max(best[j], prefix[i] - prefix[j]) for j in range(i))
        best = new
    return best[n]


def timed(fn: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=64)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    layers, partitions = args.layers, args.partitions
    print(f"machine: {machine_description()}")
    print(f"balance_cost: {layers:,} layers into {partitions} partitions (median of 5)")
    results: Dict[str, Any] = {"layers": layers, "partitions": partitions, "cases": {}}

    cases: List[tuple] = [  # type: ignore[type-arg]
        ("int costs in [0, 10^6]", [rng.randint(0, 10**6) for _ in range(layers)]),
        ("float costs in [0, 1)", [rng.random() for _ in range(layers)]),
        ("float costs, 10^-6 .. 10^6", [rng.random() * 10 ** rng.randint(-6, 6) for _ in range(layers)]),
    ]
    for name, costs in cases:
        seconds = timed(lambda costs=costs: balance_cost(costs, partitions), repeat=5)
        balance = balance_cost(costs, partitions)
        ratio = bottleneck(costs, balance) / (sum(costs) / partitions)
        print(f"  {name:<28} {seconds * 1000:8.1f} ms   bottleneck / average partition = {ratio:.4f}")
        results["cases"][name] = {"ms": seconds * 1000, "bottleneck_vs_average": ratio}

    small, parts = 300, 8
    costs = [rng.random() for _ in range(small)]
    fast = timed(lambda: balance_cost(costs, parts), repeat=5)
    slow = timed(lambda: dynamic_programme(costs, parts), repeat=1)
    exact = bottleneck(costs, balance_cost(costs, parts))
    reference = dynamic_programme(costs, parts)
    assert abs(exact - reference) <= 1e-9 * reference, (exact, reference)
    print(f"{small} layers into {parts}: balance_cost {fast * 1000:.1f} ms, O(n^2 k) DP {slow * 1000:.0f} ms "
          f"({slow / fast:.0f}x faster, same bottleneck)")
    results["against_dynamic_programme"] = {"layers": small, "partitions": parts, "ms": fast * 1000,
                                            "dynamic_programme_ms": slow * 1000}
    if args.json:
        save_json(args.json, results)
    return results


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): the median solve time per kind of costs."""
    rows = [[name, case["ms"], case["bottleneck_vs_average"]] for name, case in results["cases"].items()]
    against = results["against_dynamic_programme"]
    return Summary(["costs", "solve ms", "bottleneck / average partition"], rows, [
        f"{results['layers']:,} layers into {results['partitions']} partitions. On {against['layers']} layers into "
        f"{against['partitions']}: {against['ms']:.1f} ms against the textbook O(n^2 k) dynamic programme's "
        f"{against['dynamic_programme_ms']:.0f} ms, with the same bottleneck."])


if __name__ == "__main__":
    main()
