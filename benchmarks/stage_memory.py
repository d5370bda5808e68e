"""Stage memory benchmark: each rank's peak during a training step, torchpipe against ``torch.distributed.pipelining``
on the same model and schedule, and ``recompute='selective'`` against ``'full'`` and no checkpoint.

Two gloo ranks on 127.0.0.1, each with one stage (two for the loop's and the V's schedules) of a stack of blocks
(Linear 4x wide, GELU, Linear back, LayerNorm), MSE loss, ``--chunks`` micro-batches. In every round each
configuration runs one step (the order rotating). What a step adds is the peak resident set above its start on its
rank (``VmHWM`` reset through ``/proc/self/clear_refs`` before the step, minus the resident set then), with every
block above 64 KiB from ``mmap`` so that freed tensors leave the resident set at once; the table gives its median
over rounds. What a configuration keeps between steps (parameters; buffers a library allocates once, such as
pipelining's receive buffers) is the resident set its set-up and first step left; its peak is the two together. ``vs
pipelining``: per rank, pipelining's peak over torchpipe's for the same schedule (> 1: torchpipe holds less). Beside
them: torchpipe's prediction, ``pipe.memory()``'s predicted peak for the rank (what autograd keeps, the stages'
inputs and outputs, what a split backward keeps for its ``W``, the parameters' gradients the step makes, the
receives posted ahead), and what the step adds over it: above 1 by what the prediction leaves out (a backward's
temporaries), below where it counts a bound (each pair held to its backward's end, posted receives as resident
before their messages fill them). Then the
step time and the rank's CPU time in the step (medians, ms): with every large block from ``mmap`` a step pays a page
fault per allocation, so ``distributed.py`` is where speed is measured; the CPU time shows what a recomputation
costs whether or not it fills a wait. pipelining has no checkpointing of its own: the recomputation rows are
torchpipe's, ``'full'`` and ``'selective'`` against its ``1f1b`` without checkpoint.

    python benchmarks/stage_memory.py [--rounds 5] [--width 256] [--rows 256] [--blocks 2] [--chunks 8]
        [--json out.json] [--quick]
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
HEADERS = ["configuration", "rank", "kept MiB", "step adds MiB", "peak MiB", "vs pipelining", "predicted MiB",
           "step adds / predicted", "step ms", "CPU ms"]


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


def rank_main(rank: int, rounds: int, blocks: int, width: int, rows: int, chunks: int, out: str) -> None:
    torch.set_num_threads(1)
    if not large_blocks_from_mmap():
        raise SystemExit("stage_memory needs glibc's mallopt, to return freed blocks to the system at once")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=5))
    torch.manual_seed(1)
    x, y = torch.randn(rows * chunks, width), torch.randn(rows * chunks, width)
    for library in ("torchpipe", "pipelining"):  # what a library's first pipeline starts (threads, groups), once
        Runner(next(c for c in CONFIGS if c[0] == library), rank, blocks, width, chunks).step(x, y)
    runners: Dict[Config, Runner] = {}
    kept: Dict[str, float] = {}
    for config in CONFIGS:  # each one's set-up and first step (shapes, buffers, connections, the measurement)
        gc.collect()
        dist.barrier()
        before = proc_status_bytes("VmRSS")
        runners[config] = Runner(config, rank, blocks, width, chunks)
        runners[config].step(x, y)
        gc.collect()
        kept[name_of(config)] = (proc_status_bytes("VmRSS") - before) / MiB
    peaks: Dict[str, List[float]] = {name_of(c): [] for c in CONFIGS}
    times: Dict[str, List[float]] = {name_of(c): [] for c in CONFIGS}
    cpus: Dict[str, List[float]] = {name_of(c): [] for c in CONFIGS}
    for round_ in range(rounds):
        for k in range(len(CONFIGS)):
            config = CONFIGS[(k + round_) % len(CONFIGS)]
            gc.collect()
            dist.barrier()
            reset_peak_rss()
            start_rss = proc_status_bytes("VmRSS")
            started, cpu = time.perf_counter(), time.process_time()
            runners[config].step(x, y)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            peak = proc_status_bytes("VmHWM") - start_rss
            dist.barrier()
            peaks[name_of(config)].append(peak / MiB)
            times[name_of(config)].append(elapsed * 1e3)
            cpus[name_of(config)].append(cpu * 1e3)
    result = {name_of(c): {"kept_mib": kept[name_of(c)],
                           "step_mib": statistics.median(peaks[name_of(c)]),
                           "peak_mib": kept[name_of(c)] + statistics.median(peaks[name_of(c)]),
                           "peaks_mib": peaks[name_of(c)],
                           "step_ms": statistics.median(times[name_of(c)]),
                           "cpu_ms": statistics.median(cpus[name_of(c)]),
                           "predicted_mib": (None if runners[c].predicted(rank) is None
                                             else runners[c].predicted(rank) / MiB)}
              for c in CONFIGS}
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(rounds: int, blocks: int, width: int, rows: int, chunks: int) -> List[Dict[str, Any]]:
    """Each rank's figures per configuration."""
    with tempfile.TemporaryDirectory() as folder:
        outs = [os.path.join(folder, f"rank{rank}.json") for rank in range(WORLD)]
        commands = [[sys.executable, str(Path(__file__).resolve()), "--rank", str(rank), "--rounds", str(rounds),
                     "--blocks", str(blocks), "--width", str(width), "--rows", str(rows), "--chunks", str(chunks),
                     "--out", outs[rank]] for rank in range(WORLD)]
        run_ranks(commands, rank_environment(free_port()), timeout=1200, what="stage_memory")
        return [json.loads(Path(out).read_text()) for out in outs]


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
            rows.append([name, rank, r["kept_mib"], r["step_mib"], r["peak_mib"], versus, predicted, ratio,
                         r["step_ms"], r["cpu_ms"]])
    return rows


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=2, help="blocks per stage")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=256, help="rows per micro-batch")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="a tiny model and one round: checks that it runs")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.blocks, args.width, args.rows, args.chunks = 1, 1, 16, 4, 4
    if args.rank is not None:
        rank_main(args.rank, args.rounds, args.blocks, args.width, args.rows, args.chunks, args.out)
        return {}
    if not sys.platform.startswith("linux"):
        raise SystemExit("stage_memory reads peak resident sets from /proc: Linux only")
    print(f"machine: {machine_description()}; {WORLD} gloo ranks, 1 intra-op thread each")
    activation = args.rows * 4 * args.width * 4 / MiB
    print(f"model: {WORLD} stages of {args.blocks} blocks (Linear {args.width}->{4 * args.width}, GELU, Linear back, "
          f"LayerNorm), MSE loss, {args.chunks} micro-batches of {args.rows} rows (a wide activation: "
          f"{activation:.2f} MiB); rounds: {args.rounds}")
    ranks = measure(args.rounds, args.blocks, args.width, args.rows, args.chunks)
    rows = rows_of(ranks)
    print(format_table(HEADERS, rows))
    print("(kept: the resident set the configuration's set-up and first step left on the rank (parameters, buffers "
          "kept between steps); step adds: the median over rounds of the resident set a step adds above that; "
          "peak: the two together; vs pipelining: pipelining's same schedule's peak / torchpipe's, > 1: torchpipe "
          "holds less; predicted: pipe.memory()'s predicted peak for the rank (activations, deferred and parameter "
          "gradients, posted receives); step adds / predicted: above 1 by what the prediction leaves out (a "
          "backward's temporaries), below where it counts a bound; step ms: "
          "the step's median time with every large block from mmap, which charges each allocation its page faults "
          "(distributed.py measures speed); CPU ms: the rank's CPU time in the step, all its threads, where a "
          "recomputation shows whether or not it overlaps a wait)")
    figures = {"ranks": ranks, "rounds": args.rounds, "model": [args.blocks, args.width, args.rows, args.chunks]}
    if args.json:
        save_json(args.json, figures)
    return figures


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): per configuration and rank, the peak a step adds, against
    pipelining's same schedule and torchpipe's prediction, and the step time."""
    blocks, width, rows, chunks = results["model"]
    table = rows_of(results["ranks"])
    notes = [f"{WORLD} gloo ranks, one stage each of {blocks} blocks (Linear {width}->{4 * width}, GELU, Linear, "
             f"LayerNorm), {chunks} micro-batches of {rows} rows; rounds: {results['rounds']}. Peak: the median "
             "resident set a step adds on the rank."]
    ratios = [row[HEADERS.index("step adds / predicted")] for row in table]
    ratios = [r for r in ratios if r is not None]
    if ratios:
        notes.append(f"What a step adds is {min(ratios):.2f} to {max(ratios):.2f} times pipe.memory()'s prediction "
                     "over every torchpipe row: above 1 by a backward's temporaries, which it leaves out; below "
                     "where it counts a bound (each micro-batch held to its backward's end, the receives posted "
                     "ahead as resident before their messages fill them).")
    return Summary(HEADERS, table, notes)


if __name__ == "__main__":
    main()
