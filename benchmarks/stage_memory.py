"""Stage memory benchmark: each rank's peak during a training step, torchpipe against ``torch.distributed.pipelining``
on the same model and schedule, and ``recompute='selective'`` against ``'full'`` and no checkpoint.

Two gloo ranks on 127.0.0.1, each with one stage (two for the loop's and the V's schedules) of a stack of blocks
(Linear 4x wide, GELU, Linear back, LayerNorm), MSE loss, ``--chunks`` micro-batches. Each configuration runs in a
pair of processes of its own, so that what one leaves in the heap counts for no other: a first pipeline and two
steps start what its library starts once per process (threads, connections, the autograd engine, the code of its
steady steps), then the resident set is the baseline, and a second one is set up, runs a first step and then
``--rounds`` measured steps. Its peak in a step is the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` before the step) above the baseline, with every block above 64 KiB from ``mmap`` so that
freed tensors leave the resident set at once; what it keeps between steps (parameters; buffers a library allocates
once, such as pipelining's receive buffers) is the resident set at the step's start above the baseline, and what the
step adds the difference; the table gives each one's median over the steps. ``vs pipelining``: per rank,
pipelining's peak over torchpipe's for the same schedule (> 1: torchpipe holds less). Beside them: torchpipe's
prediction, ``pipe.memory()``'s predicted peak for the rank (what autograd keeps, the stages' inputs and outputs,
what a split backward keeps for its ``W``, the parameters' gradients the step makes, what a backward makes on its
way, the receives posted ahead), and what the step adds over it: above 1 by what the prediction leaves out (what an
operator's backward allocates and frees inside itself, the allocator's slack), below where it counts a bound (each
pair held to its backward's end beside all that backward makes, posted receives as resident before their messages
fill them). Then the step time and the rank's CPU time in the step (medians, ms): with every large block from
``mmap`` a step pays a page fault per allocation, so ``distributed.py`` is where speed is measured; the CPU time
shows what a recomputation costs whether or not it fills a wait. pipelining has no checkpointing of its own: the
recomputation rows are torchpipe's, ``'full'`` and ``'selective'`` against its ``1f1b`` without checkpoint. Their
step times, which differ by less than the machine's noise from one process pair to another, are compared apart: in
one more pair of processes, with malloc as it is, the three pipelines run ``--timing-rounds`` rounds, each round one
step of each in an order that turns, and the medians are given per rank.

    python benchmarks/stage_memory.py [--rounds 5] [--timing-rounds 15] [--width 256] [--rows 256] [--blocks 2]
        [--chunks 8] [--json out.json] [--quick]
"""
import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.memory import large_blocks_from_mmap, proc_status_bytes, reset_peak_rss  # noqa: E402
from benchmarks.harness.output import Summary, format_table, save_json  # noqa: E402
from benchmarks.harness.processes import free_port, rank_environment, run_ranks  # noqa: E402
from benchmarks.harness.rivals import RankRunner, pipelining_schedule  # noqa: E402
from benchmarks.harness.timing import rotated  # noqa: E402

WORLD = 2
MiB = 1 << 20
#: (library, schedule, checkpoint, recompute); pipelining's schedules by their class names.
Config = Tuple[str, str, str, str]
#: torchpipe's schedules and pipelining's same ones.
RIVALS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
          "looped_bfs": "ScheduleLoopedBFS", "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
          "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
#: The schedules of two stages per rank: on the loop (stage s on rank s % 2) or in the V (rank r: r and 3 - r).
LOOPED = {"interleaved_1f1b", "ScheduleInterleaved1F1B", "looped_bfs", "ScheduleLoopedBFS",
          "interleaved_zero_bubble", "ScheduleInterleavedZeroBubble"}
V_SHAPED = {"zbv", "ScheduleZBVZeroBubble", "dualpipev", "ScheduleDualPipeV"}
CONFIGS: List[Config] = [config for ours, theirs in RIVALS.items()
                         for config in [("torchpipe", ours, "never", "full"), ("pipelining", theirs, "never", "full")]]
CONFIGS += [("torchpipe", "1f1b", "always", "full"), ("torchpipe", "1f1b", "always", "selective")]
#: The configurations whose step times are compared round by round in one pair of processes: no checkpoint, then
#: checkpoint='always' with each recomputation.
RECOMPUTING: List[Config] = [("torchpipe", "1f1b", "never", "full"), ("torchpipe", "1f1b", "always", "full"),
                             ("torchpipe", "1f1b", "always", "selective")]
HEADERS = ["configuration", "rank", "kept MiB", "step adds MiB", "peak MiB", "peak spread MiB", "vs pipelining",
           "predicted MiB", "step adds / predicted", "step ms", "CPU ms"]


def name_of(config: Config) -> str:
    library, schedule, checkpoint, recompute = config
    if library == "pipelining":
        return f"pipelining {schedule}"
    extra = "" if checkpoint == "never" else f" checkpoint={checkpoint} recompute={recompute}"
    return f"torchpipe {schedule}{extra}"


def block(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.LayerNorm(width))


def model(blocks: int, width: int) -> nn.Sequential:
    """``WORLD * blocks`` blocks, as their layers (the schedules of two stages per rank cut each block in two)."""
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(WORLD * blocks) for layer in block(width)])


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


class Runner(RankRunner):
    """One configuration's training step on this rank."""

    def __init__(self, config: Config, rank: int, blocks: int, width: int, chunks: int) -> None:
        library, schedule, checkpoint, recompute = config
        module = model(blocks, width)
        stages = 2 * WORLD if schedule in LOOPED | V_SHAPED else WORLD
        size = len(module) // stages
        mine = [rank, 2 * WORLD - 1 - rank] if schedule in V_SHAPED else list(range(rank, stages, WORLD))
        self.first, self.last = 0 in mine, stages - 1 in mine
        self.pipe: Any = None
        if library == "torchpipe":
            import torchpipe

            self.pipe = torchpipe.Pipeline(module, [size] * stages, chunks=chunks, schedule=schedule,
                                           checkpoint=checkpoint, recompute=recompute, loss_fn=loss_fn,
                                           group=dist.group.WORLD)
            self.parameters = list(self.pipe.parameters())
            self.run = self.torchpipe_step
        else:
            self.schedule, self.parameters = pipelining_schedule(list(module.children()), mine, stages, schedule,
                                                                 chunks, loss_fn)
            self.run = self.pipelining_step

    def predicted(self, rank: int) -> Optional[int]:
        if self.pipe is None:
            return None
        return self.pipe.memory().predicted_peak.get(rank)


def joined(rank: int, width: int, rows: int, chunks: int) -> Tuple[Tensor, Tensor]:
    """This rank in the gloo group (one intra-op thread), and the step's batch: the same on every rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=5))
    torch.manual_seed(1)
    return torch.randn(rows * chunks, width), torch.randn(rows * chunks, width)


def timed_step(runner: Runner, x: Tensor, y: Tensor) -> Tuple[float, float]:
    """One step of ``runner``: its time and the process's CPU time in it, ms."""
    started, cpu = time.perf_counter(), time.process_time()
    runner.step(x, y)
    return (time.perf_counter() - started) * 1e3, (time.process_time() - cpu) * 1e3


def rank_main(rank: int, config: Config, rounds: int, blocks: int, width: int, rows: int, chunks: int,
              out: str) -> None:
    """One configuration on this rank, in processes of its own: nothing another configuration left in the heap
    counts for it."""
    if not large_blocks_from_mmap():
        raise SystemExit("stage_memory needs glibc's mallopt, to return freed blocks to the system at once")
    x, y = joined(rank, width, rows, chunks)
    # What the library starts once per process (threads, connections, the autograd engine, the code its steady
    # steps run, faulted in), before the baseline: a pipeline of its own and two steps.
    first = Runner(config, rank, blocks, width, chunks)
    first.step(x, y)
    first.step(x, y)
    del first
    gc.collect()
    dist.barrier()
    baseline = proc_status_bytes("VmRSS")
    runner = Runner(config, rank, blocks, width, chunks)
    runner.step(x, y)  # the set-up and first step: shapes, buffers allocated once, the measurement
    kept: List[float] = []
    adds: List[float] = []
    peaks: List[float] = []
    times: List[float] = []
    cpus: List[float] = []
    for _ in range(rounds):
        gc.collect()
        dist.barrier()
        reset_peak_rss()
        start = proc_status_bytes("VmRSS")
        elapsed, cpu = timed_step(runner, x, y)
        high = proc_status_bytes("VmHWM")
        dist.barrier()
        kept.append((start - baseline) / MiB)
        adds.append((high - start) / MiB)
        peaks.append((high - baseline) / MiB)
        times.append(elapsed)
        cpus.append(cpu)
    predicted = runner.predicted(rank)
    result = {"kept_mib": statistics.median(kept), "step_mib": statistics.median(adds),
              "peak_mib": statistics.median(peaks), "peaks_mib": peaks, "step_ms": statistics.median(times),
              "cpu_ms": statistics.median(cpus), "predicted_mib": None if predicted is None else predicted / MiB}
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def rank_timing(rank: int, rounds: int, blocks: int, width: int, rows: int, chunks: int, out: str) -> None:
    """The step times of :data:`RECOMPUTING` on this rank, round by round in one process (each round runs each
    configuration's step once, in an order that turns from round to round), with malloc as it is: what the machine's
    load does to one round it does to every configuration alike."""
    x, y = joined(rank, width, rows, chunks)
    runners = [Runner(config, rank, blocks, width, chunks) for config in RECOMPUTING]
    for runner in runners:  # the set-up, the first step's measurement and what later steps run once
        runner.step(x, y)
        runner.step(x, y)
    times: List[List[float]] = [[] for _ in runners]
    cpus: List[List[float]] = [[] for _ in runners]
    for r in range(rounds):
        for k in rotated(range(len(runners)), r):
            gc.collect()
            dist.barrier()
            elapsed, cpu = timed_step(runners[k], x, y)
            times[k].append(elapsed)
            cpus[k].append(cpu)
    result = {name_of(config): {"step_ms": statistics.median(times[k]), "cpu_ms": statistics.median(cpus[k]),
                                "steps_ms": times[k]} for k, config in enumerate(RECOMPUTING)}
    Path(out).write_text(json.dumps(result))
    del runners
    dist.destroy_process_group()


def measure(rounds: int, blocks: int, width: int, rows: int, chunks: int,
            timing_rounds: int) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Each rank's figures per configuration, each configuration in a pair of processes of its own; then each
    rank's step times of :data:`RECOMPUTING`, in one pair of processes."""
    ranks: List[Dict[str, Any]] = [{} for _ in range(WORLD)]
    model = ["--blocks", str(blocks), "--width", str(width), "--rows", str(rows), "--chunks", str(chunks)]
    script = str(Path(__file__).resolve())
    with tempfile.TemporaryDirectory() as folder:
        for k, config in enumerate(CONFIGS):
            outs = [os.path.join(folder, f"config{k}-rank{rank}.json") for rank in range(WORLD)]
            commands = [[sys.executable, script, "--rank", str(rank), "--config", str(k), "--rounds", str(rounds),
                         *model, "--out", outs[rank]] for rank in range(WORLD)]
            run_ranks(commands, rank_environment(free_port()), timeout=600, what=f"stage_memory {name_of(config)}")
            for rank, out in enumerate(outs):
                ranks[rank][name_of(config)] = json.loads(Path(out).read_text())
        outs = [os.path.join(folder, f"timing-rank{rank}.json") for rank in range(WORLD)]
        commands = [[sys.executable, script, "--rank", str(rank), "--timing", "--timing-rounds", str(timing_rounds),
                     *model, "--out", outs[rank]] for rank in range(WORLD)]
        run_ranks(commands, rank_environment(free_port()), timeout=600, what="stage_memory recomputation times")
        timing = [json.loads(Path(out).read_text()) for out in outs]
    return ranks, timing


def recomputation_times(timing: Sequence[Mapping[str, Any]], rounds: int) -> str:
    """Per rank, the median step times of no checkpoint, ``'full'`` and ``'selective'`` from the interleaved rounds,
    and whether ``'selective'`` lies between the other two."""
    never, full, selective = (name_of(config) for config in RECOMPUTING)
    parts = []
    between = []
    for rank, figures in enumerate(timing):
        a, b, c = (figures[name]["step_ms"] for name in (never, full, selective))
        parts.append(f"rank {rank}: no checkpoint {a:.0f}, 'full' {b:.0f}, 'selective' {c:.0f}")
        between.append(min(a, b) <= c <= max(a, b))
    where = ("on every rank" if all(between) else
             "on no rank" if not any(between) else
             "on rank " + ", ".join(str(r) for r, ok in enumerate(between) if ok) + " only")
    return (f"Step time of '1f1b' with checkpoint='always' against no checkpoint, {rounds} round"
            f"{'s' if rounds != 1 else ''} in one pair of "
            f"processes, each round running the three in turn (malloc as it is), median ms: {'; '.join(parts)}. "
            f"'selective' lies between no checkpoint and 'full' {where}.")


def rows_of(ranks: Sequence[Mapping[str, Any]]) -> List[List[Any]]:
    rows: List[List[Any]] = []
    for config in CONFIGS:
        name = name_of(config)
        for rank, figures in enumerate(ranks):
            r = figures[name]
            rival = RIVALS.get(config[1]) if config[0] == "torchpipe" and config[2] == "never" else None
            versus = (ranks[rank][f"pipelining {rival}"]["peak_mib"] / r["peak_mib"]
                      if rival is not None and r["peak_mib"] > 0 else None)
            predicted = r["predicted_mib"]
            ratio = r["step_mib"] / predicted if predicted else None
            rows.append([name, rank, r["kept_mib"], r["step_mib"], r["peak_mib"], spread(r), versus, predicted,
                         ratio, r["step_ms"], r["cpu_ms"]])
    return rows


def spread(figures: Mapping[str, Any]) -> float:
    """How far apart a configuration's peaks over its steps are (MiB): the noise of its median."""
    return float(max(figures["peaks_mib"]) - min(figures["peaks_mib"]))


def against_pipelining(ranks: Sequence[Mapping[str, Any]]) -> str:
    """How many rank x schedule pairs have torchpipe's peak at or below pipelining's, and how far above the rest
    are against their steps' spread."""
    pairs = [(rank, ours, figures[f"torchpipe {ours}"], figures[f"pipelining {theirs}"])
             for rank, figures in enumerate(ranks) for ours, theirs in RIVALS.items()]
    above = [(rank, ours, o["peak_mib"] - t["peak_mib"], max(spread(o), spread(t)))
             for rank, ours, o, t in pairs if o["peak_mib"] > t["peak_mib"]]
    text = (f"torchpipe's peak is at or below pipelining's in {len(pairs) - len(above)} of {len(pairs)} rank x "
            "schedule pairs")
    if not above:
        return text + "."
    return text + "; above it: " + ", ".join(
        f"{ours} rank {rank} by {by:.3f} MiB ({'within' if by <= noise else 'beyond'} the steps' spread, "
        f"{noise:.3f} MiB)" for rank, ours, by, noise in above) + "."


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=2, help="blocks per stage")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=256, help="rows per micro-batch")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--json", default=None)
    parser.add_argument("--timing-rounds", type=int, default=15,
                        help="rounds of the interleaved step times of the recomputations")
    parser.add_argument("--quick", action="store_true", help="a tiny model and one round: checks that it runs")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--timing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.timing_rounds, args.blocks, args.width, args.rows, args.chunks = 1, 1, 1, 16, 4, 4
    if args.rank is not None and args.timing:
        rank_timing(args.rank, args.timing_rounds, args.blocks, args.width, args.rows, args.chunks, args.out)
        return {}
    if args.rank is not None:
        rank_main(args.rank, CONFIGS[args.config], args.rounds, args.blocks, args.width, args.rows, args.chunks,
                  args.out)
        return {}
    if not sys.platform.startswith("linux"):
        raise SystemExit("stage_memory reads peak resident sets from /proc: Linux only")
    print(f"machine: {machine_description()}; {WORLD} gloo ranks, 1 intra-op thread each")
    activation = args.rows * 4 * args.width * 4 / MiB
    print(f"model: {WORLD} stages of {args.blocks} blocks (Linear {args.width}->{4 * args.width}, GELU, Linear back, "
          f"LayerNorm), MSE loss, {args.chunks} micro-batches of {args.rows} rows (a wide activation: "
          f"{activation:.2f} MiB); rounds: {args.rounds}")
    ranks, timing = measure(args.rounds, args.blocks, args.width, args.rows, args.chunks, args.timing_rounds)
    rows = rows_of(ranks)
    print(format_table(HEADERS, rows))
    print(against_pipelining(ranks))
    print(recomputation_times(timing, args.timing_rounds))
    print("(each configuration in processes of its own, above a baseline taken after a first pipeline of its library; "
          "kept: the resident set at a step's start (parameters, buffers kept between steps); step adds: the resident "
          "set a step adds above that at its peak; peak: the step's peak; medians over the steps; peak spread: the "
          "largest peak less the smallest; vs pipelining: pipelining's same schedule's peak / torchpipe's, > 1: "
          "torchpipe holds less; predicted: pipe.memory()'s predicted peak for the rank (activations, deferred and "
          "parameter gradients, a backward's temporaries, posted receives); step adds / predicted: above 1 by what the "
          "prediction leaves out (inside an operator's backward, the allocator's slack), below where it counts a "
          "bound; step ms: "
          "the step's median time with every large block from mmap, which charges each allocation its page faults "
          "(distributed.py measures speed; the recomputations' step times are compared in the line above); "
          "CPU ms: the rank's CPU time in the step, all its threads, where a "
          "recomputation shows whether or not it overlaps a wait)")
    figures = {"ranks": ranks, "rounds": args.rounds, "model": [args.blocks, args.width, args.rows, args.chunks],
               "timing": timing, "timing_rounds": args.timing_rounds}
    if args.json:
        save_json(args.json, figures)
    return figures


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): per configuration and rank, the peak a step adds, against
    pipelining's same schedule and torchpipe's prediction, and the step time."""
    blocks, width, rows, chunks = results["model"]
    table = rows_of(results["ranks"])
    notes = [f"{WORLD} gloo ranks, one stage each of {blocks} blocks (Linear {width}->{4 * width}, GELU, Linear, "
             f"LayerNorm), {chunks} micro-batches of {rows} rows; {results['rounds']} measured steps, each "
             "configuration in processes of its own. Peak: the median over the steps of the rank's peak resident "
             "set above its baseline (taken after a first pipeline of the library); kept: the resident set at a "
             "step's start above it; step adds: the difference.", against_pipelining(results["ranks"])]
    ratios = [row[HEADERS.index("step adds / predicted")] for row in table]
    ratios = [r for r in ratios if r is not None]
    if ratios:
        notes.append(f"What a step adds is {min(ratios):.2f} to {max(ratios):.2f} times pipe.memory()'s prediction "
                     "over every torchpipe row: above 1 by what it leaves out (what an operator's backward "
                     "allocates and frees inside itself, the allocator's slack); below where it counts a bound "
                     "(each micro-batch held to its backward's end beside all that backward makes, the receives "
                     "posted ahead as resident before their messages fill them).")
    notes.append(recomputation_times(results["timing"], results["timing_rounds"]))
    return Summary(HEADERS, table, notes)


if __name__ == "__main__":
    main()
