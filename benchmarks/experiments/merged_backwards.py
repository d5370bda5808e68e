"""What merging buys: each split schedule as a Pipeline runs it (merged) against the generator's order, round by round.

A Pipeline runs a named schedule that splits backwards through
``torchpipe.schedule.merge_backwards``: a split backward whose ``W`` fills no
gap runs whole (``B`` where its ``I`` was). This benchmark times, in one
process on two CPU workers, every such schedule twice: as it runs (the name)
and as the generator wrote it (the same ``Schedule`` passed by hand, which a
Pipeline runs as it is), on ``schedules.py``'s MLP (32 Linear+ReLU blocks,
512 wide, batch 1024 in 8 micro-batches, 4 stages on 2 workers). Before it
times them it checks that both give the same loss and gradients (a timing of
different work would mean nothing). For each schedule it prints:

- how many of the generator's split backwards run whole;
- the simulated step of the merged order over the generator's, from the
  costs measured on one step of each (``F``, ``I``, ``W`` from the
  generator's, ``B`` from the merged one's): the prediction;
- the measured step of the merged order over the generator's: the median,
  and the quartiles, over rounds that run every step once.

    python benchmarks/experiments/merged_backwards.py [--rounds 30] [--chunks 8] [--json out.json]
"""
import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

import torchpipe  # noqa: E402
from benchmarks import schedules  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.output import format_table, save_json  # noqa: E402
from benchmarks.harness.steps import pipeline_step  # noqa: E402
from benchmarks.harness.timing import Variant, median_ratio, round_robin  # noqa: E402
from torchpipe.schedule import Action, Kind, build, simulate  # noqa: E402

#: (name, stages): the named schedules that split, each on 2 workers.
SCHEDULES: List[Tuple[str, int]] = [("interleaved_zero_bubble", 4), ("zbv", 4), ("dualpipev", 4)]


def check_same_work(merged: torchpipe.Pipeline, generated: torchpipe.Pipeline, x: Tensor, y: Tensor) -> None:
    """Both pipelines' first step gives the same loss and gradients (their modules start alike); AssertionError
    if not."""
    losses = [float(pipe.step(x, y)) for pipe in (merged, generated)]
    assert abs(losses[0] - losses[1]) <= 1e-5 * max(1.0, abs(losses[1])), f"losses differ: {losses}"
    for (name, a), b in zip(merged.named_parameters(), generated.parameters()):
        assert a.grad is not None and b.grad is not None, f"{name} has no gradient"
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=f"{name}: the gradients differ")
    for pipe in (merged, generated):
        for p in pipe.parameters():
            p.grad = None


def run(rounds: int, chunks: int, model: str = "mlp") -> List[Dict[str, Any]]:
    torch.set_num_threads(1)
    variants: List[Variant] = []
    facts: List[Dict[str, Any]] = []
    for name, stages in SCHEDULES:
        merged, x, y = schedules.pipeline(model, name, stages, chunks)
        written = build(name, chunks, stages, 2)
        generated, _, _ = schedules.pipeline(model, written, stages, chunks)
        assert generated.schedule == written, "a Schedule passed by hand runs as it is"
        check_same_work(merged, generated, x, y)
        # F, I and W from a step of the generator's order, B from one of the merged order.
        costs = schedules.mean_costs(schedules.recorded_step(generated, x, y)[1])
        whole = schedules.mean_costs(schedules.recorded_step(merged, x, y)[1])
        costs.update({key: value for key, value in whole.items() if key[1] is Kind.BACKWARD})
        cost = _cost_of(costs)
        facts.append({
            "schedule": name, "split": _splits(written), "whole": _splits(written) - _splits(merged.schedule),
            "simulated": simulate(merged.schedule, cost).step_time / simulate(written, cost).step_time,
        })
        variants += [Variant(f"{name} merged", pipeline_step(merged, x, y)),
                     Variant(f"{name} as generated", pipeline_step(generated, x, y))]
    times = round_robin(variants, rounds=rounds, warmup=1, desc="merged against as generated")
    for row in facts:
        merged_times, generated_times = times[f"{row['schedule']} merged"], times[f"{row['schedule']} as generated"]
        ratios = sorted(a / b for a, b in zip(merged_times, generated_times))
        row.update({
            "measured": median_ratio(times, f"{row['schedule']} merged", f"{row['schedule']} as generated"),
            "quartiles": (ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]),
            "merged_ms": statistics.median(merged_times) * 1e3,
        })
    return facts


def _cost_of(costs: Dict[Tuple[int, Kind], float]) -> Callable[[Action], float]:
    """An action's measured cost (a whole backward never measured: its halves')."""
    def cost(action: Action) -> float:
        found = costs.get((action.stage, action.kind))
        if found is None and action.kind is Kind.BACKWARD:
            return costs[(action.stage, Kind.BACKWARD_INPUT)] + costs[(action.stage, Kind.BACKWARD_WEIGHT)]
        return costs[(action.stage, action.kind)]
    return cost


def _splits(schedule: Any) -> int:
    return sum(a.kind is Kind.BACKWARD_INPUT for a in schedule.actions())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    print(machine_description(torch.device("cpu")))
    rows = run(args.rounds, args.chunks)
    print(format_table(
        ["schedule (4 stages, 2 workers)", "backwards whole", "simulated merged / generated",
         "measured merged / generated", "quartiles", "merged step ms"],
        [[r["schedule"], f"{r['whole']} of {r['split']}", f"{r['simulated']:.3f}", f"{r['measured']:.3f}",
          f"{r['quartiles'][0]:.3f} to {r['quartiles'][1]:.3f}", f"{r['merged_ms']:.0f}"] for r in rows]))
    print(f"(mlp, batch 1024 in {args.chunks} micro-batches, one intra-op thread per worker; measured: the median "
          f"over {args.rounds} rounds of the two steps' times in the same round; simulated: from each stage's mean "
          "costs on one step of each)")
    if args.json:
        save_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
