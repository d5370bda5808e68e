"""What a pipelined step spends beyond its actions: a time per message between ranks, or per action?

``schedule='auto'`` simulates every candidate schedule from costs measured on
one step, and charges what those costs leave out of that step's span to the
simulation (see [Note: auto schedule] in ``torchpipe/schedule/auto.py``).
Which way it is charged decides how the candidates rank. This benchmark asks
the machine: on 2 gloo ranks it runs each schedule of one map (the loop's
three, then the V's two) on a 16-layer 512-wide MLP, 4 stages, ``chunks`` 8,
one step of each in turn per round, recording every step's timeline on both
ranks. For each recorded step it simulates the schedule as it ran, each
action at its recorded time, and finds

- the **hop**: the time per message between ranks (:func:`hop_time`, the
  ``communication=`` of :func:`~torchpipe.schedule.simulate`), and
- the **time per action**: added to every action
  (:func:`~torchpipe.schedule.measured.calibrate_overhead`, what ``'auto'``
  charges),

that make the simulated step as long as the recorded one (first action to
last, over both ranks). A charge that models the machine comes out the same
for every schedule of a map; one that does not varies with the schedule.
Then, round by round, from the step of the map's first schedule (the one
``'auto'`` measures on: ``interleaved_zero_bubble`` on the loop, ``zbv`` in
the V), it predicts the other schedules' steps both ways, from that step's
cost per (stage, kind) (:func:`~torchpipe.schedule.measured.typical`), as
``'auto'`` does, and prints each prediction's median error.

A second table asks whether an action's cost depends on what ran before it
on its worker. A *run* is a worker's actions of one stage and kind back to
back (:func:`run_places`): ``looped_bfs`` runs each stage's forwards, then
its backwards, in runs of ``chunks``; the measuring step's runs are two long
at most. Per schedule it prints each action's time over its (stage, kind)'s
typical time on the same round's step of the map's first schedule, by its
place in its run (the first, the second, the third or later), and the error
per action were each action's cost that typical time times its place's
factor, the schedule's own (what no measuring step that holds no more than
1F1B can tell).

An action's time here is its recorded span in the timeline (from its
message's arrival to its sends: the compute, wall clock), not the thread CPU
time ``'auto'`` measures; both leave out the same things around the actions.

    python benchmarks/experiments/cost_model.py [--rounds 12] [--batch 1024] [--json out.json]
"""
import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import models  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.output import format_table, save_json  # noqa: E402
from benchmarks.harness.processes import free_port, rank_environment, run_ranks  # noqa: E402
from benchmarks.harness.timing import rotated  # noqa: E402
from torchpipe.schedule import Action, Kind, Schedule, simulate  # noqa: E402
from torchpipe.schedule.actions import parse  # noqa: E402
from torchpipe.schedule.auto import AutoTuner  # noqa: E402
from torchpipe.schedule.measured import calibrate_overhead, typical  # noqa: E402

#: Each map's schedules, the one 'auto' measures on first.
MAPS: Dict[str, List[str]] = {
    "loop": ["interleaved_zero_bubble", "interleaved_1f1b", "looped_bfs"],
    "V": ["zbv", "dualpipev"],
}
LAYERS, WIDTH, STAGES, CHUNKS, WARMUP = 16, 512, 4, 8, 3

#: The places in a run of one stage's actions of one kind that the run table tells apart (:func:`run_places`).
RUN_PLACES = ("first", "second", "later")

#: One recorded step: each action's recorded time in seconds, and the step's span (first start to last end).
Step = Tuple[Dict[Action, float], float]


def rank_main(rank: int, batch: int, rounds: int, out: str, layers: int, width: int) -> None:
    """One rank: every schedule's pipeline, warm-up rounds, then ``rounds`` recorded rounds; writes this rank's
    timelines and each schedule's order as it ran to ``out.<rank>``."""
    import torchpipe
    from torchpipe import trace

    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    names = [name for schedules in MAPS.values() for name in schedules]
    pipes = {}
    for name in names:
        torch.manual_seed(0)
        pipes[name] = torchpipe.Pipeline(models.mlp(layers, width), [2 * layers // STAGES] * STAGES, chunks=CHUNKS,
                                         schedule=name, loss_fn=nn.functional.mse_loss, group=dist.group.WORLD)
    torch.manual_seed(1)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    recorded: Dict[str, List[List[List[Any]]]] = {name: [] for name in names}
    for r in range(WARMUP + rounds):
        for name in rotated(names, r):
            pipe = pipes[name]
            placed = pipe.schedule.stage_workers
            with trace.record_timeline() as timeline:
                pipe.step(x if placed[0] == rank else None, y if placed[-1] == rank else None)
            if r >= WARMUP:
                recorded[name].append([[str(span.action), span.start, span.end] for span in timeline
                                       if span.action is not None])
    ran = {name: [[str(action) for action in actions] for actions in pipes[name].schedule.workers] for name in names}
    Path(f"{out}.{rank}").write_text(json.dumps({"steps": recorded, "schedules": ran}))
    dist.barrier()
    dist.destroy_process_group()


def steps_of(ranks: Sequence[Mapping[str, Any]], name: str) -> List[Step]:
    """``name``'s recorded steps, both ranks' actions together (one machine: one clock)."""
    steps: List[Step] = []
    for spans in zip(*(rank["steps"][name] for rank in ranks)):
        times: Dict[Action, float] = {}
        for label, start, end in (span for rank in spans for span in rank):
            times[parse(label)] = end - start
        starts = [span[1] for rank in spans for span in rank]
        ends = [span[2] for rank in spans for span in rank]
        steps.append((times, max(ends) - min(starts)))
    return steps


def hop_time(schedule: Schedule, costs: Callable[[Action], float], span: float) -> float:
    """The time per message between workers (at least 0) for which :func:`simulate` runs ``schedule`` with
    ``costs`` in ``span``: the charge this experiment compares with ``'auto'``'s time per action (0 where the
    actions alone take as long, or where no action waits for another worker's)."""

    def step(hop: float) -> float:
        return simulate(schedule, costs, communication=hop).step_time

    if span <= step(0.0) or step(span) < span:
        return 0.0
    low, high = 0.0, span
    for _ in range(50):  # bisection: the step grows with the hop
        middle = (low + high) / 2
        low, high = (middle, high) if step(middle) < span else (low, middle)
    return (low + high) / 2


def charges(schedule: Schedule, step: Step) -> Tuple[float, float]:
    """The hop and the time per action that explain ``step`` of ``schedule``, each alone."""
    times, span = step
    own: Callable[[Action], float] = times.__getitem__
    return hop_time(schedule, own, span), calibrate_overhead(schedule, own, span)


def run_places(schedule: Schedule) -> Dict[Action, int]:
    """Each action's place in its worker's run of actions of one stage and kind back to back: 0 the first, 1 the
    second, 2 the third or later (``looped_bfs`` runs a stage's forwards, then its backwards, in runs of
    ``chunks``; the others run few actions of a stage and kind in a row)."""
    places: Dict[Action, int] = {}
    for actions in schedule.workers:
        for i, action in enumerate(actions):
            before = actions[i - 1]
            same = i > 0 and (before.stage, before.kind) == (action.stage, action.kind)
            places[action] = min(places[before] + 1, len(RUN_PLACES) - 1) if same else 0
    return places


def typical_costs(step: Step) -> Callable[[Action], float]:
    """What ``'auto'`` takes from a measured step: each (stage, kind)'s :func:`typical` time, in micro-batch
    order, and a kind the step did not run from the others (:meth:`AutoTuner.cost`)."""
    by: Dict[Tuple[int, Kind], List[Tuple[int, float]]] = {}
    for action, seconds in step[0].items():
        by.setdefault((action.stage, action.kind), []).append((action.microbatch, seconds))
    tuner = AutoTuner(STAGES, 2, CHUNKS)  # its costs only
    tuner.costs = {key: typical([seconds for _, seconds in sorted(values)]) for key, values in by.items()}
    return lambda action: tuner.cost(action.stage, action.kind)


def analyse(ranks: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per schedule: its median span and work (its actions' times summed, per rank), the hop and the time per
    action that explain each of its steps, and the median error of its steps predicted both ways from the same
    round's step of its map's first schedule."""
    results: Dict[str, Dict[str, Any]] = {}
    for placed, names in MAPS.items():
        schedules = {name: Schedule.from_lists(ranks[0]["schedules"][name]) for name in names}
        steps = {name: steps_of(ranks, name) for name in names}
        found = {name: [charges(schedules[name], step) for step in steps[name]] for name in names}
        base = names[0]
        # Per round, what 'auto' takes from the base's step: its typical costs, and its charges (found above).
        models = [(typical_costs(step), hop, overhead) for step, (hop, overhead) in zip(steps[base], found[base])]
        for name in names:
            places = run_places(schedules[name])
            # Each action's time over what the base's step of its round has for its (stage, kind), by its place.
            ratios: List[List[float]] = [[] for _ in RUN_PLACES]
            for (cost, _, _), (times, _) in zip(models, steps[name]):
                for action, seconds in times.items():
                    ratios[places[action]].append(seconds / cost(action))
            factor = [statistics.median(values) if values else 1.0 for values in ratios]
            scale = {action: factor[place] for action, place in places.items()}
            by_hop: List[float] = []
            per_action: List[float] = []
            runs_known: List[float] = []
            for (cost, hop, overhead), (_, span) in zip(models, steps[name]):
                by_hop.append(simulate(schedules[name], cost, communication=hop).step_time / span - 1)
                charged = lambda a, cost=cost, overhead=overhead: cost(a) + overhead  # noqa: E731
                # The recorded span ends with the last action: one overhead less than the simulated step.
                per_action.append((simulate(schedules[name], charged).step_time - overhead) / span - 1)
                # As if the simulation knew what each place in this schedule's runs costs (its own factors).
                by_place = lambda a, cost=cost, o=overhead, scale=scale: cost(a) * scale[a] + o  # noqa: E731
                runs_known.append((simulate(schedules[name], by_place).step_time - overhead) / span - 1)
            results[name] = {
                "map": placed, "step_ms": statistics.median(span for _, span in steps[name]) * 1e3,
                # What the actions themselves took, per rank: less where a stage's actions run back to back.
                "work_ms": statistics.median(sum(times.values()) for times, _ in steps[name]) / 2 * 1e3,
                "hop_ms": _spread([hop for hop, _ in found[name]]),
                "per_action_ms": _spread([overhead for _, overhead in found[name]]),
                "predicted_from": base, "error_by_hop": statistics.median(by_hop),
                "error_per_action": statistics.median(per_action),
                "runs": {place: [statistics.median(values) if values else None, len(values)]
                         for place, values in zip(RUN_PLACES, ratios)},
                "error_runs_known": statistics.median(runs_known),
            }
    return results


def _spread(seconds: Sequence[float]) -> List[float]:
    """The median, least and most of ``seconds``, in milliseconds."""
    return [statistics.median(seconds) * 1e3, min(seconds) * 1e3, max(seconds) * 1e3]


def measure(batch: int, rounds: int, timeout: float = 600.0, layers: int = LAYERS,
            width: int = WIDTH) -> Dict[str, Dict[str, Any]]:
    """Starts the 2 ranks (killed after ``timeout`` s) and analyses what they recorded (:func:`analyse`)."""
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "timelines")
        commands = [[sys.executable, __file__, "--rank", str(rank), "--batch", str(batch), "--rounds", str(rounds),
                     "--out", out, "--layers", str(layers), "--width", str(width)] for rank in range(2)]
        run_ranks(commands, rank_environment(free_port()), timeout, f"cost model, batch {batch}")
        return analyse([json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)])


def _range(values: Sequence[float]) -> str:
    return f"{values[0]:.3f} ({values[1]:.3f}-{values[2]:.3f})"


def _ratio(value: Sequence[Any]) -> str:
    median, count = value
    return "-" if median is None else f"{median:.3f} ({count})"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=LAYERS, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=WIDTH, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.batch, args.rounds, args.out, args.layers, args.width)
        return
    print(f"machine: {machine_description()}; 2 gloo ranks, 1 intra-op thread each")
    print(f"model: {LAYERS}x{WIDTH} Linear+ReLU MLP, MSE loss, {STAGES} stages, chunks {CHUNKS}, batch {args.batch}; "
          f"{args.rounds} rounds, a step of each schedule in turn")
    results = measure(args.batch, args.rounds)
    rows = [[name, r["map"], r["step_ms"], r["work_ms"], _range(r["hop_ms"]), _range(r["per_action_ms"]),
             r["predicted_from"], r["error_by_hop"], r["error_per_action"]] for name, r in results.items()]
    print(format_table(["schedule", "map", "step ms", "work ms", "hop ms: median (range)",
                        "per action ms: median (range)", "predicted from", "error: hop", "error: per action"], rows))
    print("(work: the recorded actions' times summed, per rank; hop, per action: the one charge, alone, for which "
          "simulate runs each recorded step of the schedule, each action at its recorded time, in its recorded "
          "span; error: the median over rounds of the step simulated from the same round's step of the map's first "
          "schedule, its typical cost per (stage, kind) and that step's charge, over the step recorded, less 1)")
    runs = [[name] + [_ratio(r["runs"][place]) for place in RUN_PLACES] + [r["error_per_action"],
                                                                          r["error_runs_known"]]
            for name, r in results.items()]
    print(format_table(["schedule"] + [f"time / typical: {place} in a run (actions)" for place in RUN_PLACES]
                       + ["error: per action", "error: runs known"], runs))
    print("(a run: a worker's actions of one stage and kind back to back; time / typical: the median of each "
          "action's recorded time over the typical time of its (stage, kind) on the same round's step of the map's "
          "first schedule, by its place in its run; runs known: the error per action were each action's cost that "
          "typical time times its place's median here, this schedule's own)")
    if args.json:
        save_json(args.json, {"batch": args.batch, "rounds": args.rounds, "results": results,
                              "machine": machine_description()})


if __name__ == "__main__":
    main()
