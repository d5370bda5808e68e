"""Distributed benchmark: a Pipeline over 2 gloo ranks against the plain module in one process, and against
PyTorch's own ``torch.distributed.pipelining`` measured in the same run.

Each rank is a process with one intra-op thread; the plain module runs in
rank 0's process with one thread while rank 1 waits. The model is a 16-layer
512-wide Linear+ReLU MLP with an MSE loss, ``chunks`` 8, batch 256 and 1024.
One pair of processes builds every configuration (both libraries' pipelines
side by side, each on its own process groups) and runs rounds: the plain
step, the same 8 micro-batches run by hand through the plain module (the
micro-batched ideal's yardstick), then one step of each configuration in
turn, the order rotating from round to round (barriers between them). So the
configurations are compared round by round, a few seconds apart, not in runs
minutes apart on a machine whose speed drifts. The speed-up is the median
over rounds of ``plain step time / pipelined step time``; *of ideal* is the
median of ``ideal / pipelined step time``, where the ideal is the by-hand
time times (m + p - 1) / (m p) = 9/16 (two ranks computing at once, less the
bubble), that is a speed-up of 2 x 8/9 x plain/by hand; *vs pipelining* is
the median over rounds of pipelining's same schedule's step time over
torchpipe's (> 1: torchpipe is faster), with the rounds torchpipe was faster
in. *Two processes* is what the machine allows: each rank runs the by-hand
micro-batches through one half of the model (a stage's work) at the same
time, over rank 0 running both halves one after the other (0.5 on two free
cores); a pipeline's best *of ideal* on this machine is then 0.5 / that
ratio (the *machine line*). Also: each library's set-up and first step, and
the fixed cost of a step (a 2x8 MLP, batch 8: the messages of 8
micro-batches with next to no computing), for steps back to back, as in
training, and for one step after a barrier (idle threads, cold caches), with
the CPU time a step back to back takes on both ranks, by kind of thread
(from ``/proc``: Linux only).

Configurations: torchpipe ``gpipe`` and ``1f1b`` on two stages, ``looped_bfs`` and
``interleaved_zero_bubble`` on four in a loop, ``zbv`` and ``dualpipev`` on four in a V;
``torch.distributed.pipelining``'s same schedules (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``), its stages taking the same parts of the model on the same ranks.

Goals: torchpipe's gpipe and 1f1b at >= 0.90 of the ideal at batch 1024 and >= 0.80 at 256, ahead of pipelining's
same schedule in the same run; a fixed cost per step no more than pipelining's. ``--quick`` (a 4 x 8 MLP, batch 16,
one round) only checks that it runs.

    python benchmarks/distributed.py [--rounds 8] [--batches 256 1024] [--configs 'torchpipe 1f1b' ...] [--quick]
                                     [--json out.json]
"""
import argparse
import copy
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks import models  # noqa: E402
from benchmarks.harness.cpu import THREAD_KINDS, thread_cpu  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.output import Summary, format_table, save_json  # noqa: E402
from benchmarks.harness.processes import free_port, rank_environment, run_ranks  # noqa: E402
from benchmarks.harness.rivals import RankRunner, pipelining_schedule  # noqa: E402
from benchmarks.harness.steps import microbatched_train_step, pipeline_ideal, train_step  # noqa: E402
from benchmarks.harness.timing import rotated  # noqa: E402
from torchpipe.schedule import Kind, Schedule, simulate  # noqa: E402
from torchpipe.schedule.auto import AutoTuner, Choice, measuring_schedule  # noqa: E402

WORLD = 2
LAYERS = 16
WIDTH = 512
CHUNKS = 8
#: A library and one of its schedules.
Config = Tuple[str, str]
#: torchpipe's schedules and the same schedule in pipelining: compared round by round.
RIVALS: Dict[Config, Config] = {
    ("torchpipe", ours): ("pipelining", theirs) for ours, theirs in [
        ("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B"), ("interleaved_1f1b", "ScheduleInterleaved1F1B"),
        ("looped_bfs", "ScheduleLoopedBFS"),
        ("interleaved_zero_bubble", "ScheduleInterleavedZeroBubble"), ("zbv", "ScheduleZBVZeroBubble"),
        ("dualpipev", "ScheduleDualPipeV"),
    ]
}
#: torchpipe's configurations with no rival: its own zero-bubble schedule on two stages, and ``'auto'`` on two
#: stages (it picks among 1f1b, zero_bubble and gpipe) and on four in a V (``'auto-4'``: zbv or dualpipev).
OWN: List[Config] = [("torchpipe", "zero_bubble"), ("torchpipe", "auto"), ("torchpipe", "auto-4")]
CONFIGS: List[Config] = [config for pair in RIVALS.items() for config in pair] + OWN
#: The schedules each 'auto' chooses among: those of its balance's placement.
PLACEMENTS = {"auto": {"1f1b", "zero_bubble", "gpipe"}, "auto-4": {"zbv", "dualpipev"}}
#: The schedules that run two stages per rank (each a quarter of the model): on the loop (stage s on rank s % 2)
#: or in the V (rank r holds stages r and 3 - r).
LOOPED = {"looped_bfs", "ScheduleLoopedBFS", "interleaved_zero_bubble", "ScheduleInterleavedZeroBubble",
          "interleaved_1f1b", "ScheduleInterleaved1F1B", "auto-loop"}
#: torchpipe's schedules on the loop's map, which 'auto' never measures for two stages per rank (it takes the V):
#: ``'auto-loop'``, a pipeline of this benchmark's own, measures there as 'auto' would (simulate's costs only).
LOOP_NAMES = ["interleaved_zero_bubble", "interleaved_1f1b", "looped_bfs"]
V_SHAPED = {"zbv", "ScheduleZBVZeroBubble", "dualpipev", "ScheduleDualPipeV", "auto-4"}
#: The goals: the fraction of the micro-batched ideal, per batch.
GOALS = {256: 0.80, 1024: 0.90}
HEADERS = ["configuration", "batch", "speed-up vs plain", "of ideal", "machine line", "goal", "vs pipelining",
           "step ms", "plain ms", "by hand ms", "two processes", "set-up + 1st step s"]
#: The model and batch that measure what a step costs by itself.
FIXED_LAYERS, FIXED_WIDTH, FIXED_BATCH = 2, 8, 8
#: The fixed cost's steps timed back to back in each round.
FIXED_BURST = 10
#: How far apart two schedules' measured steps must be for their order to count as measured, not noise: the goal's
#: noise.
NOISE = 0.03
#: A cost per (stage, kind) in seconds, and the time around each action (``'auto'``'s calibrated overhead).
CostModel = Tuple[Callable[[int, Kind], float], float]


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


class Runner(RankRunner):
    """One library's pipelined training step on this rank."""

    def __init__(self, library: str, schedule: str, rank: int, layers: int, width: int) -> None:
        self.rank = rank
        model = models.mlp(layers, width)
        stages = 2 * WORLD if schedule in LOOPED | V_SHAPED else WORLD
        size = len(model) // stages
        if schedule in V_SHAPED:
            mine = [rank, 2 * WORLD - 1 - rank]
        else:
            mine = list(range(rank, stages, WORLD))
        #: Whether this rank reads the input (holds the first stage) and the target (the last).
        self.first, self.last = 0 in mine, stages - 1 in mine
        if library == "torchpipe" and schedule == "auto-loop":
            import torchpipe

            # The loop's measuring step as 'auto' would run it there, timed by a tuner of the loop's schedules (a
            # private attribute: this benchmark's only); the pipeline runs that step whatever the tuner chooses.
            self.pipe = torchpipe.Pipeline(model, [size] * stages, chunks=CHUNKS, loss_fn=loss_fn,
                                           schedule=measuring_schedule(stages, WORLD, CHUNKS, names=LOOP_NAMES),
                                           group=dist.group.WORLD)
            self.pipe._tuner = AutoTuner(stages, WORLD, CHUNKS, names=LOOP_NAMES)
            self.parameters = list(self.pipe.parameters())
            self.run = self.torchpipe_step
        elif library == "torchpipe":
            import torchpipe

            self.pipe = torchpipe.Pipeline(model, [size] * stages, chunks=CHUNKS, schedule=schedule.split("-")[0],
                                           loss_fn=loss_fn, group=dist.group.WORLD)
            self.parameters = list(self.pipe.parameters())
            self.run = self.torchpipe_step
        else:
            self.schedule, self.parameters = pipelining_schedule(list(model.children()), mine, stages, schedule,
                                                                 CHUNKS, loss_fn)
            self.run = self.pipelining_step


def rank_main(
    rank: int, configs: Sequence[Config], batch: int, rounds: int, out: str, spawned: float,
    layers: int = LAYERS, width: int = WIDTH, burst: int = 0,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=5))
    started = time.time() - spawned
    # Both libraries imported before the timed set-ups, alike.
    from torch.distributed import pipelining  # noqa: F401

    import torchpipe  # noqa: F401

    torch.manual_seed(1)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    runners: Dict[Config, Runner] = {}
    first_step: Dict[Config, float] = {}
    for config in configs:  # each library's own set-up, then its first step (shapes, buffers, connections)
        dist.barrier()
        start = time.perf_counter()
        runners[config] = Runner(*config, rank, layers, width)
        runners[config].step(x, y)
        first_step[config] = time.perf_counter() - start
    # simulate's model in each round: a measuring pipeline of each map torchpipe's configurations run on (two
    # stages, the V, the loop) measured again (its choice forgotten), a few seconds from the round's steps, not
    # minutes (the machine's speed drifts by more than the goal's 10 %).
    models_of = {name: Runner("torchpipe", name, rank, layers, width) for name in ("auto", "auto-4", "auto-loop")
                 if any(library == "torchpipe" and _measured_by(schedule) == name for library, schedule in configs)}
    for measuring in models_of.values():
        measuring.step(x, y)
    # and at set-up: what each measured on its first step (a fresh pipeline's, made after every configuration's
    # set-up; the 'auto' configurations chose by their own first steps, before).
    first_costs = {name: _cost_model(_tuner(measuring)) for name, measuring in models_of.items()}
    round_costs: Dict[str, List[CostModel]] = {name: [] for name in models_of}
    plain = models.mlp(layers, width)

    plain_step = train_step(plain, x, target=y, loss_fn=loss_fn)
    hand_step = microbatched_train_step(plain, x, CHUNKS, target=y, loss_fn=loss_fn)
    # A stage's share of the by-hand work (both halves have the same shape): the machine line's yardstick.
    half_step = microbatched_train_step(
        nn.Sequential(*list(plain.children())[: len(plain) // 2]), x, CHUNKS, target=y, loss_fn=loss_fn
    )

    if rank == 0:
        plain_step()
        hand_step()
    half_step()
    plain_times: List[float] = []
    hand_times: List[float] = []
    pipe_times: Dict[Config, List[float]] = {config: [] for config in configs}
    burst_times: Dict[Config, List[float]] = {config: [] for config in configs}
    # Per configuration and kind of thread: CPU seconds and context switches of its steps back to back.
    burst_cpu: Dict[Config, Dict[str, Tuple[float, int]]] = {config: {} for config in configs}
    two_processes: List[float] = []
    for round_ in range(rounds):
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            plain_step()
            plain_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            hand_step()
            hand_times.append(time.perf_counter() - start)
        for config in rotated(configs, round_):  # none always after the by-hand step or one library
            runner = runners[config]
            dist.barrier()
            start = time.perf_counter()
            runner.step(x, y)
            pipe_times[config].append(time.perf_counter() - start)
            if burst:  # steps back to back, as in training (one step after a barrier starts on idle threads)
                dist.barrier()
                before = thread_cpu()
                start = time.perf_counter()
                for _ in range(burst):
                    runner.step(x, y)
                burst_times[config].append((time.perf_counter() - start) / burst)
                for kind, (seconds, switches) in thread_cpu().items():
                    was = before.get(kind, (0.0, 0))
                    cpu, count = burst_cpu[config].get(kind, (0.0, 0))
                    burst_cpu[config][kind] = (cpu + seconds - was[0], count + switches - was[1])
        for name, measuring in models_of.items():
            tuner = _tuner(measuring)
            tuner.choice = None  # this benchmark's only: the next step measures again
            dist.barrier()
            measuring.step(x, y)
            round_costs[name].append(_cost_model(tuner))
        dist.barrier()
        if rank == 0:  # both halves one after the other, then each rank its half at once
            start = time.perf_counter()
            half_step()
            half_step()
            one_after_other = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        half_step()
        took = torch.tensor([time.perf_counter() - start])
        # Point to point, not a collective: gloo's worker thread drops a collective's tensors after the caller
        # is through with them, and a process that exits meanwhile aborts (a PyTorch race at interpreter exit).
        if rank == 1:
            dist.send(took, 0)
        else:
            other = torch.zeros(1)
            dist.recv(other, 1)
            two_processes.append(max(float(took), float(other)) / one_after_other)
    if burst:  # every rank's threads: per configuration and step, CPU milliseconds and context switches
        steps = burst * rounds
        Path(f"{out}.cpu{rank}").write_text(json.dumps({
            _name(config): {kind: [seconds / steps * 1e3, switches / steps] for kind, (seconds, switches) in
                            burst_cpu[config].items()} for config in configs
        }))
    if rank == 0:
        ideal = pipeline_ideal(WORLD, CHUNKS)
        two = statistics.median(two_processes)
        shared = {  # every configuration's rounds had the same yardsticks
            "plain_ms": statistics.median(plain_times) * 1e3, "hand_ms": statistics.median(hand_times) * 1e3,
            "start_s": started, "two_processes": two, "machine_line": 0.5 / two,
        }
        results: Dict[str, Dict[str, Any]] = {}
        for config in configs:
            times = pipe_times[config]
            result: Dict[str, Any] = {
                **shared,
                "speedup": statistics.median(p / t for p, t in zip(plain_times, times)),
                "of_ideal": statistics.median(ideal * h / t for h, t in zip(hand_times, times)),
                "pipe_ms": statistics.median(times) * 1e3, "first_step_s": first_step[config],
                "pipe_burst_ms": statistics.median(burst_times[config]) * 1e3 if burst else None,
            }
            runner = runners[config]
            if config[0] == "torchpipe":
                result["schedule"] = runner.pipe.schedule_name
                if config[1].startswith("auto"):  # what it measured on its first step, and chose from
                    tuner = _tuner(runner)
                    result["measured_costs_ms"] = {f"{s}{kind.label}": cost * 1e3
                                                   for (s, kind), cost in sorted(tuner.costs.items())}
                    choice = _chosen(tuner)
                    result["overhead_ms"] = choice.overhead * 1e3
                    result["relayout_ms"] = tuner.relayout * 1e3
                    # What it may choose: its placement's schedules within 1F1B's activations.
                    result["may_choose"] = [name for name, _, peak in choice.table if peak <= choice.limit]
                predicted = _predicted(runner.pipe.schedule, first_costs)
                if predicted is not None:
                    result["predicted_ms"] = predicted * 1e3
                    # Each round's step against the one simulated from that round's measuring step.
                    per_round = [_predicted(runner.pipe.schedule, {name: costs[r] for name, costs in
                                                                   round_costs.items()}) for r in range(rounds)]
                    result["predicted_round_ms"] = statistics.median(p for p in per_round if p) * 1e3
                    result["round_error"] = statistics.median(p / t - 1 for p, t in zip(per_round, times) if p)
                    # The calibrated time around each action on the schedule's map: at set-up, the median over
                    # rounds.
                    by = _measured_by(config[1])
                    result["map_overhead_ms"] = [first_costs[by][1] * 1e3,
                                                 statistics.median(c for _, c in round_costs[by]) * 1e3]
                    result["measured_on"] = list(models_of[by].pipe.schedule.stage_workers)
            rival = RIVALS.get(config)
            if rival in pipe_times:  # the same schedule's steps in pipelining, round by round
                result["vs_rival"] = _against(pipe_times[rival], times)
                if burst:
                    result["burst_vs_rival"] = _against(burst_times[rival], burst_times[config])
            results[_name(config)] = result
        for config in configs:  # 'auto' against each fixed schedule of torchpipe's, round by round
            if config[0] == "torchpipe" and config[1].startswith("auto"):
                results[_name(config)]["vs_fixed"] = {
                    _name(fixed): _against(pipe_times[fixed], pipe_times[config]) for fixed in configs
                    if fixed[0] == "torchpipe" and not fixed[1].startswith("auto")
                }
        Path(out).write_text(json.dumps(results))
    # The ranks leave together, once rank 0 is through (its figures take a while): a rank that ended while the
    # other still ran aborted at exit ("terminate called without an active exception", 2 runs of 3). Point to
    # point, as above.
    done = torch.zeros(1)
    if rank == 0:
        dist.send(done, 1)
    else:
        dist.recv(done, 0)
    dist.destroy_process_group()


def _tuner(runner: Runner) -> AutoTuner:
    """An ``'auto'`` configuration's tuner, its choice made (a private attribute: this benchmark's only)."""
    tuner = runner.pipe._tuner
    assert isinstance(tuner, AutoTuner) and tuner.choice is not None, "'auto' chooses on its first step"
    return tuner


def _chosen(tuner: AutoTuner) -> Choice:
    assert tuner.choice is not None
    return tuner.choice


def _cost_model(tuner: AutoTuner) -> CostModel:
    """What ``tuner`` measured: each stage's cost of a kind and the calibrated time around each action,
    as they are now (a copy: its next measuring step leaves them as they are)."""
    measured = copy.copy(tuner)
    measured.costs = dict(tuner.costs)
    return measured.cost, _chosen(tuner).overhead


def _measured_by(schedule: str) -> str:
    """The measuring pipeline whose costs simulate a torchpipe schedule (a name of this benchmark's): the one on
    its map, ``'auto'`` on two stages, ``'auto-4'`` in the V, ``'auto-loop'`` on the loop."""
    return "auto-loop" if schedule in LOOPED else "auto-4" if schedule in V_SHAPED else "auto"


def _predicted(schedule: Schedule, costs: Mapping[str, CostModel]) -> Optional[float]:
    """The step time (seconds) :func:`torchpipe.schedule.simulate` predicts for ``schedule`` from the costs
    measured on its own map (:func:`_measured_by`); None where that measuring pipeline is not in the run."""
    loop = tuple(s % WORLD for s in range(schedule.stages))
    model = costs.get("auto" if schedule.stages == WORLD else "auto-loop" if schedule.stage_workers == loop
                      else "auto-4")
    if model is None:
        return None
    cost, overhead = model
    return simulate(schedule, lambda a: cost(a.stage, a.kind) + overhead).step_time


def _against(rival: Sequence[float], ours: Sequence[float]) -> Dict[str, Any]:
    """Round by round, the rival's step time over ours (> 1: ours is faster): the median, and in how many rounds
    ours was faster."""
    ratios = [r / o for r, o in zip(rival, ours)]
    return {"ratio": statistics.median(ratios), "ahead": sum(ratio > 1 for ratio in ratios), "rounds": len(ratios)}


def _name(config: Config) -> str:
    return " ".join(config)


def measure(
    configs: Sequence[Config], batch: int, rounds: int, timeout: float = 600.0, layers: int = LAYERS,
    width: int = WIDTH, burst: int = 0,
) -> Dict[str, Dict[str, Any]]:
    """Starts 2 ranks that build every configuration and time their steps round by round, in turn; rank 0's
    figures per configuration (``"torchpipe 1f1b"``: ...). The ranks are killed after ``timeout`` s. With
    ``burst``, each round also times that many steps back to back (``pipe_burst_ms``: per step; ``cpu``: per
    rank, CPU ms and context switches a step by kind of thread). Where a torchpipe schedule's rival (its
    schedule in pipelining) is measured too, ``vs_rival`` (and ``burst_vs_rival``) compare the two round by
    round. Each torchpipe schedule also gets ``predicted_ms`` and ``predicted_round_ms``
    (:func:`torchpipe.schedule.simulate`'s step from the costs measured on its map at set-up, and per round),
    ``round_error``, ``map_overhead_ms`` (the calibrated time around each action on its map: at set-up, the median
    over rounds) and ``measured_on`` (that map: each stage's rank)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "result.json")
        spawned = time.time()
        commands = [[sys.executable, __file__, "--rank", str(rank), "--configs", *map(_name, configs),
                     "--batch", str(batch), "--rounds", str(rounds), "--out", out, "--spawned", repr(spawned),
                     "--layers", str(layers), "--width", str(width), "--burst", str(burst)] for rank in range(WORLD)]
        names = ", ".join(map(_name, configs))
        run_ranks(commands, rank_environment(port), timeout, f"{names}, batch {batch}")
        results: Dict[str, Dict[str, Any]] = json.loads(Path(out).read_text())
        if burst:
            cpu = [json.loads(Path(f"{out}.cpu{rank}").read_text()) for rank in range(WORLD)]
            for name, result in results.items():
                result["cpu"] = [rank[name] for rank in cpu]
        return results


def _versus(result: Dict[str, Any], key: str) -> str:
    """A torchpipe configuration's comparison with its rival: ``"1.043 (6/8)"``, or ``""``."""
    against = result.get(key)
    return f"{against['ratio']:.3f} ({against['ahead']}/{against['rounds']})" if against else ""


def _print_model(measured: Mapping[str, Dict[str, Any]], batch: int) -> None:
    """How well :func:`torchpipe.schedule.simulate` predicted torchpipe's step times from the costs measured on
    each schedule's map (the error per schedule, the two rankings), and ``'auto'`` against every fixed
    schedule."""
    predicted = {name: r for name, r in measured.items()
                 if "predicted_ms" in r and not name.startswith("torchpipe auto")}
    if predicted:
        table = [[name, r["schedule"], r["pipe_ms"], r["predicted_ms"], r["predicted_ms"] / r["pipe_ms"] - 1,
                  r["predicted_round_ms"], r["round_error"]] for name, r in predicted.items()]
        print(format_table(["configuration", "ran", "measured ms", "simulated ms", "error",
                            "per round: simulated ms", "error"], table))

        def order(key: str) -> str:
            return ", ".join(n.split(" ", 1)[1] for n in sorted(predicted, key=lambda n: predicted[n][key]))

        def pairs(key: str) -> str:
            return ", ".join(f"{right} of {of}" for right, of in (ordered_pairs(
                {n: r["pipe_ms"] for n, r in predicted.items()}, {n: r[key] for n, r in predicted.items()}, apart)
                for apart in (0.0, NOISE)))

        print(f"batch {batch}, fastest first: measured {order('pipe_ms')}; simulated {order('predicted_ms')}; "
              f"per round {order('predicted_round_ms')}. The largest error {max(abs(row[4]) for row in table):.1%}, "
              f"per round {max(abs(row[6]) for row in table):.1%}. Pairs of schedules in the measured order, of "
              f"all and of those measured more than {NOISE:.0%} apart: simulated {pairs('predicted_ms')}; per "
              f"round {pairs('predicted_round_ms')}. (simulated: from the costs a measuring pipeline on the "
              "schedule's own map (two stages, the V, the loop) took as 'auto' does on its first step at set-up: "
              "F, B, I, W per stage and the calibrated time around each action; per round: from a measuring step of "
              "each in every round, each round's step against its own round's simulated one, the median over "
              "rounds)")
    for name, r in measured.items():
        if "vs_fixed" in r:
            placed = PLACEMENTS[name.split(" ", 1)[1]]
            for among, fixed in (("", list(r["vs_fixed"])), (" of its placement", [
                    f for f in r["vs_fixed"] if f.split(" ", 1)[1] in placed]), (
                    " it may choose (within 1F1B's activations)", [
                        f for f in r["vs_fixed"] if f.split(" ", 1)[1] in r.get("may_choose", ())])):
                if not fixed:
                    continue
                best = min(fixed, key=lambda f: measured[f]["pipe_ms"])
                against = r["vs_fixed"][best]
                print(f"{name} (ran {r['schedule']}) against the fastest fixed schedule{among}, {best}: its step "
                      f"{1 / against['ratio']:.3f} of that one's (median over rounds; faster in {against['ahead']} "
                      f"of {against['rounds']} rounds)")


def ordered_pairs(measured: Mapping[str, float], predicted: Mapping[str, float], apart: float = 0.0
                  ) -> Tuple[int, int]:
    """Of the pairs of configurations whose measured times differ by more than ``apart`` (relative to the faster),
    how many the prediction orders alike, and how many there are: (right, pairs)."""
    right = total = 0
    names = sorted(measured)
    for k, a in enumerate(names):
        for b in names[k + 1:]:
            fast, slow = sorted((a, b), key=lambda n: measured[n])
            if measured[slow] > measured[fast] * (1 + apart):
                total += 1
                right += predicted[fast] < predicted[slow]
    return right, total


def _config(name: str) -> Config:
    library, _, schedule = name.partition(" ")
    config = (library, schedule)
    if config not in CONFIGS:
        raise SystemExit(f"--configs: {name!r} is not one of {', '.join(map(_name, CONFIGS))}")
    return config


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--json", default=None)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", default=None,
                        help="configurations to run (default: all): 'torchpipe zbv' 'pipelining ScheduleDualPipeV'")
    parser.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spawned", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=LAYERS, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=WIDTH, help=argparse.SUPPRESS)
    parser.add_argument("--burst", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a 4 x 8 MLP, batch 16, one round: checks that it runs")
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, [_config(name) for name in args.configs], args.batch, args.rounds, args.out,
                  args.spawned, args.layers, args.width, args.burst)
        return {}
    fixed_rounds, fixed_burst = max(args.rounds, 32), FIXED_BURST
    if args.quick:
        args.layers, args.width, args.batches, args.rounds = 4, 8, [16], 1
        fixed_rounds, fixed_burst = 1, 2
    configs = [_config(name) for name in args.configs] if args.configs else CONFIGS
    print(f"machine: {machine_description()}; {WORLD} gloo ranks, 1 intra-op thread each; plain: 1 thread")
    print(f"model: {args.layers}x{args.width} Linear+ReLU MLP, MSE loss, chunks {CHUNKS}; the {len(configs)} "
          "configurations in one pair of processes, a step of each in every round (in turn, the order rotating)")
    rows: List[List[Any]] = []
    results: Dict[str, Dict[str, Any]] = {}
    for batch in args.batches:
        measured = measure(configs, batch, args.rounds, layers=args.layers, width=args.width)
        for name, result in measured.items():
            results[f"{name} batch={batch}"] = result
            rows.append([name, batch, result["speedup"], result["of_ideal"], result["machine_line"],
                         GOALS.get(batch), _versus(result, "vs_rival"), result["pipe_ms"], result["plain_ms"],
                         result["hand_ms"], result["two_processes"], result["first_step_s"]])
        print(format_table(HEADERS, rows[-len(measured):]), flush=True)
        _print_model(measured, batch)
    if len(args.batches) > 1:
        print()
        print(format_table(HEADERS, rows))
    print("(speed-up: median over rounds of plain step time / pipelined step time; of ideal: median of the by-hand "
          f"time x {pipeline_ideal(WORLD, CHUNKS):.4f} / pipelined step time; vs pipelining: median over "
          "rounds of the step time of pipelining's same schedule / torchpipe's (> 1: torchpipe faster), and in how "
          f"many rounds torchpipe was faster; by hand: the same {CHUNKS} micro-batches through the plain module on "
          "one thread; two processes: each rank a half's by-hand work at once / rank 0 both halves in turn; machine "
          "line: 0.5 / two processes, the best of ideal these cores allow; set-up: building the library's pipeline "
          "and its first step, after the processes started (python, torch, the process group): "
          f"{max(result['start_s'] for result in results.values()):.1f} s at most)")
    print()
    # The cost of a step itself: messages, threads, control; the model computes next to nothing.
    fixed: List[List[Any]] = []
    measured = measure(configs, FIXED_BATCH, fixed_rounds, layers=FIXED_LAYERS, width=FIXED_WIDTH, burst=fixed_burst)
    for name, result in measured.items():
        results[f"{name} fixed cost"] = result
        cpu = result["cpu"]
        per_kind = [sum(rank.get(kind, [0.0, 0.0])[0] for rank in cpu) for kind in THREAD_KINDS]
        switches = sum(value[1] for rank in cpu for value in rank.values())
        fixed.append([name, result["pipe_burst_ms"], _versus(result, "burst_vs_rival"), result["pipe_ms"],
                      sum(per_kind), *per_kind, switches])
    print(format_table(["configuration", "fixed cost of a step, ms", "vs pipelining", "after a barrier, ms",
                        "CPU ms", *(f"{kind} ms" for kind in THREAD_KINDS), "switches"], fixed))
    print(f"(median step time of a {FIXED_LAYERS}x{FIXED_WIDTH} MLP, batch {FIXED_BATCH}, chunks {CHUNKS}: "
          f"{CHUNKS} micro-batches cross each way with next to no computing; steps {fixed_burst} back to back, as "
          "in training, and one step after a barrier, which starts on idle threads and cold caches; vs pipelining: "
          "round by round, pipelining's same schedule's steps back to back / torchpipe's, the median and the rounds "
          "torchpipe was faster in; CPU ms: the CPU time of a step back to back, both ranks' threads together, then "
          "by kind of thread (main: the one that calls step(); gloo: the transports'; store: the torch.distributed "
          "store's server, in rank 0; other threads: the ones Python started); switches: their context switches a "
          "step. CPU ms / step time: how many cores the step keeps busy on average)")
    figures = {"results": results, "goals": GOALS, "batches": args.batches, "rounds": args.rounds,
               "model": [args.layers, args.width]}
    if args.json:
        save_json(args.json, figures)
    return figures


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): per configuration and batch, the speed-up over the plain
    module, the share of the micro-batched ideal, the machine line, torchpipe against pipelining's same schedule,
    the step time; then each configuration's fixed cost of a step (batch: "fixed cost")."""
    goals = {int(batch): goal for batch, goal in results["goals"].items()}
    rows = []
    for key, r in results["results"].items():
        name, _, batch = key.rpartition(" batch=")
        if not name:
            continue
        ran = f" (ran {r['schedule']})" if name.startswith("torchpipe auto") else ""
        rows.append([name + ran, int(batch), r["speedup"], r["of_ideal"], r["machine_line"], goals.get(int(batch)),
                     _versus(r, "vs_rival") or None, r["pipe_ms"]])
    rows += [[key[: -len(" fixed cost")], "fixed cost", None, None, None, None,
              _versus(r, "burst_vs_rival") or None, r["pipe_burst_ms"]]
             for key, r in results["results"].items() if key.endswith(" fixed cost")]
    layers, width = results["model"]
    notes = [f"A {layers} x {width} Linear+ReLU MLP, {CHUNKS} micro-batches, on {WORLD} gloo ranks; "
             f"rounds: {results['rounds']}. The fixed cost: a {FIXED_LAYERS} x {FIXED_WIDTH} MLP, batch {FIXED_BATCH}, "
             "steps back to back (its step ms)."]
    return Summary(["configuration", "batch", "speed-up vs plain", "of ideal", "machine line", "goal",
                    "vs pipelining (rounds ahead)", "step ms"], rows, notes)


if __name__ == "__main__":
    main()
