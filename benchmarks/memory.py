"""Memory benchmark: peak training-step memory per checkpoint mode and chunks, and the largest batch in a budget.

Every measurement runs in a fresh child process. On CPU the figure is the
step's peak resident set size (VmHWM) minus the same process's
peak after torch, the model, its GPipe wrapper and the input exist
and one warm-up step on a tiny batch (two samples per micro-batch) has run, so
that lazy initialisation, worker threads and their malloc arenas are in the
baseline (measured the same way); then two steps run, so gradients and
allocator caches are included. On CUDA it is
``torch.cuda.max_memory_allocated`` summed over the pipeline's devices minus
``memory_allocated`` before the first step. Every figure is also given as a
ratio to the plain module's. ``--budget-mb`` adds, per mode, the largest batch
(a multiple of ``--granularity``) whose step stays within the budget, found
by doubling then bisecting, each probe in its own child.

    python benchmarks/memory.py [--preset small|paper|tiny] [--models resnet101 unet amoebanet] [--chunks 1 8]
        [--modes never except_last always] [--partitions 2] [--budget-mb 64] [--json out.json] [--plot out.png]
"""
import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import models  # noqa: E402
from benchmarks.harness.machine import cores, default_device, machine_description, torchgpipe_module  # noqa: E402
from benchmarks.harness.memory import cpu_peak_rss_bytes  # noqa: E402
from benchmarks.harness.output import Summary, bar_plot, format_table, progress, save_json  # noqa: E402
from benchmarks.harness.processes import run_in_child  # noqa: E402
from benchmarks.harness.steps import train_step  # noqa: E402

MODES = ("never", "except_last", "always")
MiB = 1024 * 1024


def _workload(model: str, preset: str, library: str) -> Tuple[nn.Module, nn.Sequential, Tuple[int, ...]]:
    """(plain baseline, Sequential to pipeline, input shape) for ``library`` ('torchpipe' or 'torchgpipe')."""
    if model != "unet":
        w = models.build(model, preset)
        assert isinstance(w.module, nn.Sequential)
        return w.module, w.module, w.input_shape
    torch.manual_seed(0)
    plain = models.unet(preset, "plain")
    try:
        torch.manual_seed(0)
        seq = models.unet(preset, "skip", api=library).module
    except ImportError:
        torch.manual_seed(0)
        seq = models.unet(preset, "tuple").module
    assert isinstance(seq, nn.Sequential)
    return plain.module, seq, plain.input_shape


def measure(model: str, preset: str, library: str, batch: int, partitions: int = 2, chunks: int = 1,
            checkpoint: str = "never", device: str = "cpu", steps: int = 2) -> Dict[str, Any]:
    """In a child process: the step's peak memory above the baseline (after a tiny warm-up step), in bytes.

    ``library``: 'plain', 'torchpipe' or 'torchgpipe'. Balance: an even split of layers.
    """
    from benchmarks.speed import pipeline_devices

    torch.set_num_threads(cores())
    dev = torch.device(device)
    plain, sequential, shape = _workload(model, preset, "torchgpipe" if library == "torchgpipe" else "torchpipe")
    module: nn.Module
    devices = [dev]
    if library == "plain":
        module = plain.to(dev)
    else:
        found = pipeline_devices(dev, partitions)
        if found is None:
            raise RuntimeError(f"{partitions} partitions need {partitions} CUDA devices")
        devices = found
        balance = models.even_balance(len(sequential), partitions)
        if library == "torchpipe":
            import torchpipe

            module = torchpipe.GPipe(sequential, balance, devices=devices, chunks=chunks, checkpoint=checkpoint)
        else:
            import torchgpipe

            module = torchgpipe.GPipe(sequential, balance, devices=devices, chunks=chunks, checkpoint=checkpoint)
    x = torch.randn((batch,) + tuple(shape[1:]), device=dev)
    step = train_step(module, x)
    # Warm-up on two samples per micro-batch (BatchNorm needs two), so that lazy initialisation (kernels,
    # thread pools, the workers and their malloc arenas) lands in the baseline: the figure is the batch's own.
    warm = 2 * chunks if library != "plain" else 2
    train_step(module, torch.randn((warm,) + tuple(shape[1:]), device=dev))()
    if dev.type == "cuda":
        for d in set(devices):
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)
        base = sum(torch.cuda.memory_allocated(d) for d in set(devices))
        for _ in range(steps):
            step()
        peak = sum(torch.cuda.max_memory_allocated(d) for d in set(devices))
    else:
        base = cpu_peak_rss_bytes()
        for _ in range(steps):
            step()
        peak = cpu_peak_rss_bytes()
    return {"baseline_bytes": base, "peak_bytes": peak, "step_bytes": max(0, peak - base)}


def _child(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    return dict(run_in_child("benchmarks.memory:measure", kwargs))


def peak_table(args: argparse.Namespace, model: str, pool: ThreadPoolExecutor, bar: Any) -> Dict[str, Any]:
    jobs: List[Tuple[str, Dict[str, Any]]] = [("plain", {"library": "plain"})]
    libraries = ["torchpipe"] + (["torchgpipe"] if args.torchgpipe else [])
    for library in libraries:
        for checkpoint in args.modes:
            for chunks in args.chunks:
                jobs.append((f"{library} {checkpoint} chunks={chunks}",
                             {"library": library, "checkpoint": checkpoint, "chunks": chunks}))
    shared_kwargs = {"model": model, "preset": args.preset, "device": args.device, "partitions": args.partitions}

    def run(job: Tuple[str, Dict[str, Any]]) -> Dict[str, Any]:
        result = _child({**shared_kwargs, "batch": batch_of(args, model), **job[1]})
        bar.update(1)
        return result

    measured = dict(zip([name for name, _ in jobs], pool.map(run, jobs)))
    plain = measured["plain"]["step_bytes"]
    return {name: {**m, "ratio": m["step_bytes"] / plain if plain else None} for name, m in measured.items()}


def batch_of(args: argparse.Namespace, model: str) -> int:
    if args.batch:
        return int(args.batch)
    # The small preset's own batch holds too little memory to rise above RSS noise; use 4 times it.
    return models.build(model, args.preset).batch * (4 if args.preset == "small" else 1)


def largest_batch(args: argparse.Namespace, model: str, library: str, checkpoint: str, chunks: int,
                  bar: Any) -> Dict[str, Any]:
    """The largest multiple of ``--granularity`` whose step stays within ``--budget-mb``: double, then bisect."""
    budget = args.budget_mb * MiB
    step = args.granularity
    probes: Dict[int, int] = {}

    def fits(batch: int) -> bool:
        probes[batch] = _child({"model": model, "preset": args.preset, "device": args.device, "library": library,
                                "partitions": args.partitions, "chunks": chunks, "checkpoint": checkpoint,
                                "batch": batch})["step_bytes"]
        assert isinstance(probes[batch], int)
        bar.update(1)
        return bool(probes[batch] <= budget)

    if not fits(step):
        return {"batch": 0, "probes": probes}
    lo, hi = step, 2 * step
    while hi <= args.max_batch and fits(hi):
        lo, hi = hi, 2 * hi
    if hi > args.max_batch:
        return {"batch": lo, "probes": probes, "capped": True}
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return {"batch": lo, "probes": probes}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", choices=models.PRESETS, default="small")
    parser.add_argument("--models", nargs="+", choices=list(models.MODELS), default=list(models.MODELS))
    parser.add_argument("--chunks", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="checkpoint modes")
    parser.add_argument("--partitions", type=int, default=2, help="GPipe partitions (even split of layers)")
    parser.add_argument("--batch", type=int, default=None, help="mini-batch size (default: the preset's; 4x for small)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--budget-mb", type=float, default=None, help="also find the largest batch within this")
    parser.add_argument("--budget-models", nargs="+", default=None, help="models for --budget-mb (default: all)")
    parser.add_argument("--granularity", type=int, default=16, help="batch sizes probed are multiples of this")
    parser.add_argument("--max-batch", type=int, default=4096, help="stop doubling here")
    parser.add_argument("--budget-chunks", type=int, default=8, help="chunks for the --budget-mb search")
    parser.add_argument("--budget-torchgpipe", action="store_true", help="also search torchgpipe's largest batch")
    parser.add_argument("--jobs", type=int, default=2, help="child processes at a time (memory is not timing)")
    parser.add_argument("--no-torchgpipe", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    args.device = str(default_device(args.device))
    args.torchgpipe = not args.no_torchgpipe and torchgpipe_module() is not None
    how = ("peak RSS (VmHWM) of a child process minus its peak after a tiny warm-up step"
           if args.device == "cpu" else "torch.cuda.max_memory_allocated minus memory_allocated before the step")
    print(f"machine: {machine_description(torch.device(args.device))}")
    print(f"preset {args.preset}, {args.partitions} partitions (even split), memory = {how}; "
          f"torchgpipe: {'yes' if args.torchgpipe else 'no'}")
    results: Dict[str, Any] = {"preset": args.preset, "device": args.device, "partitions": args.partitions,
                               "measure": how, "budget_mb": args.budget_mb, "budget_chunks": args.budget_chunks,
                               "models": {}}
    per_model = 1 + (2 if args.torchgpipe else 1) * len(args.modes) * len(args.chunks)
    bar = progress(per_model * len(args.models), desc="memory", disable=args.quiet)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        tables = {m: peak_table(args, m, pool, bar) for m in args.models}
    bar.close()
    for model, table in tables.items():
        print(f"\n{model} (batch {batch_of(args, model)}): step memory above baseline")
        rows = [[name, m["step_bytes"] / MiB, m["ratio"]] for name, m in table.items()]
        print(format_table(["configuration", "MiB", "x plain"], rows), flush=True)
        results["models"][model] = {"batch": batch_of(args, model), "peak": table}
    if args.budget_mb:
        chunks = args.budget_chunks
        searches = [("plain", "never")] + [("torchpipe", c) for c in args.modes]
        if args.torchgpipe and args.budget_torchgpipe:
            searches += [("torchgpipe", c) for c in args.modes]
        names = args.budget_models or args.models
        bar = progress(len(names) * len(searches) * 8, desc="largest batch", disable=args.quiet)

        def search(job: Tuple[str, str, str]) -> Dict[str, Any]:
            return largest_batch(args, job[0], job[1], job[2], chunks, bar)

        jobs = [(m, lib, c) for m in names for lib, c in searches]
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            found = list(pool.map(search, jobs))
        bar.close()
        for model in names:
            rows = []
            plain_batch = next(f["batch"] for (m, lib, _), f in zip(jobs, found) if m == model and lib == "plain")
            for (m, lib, c), f in zip(jobs, found):
                if m == model:
                    label = "plain" if lib == "plain" else f"{lib} {c} chunks={chunks}"
                    rows.append([label, f["batch"], f["batch"] / plain_batch if plain_batch else None])
                    results["models"][model].setdefault("largest_batch", {})[label] = f
            print(f"\n{model}: largest batch (multiple of {args.granularity}) within {args.budget_mb:g} MiB")
            print(format_table(["configuration", "batch", "x plain"], rows), flush=True)
    if args.json:
        save_json(args.json, results)
        print(f"json: {args.json}")
    if args.plot:
        groups = {m: {n: v["ratio"] for n, v in r["peak"].items() if v["ratio"] is not None}
                  for m, r in results["models"].items()}
        bar_plot(args.plot, groups, title=f"step memory / plain module ({args.preset}, {args.device})\n"
                 f"{machine_description()}", ylabel="x plain", reference=1.0)
        print(f"plot: {args.plot}")
    return results


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): each configuration's step memory over the plain module's and,
    where ``--budget-mb`` searched, the largest batch within the budget."""
    budget = results.get("budget_mb")
    rows = []
    for name, model in results["models"].items():
        largest = model.get("largest_batch", {})
        for label, m in model["peak"].items():
            rows.append([name, model["batch"], label, m["step_bytes"] / MiB, m["ratio"],
                         largest[label]["batch"] if label in largest else None])
        rows += [[name, None, label, None, None, found["batch"]] for label, found in largest.items()
                 if label not in model["peak"]]
    return Summary(["model", "batch", "configuration", "step MiB", "x plain",
                    f"largest batch in {budget:g} MiB" if budget else "largest batch"], rows,
                   [f"Preset {results['preset']}, {results['partitions']} partitions, on {results['device']}: "
                    f"{results['measure']}."])


if __name__ == "__main__":
    main()
