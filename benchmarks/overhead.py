"""GPipe's overhead and speed-up on CPU, against the plain module and the same micro-batches run by hand.

For a 32-layer 512-wide Linear+ReLU MLP (batch 1024), prints each
configuration's train step time (forward, ``sum().backward()``) as a ratio to
the plain module's step and to the *micro-batched ideal*: the same
micro-batches run by hand through the plain module, one after another (what
micro-batching alone costs: smaller matrix products). Against that yardstick a
pipeline of ``p`` partitions and ``m`` micro-batches at best takes
``(m + p - 1) / (m p)``. One intra-op thread per partition. Each ratio is the
median over rounds in which the two steps alternate, so machine drift cancels.
If ``torchgpipe`` is importable its ratios are printed beside ours.

It also prints what two bare threads get from the cores (the machine line:
0.5 of one thread on two free cores) and GPipe's fixed cost per task: a step
of 2 partitions and 32 micro-batches of a 2-layer, 4-wide model (whose layers
cost next to nothing), minus the same micro-batches by hand, over its 128
tasks.

    python benchmarks/overhead.py [--rounds 11] [--batch 1024] [--layers 32] [--width 512] [--json out.json]
"""
import argparse
import copy
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import torchpipe  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.harness.machine import machine_description, torchgpipe_module  # noqa: E402
from benchmarks.harness.output import Summary, save_json  # noqa: E402
from benchmarks.harness.steps import Step, microbatched_train_step, pipeline_ideal, train_step  # noqa: E402
from benchmarks.harness.timing import Variant, compare, two_thread_ratio  # noqa: E402

#: (name, partitions, chunks, checkpoint); the partitions split the MLP's layers evenly.
CONFIGS: List[Tuple[str, int, int, str]] = [
    ("1 partition, chunks=1, never", 1, 1, "never"),
    ("1 partition, chunks=8, never", 1, 8, "never"),
    ("2 partitions, chunks=8, never", 2, 8, "never"),
    ("2 partitions, chunks=8, except_last", 2, 8, "except_last"),
]
#: The goals, as ratios to the micro-batched ideal (chunks=1: to the plain module).
GOALS = {0: 1.02, 1: 1.03, 2: 0.62, 3: 0.80}


def sum_step(model: nn.Module, x: torch.Tensor) -> Step:
    """Forward, ``sum().backward()``, drop the grads (the issue's step)."""
    return train_step(model, x, loss_fn=torch.sum)


def ratio(plain: Step, other: Step, rounds: int, warmup: int = 2) -> Tuple[float, float]:
    """(median of the interleaved pairs' ratios, median plain step time) via :func:`compare`."""
    [result] = compare(Variant("plain", plain), [Variant("other", other)], rounds=rounds, warmup=warmup, quiet=True)
    return result.ratio, result.plain_seconds


def build(kind: str, model: nn.Sequential, partitions: int, chunks: int, checkpoint: str) -> Optional[nn.Module]:
    balance = models.even_balance(len(model), partitions)
    devices = ["cpu"] * len(balance)
    if kind == "torchpipe":
        return torchpipe.GPipe(model, balance, devices=devices, chunks=chunks, checkpoint=checkpoint)
    torchgpipe = torchgpipe_module()
    if torchgpipe is None:
        return None
    return torchgpipe.GPipe(model, balance, devices=devices, chunks=chunks, checkpoint=checkpoint)


def fixed_cost_per_task(rounds: int) -> float:
    """Microseconds each task of a GPipe step costs beyond its layers' work (2 partitions, 32 micro-batches)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(32, 4)
    piped = torchpipe.GPipe(model, [1, 1], devices=["cpu", "cpu"], chunks=32, checkpoint="never")
    by_hand = microbatched_train_step(model, x, 32)
    _, hand_s = ratio(by_hand, microbatched_train_step(model, x, 32), rounds)
    relative, _ = ratio(by_hand, sum_step(piped, x), rounds)
    tasks = 2 * 32 * 2
    return (relative - 1.0) * hand_s / tasks * 1e6


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=32, help="the MLP's Linear+ReLU pairs")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.width)
    reference = models.mlp(args.layers, args.width)
    plain = sum_step(reference, x)
    print(f"machine: {machine_description()}; {torch.get_num_threads()} intra-op thread per partition")
    results: Dict[str, Dict[str, float]] = {}
    header = (f"{'configuration':38s} {'/plain':>7s} {'/by hand':>9s} {'ideal':>6s} {'goal':>6s} "
              f"{'torchgpipe /by hand':>20s}")
    print(header)
    print("-" * len(header))
    for index, (name, partitions, chunks, checkpoint) in enumerate(CONFIGS):
        row: Dict[str, float] = {}
        ours = build("torchpipe", models.mlp(args.layers, args.width), partitions, chunks, checkpoint)
        assert ours is not None
        hand = microbatched_train_step(reference, x, chunks)
        row["plain"], row["plain_s"] = ratio(plain, sum_step(ours, x), args.rounds)
        row["hand"], row["hand_s"] = ratio(hand, sum_step(ours, x), args.rounds) if chunks > 1 else \
            (row["plain"], row["plain_s"])
        row["ideal"] = pipeline_ideal(partitions, chunks)
        theirs = build("torchgpipe", models.mlp(args.layers, args.width), partitions, chunks, checkpoint)
        if theirs is not None:
            row["torchgpipe"], _ = ratio(hand, sum_step(theirs, x), args.rounds)
        results[name] = row
        tg = f"{row['torchgpipe']:20.3f}" if "torchgpipe" in row else f"{'n/a':>20s}"
        print(f"{name:38s} {row['plain']:7.3f} {row['hand']:9.3f} {row['ideal']:6.3f} {GOALS[index]:6.2f} {tg}",
              flush=True)
        del ours, theirs
    by_hand_8 = results[CONFIGS[1][0]]["hand_s"] / results[CONFIGS[0][0]]["plain_s"]
    print(f"(median step time over the plain step, and over the same micro-batches by hand; ideal: (m + p - 1)"
          f" / (m p) of by hand; the plain step takes {results[CONFIGS[0][0]]['plain_s'] * 1e3:.0f} ms, 8"
          f" micro-batches by hand {by_hand_8:.2f}x that)")
    # What the two cores allow now: the two halves of the 8 micro-batches on two bare threads at once.
    halves = [microbatched_train_step(copy.deepcopy(reference), half, 4) for half in x.chunk(2)]
    two_threads = two_thread_ratio(halves[0], halves[1], rounds=args.rounds)
    ideal = pipeline_ideal(2, 8)
    print(f"two bare threads, each with half of the 8 micro-batches: {two_threads:.3f} of the time on one thread "
          f"(two free cores: 0.500); so a 2-partition pipeline's best here now is {two_threads:.3f} x 2 x "
          f"{ideal:.4f} = {two_threads * 2 * ideal:.3f} of the micro-batches by hand")
    per_task = fixed_cost_per_task(args.rounds)
    print(f"fixed cost per task (2 partitions x 32 micro-batches of a model whose layers cost nothing): "
          f"{per_task:.0f} us")
    figures = {"ratios": results, "goals": {CONFIGS[i][0]: g for i, g in GOALS.items()}, "two_threads": two_threads,
               "machine_line": two_threads * 2 * ideal, "fixed_cost_per_task_us": per_task, "batch": args.batch,
               "layers": args.layers, "width": args.width, "rounds": args.rounds}
    if args.json:
        save_json(args.json, figures)
    return figures


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py)."""
    rows = [[name, row["plain"], row["hand"], row["ideal"], results["goals"][name], row.get("torchgpipe")]
            for name, row in results["ratios"].items()]
    return Summary(["configuration", "step / plain", "step / by hand", "ideal", "goal", "torchgpipe / by hand"], rows,
                   [f"Two bare threads, each with half of the 8 micro-batches, take {results['two_threads']:.3f} of "
                    f"one thread's time (0.500 on two free cores): the machine line for 2 partitions is "
                    f"{results['machine_line']:.3f} of by hand. GPipe's fixed cost per task: "
                    f"{results['fixed_cost_per_task_us']:.0f} us."])


if __name__ == "__main__":
    main()
