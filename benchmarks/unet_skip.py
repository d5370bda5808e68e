"""U-Net skip benchmark: long skips carried as tuples through every layer versus ``torchpipe.skip``.

Builds the same U-Net three ways (same layers, same weights; see
:mod:`benchmarks.models`): the plain module (skips kept by its ``forward``),
an ``nn.Sequential`` passing ``(x, skip_0, skip_1, ...)`` through every layer
and partition boundary, and an ``nn.Sequential`` of ``@skippable`` layers
(``stash``/``pop``), whose skips travel straight from the stashing partition
to the popping one. Prints each GPipe variant's training-step time as a ratio
to the plain module's, interleaved in pairs in one run (medians), on CPU with
``'cpu'`` partitions; torchgpipe's stash/pop beside ours when importable.

    python benchmarks/unet_skip.py [--preset small|paper|tiny] [--configs 2x8 4x8] [--checkpoint except_last]
        [--json out.json]
"""
import argparse
import copy
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import torchpipe  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.harness.machine import cores, intra_op_threads, machine_description, torchgpipe_module  # noqa: E402
from benchmarks.harness.output import Summary, format_table, save_json  # noqa: E402
from benchmarks.harness.steps import microbatched_train_step, pipeline_ideal, train_step  # noqa: E402
from benchmarks.harness.timing import Variant, compare  # noqa: E402
from benchmarks.speed import find_balance, parse_config  # noqa: E402


def build_variants(preset: str) -> Dict[str, nn.Module]:
    """'plain', 'tuple' and (where importable) 'skip' and 'skip-torchgpipe' U-Nets with equal weights."""
    torch.manual_seed(0)
    built: Dict[str, nn.Module] = {"plain": models.unet(preset, "plain").module}
    for key, variant, api in [("tuple", "tuple", "torchpipe"), ("skip", "skip", "torchpipe"),
                              ("skip-torchgpipe", "skip", "torchgpipe")]:
        try:
            module = models.unet(preset, variant, api=api).module
        except ImportError:
            continue
        models.copy_weights(built["plain"], module)
        built[key] = module
    return built


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", choices=models.PRESETS, default="small")
    parser.add_argument("--configs", nargs="+", default=["2x8", "4x8"], help="PARTITIONSxCHUNKS")
    parser.add_argument("--checkpoint", choices=["always", "except_last", "never"], default="except_last")
    parser.add_argument("--balance", choices=["time", "even"], default="even",
                        help="the same balance is used for every variant")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    device = torch.device("cpu")
    threads = cores()
    torch.set_num_threads(threads)
    built = build_variants(args.preset)
    shape = models.unet(args.preset, "plain").input_shape
    sample = torch.randn(shape)
    tg = torchgpipe_module()
    print(f"machine: {machine_description(device)}")
    depth = len(list(built["tuple"].children()))
    print(f"U-Net {args.preset} (batch {shape[0]}, {depth} layers), checkpoint={args.checkpoint!r}, "
          f"plain module with {threads} threads, each partition's worker max(1, {threads} // partitions); "
          f"variants: {', '.join(k for k in built if k != 'plain')}")
    plain = Variant("plain", train_step(built["plain"], sample), threads)
    rows: List[List[Any]] = []
    results: Dict[str, Any] = {"preset": args.preset, "checkpoint": args.checkpoint, "configs": []}
    for text in args.configs:
        partitions, chunks = parse_config(text)
        tuple_seq = built["tuple"]
        assert isinstance(tuple_seq, nn.Sequential)
        balance = (find_balance(tuple_seq, sample, partitions, "time", device, 0.5) if args.balance == "time"
                   else models.even_balance(len(tuple_seq), partitions))
        variants: List[Variant] = []
        for key in ("tuple", "skip"):
            if key not in built:
                continue
            with intra_op_threads(threads):
                layers = copy.deepcopy(built[key])
                assert isinstance(layers, nn.Sequential)
                pipe = torchpipe.GPipe(layers, balance, devices=["cpu"] * partitions,
                                       chunks=chunks, checkpoint=args.checkpoint)
                step = train_step(pipe, sample)
                step()
            variants.append(Variant(f"torchpipe {key}", step, 1))
        variants.append(Variant("by hand", microbatched_train_step(built["plain"], sample, chunks), threads))
        if tg is not None and "skip-torchgpipe" in built:
            theirs = tg.GPipe(copy.deepcopy(built["skip-torchgpipe"]), balance, devices=["cpu"] * partitions,
                              chunks=chunks, checkpoint=args.checkpoint)
            variants.append(Variant("torchgpipe skip", train_step(theirs, sample), 1))
        compared = {c.name: c for c in compare(plain, variants, rounds=args.rounds, warmup=args.warmup,
                                                 desc=f"unet {text}", quiet=args.quiet)}
        ratios = [compared[n].ratio if n in compared else None
                  for n in ("torchpipe tuple", "torchpipe skip", "torchgpipe skip")]
        hand = compared["by hand"].ratio
        skip_vs_hand = compared["torchpipe skip"].ratio / hand if "torchpipe skip" in compared else None
        rows.append([text, ",".join(map(str, balance)), hand, *ratios, skip_vs_hand,
                     pipeline_ideal(partitions, chunks)])
        results["configs"].append({"partitions": partitions, "chunks": chunks, "balance": balance,
                                   "ideal": pipeline_ideal(partitions, chunks),
                                   **{name: c.as_dict() for name, c in compared.items()}})
    print(format_table(["partitions x chunks", "balance", "micro-batched / plain", "tuple / plain",
                        "stash/pop / plain", "torchgpipe stash/pop / plain", "stash/pop / micro-batched",
                        "ideal"], rows))
    print("(step time / the plain module's step time, median of interleaved pairs; < 1 is faster. micro-batched: "
          "the same micro-batches through the plain module by hand, one after another; ideal: (m + p - 1) / (m p) "
          "of that, for p partitions on p cores)", flush=True)
    if args.json:
        save_json(args.json, results)
        print(f"json: {args.json}")
    return results


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): each variant's step time over the plain U-Net's."""
    rows = []
    for config in results["configs"]:
        ratio = {name: config[name]["ratio"] if name in config else None
                 for name in ("by hand", "torchpipe tuple", "torchpipe skip", "torchgpipe skip")}
        skip, hand = ratio["torchpipe skip"], ratio["by hand"]
        rows.append([f"{config['partitions']}x{config['chunks']}", ratio["by hand"], ratio["torchpipe tuple"], skip,
                     ratio["torchgpipe skip"], skip / hand if skip is not None and hand else None, config["ideal"]])
    return Summary(["partitions x chunks", "by hand / plain", "tuple / plain", "stash/pop / plain",
                    "torchgpipe stash/pop / plain", "stash/pop / by hand", "ideal"], rows,
                   [f"Preset {results['preset']}, checkpoint {results['checkpoint']!r}; step time over the plain "
                    "U-Net's (< 1 is faster)."])


if __name__ == "__main__":
    main()
