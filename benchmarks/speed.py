"""Speed benchmark: training throughput of ResNet-101, U-Net, AmoebaNet-D and a traced ResNet-50, plain and under GPipe.

For each model, prints the plain module's samples/s and, for each
``partitions x chunks`` configuration, GPipe's samples/s and its throughput as
a ratio to the plain module's, measured in the same run with plain and
pipelined steps interleaved in pairs (see :mod:`benchmarks.harness.timing`); when
``torchgpipe`` is importable its figures are printed beside ours.

``resnet50-traced`` is a ResNet-50 that is not a Sequential (torchvision's when
it imports, else :class:`benchmarks.models.ResNet`, the same architecture)
made into one by ``torchpipe.as_sequential``: GPipe over it against the plain
module, GPipe over the same model written by hand as a Sequential
(:func:`benchmarks.models.resnet_by_hand`, one layer per block) against the
plain module, and the two pipelines against each other, interleaved in pairs
and cut at the same blocks (``traced / hand-written``: step time, < 1.05 is
the goal).

On CPU every partition is a ``'cpu'`` device and each partition's worker gets
``max(1, cores // partitions)`` intra-op threads; the plain module gets all
cores. On CUDA partition j is ``cuda:j`` (configurations needing more GPUs
than there are are skipped).

    python benchmarks/speed.py [--preset small|paper|tiny] [--models resnet101 unet amoebanet resnet50-traced]
        [--configs 1x1 2x4 2x8 4x8] [--balance time|even] [--json out.json] [--plot out.png]
        [--timeline DIR]
"""
import argparse
import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import torchpipe  # noqa: E402
import torchpipe.trace  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.harness.machine import (  # noqa: E402
    cores,
    default_device,
    intra_op_threads,
    machine_description,
    torchgpipe_module,
)
from benchmarks.harness.output import Summary, bar_plot, format_table, save_json  # noqa: E402
from benchmarks.harness.steps import microbatched_train_step, pipeline_ideal, train_step  # noqa: E402
from benchmarks.harness.timing import Variant, compare  # noqa: E402
from benchmarks.models import even_balance  # noqa: E402

DEFAULT_CONFIGS = {"small": ["1x1", "2x4", "2x8", "4x8"], "paper": ["1x1", "2x8", "4x16", "8x32"], "tiny": ["2x2"]}

#: Models of this benchmark that are not in benchmarks.models.MODELS: built here.
TRACED = "resnet50-traced"
MODEL_NAMES = list(models.MODELS) + [TRACED]


def parse_config(text: str) -> Tuple[int, int]:
    """``'2x8'`` -> (2 partitions, 8 chunks)."""
    try:
        partitions, chunks = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a configuration is PARTITIONSxCHUNKS, like 2x8; got {text!r}") from None
    if partitions < 1 or chunks < 1:
        raise argparse.ArgumentTypeError(f"partitions and chunks must be positive; got {text!r}")
    return partitions, chunks


def find_balance(module: nn.Sequential, sample: torch.Tensor, partitions: int, how: str,
                 device: torch.device, timeout: float) -> List[int]:
    if partitions == 1:
        return [len(module)]
    if how == "even":
        return even_balance(len(module), partitions)
    from torchpipe_balancing import balance_by_time

    return balance_by_time(partitions, module, sample, timeout=timeout, device=device)


def pipeline_devices(device: torch.device, partitions: int) -> Optional[List[torch.device]]:
    """One device per partition, or None when CUDA has too few GPUs."""
    if device.type == "cpu":
        return [torch.device("cpu")] * partitions
    if torch.cuda.device_count() < partitions:
        return None
    return [torch.device("cuda", j) for j in range(partitions)]


def unet_variant() -> Tuple[str, str]:
    """The U-Net variant to benchmark: 'skip' when torchpipe.skip exists, else 'tuple'; and a note."""
    try:
        models.skip_api("torchpipe")
    except ImportError:
        return "tuple", "torchpipe.skip is not importable yet: U-Net skips carried as tuples through every layer"
    return "skip", "U-Net with torchpipe.skip stash/pop"


@dataclass
class Entry:
    """One model of the benchmark: what GPipe pipelines, the plain baseline, and what else runs beside it."""

    workload: models.Workload
    plain: nn.Module
    #: What torchgpipe pipelines, or None.
    theirs: Optional[nn.Module]
    note: str = ""
    #: The same model written by hand as a Sequential, compared with the traced one (resnet50-traced only).
    hand: Optional[nn.Sequential] = None
    #: The qualified name in the model of each layer of ``hand`` ('' for a layer that is not the model's).
    hand_names: Optional[List[str]] = None


def traced_resnet50(preset: str, width: Optional[int] = None, size: Optional[int] = None) -> Entry:
    """ResNet-50 as a module, as_sequential of it, and the same model by hand (three copies, same weights)."""
    torch.manual_seed(0)
    resnet = models.resnet50(preset, width=width, size=size)
    module = resnet.module
    sequential = torchpipe.as_sequential(copy.deepcopy(module), resnet.sample(batch=2))
    source = copy.deepcopy(module)
    hand = models.resnet_by_hand(source)
    names = {id(m): name for name, m in source.named_modules()}
    workload = models.Workload(TRACED, sequential, resnet.input_shape)
    note = (f"{resnet.name} (stem width {resnet.module.conv1.out_channels}, {resnet.input_shape[-1]}x"
            f"{resnet.input_shape[-1]} images) made a Sequential by torchpipe.as_sequential: {len(sequential)} "
            f"layers; by hand: {len(hand)} layers (one per block)")
    return Entry(workload, module, None, note, hand, [names.get(id(layer), "") for layer in hand])


def workloads(names: Sequence[str], preset: str, resnet50_width: Optional[int] = None,
              resnet50_image: Optional[int] = None) -> List[Entry]:
    """The pipelined Sequential, the plain baseline and the torchgpipe-ready Sequential (or None) of each model."""
    out: List[Entry] = []
    for name in names:
        if name == TRACED:
            out.append(traced_resnet50(preset, resnet50_width, resnet50_image))
            continue
        if name != "unet":
            w = models.build(name, preset)
            out.append(Entry(w, w.module, w.module))
            continue
        variant, note = unet_variant()
        torch.manual_seed(0)
        w = models.unet(preset, variant)
        torch.manual_seed(0)
        plain = models.unet(preset, "plain").module
        theirs: Optional[nn.Module] = w.module
        if variant == "skip":
            try:
                torch.manual_seed(0)
                theirs = models.unet(preset, "skip", api="torchgpipe").module
            except ImportError:
                theirs = None
        out.append(Entry(w, plain, theirs, note))
    return out


def same_cut(traced: nn.Sequential, hand_names: Sequence[str], hand_balance: Sequence[int]) -> List[int]:
    """The balance of ``traced`` whose partitions hold the blocks that ``hand_balance`` gives each partition.

    Each traced layer is named after a submodule (``layer2.0.conv1``); the
    hand-written layer with that name or a prefix of it (``layer2.0``) says
    where it goes.
    """
    starts = [sum(hand_balance[: j + 1]) for j in range(len(hand_balance) - 1)]
    positions = []
    for layer in traced:
        name = layer.name.split("..")[0].split("#")[0]
        positions.append(next(i for i, hand in enumerate(hand_names) if hand and (
            name == hand or name.startswith(hand + "."))))
    cuts = [next(k for k, p in enumerate(positions) if p >= start) for start in starts]
    edges = [0, *cuts, len(traced)]
    return [b - a for a, b in zip(edges, edges[1:])]


def run(args: argparse.Namespace) -> Dict[str, Any]:
    device = default_device(args.device)
    threads = cores() if device.type == "cpu" else torch.get_num_threads()
    torch.set_num_threads(threads)
    # torchgpipe runs its backward on the caller's thread and starts fresh worker threads every step;
    # on CPU it was fastest here with 1 caller thread (its workers keep the OpenMP default).
    tg_threads = args.tg_threads if args.tg_threads is not None else (1 if device.type == "cpu" else None)
    configs = [parse_config(c) for c in (args.configs or DEFAULT_CONFIGS[args.preset])]
    tg = None if args.no_torchgpipe else torchgpipe_module()
    print(f"machine: {machine_description(device)}")
    if device.type == "cpu":
        print(f"CPU: plain module with {threads} intra-op threads; torchpipe partition workers with "
              f"max(1, {threads} // partitions) threads each (the caller waits with 1); torchgpipe's caller "
              f"with {args.tg_threads or 1} (fastest for it here)")
    print(f"preset {args.preset}, checkpoint={args.checkpoint!r}, balance by {args.balance}, "
          f"{args.rounds} interleaved pairs per figure (median), torchgpipe: {'yes' if tg else 'not importable'}")
    results: Dict[str, Any] = {"preset": args.preset, "device": str(device), "checkpoint": args.checkpoint,
                               "balance_by": args.balance, "threads": threads, "models": {}}
    for entry in workloads(args.models, args.preset, args.resnet50_width, args.resnet50_image):
        workload, plain_module, theirs_module, note = entry.workload, entry.plain, entry.theirs, entry.note
        if note:
            print(f"note: {note}")
        sample = workload.sample(device=device)
        plain = plain_module.to(device)
        plain_step = Variant("plain", train_step(plain, sample), threads)
        sequential = workload.module
        assert isinstance(sequential, nn.Sequential)
        hand = entry.hand.to(device) if entry.hand is not None else None
        rows: List[Dict[str, Any]] = []
        balances: Dict[int, List[int]] = {}
        hand_balances: Dict[int, List[int]] = {}
        for partitions, chunks in configs:
            devices = pipeline_devices(device, partitions)
            if devices is None or partitions > len(sequential) or (hand is not None and partitions > len(hand)):
                print(f"{workload.name} {partitions}x{chunks}: skipped (needs {partitions} devices/layers)")
                continue
            if partitions not in balances:
                balances[partitions] = find_balance(sequential, sample, partitions, args.balance, device,
                                                    args.balance_timeout)
                if hand is not None:
                    hand_balances[partitions] = find_balance(hand, sample, partitions, args.balance, device,
                                                             args.balance_timeout)
            balance = balances[partitions]
            variants = []
            with intra_op_threads(threads):  # workers take their share of the caller's threads
                ours = torchpipe.GPipe(copy.deepcopy(sequential), balance, devices=devices, chunks=chunks,
                                       checkpoint=args.checkpoint)
                ours_step = train_step(ours, sample)
                ours_step()  # starts the workers under `threads`
            variants.append(Variant("torchpipe", ours_step, 1 if device.type == "cpu" else None))
            # The micro-batched ideal's yardstick: the same micro-batches through the plain module, by hand.
            variants.append(Variant("by hand", microbatched_train_step(plain, sample, chunks), threads))
            pair: List[Variant] = []
            if hand is not None:
                with intra_op_threads(threads):
                    by_hand = torchpipe.GPipe(copy.deepcopy(hand), hand_balances[partitions], devices=devices,
                                              chunks=chunks, checkpoint=args.checkpoint)
                    hand_step = train_step(by_hand, sample)
                    hand_step()
                    # The traced model cut at the same blocks as the hand-written one: only the layers differ.
                    assert entry.hand_names is not None
                    cut = same_cut(sequential, entry.hand_names, hand_balances[partitions])
                    twin = torchpipe.GPipe(copy.deepcopy(sequential), cut, devices=devices, chunks=chunks,
                                           checkpoint=args.checkpoint)
                    twin_step = train_step(twin, sample)
                    twin_step()
                cpu_threads = 1 if device.type == "cpu" else None
                variants.append(Variant("hand-written", hand_step, cpu_threads))
                pair = [Variant("hand-written", hand_step, cpu_threads),
                        Variant("traced, same cut", twin_step, cpu_threads)]
            if tg is not None and theirs_module is not None:
                theirs = tg.GPipe(copy.deepcopy(theirs_module), balance, devices=devices, chunks=chunks,
                                  checkpoint=args.checkpoint)
                variants.append(Variant("torchgpipe", train_step(theirs, sample), tg_threads))
            compared = compare(plain_step, variants, rounds=args.rounds, warmup=args.warmup, device=device,
                               desc=f"{workload.name} {partitions}x{chunks}", quiet=args.quiet)
            row: Dict[str, Any] = {"partitions": partitions, "chunks": chunks, "balance": balance}
            for c in compared:
                row[c.name] = {"samples_per_s": workload.batch / c.seconds, "plain_samples_per_s":
                               workload.batch / c.plain_seconds, "throughput_ratio": 1.0 / c.ratio,
                               "time_ratio": c.ratio, "seconds": c.seconds, "plain_seconds": c.plain_seconds}
            if pair:
                (versus,) = compare(pair[0], pair[1:], rounds=args.rounds, warmup=args.warmup, device=device,
                                    desc=f"{workload.name} {partitions}x{chunks} traced/hand", quiet=args.quiet)
                row["hand-written"]["balance"] = hand_balances[partitions]
                row["traced_vs_hand"] = {"time_ratio": versus.ratio, "cut": cut, "seconds": versus.seconds,
                                         "hand_seconds": versus.plain_seconds, "ratios": versus.ratios}
            rows.append(row)
            if args.timeline and partitions > 1 and not any(r.get("timeline") for r in rows):
                row["timeline"] = save_timeline(ours, sample, Path(args.timeline), f"{workload.name}-{partitions}x"
                                                f"{chunks}")
            del variants, ours, pair
        print_model(workload, rows)
        results["models"][workload.name] = {"batch": workload.batch, "input_shape": list(workload.input_shape),
                                            "layers": len(sequential), "note": note, "configs": rows}
        if hand is not None:
            results["models"][workload.name]["hand_layers"] = len(hand)
    return results


def save_timeline(model: nn.Module, sample: torch.Tensor, folder: Path, name: str) -> str:
    """Records one training step's pipeline timeline; saves it as PNG and Chrome trace; returns the PNG path."""
    with intra_op_threads(1), torchpipe.trace.record_timeline() as timeline:
        train_step(model, sample)()
    png = folder / f"{name}.png"
    timeline.save_png(png, title=f"{name}: one training step (number: micro-batch)")
    timeline.save_chrome_trace(folder / f"{name}.json")
    print(f"timeline: {png}")
    return str(png)


def print_model(workload: models.Workload, rows: Sequence[Dict[str, Any]]) -> None:
    if not rows:
        return
    plain_rate = sorted(r["torchpipe"]["plain_samples_per_s"] for r in rows)[len(rows) // 2]
    layers = len(list(workload.module.children()))
    print(f"\n{workload.name} (batch {workload.batch}, {layers} layers): plain {plain_rate:.1f} samples/s "
          "(median over the run)")
    table = []
    traced = any("traced_vs_hand" in r for r in rows)
    for r in rows:
        ours, theirs, hand_made = r["torchpipe"], r.get("torchgpipe"), r["by hand"]
        line = [f"{r['partitions']}x{r['chunks']}", ",".join(map(str, r["balance"])), ours["samples_per_s"],
                ours["throughput_ratio"], hand_made["throughput_ratio"], ours["time_ratio"] / hand_made["time_ratio"],
                pipeline_ideal(r["partitions"], r["chunks"])]
        if traced:
            hand, versus = r["hand-written"], r["traced_vs_hand"]
            line += [hand["samples_per_s"], hand["throughput_ratio"], versus["time_ratio"]]
        else:
            line += [theirs["samples_per_s"] if theirs else None, theirs["throughput_ratio"] if theirs else None]
        table.append(line)
    if traced:
        print(format_table(["partitions x chunks", "balance", "traced/s", "x plain", "micro-batched x plain",
                            "time / micro-batched", "ideal", "hand-written/s", "x plain", "traced/hand time"],
                           table))
        print("(x plain: throughput / the plain module's, median of interleaved pairs; > 1 is faster. traced/hand "
              "time: step time of GPipe over the traced model cut at the same blocks as the hand-written one, over "
              "the hand-written one's, median of interleaved pairs; < 1.05 is the goal. micro-batched: the same "
              "micro-batches through the plain module by hand; ideal: (m + p - 1) / (m p))", flush=True)
        return
    print(format_table(["partitions x chunks", "balance", "torchpipe/s", "x plain", "micro-batched x plain",
                        "time / micro-batched", "ideal", "torchgpipe/s", "x plain"], table))
    print("(x plain: throughput / the plain module's, median of interleaved pairs; > 1 is faster. micro-batched: "
          "the same micro-batches through the plain module by hand, one after another, with the plain module's "
          "threads; time / micro-batched: the pipeline's step time over theirs; ideal: (m + p - 1) / (m p), the "
          "best a pipeline of p stages on p cores can do against m micro-batches on one core)", flush=True)


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): per model and configuration, throughput over the plain
    module's (> 1 is faster), by torchpipe, by the same micro-batches by hand, and by torchgpipe where it ran."""
    rows = []
    for name, model in results["models"].items():
        for r in model["configs"]:
            ours, hand = r["torchpipe"], r["by hand"]
            theirs, versus = r.get("torchgpipe"), r.get("traced_vs_hand")
            rows.append([name, f"{r['partitions']}x{r['chunks']}", ours["plain_samples_per_s"],
                         ours["samples_per_s"], ours["throughput_ratio"], hand["throughput_ratio"],
                         ours["time_ratio"] / hand["time_ratio"], pipeline_ideal(r["partitions"], r["chunks"]),
                         theirs["throughput_ratio"] if theirs else None, versus["time_ratio"] if versus else None])
    return Summary(["model", "partitions x chunks", "plain samples/s", "torchpipe samples/s", "x plain",
                    "by hand x plain", "time / by hand", "ideal", "torchgpipe x plain", "traced / hand-written time"],
                   rows, [f"Preset {results['preset']}, checkpoint {results['checkpoint']!r}, on {results['device']}."])


def plot(results: Dict[str, Any], path: str) -> None:
    groups: Dict[str, Dict[str, float]] = {}
    for name, model in results["models"].items():
        bars: Dict[str, float] = {}
        for r in model["configs"]:
            for lib in ("torchpipe", "torchgpipe", "hand-written"):
                if lib in r:
                    bars[f"{lib} {r['partitions']}x{r['chunks']}"] = r[lib]["throughput_ratio"]
        groups[name] = bars
    bar_plot(path, groups, title=f"throughput / plain module ({results['preset']} preset, "
             f"{results['device']})\n{machine_description()}", ylabel="x plain", reference=1.0)
    print(f"plot: {path}")


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", choices=models.PRESETS, default="small")
    parser.add_argument("--models", nargs="+", choices=MODEL_NAMES, default=MODEL_NAMES)
    parser.add_argument("--configs", nargs="+", default=None, help="PARTITIONSxCHUNKS, e.g. 2x8 (default per preset)")
    parser.add_argument("--checkpoint", choices=["always", "except_last", "never"], default="except_last")
    parser.add_argument("--balance", choices=["time", "even"], default="time",
                        help="torchpipe_balancing.balance_by_time, or an even split of layers")
    parser.add_argument("--balance-timeout", type=float, default=0.5, help="profiling time for balance_by_time")
    parser.add_argument("--rounds", type=int, default=5, help="timed (plain, pipelined) pairs per figure")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--no-torchgpipe", action="store_true", help="skip torchgpipe even if importable")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here")
    parser.add_argument("--timeline", default=None, help="folder for a timeline PNG + Chrome trace per model")
    parser.add_argument("--tg-threads", type=int, default=None,
                        help="intra-op threads of torchgpipe's caller on CPU (default 1)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--resnet50-width", type=int, default=None,
                        help=f"{TRACED}: the stem's channels (default: the preset's; 64 is torchvision's)")
    parser.add_argument("--resnet50-image", type=int, default=None,
                        help=f"{TRACED}: the image size (default: the preset's)")
    args = parser.parse_args(argv)
    results = run(args)
    if args.json:
        save_json(args.json, results)
        print(f"json: {args.json}")
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
