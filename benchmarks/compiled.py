"""Compiled layers against eager: the training step of ``make run-lm``'s model with ``compile_layers``, on CPU.

The model and the pipeline are examples/train_lm.py's (imported from it, with
its defaults: a GPT-2 of 4 blocks, width 128, a byte vocabulary, embedding and
head tied, traced by ``as_sequential``; 16 windows of 128 bytes, 4
micro-batches, 2 stages on 2 CPU workers, schedule 1f1b). One copy of the
Sequential stays eager; the other has each layer compiled in place by
:func:`torchpipe.compiling.compile_layers`, with inductor where a C++ compiler
works here, else ``aot_eager`` (the output says which backend ran, and why).
Each figure is the median over interleaved pairs (eager step, compiled step)
after steps that compile every graph the step needs:

* ``Pipeline``: ``pipe.step(ids, ids)`` (forward, the next-byte loss,
  backward; gradients dropped), the example's pipeline;
* ``Sequential``: the same Sequential as one module, the whole mini-batch,
  forward, loss, backward (one intra-op thread).

Each runs for two cuts of the same model: the example's (``as_sequential``'s
default: a layer per call of a submodule with parameters, so each linear
layer and layer norm is a layer of its own) and a layer per transformer block
(the example's code with ``split_points`` at the blocks, as one compiles each
block), whose larger graphs leave the compiler more to fuse. A ratio below 1
means compiled is faster. The first steps' time (compiling every layer) is
printed beside.

    python benchmarks/compiled.py [--rounds 7] [--backend auto|inductor|aot_eager|eager] [--quick] [--json out.json]
"""
import argparse
import contextlib
import copy
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import torchpipe  # noqa: E402
from benchmarks.harness.machine import intra_op_threads, machine_description  # noqa: E402
from benchmarks.harness.output import Summary, save_json  # noqa: E402
from benchmarks.harness.steps import Step, drop_grads, pipeline_step  # noqa: E402
from benchmarks.harness.timing import Variant, compare  # noqa: E402
from torchpipe.compiling import compile_layers  # noqa: E402

#: examples/train_lm.py's flags for --quick: a model that compiles in seconds.
QUICK = ["--layers", "1", "--width", "32", "--heads", "2", "--length", "16", "--batch", "8", "--chunks", "2"]


def train_lm() -> Any:
    """examples/train_lm.py as a module (examples/ is not a package)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_lm as example
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return example


def choose_backend(wanted: str) -> Tuple[str, str]:
    """The backend to compile with and why: inductor if it compiles and runs a small function here."""
    if wanted != "auto":
        return wanted, "as asked"
    try:
        probe = torch.compile(lambda x: torch.relu(x) * 2.0 + 1.0, backend="inductor")
        expected = torch.relu(torch.arange(4.0)) * 2.0 + 1.0
        if not torch.equal(probe(torch.arange(4.0)), expected):
            return "aot_eager", "inductor computed a wrong probe"
    except Exception as error:  # no C++ compiler (InvalidCxxCompiler, CppCompileError), or anything else
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return "aot_eager", f"inductor does not work here ({type(error).__name__}: {first[:160]})"
    finally:
        torch._dynamo.reset()
    return "inductor", "a C++ compiler works here"


@contextlib.contextmanager
def cut_at_blocks(layers: int) -> Iterator[None]:
    """``torchpipe.as_sequential`` called with ``split_points`` at the GPT-2's blocks (and its final norm and head)
    meanwhile: the example's own model code, cut at its blocks."""
    original = torchpipe.as_sequential
    splits = [f"transformer.h.{k}" for k in range(layers)] + ["transformer.ln_f", "lm_head"]

    def at_blocks(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Sequential:
        return original(module, *args, split_points=splits, **kwargs)

    torchpipe.as_sequential = at_blocks
    try:
        yield
    finally:
        torchpipe.as_sequential = original


def sequential_step(seq: nn.Sequential, ids: Tensor, loss_fn: Any) -> Step:
    def step() -> None:
        with intra_op_threads(1):
            loss_fn(seq(ids), ids).backward()
        drop_grads(seq)

    return step


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed pairs (eager step, compiled step)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed pairs after the compiling steps")
    parser.add_argument("--backend", default="auto", help="auto: inductor where a C++ compiler works, else aot_eager")
    parser.add_argument("--quick", action="store_true", help="a tiny model (its figures mean little)")
    parser.add_argument("--json", default=None, help="write the results here")
    args, example_flags = parser.parse_known_args(argv)
    example = train_lm()
    lm = example.parse_args((QUICK if args.quick else []) + example_flags + ["--timeline", ""])
    backend, why = choose_backend(args.backend)
    print(f"machine: {machine_description()}")
    print(f"backend: {backend} ({why})")
    print(f"model: examples/train_lm.py's GPT-2, {lm.layers} blocks, width {lm.width}; batch {lm.batch} x "
          f"{lm.length} bytes; Pipeline of {lm.stages} stages on CPU workers, schedule {lm.schedule!r}, "
          f"chunks {lm.chunks}")
    run = example.Run(lm)
    train_text, _ = example.corpus()
    ids = example.windows(train_text, lm.batch, lm.length, torch.Generator().manual_seed(lm.seed))

    cuts: Dict[str, nn.Sequential] = {"as train_lm.py": example.language_model(lm)[0]}
    with cut_at_blocks(lm.layers):
        cuts["per block"] = example.language_model(lm)[0]
    rows: Dict[str, Any] = {}
    header = (f"{'cut':15s} {'layers':>6s} {'configuration':12s} {'compiled / eager':>17s} {'eager ms':>9s} "
              f"{'compiled ms':>12s} {'compiling s':>12s}")
    print(header)
    print("-" * len(header))
    for cut, eager in cuts.items():
        compiled = copy.deepcopy(eager)
        compile_layers(compiled, {"backend": backend})
        balance = example.find_balance(lm, eager, run.stages, ids)
        pipes = {name: run.build(seq, balance, {}) for name, seq in (("eager", eager), ("compiled", compiled))}
        configurations = [
            ("Pipeline", pipeline_step(pipes["eager"], ids, ids), pipeline_step(pipes["compiled"], ids, ids)),
            ("Sequential", sequential_step(eager, ids, example.next_token_loss),
             sequential_step(compiled, ids, example.next_token_loss)),
        ]
        for name, eager_step, compiled_step in configurations:
            start = time.perf_counter()
            for _ in range(2):  # compiles every graph the step needs (the second: variants dynamo meets then)
                compiled_step()
            compiling = time.perf_counter() - start
            [result] = compare(Variant("eager", eager_step), [Variant("compiled", compiled_step)],
                               rounds=args.rounds, warmup=args.warmup, quiet=True)
            rows[f"{cut}, {name}"] = {
                "cut": cut, "layers": len(eager), "balance": balance, "configuration": name, "ratio": result.ratio,
                "eager_s": result.plain_seconds, "compiled_s": result.seconds, "compiling_s": compiling,
            }
            print(f"{cut:15s} {len(eager):6d} {name:12s} {result.ratio:17.3f} {result.plain_seconds * 1e3:9.1f} "
                  f"{result.seconds * 1e3:12.1f} {compiling:12.1f}", flush=True)
    print(f"(ratios: median over {args.rounds} interleaved pairs of the compiled step time / the eager one; below 1 "
          "is faster; compiling: the first two compiled steps, with inductor's caches as they were)")
    results = {"backend": backend, "why": why, "ratios": rows, "args": vars(args),
               "model": {k: getattr(lm, k) for k in ("layers", "width", "heads", "length", "batch", "chunks",
                                                      "stages", "schedule")}}
    if args.json:
        save_json(args.json, results)
    return results


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): compiled step time over eager, per cut and configuration."""
    model = results["model"]
    rows = [[row["cut"], row["layers"], row["configuration"], row["ratio"], row["eager_s"] * 1e3,
             row["compiled_s"] * 1e3, row["compiling_s"]] for row in results["ratios"].values()]
    return Summary(["cut", "layers", "configuration", "compiled / eager", "eager ms", "compiled ms", "compiling s"],
                   rows,
                   [f"backend {results['backend']} ({results['why']}); examples/train_lm.py's GPT-2 of "
                    f"{model['layers']} blocks, width {model['width']}, batch {model['batch']} x {model['length']}; "
                    f"Pipeline of {model['stages']} stages, {model['schedule']}, chunks {model['chunks']}; "
                    f"{results['args']['rounds']} interleaved pairs."])


if __name__ == "__main__":
    main()
