"""The benchmarks' common runner: interleaved timing, machine line, devices, progress, JSON, plots, child processes.

Every benchmark prints figures as ratios to the plain module measured in the
same run: :func:`compare` alternates the plain step and each variant's step
(``plain, variant, plain, variant, ...``) after a warm-up, so drift of a noisy
machine hits both sides of each pair, and reports the median of the per-pair
ratios. On CUDA every timed step ends with ``torch.cuda.synchronize``.
"""
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import torch
from torch import Tensor, nn

__all__ = [
    "ROOT",
    "Step",
    "Variant",
    "Comparison",
    "machine_description",
    "default_device",
    "synchronize",
    "intra_op_threads",
    "train_step",
    "compare",
    "progress",
    "torchgpipe_module",
    "save_json",
    "bar_plot",
    "format_table",
    "run_in_child",
    "cpu_peak_rss_bytes",
    "cores",
]

#: The repository root (benchmarks/..).
ROOT = Path(__file__).resolve().parent.parent

#: A callable that runs one step and returns nothing.
Step = Callable[[], None]


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(device: Optional[torch.device] = None) -> str:
    """One line naming the machine: CPU model, cores, torch version, and the CUDA device if any."""
    line = f"{_cpu_model()}, {cores()} cores, torch {torch.__version__}, Python {platform.python_version()}"
    if torch.cuda.is_available():
        index = device.index if device is not None and device.type == "cuda" and device.index is not None else 0
        line += f", CUDA {torch.version.cuda}: {torch.cuda.get_device_name(index)} x{torch.cuda.device_count()}"
    else:
        line += ", no CUDA"
    return line


def default_device(requested: Optional[str] = None) -> torch.device:
    """``requested`` if given, else ``cuda`` when available, else ``cpu``."""
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def intra_op_threads(count: Optional[int]) -> Iterator[None]:
    """Sets ``torch.set_num_threads(count)`` in the calling thread for the block (``None``: leave it)."""
    if count is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _loss(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output.float().mean()
    return sum((_loss(o) for o in output), torch.zeros((), device=_first_tensor(output).device))


def _first_tensor(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    return _first_tensor(output[0])


def train_step(model: nn.Module, input: Union[Tensor, Tuple[Tensor, ...]]) -> Step:
    """A training step: forward, ``mean()`` of the output (summed over tuple outputs), backward, drop grads."""

    def step() -> None:
        _loss(model(input)).backward()  # type: ignore[no-untyped-call]
        for p in model.parameters():
            p.grad = None

    return step


def microbatched_train_step(
    model: nn.Module,
    input: Union[Tensor, Tuple[Tensor, ...]],
    chunks: int,
    *,
    target: Optional[Tensor] = None,
    loss_fn: Optional[Callable[[Any, Tensor], Tensor]] = None,
) -> Step:
    """The micro-batched ideal's yardstick: the plain module's training step on the mini-batch cut into
    ``chunks`` micro-batches, run one after another on the calling thread (each micro-batch's loss weighed by
    its share, so the gradients are the whole batch's). A pipeline can at best overlap these micro-batches;
    cutting the batch alone already costs what smaller kernels lose.

    The loss is :func:`train_step`'s (the output's mean), or ``loss_fn(output, target)`` on the target's
    matching micro-batch (a mean-reduced loss)."""
    inputs = (input,) if isinstance(input, Tensor) else tuple(input)
    parts = list(zip(*(x.chunk(chunks) for x in inputs)))
    targets: List[Optional[Tensor]] = list(target.chunk(chunks)) if target is not None else [None] * len(parts)
    total = inputs[0].size(0)

    def step() -> None:
        for part, part_target in zip(parts, targets):
            output = model(part[0] if isinstance(input, Tensor) else part)
            loss = _loss(output) if loss_fn is None or part_target is None else loss_fn(output, part_target)
            (loss * (part[0].size(0) / total)).backward()  # type: ignore[no-untyped-call]
        for p in model.parameters():
            p.grad = None

    return step


def pipeline_ideal(partitions: int, chunks: int) -> float:
    """The best step time of a pipeline of ``partitions`` stages on as many cores, over the same ``chunks``
    micro-batches run by hand on one: (m + p - 1) / (m p) (the bubble of m micro-batches over p stages)."""
    return (chunks + partitions - 1) / (chunks * partitions)


def at_once(first: Step, second: Step) -> Step:
    """A step that runs ``first`` on the calling thread and ``second`` on another thread, at the same time (each
    with the caller's intra-op thread count)."""
    threads = torch.get_num_threads()

    def on_the_other_thread() -> None:
        torch.set_num_threads(threads)  # OpenMP's thread count is per thread: the same as the caller's
        second()

    def step() -> None:
        other = threading.Thread(target=on_the_other_thread)
        other.start()
        first()
        other.join()

    return step


def two_thread_ratio(first: Step, second: Step, *, rounds: int = 5) -> float:
    """What this machine's cores allow right now: the time of ``first`` and ``second`` (two independent
    halves of one piece of work) on two threads at once, over their time one after the other (median of
    interleaved pairs). 0.5 is two free cores; shared or hyper-threaded vCPUs, memory bandwidth and the GIL
    show here as more. A pipeline of two stages at that pace takes this ratio times 2 times the bubble's
    (m + p - 1) / (m p) (its stages each touch half the weights, so it may do better)."""

    def sequential() -> None:
        first()
        second()

    [result] = compare(Variant("one thread", sequential), [Variant("two threads", at_once(first, second))],
                       rounds=rounds, warmup=1, quiet=True)
    return result.ratio


@dataclass
class Variant:
    """A step to compare with the plain step.

    ``threads``: intra-op threads of the calling thread while this step runs
    (``None`` leaves them as they are).
    """

    name: str
    step: Step
    threads: Optional[int] = None


@dataclass
class Comparison:
    """Timings of one variant against the plain step it was interleaved with (seconds)."""

    name: str
    ratio: float
    seconds: float
    plain_seconds: float
    ratios: List[float] = field(default_factory=list)

    def throughput(self, batch: int) -> float:
        return batch / self.seconds

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _timed(variant: Variant, device: torch.device) -> float:
    with intra_op_threads(variant.threads):
        synchronize(device)
        start = time.perf_counter()
        variant.step()
        synchronize(device)
        return time.perf_counter() - start


def compare(
    plain: Variant,
    variants: Sequence[Variant],
    *,
    rounds: int = 5,
    warmup: int = 1,
    device: Optional[torch.device] = None,
    desc: str = "",
    quiet: bool = False,
) -> List[Comparison]:
    """Times each variant against ``plain``, interleaved in pairs; medians and the median ratio.

    For each variant: ``warmup`` untimed pairs, then ``rounds`` timed pairs
    ``(plain, variant)``. ``ratio`` is the median of the per-pair ratios
    ``variant / plain`` (so drift between pairs cancels); ``seconds`` and
    ``plain_seconds`` are the medians of each side.
    """
    device = device if device is not None else torch.device("cpu")
    results: List[Comparison] = []
    bar = progress(total=len(variants) * (rounds + warmup), desc=desc, disable=quiet)
    try:
        for variant in variants:
            plain_times, times = _timed_rounds([plain, variant], rounds, warmup, device, bar, rotate=False)
            ratios = [t / p for t, p in zip(times, plain_times)]
            results.append(Comparison(variant.name, statistics.median(ratios), statistics.median(times),
                                      statistics.median(plain_times), ratios))
    finally:
        bar.close()
    return results


def round_robin(
    variants: Sequence[Variant],
    *,
    rounds: int = 5,
    warmup: int = 1,
    device: Optional[torch.device] = None,
    desc: str = "",
    quiet: bool = False,
) -> Dict[str, List[float]]:
    """Each variant's step times (seconds), every variant run once per round, in an order that rotates by one
    each round (no variant always follows the same one).

    Ratios of two variants taken round by round (:func:`median_ratio`) compare steps run seconds apart, for
    any pair, where :func:`compare` compares each variant with the plain step only (variants measured minutes
    apart on a machine whose speed drifts).
    """
    assert len({variant.name for variant in variants}) == len(variants), "the variants need distinct names"
    bar = progress(total=rounds + warmup, desc=desc, disable=quiet)
    try:
        timed = _timed_rounds(variants, rounds, warmup, device or torch.device("cpu"), bar, rotate=True)
    finally:
        bar.close()
    return {variant.name: times for variant, times in zip(variants, timed)}


T = TypeVar("T")


def rotated(items: Sequence[T], by: int) -> List[T]:
    """``items`` starting from its ``by``-th (modulo its length): round ``by``'s order of steps that run once a
    round, so that none always follows the same one."""
    by %= len(items)
    return list(items[by:]) + list(items[:by])


def _timed_rounds(
    variants: Sequence[Variant], rounds: int, warmup: int, device: torch.device, bar: Any, rotate: bool
) -> List[List[float]]:
    """Each variant's step times over ``rounds`` rounds after ``warmup`` untimed ones; a round runs every
    variant once, in their order, or (``rotate``) starting one later each round."""
    times: List[List[float]] = [[] for _ in variants]
    for round in range(warmup + rounds):
        for k in rotated(range(len(variants)), round if rotate else 0):
            seconds = _timed(variants[k], device)
            if round >= warmup:
                times[k].append(seconds)
        bar.update(1)
    return times


def median_ratio(times: Mapping[str, Sequence[float]], name: str, over: str) -> float:
    """The median over rounds of ``name``'s step time / ``over``'s in the same round (of :func:`round_robin`)."""
    return statistics.median(a / b for a, b in zip(times[name], times[over]))


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


def progress(total: int, desc: str = "", disable: bool = False) -> Any:
    """A ``tqdm`` progress bar on stderr (a silent stand-in when tqdm is missing or ``disable``)."""
    if disable:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True)


def torchgpipe_module() -> Optional[ModuleType]:
    """``torchgpipe`` if it is importable (for figures beside ours), else None."""
    try:
        import torchgpipe
    except ImportError:
        return None
    return torchgpipe


def save_json(path: Union[str, Path], payload: Mapping[str, Any]) -> None:
    """Writes ``payload`` with the machine line added as ``machine`` (its folder is created)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine_description(), **payload}
    target.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


def bar_plot(
    path: Union[str, Path],
    groups: Mapping[str, Mapping[str, float]],
    *,
    title: str,
    ylabel: str,
    reference: Optional[float] = None,
) -> None:
    """A grouped bar chart saved as PNG: one group per outer key, one bar per inner key.

    ``reference`` draws a dashed horizontal line (1.0 for ratios to the plain module).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names: List[str] = []
    for bars in groups.values():
        names += [n for n in bars if n not in names]
    figure = Figure(figsize=(max(6.0, 1.2 + 0.35 * len(names) * len(groups)), 4.2))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    width = 0.8 / max(1, len(names))
    for index, name in enumerate(names):
        xs = [g + (index - (len(names) - 1) / 2) * width for g, bars in enumerate(groups.values()) if name in bars]
        ys = [bars[name] for bars in groups.values() if name in bars]
        axes.bar(xs, ys, width, label=name)
    if reference is not None:
        axes.axhline(reference, color="black", linestyle="--", linewidth=0.8)
    axes.set_xticks(range(len(groups)))
    axes.set_xticklabels(list(groups))
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=110, format="png")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; floats get 3 decimals, the first column is left-aligned."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}"
        return "n/a" if value is None else str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def proc_status_bytes(field: str) -> int:
    """A size line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``...), in bytes.

    Raises:
        RuntimeError: there is no such line (the memory figures need Linux).
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line (the memory figures need Linux)")


def reset_peak_rss() -> bool:
    """Resets this process's peak resident set size (``VmHWM``) to the current one, through
    ``/proc/self/clear_refs`` (Linux 4.0+); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


#: The kinds of thread :func:`thread_cpu` tells apart, by the name the OS knows them by (threads Python starts
#: are all named after the interpreter: "other threads").
THREAD_KINDS = ("main", "gloo", "store", "other threads")


def thread_cpu() -> Dict[str, Tuple[float, int]]:
    """This process's CPU seconds and context switches so far, per kind of thread (:data:`THREAD_KINDS`: the
    main thread, gloo's, the ``torch.distributed`` store's server, the rest), from ``/proc/self/task`` (Linux;
    ``{}`` elsewhere). Threads that ended meanwhile are not counted; the CPU time is in clock ticks (10 ms)."""
    totals: Dict[str, Tuple[float, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
        if int(tid) == os.getpid():
            kind = "main"
        elif "gloo" in name:  # gloo_tcp_loop, pt_gloo_runloop
            kind = "gloo"
        elif name.startswith("pt_tcpstore"):
            kind = "store"
        else:
            kind = "other threads"
        cpu, count = totals.get(kind, (0.0, 0))
        totals[kind] = (cpu + seconds, count + switches)
    return totals


def cpu_peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes.

    On Linux this is ``VmHWM`` from ``/proc/self/status``, the peak of this
    process's own address space. ``getrusage``'s ``ru_maxrss`` is not used
    there: Linux carries it over fork and exec, so a child of a large parent
    would report at least the parent's size. Elsewhere, ``ru_maxrss``.
    """
    try:
        return proc_status_bytes("VmHWM")
    except (OSError, RuntimeError):
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def run_in_child(target: str, kwargs: Mapping[str, Any], *, timeout: float = 600.0) -> Any:
    """Runs ``module:function(**kwargs)`` in a fresh Python process and returns its JSON-able result.

    A fresh process per call is what makes :func:`cpu_peak_rss_bytes` a
    per-measurement peak. The child's intra-op thread count is inherited through
    ``OMP_NUM_THREADS`` only if the caller set it; the function decides.

    Raises:
        RuntimeError: the child failed; its stderr's tail is in the message.
    """
    module, function = target.split(":")
    code = (
        "import json, sys\n"
        f"from {module} import {function} as f\n"
        "result = f(**json.loads(sys.argv[1]))\n"
        "print('\\n' + json.dumps(result))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    done = subprocess.run([sys.executable, "-c", code, json.dumps(dict(kwargs))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"{target}({dict(kwargs)}) failed in a child process (exit {done.returncode}):\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a process group's store)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_environment(port: int, **extra: str) -> Dict[str, str]:
    """The environment of a benchmark's rank: this one, with the store on 127.0.0.1:``port``, one OpenMP
    thread, ``benchmarks`` importable, and ``extra``."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_ranks(commands: Sequence[Sequence[str]], env: Mapping[str, str], timeout: float, what: str) -> None:
    """Runs one process per command (its rank) and waits for all; every one still running is killed when
    ``timeout`` seconds have passed or one fails.

    Raises:
        RuntimeError: a rank exited with an error (``what`` names the run).
        subprocess.TimeoutExpired: the ranks did not all end in time.
    """
    children = [subprocess.Popen(list(command), cwd=ROOT, env=dict(env), start_new_session=True)
                for command in commands]
    try:
        deadline = time.monotonic() + timeout
        for child in children:
            if child.wait(timeout=max(0.1, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"{what}: a rank exited with {child.returncode}")
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
