"""Distributed benchmark: a Pipeline over 2 gloo ranks against the plain module in one process, and against
PyTorch's own ``torch.distributed.pipelining`` measured in the same run.

Each rank is a process with one intra-op thread; the plain module runs in
rank 0's process with one thread while rank 1 waits. The model is a 16-layer
512-wide Linear+ReLU MLP with an MSE loss, ``chunks`` 8, batch 256 and 1024.
For each configuration the plain step, the same 8 micro-batches run by hand
through the plain module (the micro-batched ideal's yardstick) and the
pipelined step alternate in rounds (barriers between them). The speed-up is
the median over rounds of ``plain step time / pipelined step time``; *of
ideal* is the median of ``ideal / pipelined step time``, where the ideal is
the by-hand time times (m + p - 1) / (m p) = 9/16 (two ranks computing at once,
less the bubble), that is a speed-up of 2 x 8/9 x plain/by hand. *Two processes* is what the machine
allows: each rank runs the by-hand micro-batches through one half of the model (a stage's work) at the same
time, over rank 0 running both halves one after the other (0.5 on two free cores); a pipeline's best *of
ideal* on this machine is then 0.5 / that ratio (the *machine line*). Also: the time from starting the
processes to the end of the first step, per library, and the fixed cost of a
step (a 2x8 MLP, batch 8: the messages of 8 micro-batches with next to no
computing), for steps back to back, as in training, and for one step after a
barrier (idle threads, cold caches), with the CPU time a step back to back
takes on both ranks, by kind of thread (from ``/proc``: Linux only).

Configurations: torchpipe ``gpipe`` and ``1f1b``; ``torch.distributed.pipelining``'s
``ScheduleGPipe`` and ``Schedule1F1B`` (its stages take the same halves of the model).

Goals (issue 18): torchpipe's gpipe and 1f1b at >= 0.90 of the ideal at batch 1024 and >= 0.80 at 256, ahead
of pipelining's same schedule in the same run; a fixed cost per step no more than pipelining's.

    python benchmarks/distributed.py [--rounds 7] [--batches 256 1024] [--json out.json]
"""
import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks import common, models  # noqa: E402

WORLD = 2
LAYERS = 16
WIDTH = 512
CHUNKS = 8
CONFIGS = [("torchpipe", "gpipe"), ("torchpipe", "1f1b"), ("pipelining", "ScheduleGPipe"),
           ("pipelining", "Schedule1F1B")]
#: Issue 18's goals: the fraction of the micro-batched ideal, per batch.
GOALS = {256: 0.80, 1024: 0.90}
HEADERS = ["configuration", "batch", "speed-up vs plain", "of ideal", "machine line", "goal", "step ms", "plain ms",
           "by hand ms", "two processes", "start to 1st step s"]
#: The model and batch that measure what a step costs by itself.
FIXED_LAYERS, FIXED_WIDTH, FIXED_BATCH = 2, 8, 8
#: The fixed cost's steps timed back to back in each round.
FIXED_BURST = 10


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


class Runner:
    """One library's pipelined training step on this rank."""

    def __init__(self, library: str, schedule: str, rank: int, layers: int, width: int) -> None:
        self.rank = rank
        model = models.mlp(layers, width)
        half = len(model) // 2
        if library == "torchpipe":
            import torchpipe

            self.pipe = torchpipe.Pipeline(model, [half, half], chunks=CHUNKS, schedule=schedule, loss_fn=loss_fn,
                                           group=dist.group.WORLD)
            self.parameters = list(self.pipe.parameters())
            self.run = self._torchpipe
        else:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            part = nn.Sequential(*list(model.children())[half * rank: half * (rank + 1)])
            stage = PipelineStage(part, rank, WORLD, torch.device("cpu"))
            kind = {"ScheduleGPipe": ScheduleGPipe, "Schedule1F1B": Schedule1F1B}[schedule]
            self.schedule = kind(stage, CHUNKS, loss_fn=loss_fn)
            self.parameters = list(part.parameters())
            self.run = self._pipelining

    def _torchpipe(self, x: Tensor, y: Tensor) -> None:
        self.pipe.step(x if self.rank == 0 else None, y if self.rank == WORLD - 1 else None)

    def _pipelining(self, x: Tensor, y: Tensor) -> None:
        if self.rank == 0:
            self.schedule.step(x)
        else:
            losses: List[Tensor] = []
            self.schedule.step(target=y, losses=losses)

    def step(self, x: Tensor, y: Tensor) -> None:
        self.run(x, y)
        for p in self.parameters:
            p.grad = None


def rank_main(
    rank: int, library: str, schedule: str, batch: int, rounds: int, out: str, spawned: float,
    layers: int = LAYERS, width: int = WIDTH, burst: int = 0,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=5))
    torch.manual_seed(1)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    runner = Runner(library, schedule, rank, layers, width)
    runner.step(x, y)
    first_step = time.time() - spawned
    plain = models.mlp(layers, width)

    def plain_step() -> None:
        loss_fn(plain(x), y).backward()
        for p in plain.parameters():
            p.grad = None

    hand_step = common.microbatched_train_step(plain, x, CHUNKS, target=y, loss_fn=loss_fn)
    # A stage's share of the by-hand work (both halves have the same shape): the machine line's yardstick.
    half_step = common.microbatched_train_step(
        nn.Sequential(*list(plain.children())[: len(plain) // 2]), x, CHUNKS, target=y, loss_fn=loss_fn
    )

    if rank == 0:
        plain_step()
        hand_step()
    half_step()
    ratios: List[float] = []
    of_ideal: List[float] = []
    plain_times: List[float] = []
    hand_times: List[float] = []
    pipe_times: List[float] = []
    two_processes: List[float] = []
    burst_times: List[float] = []
    burst_cpu: Dict[str, Tuple[float, int]] = {}  # per kind of thread: CPU seconds and context switches
    ideal = (CHUNKS + WORLD - 1) / (CHUNKS * WORLD)
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            plain_step()
            plain_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            hand_step()
            hand_times.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        runner.step(x, y)
        pipe_times.append(time.perf_counter() - start)
        if burst:  # steps back to back, as in training (one step after a barrier starts on idle threads)
            dist.barrier()
            before = common.thread_cpu()
            start = time.perf_counter()
            for _ in range(burst):
                runner.step(x, y)
            burst_times.append((time.perf_counter() - start) / burst)
            for kind, (seconds, switches) in common.thread_cpu().items():
                was = before.get(kind, (0.0, 0))
                cpu, count = burst_cpu.get(kind, (0.0, 0))
                burst_cpu[kind] = (cpu + seconds - was[0], count + switches - was[1])
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
            ratios.append(plain_times[-1] / pipe_times[-1])
            of_ideal.append(ideal * hand_times[-1] / pipe_times[-1])
    if burst_times:  # every rank's threads: per step, CPU milliseconds and context switches
        steps = burst * len(burst_times)
        Path(f"{out}.cpu{rank}").write_text(json.dumps(
            {kind: [seconds / steps * 1e3, switches / steps] for kind, (seconds, switches) in burst_cpu.items()}
        ))
    if rank == 0:
        Path(out).write_text(json.dumps({
            "speedup": statistics.median(ratios), "of_ideal": statistics.median(of_ideal),
            "plain_ms": statistics.median(plain_times) * 1e3, "hand_ms": statistics.median(hand_times) * 1e3,
            "pipe_ms": statistics.median(pipe_times) * 1e3, "first_step_s": first_step,
            "two_processes": statistics.median(two_processes),
            "machine_line": 0.5 / statistics.median(two_processes),
            "pipe_burst_ms": statistics.median(burst_times) * 1e3 if burst_times else None,
        }))
    dist.destroy_process_group()


def measure(
    library: str, schedule: str, batch: int, rounds: int, timeout: float = 600.0, layers: int = LAYERS,
    width: int = WIDTH, burst: int = 0,
) -> Dict[str, Any]:
    """Starts 2 ranks for one configuration; rank 0's figures (the ranks are killed after ``timeout`` s). With
    ``burst``, each round also times that many steps back to back (``pipe_burst_ms``: per step)."""
    port = common.free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "result.json")
        spawned = time.time()
        commands = [[sys.executable, __file__, "--rank", str(rank), "--library", library, "--schedule", schedule,
                     "--batch", str(batch), "--rounds", str(rounds), "--out", out, "--spawned", repr(spawned),
                     "--layers", str(layers), "--width", str(width), "--burst", str(burst)] for rank in range(WORLD)]
        common.run_ranks(commands, common.rank_environment(port), timeout, f"{library} {schedule} batch {batch}")
        result = dict(json.loads(Path(out).read_text()))
        if burst:
            result["cpu"] = [json.loads(Path(f"{out}.cpu{rank}").read_text()) for rank in range(WORLD)]
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--json", default=None)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--library", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spawned", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=LAYERS, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=WIDTH, help=argparse.SUPPRESS)
    parser.add_argument("--burst", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.library, args.schedule, args.batch, args.rounds, args.out, args.spawned,
                  args.layers, args.width, args.burst)
        return
    print(f"machine: {common.machine_description()}; {WORLD} gloo ranks, 1 intra-op thread each; plain: 1 thread")
    print(f"model: {LAYERS}x{WIDTH} Linear+ReLU MLP, MSE loss, chunks {CHUNKS}")
    rows: List[List[Any]] = []
    results: Dict[str, Dict[str, Any]] = {}
    for batch in args.batches:
        for library, schedule in CONFIGS:
            result = measure(library, schedule, batch, args.rounds)
            results[f"{library} {schedule} batch={batch}"] = result
            rows.append([f"{library} {schedule}", batch, result["speedup"], result["of_ideal"], result["machine_line"],
                         GOALS.get(batch), result["pipe_ms"], result["plain_ms"], result["hand_ms"],
                         result["two_processes"], result["first_step_s"]])
            print(common.format_table(HEADERS, [rows[-1]]).splitlines()[-1], flush=True)
    print()
    print(common.format_table(HEADERS, rows))
    print("(speed-up: median over rounds of plain step time / pipelined step time, measured alternately; of ideal: "
          f"median of the by-hand time x {(CHUNKS + WORLD - 1) / (CHUNKS * WORLD):.4f} / pipelined step time; by "
          f"hand: the same {CHUNKS} micro-batches through the plain module on one thread; two processes: each rank "
          "a half's by-hand work at once / rank 0 both halves in turn; machine line: 0.5 / two processes, the best "
          "of ideal these cores allow)")
    print()
    # The cost of a step itself: messages, threads, control; the model computes next to nothing.
    fixed: List[List[Any]] = []
    for library, schedule in CONFIGS:
        result = measure(library, schedule, FIXED_BATCH, max(args.rounds, 30), layers=FIXED_LAYERS,
                         width=FIXED_WIDTH, burst=FIXED_BURST)
        results[f"{library} {schedule} fixed cost"] = result
        cpu = result["cpu"]
        per_kind = [sum(rank.get(kind, [0.0, 0.0])[0] for rank in cpu) for kind in common.THREAD_KINDS]
        switches = sum(value[1] for rank in cpu for value in rank.values())
        fixed.append([f"{library} {schedule}", result["pipe_burst_ms"], result["pipe_ms"], sum(per_kind), *per_kind,
                      switches])
    print(common.format_table(["configuration", "fixed cost of a step, ms", "after a barrier, ms", "CPU ms",
                               *(f"{kind} ms" for kind in common.THREAD_KINDS), "switches"], fixed))
    print(f"(median step time of a {FIXED_LAYERS}x{FIXED_WIDTH} MLP, batch {FIXED_BATCH}, chunks {CHUNKS}: "
          f"{CHUNKS} micro-batches cross each way with next to no computing; steps {FIXED_BURST} back to back, as "
          "in training, and one step after a barrier, which starts on idle threads and cold caches; CPU ms: the "
          "CPU time of a step back to back, both ranks' threads together, then by kind of thread (main: the one "
          "that calls step(); gloo: its transport's; store: the torch.distributed store's server, in rank 0; other "
          "threads: the ones Python started); switches: their context switches a step. CPU ms / step time: how "
          "many cores the step keeps busy on average)")
    if args.json:
        common.save_json(args.json, {"results": results, "goals": GOALS})


if __name__ == "__main__":
    main()
