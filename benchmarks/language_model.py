"""Cost of ``as_sequential`` on a language model: the traced GPT-2 against the plain one (the goal: <= 1.05).

Builds a tiny GPT-2 from a config (nothing downloaded; needs ``transformers``)
and prints the train step time (forward, ``mean().backward()`` of the logits,
drop the gradients) of the traced model as a ratio to the plain model's, on
CPU with 1 intra-op thread:

* the Sequential of the tied model, called as a plain module, against the model;
* ``GPipe`` on one partition: the untied model's Sequential against the untied
  model as GPipe's one layer (GPipe does not take layers that share a parameter
  yet), so both bear GPipe's own cost of a step (threads, random streams).

Each ratio is the median over rounds in which the plain step and the other
alternate. ``--dropout`` sets GPT-2's three dropout probabilities (0.1 is its
default); inside GPipe, dropout draws from torchpipe's random streams.

    python benchmarks/language_model.py [--rounds 41] [--layers 2] [--width 64] [--dropout 0.1] [--json out.json]
"""
import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import torchpipe  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.output import Summary, save_json  # noqa: E402
from benchmarks.harness.steps import train_step  # noqa: E402
from benchmarks.harness.timing import Variant, compare  # noqa: E402
from benchmarks.models import Logits  # noqa: E402

GOAL = 1.05


def gpt2(layers: int, width: int, vocab: int, tie: bool, dropout: float) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=max(1, width // 16), vocab_size=vocab, n_positions=256,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie, resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return transformers.GPT2LMHeadModel(config)


def pair(args: argparse.Namespace, tie: bool, ids: torch.Tensor) -> Tuple[nn.Module, nn.Sequential]:
    """The plain model (ids in, logits out) and its Sequential."""
    torch.manual_seed(0)
    model = gpt2(args.layers, args.width, args.vocab, tie, args.dropout)
    return Logits(model), torchpipe.as_sequential(model, input_ids=ids, use_cache=False, output="logits")


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.length))
    print(f"machine: {machine_description()}; {torch.get_num_threads()} intra-op thread")
    print(f"GPT-2: {args.layers} layers, width {args.width}, vocabulary {args.vocab}, dropout {args.dropout}; "
          f"batch {args.batch} x {args.length} tokens; train step = forward + logits.mean().backward()")

    tied_plain, tied_seq = pair(args, True, ids)
    untied_plain, untied_seq = pair(args, False, ids)

    def one_partition(module: nn.Module) -> nn.Module:
        return torchpipe.GPipe(module, [len(module)], devices=["cpu"], chunks=1, checkpoint="never")

    rows: Dict[str, Any] = {}
    configurations = [
        ("as_sequential (tied), as a module", tied_plain, tied_seq),
        ("GPipe, 1 partition (untied)", one_partition(nn.Sequential(untied_plain)), one_partition(untied_seq)),
    ]
    header = f"{'configuration':40s} {'ratio':>7s} {'goal':>6s} {'plain ms':>9s}"
    print(header)
    print("-" * len(header))
    for name, plain, other in configurations:
        [result] = compare(
            Variant("plain", train_step(plain, ids)),
            [Variant(name, train_step(other, ids))],
            rounds=args.rounds, warmup=3, quiet=True,
        )
        rows[name] = {"ratio": result.ratio, "plain_s": result.plain_seconds, "seconds": result.seconds}
        print(f"{name:40s} {result.ratio:7.3f} {GOAL:6.2f} {result.plain_seconds * 1e3:9.2f}", flush=True)
    print("(ratios: median over interleaved pairs of step time / plain step time; one partition and one "
          "micro-batch, so the plain step is also the micro-batched ideal)")
    results = {"ratios": rows, "goal": GOAL, "args": vars(args)}
    if args.json:
        save_json(args.json, results)
    return results


def summary(results: Mapping[str, Any]) -> Summary:
    """RESULTS.md's table of a run (see run_all.py): each configuration's step time over the plain model's."""
    args = results["args"]
    rows = [[name, row["ratio"], results["goal"], row["plain_s"] * 1e3] for name, row in results["ratios"].items()]
    return Summary(["configuration", "step / plain", "goal", "plain ms"], rows,
                   [f"GPT-2: layers {args['layers']}, width {args['width']}, vocabulary {args['vocab']}, dropout "
                    f"{args['dropout']}; batch {args['batch']} x {args['length']} tokens; interleaved pairs: "
                    f"{args['rounds']}."])


if __name__ == "__main__":
    main()
