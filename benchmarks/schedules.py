"""Schedules benchmark: step time and peak step memory of every Pipeline schedule against the plain module.

On CPU workers with one intra-op thread each, against the plain module with
one thread, for a 32-layer 512-wide Linear+ReLU MLP (batch 1024, MSE loss)
and the small U-Net with long skips (``torchpipe.skip``): for ``gpipe``,
``1f1b`` and ``zero_bubble`` on 2 stages and ``interleaved_1f1b`` on 4 stages
over 2 workers, ``chunks`` 8, it prints

- the step time as a ratio to the plain step, to the same micro-batches run
  by hand, and to ``1f1b`` (each the median over rounds that run every step
  once, of the two steps' times in the same round),
- the peak step memory as a ratio to the plain step's (a child process per
  figure, as in ``memory.py``),
- the bubble fraction the schedule simulator predicts with the per-action
  costs measured in this run, and the idle fraction measured from the
  timeline of one step (``1 - busy / (workers x step time)``);
- what the machine allows in the same rounds: the by-hand micro-batches in
  two halves on two bare threads at once, over the by-hand step (0.5 on two
  free cores), and what a 2-stage pipeline would take at that pace (that
  times 2 times the bubble's 9/16; its stages each touch half the weights,
  so it may do better);
- each schedule's step over its *machine line*: the two bare threads' step of
  the same round times 2 times the schedule's ideal, ``1 / (2 (1 - bubble))``
  with the bubble :func:`~torchpipe.schedule.simulate` gives for the mean
  cost per stage and action kind measured on one of its steps (9/16 for
  GPipe's order on alike stages with a backward twice the forward; more here,
  where the first stage's backward computes no input gradient; less for the
  interleaved, zero-bubble and V schedules), the median over rounds;
- ``torchpipe.GPipe`` on the same two stages without checkpointing, its loss
  on the whole output: Pipeline's ``'gpipe'`` beside the class that runs the
  same order.

Goals (MLP): every schedule's step time <= 0.62 of the same micro-batches by
hand (the ideal is 9/16); ``zero_bubble`` no slower than ``1f1b``; ``1f1b``
peak step memory <= 0.5 of ``gpipe``'s; every schedule <= 1.05 of its machine
line. ``--models mlp-tiny`` (a 4 x 8 MLP, batch 16) only checks that it runs.

    python benchmarks/schedules.py [--rounds 7] [--models mlp unet mlp-tiny] [--chunks 8] [--schedules gpipe ...]
        [--json out.json]
"""
import argparse
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import torchpipe  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.memory import cpu_peak_rss_bytes, reset_peak_rss  # noqa: E402
from benchmarks.harness.output import Summary, format_table, save_json  # noqa: E402
from benchmarks.harness.processes import run_in_child  # noqa: E402
from benchmarks.harness.steps import (  # noqa: E402
    Step,
    microbatched_train_step,
    pipeline_ideal,
    pipeline_step,
    train_step,
)
from benchmarks.harness.timing import Variant, at_once, median_ratio, round_robin  # noqa: E402
from torchpipe import trace  # noqa: E402
from torchpipe.schedule import Kind, Schedule, simulate  # noqa: E402
from torchpipe.schedule.split import TUNING_STEPS  # noqa: E402

#: (name, schedule, stages); two workers each.
CONFIGS: List[Tuple[str, str, int]] = [
    ("gpipe", "gpipe", 2),
    ("1f1b", "1f1b", 2),
    ("interleaved_1f1b (4 stages)", "interleaved_1f1b", 4),
    ("zero_bubble", "zero_bubble", 2),
    ("looped_bfs (4 stages)", "looped_bfs", 4),
    ("interleaved_zero_bubble (4 stages)", "interleaved_zero_bubble", 4),
    ("zbv (4 stages, V)", "zbv", 4),
    ("dualpipev (4 stages, V)", "dualpipev", 4),
]
#: Every schedule at most this fraction of the same micro-batches run by hand (ideal 9/16).
TIME_GOAL = 0.62
MEMORY_GOAL = 0.5
#: Every schedule at most this fraction of its machine line.
LINE_GOAL = 1.05


def workload(name: str) -> Tuple[nn.Sequential, Tensor, Tensor]:
    """(the Sequential, an input batch, a target of the output's shape)."""
    torch.manual_seed(0)
    if name == "mlp":
        return models.mlp(), torch.randn(1024, 512), torch.randn(1024, 512)
    if name == "mlp-tiny":
        return models.mlp(4, 8), torch.randn(16, 8), torch.randn(16, 8)
    if name == "unet":
        built = models.unet("small", "skip")
        assert isinstance(built.module, nn.Sequential)
        x = built.sample()
        with torch.no_grad():
            target = torch.randn_like(built.module(x))
        return built.module, x, target
    raise ValueError(f"unknown model {name!r}")


def pipeline(name: str, schedule: Union[str, Schedule], stages: int, chunks: int
             ) -> Tuple[torchpipe.Pipeline, Tensor, Tensor]:
    module, x, y = workload(name)
    devices = ["cpu"] * 2
    pipe = torchpipe.Pipeline(module, models.even_balance(len(module), stages), chunks=chunks, schedule=schedule,
                              loss_fn=nn.functional.mse_loss, devices=devices)
    return pipe, x, y


def plain_step(name: str) -> Step:
    module, x, y = workload(name)
    return train_step(module, x, target=y, loss_fn=nn.functional.mse_loss)


def by_hand_step(name: str, chunks: int) -> Step:
    """The plain module run micro-batch by micro-batch on one thread: what micro-batching alone costs here."""
    module, x, y = workload(name)
    return microbatched_train_step(module, x, chunks, target=y, loss_fn=nn.functional.mse_loss)


def two_threads_step(name: str, chunks: int) -> Step:
    """The by-hand step's micro-batches split in two halves, run on two bare threads at once (each on its own
    copy of the module): over the by-hand step, what this machine's two cores give two threads now (see
    :func:`benchmarks.harness.timing.two_thread_ratio`)."""
    module, x, y = workload(name)
    first, second = [
        microbatched_train_step(copy, x_half, chunks // 2, target=y_half, loss_fn=nn.functional.mse_loss)
        for copy, x_half, y_half in zip((module, workload(name)[0]), x.chunk(2), y.chunk(2))
    ]
    return at_once(first, second)


def recorded_step(pipe: torchpipe.Pipeline, x: Tensor, y: Tensor) -> Tuple[Schedule, List[trace.Span]]:
    """One step recorded after one more as its warm-up, its gradients dropped: (the schedule it ran, its
    actions' spans)."""
    pipe.step(x, y)
    # The schedule the recorded step runs: a zero-bubble split still being decided may change after it.
    schedule = pipe.schedule
    with trace.record_timeline() as timeline:
        pipe.step(x, y)
    for p in pipe.parameters():
        p.grad = None
    return schedule, [s for s in timeline.tasks() if s.action is not None]


def mean_costs(spans: List[trace.Span]) -> Dict[Tuple[int, Kind], float]:
    """Each (stage, action kind)'s mean duration (s) over ``spans``."""
    durations: Dict[Tuple[int, Kind], List[float]] = {}
    for s in spans:
        assert s.action is not None
        durations.setdefault((s.action.stage, s.action.kind), []).append(s.duration)
    return {key: statistics.mean(values) for key, values in durations.items()}


def timeline_figures(pipe: torchpipe.Pipeline, x: Tensor, y: Tensor) -> Tuple[float, float]:
    """(simulated bubble with this step's measured mean cost per stage and action kind, idle fraction measured).

    Per stage: the stages are not alike even where their layers are. The first stage's backward computes no
    input gradient (its input needs none), so it costs about two thirds of the others' on the MLP, and the
    worker that holds the later stages sets the pace (GPipe's order on 2 stages: a bubble of 0.20, not 1/9)."""
    schedule, spans = recorded_step(pipe, x, y)
    mean = mean_costs(spans)
    simulated = simulate(schedule, lambda a: mean[(a.stage, a.kind)]).bubble
    start = min(s.start for s in spans)
    end = max(s.end for s in spans)
    busy = sum(s.duration for s in spans)
    workers = schedule.num_workers
    return simulated, 1.0 - busy / (workers * (end - start))


def schedule_ideal(bubble: float, workers: int = 2) -> float:
    """A schedule's best step over the same work on one thread: ``1 / (workers (1 - bubble))`` (its simulated
    bubble; 9/16 for GPipe's or 1F1B's 8 micro-batches on 2 alike stages with a backward twice the forward)."""
    return 1.0 / (workers * (1.0 - bubble))


def gpipe_step(name: str, chunks: int) -> Step:
    """``torchpipe.GPipe`` without checkpointing on the same 2 stages, 2 CPU workers: its forward, the loss on the
    whole output, its backward (GPipe's schedule, beside Pipeline's ``'gpipe'``)."""
    module, x, y = workload(name)
    model = torchpipe.GPipe(module, models.even_balance(len(module), 2), chunks=chunks, checkpoint="never",
                            devices=["cpu"] * 2)
    return train_step(model, x, target=y, loss_fn=nn.functional.mse_loss)


def step_memory(model: str, schedule: Optional[str], stages: int, chunks: int) -> int:
    """The peak step memory of one configuration, measured in a child process (see :func:`memory`)."""
    result = run_in_child("benchmarks.schedules:memory",
                          {"model": model, "schedule": schedule, "stages": stages, "chunks": chunks})
    return int(result["step_bytes"])


def memory(model: str, schedule: Optional[str], stages: int, chunks: int) -> Dict[str, Any]:
    """In a child process: the peak RSS of two steps above the peak after a warm-up step on a tiny batch.

    As in ``memory.py``: the warm-up (two samples per micro-batch) puts the
    parameters' gradients, the workers and lazy initialisation in the
    baseline, so the figure is what the batch's own step holds at its peak
    (activations and temporaries). glibc's mmap threshold is pinned (by
    :func:`main`, for the children) so that freed activations go back to the
    system: the peak RSS follows the live tensors instead of the allocator's
    reuse.
    """
    torch.set_num_threads(1)
    warm = slice(0, 2 * chunks)
    if schedule is None:
        module, x, y = workload(model)

        def run(batch: slice) -> None:
            nn.functional.mse_loss(module(x[batch]), y[batch]).backward()
    else:
        pipe, x, y = pipeline(model, schedule, stages, chunks)

        def run(batch: slice) -> None:
            pipe.step(x[batch], y[batch])

    # Gradients stay: later steps accumulate into them in place. A zero_bubble pipeline chooses its split first,
    # on steps of the whole batch (the second runs every stage split, the most it may hold), and its peak
    # starts again after them, so that the figure is the split's it trains with (where the peak cannot be
    # reset, it includes them: an upper bound).
    run(warm)
    if schedule == "zero_bubble":
        for _ in range(TUNING_STEPS):
            run(slice(None))
        reset_peak_rss()
    base = cpu_peak_rss_bytes()
    for _ in range(2):
        run(slice(None))
    return {"step_bytes": max(0, cpu_peak_rss_bytes() - base)}


def run(model: str, rounds: int, chunks: int, jobs: int = 2, schedules: Optional[Sequence[str]] = None
        ) -> List[Dict[str, Any]]:
    """Every row of ``model``'s table: the by-hand step's, each configuration's (those of ``schedules``, by
    schedule name: all by default), GPipe's."""
    torch.set_num_threads(1)
    configs = [config for config in CONFIGS if schedules is None or config[1] in schedules]
    pipes: Dict[str, Tuple[torchpipe.Pipeline, Tensor, Tensor]] = {}
    for name, schedule, stages in configs:
        pipe, x, y = pipes[name] = pipeline(model, schedule, stages, chunks)
        if schedule == "zero_bubble":  # its split first: measured, then tried against 1F1B on its own steps
            for _ in range(TUNING_STEPS):
                pipeline_step(pipe, x, y)()
    # Every step once a round (plain, by hand, each schedule): each ratio is over steps run seconds apart.
    variants = [Variant("plain", plain_step(model)), Variant("by hand", by_hand_step(model, chunks)),
                Variant("two threads", two_threads_step(model, chunks)), Variant(GPIPE, gpipe_step(model, chunks))]
    variants += [Variant(name, pipeline_step(*pipes[name])) for name, _, _ in configs]
    times = round_robin(variants, rounds=rounds, warmup=1, desc=f"{model} round robin")
    plain_ms = statistics.median(times["plain"]) * 1e3
    two_threads = median_ratio(times, "two threads", "by hand")
    rows: List[Dict[str, Any]] = [{
        "model": model, "schedule": f"plain, {chunks} micro-batches by hand",
        "time_ratio": median_ratio(times, "by hand", "plain"), "plain_ms": plain_ms, "memory_ratio": None,
        "simulated_bubble": None, "measured_idle": None, "two_threads": two_threads,
        "machine_line": two_threads * 2 * pipeline_ideal(2, chunks),
    }]
    bubbles: Dict[str, Tuple[float, float]] = {}
    splits: Dict[str, List[int]] = {}
    for name, _, _ in configs:
        pipe, x, y = pipes.pop(name)
        bubbles[name] = timeline_figures(pipe, x, y)
        splits[name] = sorted({a.stage for a in pipe.schedule.actions() if a.kind is Kind.BACKWARD_INPUT})
        del pipe
    # The peak memory of each, once the timing is done: a child process each, ``jobs`` at a time.
    measured: List[Tuple[Optional[str], int]] = [(None, 1)] + [(schedule, stages) for _, schedule, stages in configs]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        plain_memory, *memories = pool.map(lambda config: step_memory(model, config[0], config[1], chunks), measured)
    for (name, _, _), memory_bytes in zip(configs, memories):
        rows.append(_row(model, name, times, plain_ms, bubbles[name], split_stages=splits[name],
                         memory_ratio=memory_bytes / max(plain_memory, 1)))
    # GPipe runs Pipeline's 'gpipe' order: that schedule's simulated bubble is its ideal too.
    rows.append(_row(model, GPIPE, times, plain_ms, (bubbles["gpipe"][0], None)))
    return rows


#: GPipe's row: the same two stages and micro-batches, without checkpointing (as Pipeline runs by default).
GPIPE = "GPipe(checkpoint='never')"


def _row(model: str, name: str, times: Dict[str, List[float]], plain_ms: float,
         bubble: Tuple[float, Optional[float]], **extra: Any) -> Dict[str, Any]:
    """A schedule's figures; ``vs_line``: the median over rounds of its step over the machine line, the two bare
    threads' step that round times ``2 x`` the schedule's ideal (:func:`schedule_ideal` of its simulated
    bubble)."""
    ideal = schedule_ideal(bubble[0])
    return {
        "model": model, "schedule": name, "time_ratio": median_ratio(times, name, "plain"), "plain_ms": plain_ms,
        "vs_by_hand": median_ratio(times, name, "by hand"), "vs_1f1b": median_ratio(times, name, "1f1b"),
        "ideal": ideal, "vs_line": median_ratio(times, name, "two threads") / (2 * ideal),
        "memory_ratio": None, "simulated_bubble": bubble[0], "measured_idle": bubble[1], **extra,
    }


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    # For the memory children (see memory()): freed tensors go back to the system at once.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", nargs="+", default=["mlp", "unet"], choices=["mlp", "unet", "mlp-tiny"])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=2, help="memory's child processes at a time (after the timing)")
    parser.add_argument("--schedules", nargs="+", default=None, choices=[schedule for _, schedule, _ in CONFIGS],
                        help="only these (gpipe and 1f1b always run: the others are compared with them)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(f"machine: {machine_description()}; workers and plain with 1 intra-op thread each")
    headers = ["model / schedule", "step time / plain", "/ by hand", "/ 1f1b", "ideal", "/ machine line",
               "peak memory / plain", "simulated bubble", "measured idle"]
    rows: List[Dict[str, Any]] = []
    for model in args.models:
        rows += run(model, args.rounds, args.chunks, args.jobs,
                    None if args.schedules is None else {"gpipe", "1f1b", *args.schedules})
    print()
    print(format_table(headers, [[f"{r['model']} {r['schedule']}", r["time_ratio"], r.get("vs_by_hand"),
                                  r.get("vs_1f1b"), r.get("ideal"), r.get("vs_line"), r["memory_ratio"],
                                  r["simulated_bubble"], r["measured_idle"]] for r in rows]))
    for r in rows:
        if "machine_line" in r:
            print(f"{r['model']}: the by-hand micro-batches in two halves on two bare threads at once take "
                  f"{r['two_threads']:.3f} of the by-hand time (two free cores: 0.500); at that pace a 2-stage "
                  f"pipeline would take {r['two_threads']:.3f} x 2 x {pipeline_ideal(2, args.chunks):.4f} = "
                  f"{r['machine_line']:.3f} of it (its stages each touch half the weights: it may do better)")
    mlp_rows = {r["schedule"]: r for r in rows if r["model"] == "mlp" and r["memory_ratio"] is not None}
    if "zero_bubble" in mlp_rows:  # the goals, on the MLP with every schedule that has one
        worst = max(r["vs_by_hand"] for r in mlp_rows.values())
        memory_vs_gpipe = mlp_rows["1f1b"]["memory_ratio"] / mlp_rows["gpipe"]["memory_ratio"]
        print(f"\nMLP goals: every schedule <= {TIME_GOAL} of the same micro-batches by hand (worst {worst:.3f}, "
              f"ideal {pipeline_ideal(2, args.chunks):.4f}); zero_bubble <= 1 of 1f1b "
              f"({mlp_rows['zero_bubble']['vs_1f1b']:.3f}); "
              f"1f1b peak memory <= {MEMORY_GOAL} of gpipe's ({memory_vs_gpipe:.3f})")
        lines = {r["schedule"]: r["vs_line"] for r in rows if r["model"] == "mlp" and "vs_line" in r}
        print(f"MLP goal: every schedule <= {LINE_GOAL} of its machine line (worst "
              f"{max(lines.values()):.3f}: {max(lines, key=lambda name: lines[name])}; {GPIPE} {lines[GPIPE]:.3f})")
        split = mlp_rows["zero_bubble"]["split_stages"]
        print(f"zero_bubble's split: {'splits the backward of stages ' + str(split) if split else 'no stage split'}"
              f"{'' if split else ' (the order of 1f1b)'}")
    medians = [f"{m} {statistics.median(r['plain_ms'] for r in rows if r['model'] == m):.0f} ms" for m in args.models]
    print(f"(ratios: median over rounds that run every step once, of the two steps' times in the same round; "
          f"/ by hand: over the same micro-batches run by hand through the plain module; ideal: (m + p - 1) / (m p) "
          f"of that; plain step medians: {', '.join(medians)})")
    results = {"rows": rows, "chunks": args.chunks, "rounds": args.rounds,
               "goals": {"time": TIME_GOAL, "memory_vs_gpipe": MEMORY_GOAL, "machine_line": LINE_GOAL}}
    if args.json:
        save_json(args.json, results)
    return results


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): each schedule's step time over the plain step's, the
    by-hand step's, 1F1B's and its machine line; its peak step memory over the plain step's."""
    rows = [[r["model"], r["schedule"], r["time_ratio"], r.get("vs_by_hand"), r.get("vs_1f1b"), r.get("vs_line"),
             r["memory_ratio"], r["simulated_bubble"], r["measured_idle"]] for r in results["rows"]]
    notes = [f"{r['model']}: two bare threads, each with half the by-hand micro-batches, take {r['two_threads']:.3f} "
             f"of the by-hand step (0.500 on two free cores); a 2-stage pipeline at that pace takes "
             f"{r['machine_line']:.3f} of it." for r in results["rows"] if "machine_line" in r]
    return Summary(["model", "schedule", "step / plain", "step / by hand", "step / 1f1b", "step / machine line",
                    "peak memory / plain", "simulated bubble", "measured idle"], rows, notes)


if __name__ == "__main__":
    main()
