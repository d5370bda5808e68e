"""Mesh benchmark: one model and one global batch as a 2-rank pipeline, as 2 data-parallel replicas ('replicate'
and 'shard'), and as the plain module in one process: step time, peak step memory per rank, and the share of the
step that the gradient reduction over 'dp' leaves exposed.

Layouts, each on 2 CPU processes (gloo on 127.0.0.1, one intra-op thread each), for the same model, the same
global batch and the same optimizer (Adam):

- ``pp 2 x dp 1``: a ``Pipeline`` over 2 ranks, one stage each, ``'1f1b'``, ``--chunks`` micro-batches;
- ``dp 2 x pp 1, replicate``: 2 replicas of a 1-stage pipeline on a ``(dp, pp) = (2, 1)`` DeviceMesh, each
  on half the batch, gradients all-reduced;
- ``dp 2 x pp 1, shard``: the same with FSDP2 shards: parameters, gradients and optimizer state halved,
  parameters gathered once per step, gradients reduce-scattered;
- ``dp 2 x pp 2, replicate`` (``--layouts dp2xpp2-replicate``, not run by default: 4 processes take turns on
  2 cores): 2 replicas of the 2-stage pipeline, where a stage's reduction can overlap the other stage's
  backward;

against, in one process with one thread: the plain module (the baseline), the batch cut into ``--chunks``
micro-batches by hand (the pipeline's ideal is half of that: both cores busy, no bubble, no messages), and the
plain module on half the batch (the data-parallel ideal: one replica's work, no reduction). A step is forward,
loss (MSE), backward, ``optimizer.step()`` and ``zero_grad()``. Models (``--models``): ``wide``, 8 x 1024
Linear+ReLU, batch 128 (parameters, gradients and Adam's state dominate the memory), and ``deep``, 16 x 256,
batch 2048 (activations dominate).

Time: every layout's ranks (and the one-process variants) stay alive, idle between commands, and the variants
take turns round by round (plain, by hand, half batch, each layout), so drift of a busy machine hits them all;
a layout's step time is the slowest rank's, and each figure is the median over rounds (speed-up: the median of
each round's plain time / variant time).

Memory per rank on CPU: the exact bytes of the parameters, gradients and optimizer state (Adam: two tensors
per parameter) the rank holds (a DTensor's local shard), and the step's peak: the peak resident set size of
two steps above the resident size when they started (after warm-up steps, so code pages and lazy
initialisation are not counted; the peak is reset through ``/proc/self/clear_refs``, and glibc hands large
blocks straight back, ``MALLOC_MMAP_THRESHOLD_=65536``, so the resident set follows live tensors: in
processes of their own, after the timing, since that costs page faults every step). The
gradients are freed by ``zero_grad()``, so they are part of the step's peak; what the peak holds beyond
them is activations, under 'shard' the gathered parameters and whole gradients, and message buffers.
Total: parameters + optimizer state + the step's peak.

Reduction: a few steps recorded with :func:`torchpipe.trace.record_timeline`; per step, the time a
gradient reduction (``'reduce'`` spans, one per stage) was in flight while no rank of the replica's pipeline
computed (forward, backward), as a share of the step (``pipe.step`` alone), median over steps.

    python benchmarks/mesh.py [--rounds 7] [--models wide deep] [--chunks 8] [--layouts ...] [--json F] [--quick]
"""
import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks import models  # noqa: E402
from benchmarks.harness import ROOT  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.memory import step_peak_bytes  # noqa: E402
from benchmarks.harness.output import Summary, format_table, progress, save_json  # noqa: E402
from benchmarks.harness.processes import child_environment, free_port  # noqa: E402
from benchmarks.harness.steps import Step, microbatched_train_step, train_step  # noqa: E402

MiB = 1024 * 1024


@dataclass(frozen=True)
class Workload:
    """An MLP of ``layers`` Linear+ReLU pairs of ``width`` features, trained on a global batch of ``batch``."""

    layers: int
    width: int
    batch: int
    what: str


MODELS = {
    "wide": Workload(8, 1024, 128, "parameters dominate"),
    "deep": Workload(16, 256, 2048, "activations dominate"),
}
#: The same shapes, small enough for a smoke test.
QUICK = {
    "wide": Workload(2, 64, 16, "parameters dominate"),
    "deep": Workload(4, 16, 64, "activations dominate"),
}


@dataclass(frozen=True)
class Layout:
    """Ranks on a ``(dp, pp)`` mesh; ``mode`` None: a pipeline over every rank (``group=``), no mesh."""

    dp: int
    pp: int
    mode: Optional[str]

    @property
    def name(self) -> str:
        if self.mode is None:
            return f"pp {self.pp} x dp {self.dp} (pipeline)"
        return f"dp {self.dp} x pp {self.pp}, {self.mode}"

    @property
    def world(self) -> int:
        return self.dp * self.pp


LAYOUTS = {
    "pp2": Layout(1, 2, None),
    "dp2-replicate": Layout(2, 1, "replicate"),
    "dp2-shard": Layout(2, 1, "shard"),
    # 4 processes: on 2 cores they take turns; for the reduction's overlap with another stage's backward.
    "dp2xpp2-replicate": Layout(2, 2, "replicate"),
}
DEFAULT_LAYOUTS = ["pp2", "dp2-replicate", "dp2-shard"]
LOCAL = ("plain", "by hand", "half batch")

#: Lines a worker writes for the controller start with this (anything else on stdout is ignored).
_MARK = "@@mesh "


# --- what runs in the processes ------------------------------------------------------------------------


def _bytes(tensors: Sequence[Any]) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def batch_of(workload: Workload) -> Tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(workload.batch, workload.width, generator=generator),
            torch.randn(workload.batch, workload.width, generator=generator))


class Trainer:
    """One process's training step: the plain module and its variants, or one rank of a layout."""

    def __init__(self, workload: Workload, layout: Optional[Layout], rank: int, chunks: int) -> None:
        self.workload = workload
        self.layout = layout
        self.rank = rank
        x, y = batch_of(workload)
        self.pipe: Any = None
        self.first = self.last = True
        #: The one-process variants' steps (:data:`LOCAL`), their gradients left for the optimizer.
        self.local: Dict[str, Step] = {}
        if layout is None:
            self.model: nn.Module = models.mlp(workload.layers, workload.width)
            self.x, self.y = x, y
            half = len(x) // 2
            mse = nn.functional.mse_loss
            self.local = {
                "plain": train_step(self.model, x, target=y, loss_fn=mse, keep_grads=True),
                "by hand": microbatched_train_step(self.model, x, chunks, target=y, loss_fn=mse, keep_grads=True),
                "half batch": train_step(self.model, x[:half], target=y[:half], loss_fn=mse, keep_grads=True),
            }
        else:
            import torch.distributed as dist

            import torchpipe

            options: Dict[str, Any] = {"group": dist.group.WORLD}
            replica = 0
            if layout.mode is not None:
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh("cpu", (layout.dp, layout.pp), mesh_dim_names=("dp", "pp"))
                options = {"mesh": mesh, "data_parallel": layout.mode}
                replica = mesh.get_local_rank("dp")
            share = workload.batch // layout.dp
            self.x, self.y = x[replica * share: (replica + 1) * share], y[replica * share: (replica + 1) * share]
            with torch.device("meta"):  # each rank materialises its own stages only
                model = models.mlp(workload.layers, workload.width)
            stages = layout.pp
            balance = [len(model) // stages] * stages
            balance[-1] += len(model) - sum(balance)
            self.pipe = torchpipe.Pipeline(model, balance, chunks=chunks if layout.pp > 1 else 1, schedule="1f1b",
                                           loss_fn=nn.functional.mse_loss, **options)
            workers = self.pipe.schedule.stage_workers
            self.first, self.last = self.pipe.rank == workers[0], self.pipe.rank == workers[-1]
            self.model = self.pipe
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)

    def forward_backward(self, variant: str) -> None:
        if self.pipe is not None:
            self.pipe.step(self.x if self.first else None, self.y if self.last else None)
        elif variant in self.local:
            self.local[variant]()
        else:
            raise ValueError(f"unknown variant {variant!r}")

    def step(self, variant: str = "plain") -> None:
        self.forward_backward(variant)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def timed(self, variant: str, steps: int) -> List[float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.step(variant)
            times.append(time.perf_counter() - start)
        return times

    def memory(self) -> Dict[str, Any]:
        """The memory of two steps: the exact bytes of the parameters, gradients and optimizer state this process
        holds, and the step's peak resident size above the resident size when the steps started (activations,
        gradients, gathered parameters, message buffers): None where the peak cannot be reset."""
        params = list(self.model.parameters())
        grads = 0

        def two_steps() -> None:
            nonlocal grads
            for _ in range(2):
                self.forward_backward("plain")
                grads = _bytes([p.grad for p in params if p.grad is not None])
                self.optimizer.step()
                self.optimizer.zero_grad()

        transient = step_peak_bytes(two_steps)
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, Tensor) and t.dim()]
        return {"transient_bytes": transient, "params_bytes": _bytes(params), "grads_bytes": grads,
                "optimizer_bytes": _bytes(state)}

    def timeline(self, steps: int) -> Optional[Dict[str, Any]]:
        """Per recorded step: its time and the reductions' exposed share (on the first rank of replica 0)."""
        from torchpipe import trace

        figures: List[Dict[str, float]] = []
        for _ in range(steps):
            with trace.record_timeline() as timeline:
                start = time.perf_counter()
                self.pipe.step(self.x if self.first else None, self.y if self.last else None)
                seconds = time.perf_counter() - start
            self.optimizer.step()
            self.optimizer.zero_grad()
            merged = self.pipe.gather_timeline(timeline)  # this replica's pipeline (see docs/distributed.md)
            if merged is not None and self.rank == 0:
                figures.append({"step_s": seconds, **reduction_figures(merged)})
        if self.rank != 0:
            return None
        return {key: statistics.median(f[key] for f in figures) for key in figures[0]}


def _union(intervals: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    merged: List[Tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: Sequence[Tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _minus(a: Sequence[Tuple[float, float]], b: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The parts of the (disjoint, sorted) intervals ``a`` outside the (disjoint, sorted) intervals ``b``."""
    out: List[Tuple[float, float]] = []
    for start, end in a:
        cursor = start
        for b_start, b_end in b:
            if b_end <= cursor or b_start >= end:
                continue
            if b_start > cursor:
                out.append((cursor, b_start))
            cursor = max(cursor, b_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def reduction_figures(timeline: Any) -> Dict[str, float]:
    """Seconds of one step's gradient reductions: in all (the sum of the 'reduce' spans) and exposed (while one
    was in flight, no rank of the pipeline computed a forward or backward); and the seconds each rank computed,
    on average over the ranks."""
    reduces = [(s.start, s.end) for s in timeline if s.kind == "reduce"]
    computing = [s for s in timeline if s.kind not in ("reduce", "copy")]
    exposed = _length(_minus(_union(reduces), _union([(s.start, s.end) for s in computing])))
    ranks = sorted({s.rank or 0 for s in computing}) or [0]
    busy = [_length(_union([(s.start, s.end) for s in computing if (s.rank or 0) == r])) for r in ranks]
    return {"reduce_s": sum(e - s for s, e in reduces), "exposed_s": exposed, "compute_s": statistics.mean(busy)}


def worker_main(args: argparse.Namespace) -> None:
    """A process of the benchmark: builds its trainer, then answers the controller's commands on stdin."""
    torch.set_num_threads(1)
    workload = Workload(**json.loads(args.workload))
    layout = None if args.layout is None else LAYOUTS[args.layout]
    if layout is not None:
        import datetime

        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                             world_size=layout.world, timeout=datetime.timedelta(minutes=5))
    trainer = Trainer(workload, layout, args.rank, args.chunks)
    for variant in (LOCAL if layout is None else ("plain",)):
        trainer.step(variant)  # warm-up: Adam's state, the pipeline's threads and groups
    trainer.step()
    _answer({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "time":
            _answer({"times": trainer.timed(command["variant"], command["steps"])})
        elif command["do"] == "memory":
            _answer(trainer.memory())
        elif command["do"] == "timeline":
            _answer({"timeline": trainer.timeline(command["steps"])})
        elif command["do"] == "quit":
            break
    if layout is not None:
        torch.distributed.destroy_process_group()


def _answer(payload: Dict[str, Any]) -> None:
    sys.stdout.write(_MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


# --- the controller -----------------------------------------------------------------------------------


class Process:
    """A worker process, its answers read by a thread into a queue; killed with its process group."""

    def __init__(self, command: List[str], env: Dict[str, str]) -> None:
        self.child = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.answers: queue.Queue[Optional[str]] = queue.Queue()
        self.errors: List[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_errors, daemon=True).start()

    def _read(self) -> None:
        assert self.child.stdout is not None
        for line in self.child.stdout:
            if line.startswith(_MARK):
                self.answers.put(line[len(_MARK):])
        self.answers.put(None)

    def _read_errors(self) -> None:
        assert self.child.stderr is not None
        for line in self.child.stderr:
            self.errors = (self.errors + [line])[-30:]

    def send(self, command: Dict[str, Any]) -> None:
        assert self.child.stdin is not None
        self.child.stdin.write(json.dumps(command) + "\n")
        self.child.stdin.flush()

    def receive(self, deadline: float) -> Dict[str, Any]:
        try:
            line = self.answers.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"a worker did not answer in time:\n{''.join(self.errors)}") from None
        if line is None:
            raise RuntimeError(f"a worker exited (code {self.child.wait()}):\n{''.join(self.errors)}")
        return dict(json.loads(line))

    def kill(self) -> None:
        if self.child.poll() is None:
            try:
                os.killpg(self.child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.child.wait(5)


class Group:
    """The processes of one variant (1 for the one-process variants, a layout's ranks otherwise)."""

    def __init__(self, layout_key: Optional[str], workload: Workload, chunks: int, for_memory: bool = False) -> None:
        self.layout = None if layout_key is None else LAYOUTS[layout_key]
        port = free_port()
        # For memory, the resident set follows the live tensors (but every large tensor costs page faults).
        malloc = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"} if for_memory else {}
        env = child_environment(OMP_NUM_THREADS="1", **malloc)
        world = 1 if self.layout is None else self.layout.world
        self.processes = []
        for rank in range(world):
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rank", str(rank), "--port",
                       str(port), "--chunks", str(chunks), "--workload", json.dumps(workload.__dict__)]
            if layout_key is not None:
                command += ["--layout", layout_key]
            self.processes.append(Process(command, env))

    def ask(self, command: Dict[str, Any], timeout: float) -> List[Dict[str, Any]]:
        """Sends ``command`` to every process; their answers, by rank."""
        for process in self.processes:
            process.send(command)
        deadline = time.monotonic() + timeout
        return [process.receive(deadline) for process in self.processes]

    def ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.receive(deadline)

    def close(self) -> None:
        for process in self.processes:
            try:
                process.send({"do": "quit"})
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 10
        for process in self.processes:
            try:
                process.child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            process.kill()


def run_model(name: str, workload: Workload, layouts: Sequence[str], rounds: int, chunks: int, timeline_steps: int,
              timeout: float, quiet: bool = False) -> Dict[str, Any]:
    """Every figure of one model: times (interleaved rounds), memory per rank, and the reductions' share."""
    keys: List[Optional[str]] = [None, *layouts]
    groups: Dict[Optional[str], Group] = {}
    try:  # time and reductions, with glibc's own allocation (as a user's run)
        for key in keys:
            groups[key] = Group(key, workload, chunks)
        for group in groups.values():
            group.ready(timeout)
        variants: List[Tuple[str, Optional[str], str]] = [(v, None, v) for v in LOCAL]
        variants += [(LAYOUTS[k].name, k, "plain") for k in layouts]
        times: Dict[str, List[float]] = {label: [] for label, _, _ in variants}
        bar = progress(rounds, desc=f"mesh {name}", disable=quiet)
        for _ in range(rounds):
            for label, key, variant in variants:
                answers = groups[key].ask({"do": "time", "variant": variant, "steps": 1}, timeout)
                times[label].append(max(a["times"][0] for a in answers))  # the slowest rank's
            bar.update(1)
        bar.close()
        reductions = {LAYOUTS[k].name: groups[k].ask({"do": "timeline", "steps": timeline_steps}, timeout)[0]
                      ["timeline"]
                      for k in layouts}
    finally:
        for group in groups.values():
            group.close()
    memory: Dict[str, Any] = {}
    for key in keys:  # one layout at a time, in processes whose resident set follows their tensors
        group = Group(key, workload, chunks, for_memory=True)
        try:
            group.ready(timeout)
            memory[LAYOUTS[key].name if key else "plain"] = group.ask({"do": "memory"}, timeout)
        finally:
            group.close()
    plain = times["plain"]
    rows = []
    for label, _, _ in variants:
        rows.append({"variant": label, "step_s": statistics.median(times[label]),
                     "speedup": statistics.median(p / t for p, t in zip(plain, times[label])),
                     "samples_per_s": workload.batch / statistics.median(times[label]), "times": times[label]})
    ideal_pp = [t / 2 for t in times["by hand"]]
    rows.append({"variant": "ideal pp 2: by hand / 2", "step_s": statistics.median(ideal_pp),
                 "speedup": statistics.median(p / t for p, t in zip(plain, ideal_pp)),
                 "samples_per_s": workload.batch / statistics.median(ideal_pp), "times": ideal_pp})
    return {"workload": workload.__dict__, "chunks": chunks, "rounds": rounds, "times": rows, "memory": memory,
            "reduction": reductions}


def print_model(name: str, result: Dict[str, Any]) -> None:
    workload = Workload(**result["workload"])
    params = sum(workload.width * workload.width + workload.width for _ in range(workload.layers))
    print(f"\n{name}: {workload.layers} x {workload.width} Linear+ReLU MLP ({params * 4 / MiB:.1f} MiB of parameters), "
          f"global batch {workload.batch}, chunks {result['chunks']} for pp 2; {workload.what}")
    plain_s = next(r["step_s"] for r in result["times"] if r["variant"] == "plain")
    rows = [[r["variant"], r["step_s"] * 1e3, r["samples_per_s"], r["speedup"], r["step_s"] / plain_s]
            for r in result["times"]]
    print(format_table(["variant", "step ms", "samples/s", "speed-up (paired)", "time / plain"], rows))
    memory_rows = []
    plain_total: Optional[float] = None
    for label, ranks in result["memory"].items():
        for rank, m in enumerate(ranks):
            transient = m["transient_bytes"]
            total = None if transient is None else m["params_bytes"] + m["optimizer_bytes"] + transient
            plain_total = total if label == "plain" else plain_total
            memory_rows.append([f"{label}, rank {rank}" if len(ranks) > 1 else label, m["params_bytes"] / MiB,
                                m["optimizer_bytes"] / MiB, m["grads_bytes"] / MiB,
                                None if transient is None else transient / MiB,
                                None if transient is None else (transient - m["grads_bytes"]) / MiB,
                                None if total is None else total / MiB,
                                total / plain_total if total is not None and plain_total else None])
    print(format_table(["memory per rank (MiB)", "params", "optimizer", "grads", "step peak",
                        "step peak - grads", "total", "total / plain"], memory_rows))
    reduction_rows = []
    for label, figures in result["reduction"].items():
        if figures is None:
            continue
        reduction_rows.append([label, figures["step_s"] * 1e3, figures["reduce_s"] / figures["step_s"],
                               figures["exposed_s"] / figures["step_s"], figures["compute_s"] / figures["step_s"]])
    print(format_table(["reduction (pipe.step only)", "step ms", "reduce spans / step",
                        "exposed reduce / step", "busy / step (per rank)"], reduction_rows))


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=DEFAULT_LAYOUTS)
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches of the 2-stage pipeline")
    parser.add_argument("--timeline-steps", type=int, default=5, help="steps recorded for the reduction's share")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a command may take before every "
                        "process is killed")
    parser.add_argument("--quick", action="store_true", help="tiny models, one round (a smoke test)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args)
        return {}
    if args.quick:
        args.rounds, args.timeline_steps = 1, 1
    table = QUICK if args.quick else MODELS
    print(f"machine: {machine_description()}; every process 1 intra-op thread, gloo on 127.0.0.1, Adam; "
          f"load average {_load()}")
    results: Dict[str, Any] = {"rounds": args.rounds, "chunks": args.chunks, "models": {}}
    for name in args.models:
        result = run_model(name, table[name], args.layouts, args.rounds, args.chunks, args.timeline_steps,
                           args.timeout, args.quiet)
        results["models"][name] = result
        print_model(name, result)
    print(f"\n(step time: median over {args.rounds} interleaved rounds, the slowest rank's; speed-up: median of "
          "plain / variant per round; memory: exact bytes of parameters, optimizer state and gradients, and the "
          "measured peak resident set of two steps above their start; total = params + optimizer + step peak)")
    print(f"load average at the end: {_load()} (other processes on the machine slow every figure down)")
    if args.json:
        save_json(args.json, results)
    return results


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): per model and variant, the step time, the speed-up over the
    plain module, the memory of its largest rank over the plain module's (parameters, optimizer state and the
    step's peak), and the share of the step the gradient reduction left exposed."""
    rows = []
    for name, result in results["models"].items():
        totals: Dict[str, Optional[float]] = {}
        for label, ranks in result["memory"].items():
            sizes = [None if m["transient_bytes"] is None else m["params_bytes"] + m["optimizer_bytes"]
                     + m["transient_bytes"] for m in ranks]
            totals[label] = None if None in sizes else max(s for s in sizes if s is not None)
        plain = totals.get("plain")
        for r in result["times"]:
            total = totals.get(r["variant"])
            reduction = result["reduction"].get(r["variant"])
            rows.append([name, r["variant"], r["step_s"] * 1e3, r["speedup"],
                         total / plain if total is not None and plain else None,
                         reduction["exposed_s"] / reduction["step_s"] if reduction else None])
    return Summary(["model", "variant", "step ms", "speed-up vs plain", "memory per rank / plain",
                    "exposed reduction / step"], rows,
                   [f"Interleaved rounds: {results['rounds']}; micro-batches of the pipeline: {results['chunks']}; "
                    "memory: parameters, optimizer state and the step's peak on the largest rank."])


def _load() -> str:
    try:
        return " ".join(f"{value:.1f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
