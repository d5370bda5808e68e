"""A zero-bubble stage's backward split in two (``I`` then ``W``) against its one backward, on one stage.

The zero-bubble schedules (``zero_bubble``, ``interleaved_zero_bubble``,
``zbv``, ``dualpipev``) split a stage's backward: ``I`` computes the input
gradients the previous stage waits for, ``W`` the weight gradients later
(see ``torchpipe/runtime/weight_grad.py``). The kernels are the same as the
one backward's; what the split adds is its own: finding the parameter groups,
capturing the gradients at the intermediates, one engine run per group in
``W``, and a graph kept whole from ``I`` to ``W`` where the one backward frees
each node's saved tensors as it goes. ``schedules.py`` cannot resolve a few
per cent of that in a whole step (its ratios move more than that from run to
run on a small CPU), so this experiment times one stage, round by round:

- ``forward``: the stage's forward alone (subtracted below: the figures are of
  the backward alone);
- ``one backward``: ``torch.autograd.backward`` (the plain module's; 1.0);
- ``one backward, graph kept``: the same with ``retain_graph=True``, which holds
  every saved tensor to the end as the split must (the machine's share of
  the split's cost: what holding the graph costs its allocator and caches);
- ``split``: torchpipe's ``I`` then ``W``;
- ``split, public calls``: the same with ``W``'s engine runs through
  ``torch.autograd.backward`` (what a PyTorch before 2.3 gets);
- ``split, before``: the same, its groups also run oldest capture first (the
  order torchpipe's split first ran them in);
- ``pipelining``: ``torch.distributed.pipelining``'s ``stage_backward_input``
  then ``stage_backward_weight`` (the anchor), where importable.

The stage is one of ``zbv``'s in ``schedules.py``: 8 of the MLP's 32
Linear+ReLU blocks (512 wide), a micro-batch of 128 (1024 in 8), one intra-op
thread. Each ratio is the median over rounds of
``(variant - forward) / (one backward - forward)``, all from the same round.

    python benchmarks/experiments/split_backward.py [--rounds 200] [--layers 8] [--batch 128] [--width 512]
                                                    [--device cpu] [--json out.json]

On a GPU (``--device cuda``; ``gpu_check.py`` runs it in its schedules section) every timed step ends with a
synchronisation.
"""
import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks import models  # noqa: E402
from benchmarks.harness.machine import machine_description  # noqa: E402
from benchmarks.harness.output import format_table, save_json  # noqa: E402
from benchmarks.harness.timing import Variant, round_robin  # noqa: E402
from torchpipe.runtime import weight_grad  # noqa: E402

#: A backward of the stage: (its output, the output's gradient, its input, its parameters).
Backward = Callable[[Tensor, Tensor, Tensor, Sequence[nn.Parameter]], None]

FORWARD = "forward"
ONE = "one backward"
SPLIT = "split"
ANCHOR = "pipelining"
BEFORE = "split, before (oldest first, public)"


def one_backward(out: Tensor, grad: Tensor, x: Tensor, params: Sequence[nn.Parameter]) -> None:
    torch.autograd.backward([out], [grad])


def one_backward_kept(out: Tensor, grad: Tensor, x: Tensor, params: Sequence[nn.Parameter]) -> None:
    torch.autograd.backward([out], [grad], retain_graph=True)


def split(out: Tensor, grad: Tensor, x: Tensor, params: Sequence[nn.Parameter], oldest_first: bool = False) -> None:
    _, state = weight_grad.backward_input([out], [grad], [x])
    assert state is not None
    if oldest_first:  # W's groups in the order I captured them, as torchpipe first ran them
        state.groups.reverse()
    weight_grad.backward_weight(state)


def split_public(out: Tensor, grad: Tensor, x: Tensor, params: Sequence[nn.Parameter],
                 oldest_first: bool = False) -> None:
    entry, weight_grad._engine_run_backward = weight_grad._engine_run_backward, None
    try:
        split(out, grad, x, params, oldest_first)
    finally:
        weight_grad._engine_run_backward = entry


def split_before(out: Tensor, grad: Tensor, x: Tensor, params: Sequence[nn.Parameter]) -> None:
    split_public(out, grad, x, params, oldest_first=True)


def pipelining_split() -> Optional[Backward]:
    """``torch.distributed.pipelining``'s split backward, or None where this PyTorch has none."""
    try:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    except ImportError:
        return None

    def run(out: Tensor, grad: Tensor, x: Tensor, params: Sequence[nn.Parameter]) -> None:
        _, groups = stage_backward_input([out], [grad], [x], iter(params))
        found = stage_backward_weight(iter(params), groups)
        for p, g in zip(params, found):  # it hands the gradients back: accumulate them as the others do
            if g is not None and g is not p.grad:
                p.grad = g if p.grad is None else p.grad + g

    return run


def backwards() -> List[Tuple[str, Backward]]:
    found: List[Tuple[str, Backward]] = [(ONE, one_backward), ("one backward, graph kept", one_backward_kept),
                                         (SPLIT, split)]
    if weight_grad._engine_run_backward is not None:
        found.append(("split, public calls", split_public))
    found.append((BEFORE, split_before))
    anchor = pipelining_split()
    if anchor is not None:
        found.append((ANCHOR, anchor))
    return found


def stage(layers: int, batch: int, width: int = 512,
          device: Union[str, torch.device] = "cpu") -> Tuple[nn.Sequential, Tensor, Tensor]:
    """(one stage of the schedules benchmark's MLP, an input micro-batch, the output's gradient) on ``device``."""
    torch.manual_seed(0)
    return (models.mlp(layers, width).to(device), torch.randn(batch, width, device=device),
            torch.randn(batch, width, device=device))


def step(module: nn.Sequential, x: Tensor, grad: Tensor, backward: Optional[Backward]) -> Callable[[], None]:
    params = list(module.parameters())

    def run() -> None:
        leaf = x.detach().requires_grad_()
        out = module(leaf)
        if backward is not None:
            backward(out, grad, leaf, params)
        for p in params:
            p.grad = None

    return run


def check_gradients(module: nn.Sequential, x: Tensor, grad: Tensor, found: List[Tuple[str, Backward]]) -> None:
    """Raises unless every backward gives the one backward's gradients: a timing of different work means nothing."""
    params = list(module.parameters())
    want: Optional[List[Tensor]] = None
    for name, backward in found:
        leaf = x.detach().requires_grad_()
        backward(module(leaf), grad, leaf, params)
        got = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        for p in params:
            p.grad = None
        if want is None:
            want = got
        elif not all(torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(got, want)):
            raise AssertionError(f"{name!r} gives other parameter gradients than {ONE!r}")


def run(rounds: int, layers: int, batch: int, width: int = 512, device: Union[str, torch.device] = "cpu",
        quiet: bool = False) -> Dict[str, Any]:
    """Each backward's median time and its ratio to the one backward's (on a CPU: with one intra-op thread)."""
    device = torch.device(device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    module, x, grad = stage(layers, batch, width, device)
    found = backwards()
    check_gradients(module, x, grad, found)
    variants = [Variant(FORWARD, step(module, x, grad, None))]
    variants += [Variant(name, step(module, x, grad, backward)) for name, backward in found]
    times = round_robin(variants, rounds=rounds, warmup=3, device=device, desc="split backward", quiet=quiet)
    backward_ms = {name: statistics.median(t - f for t, f in zip(times[name], times[FORWARD])) * 1e3
                   for name, _ in found}
    ratios = {name: _backward_ratio(times, name, ONE) for name, _ in found}
    anchor = _backward_ratio(times, SPLIT, ANCHOR) if ANCHOR in times else None
    before = _backward_ratio(times, SPLIT, BEFORE)
    return {"layers": layers, "batch": batch, "width": width, "device": str(device), "rounds": rounds,
            "forward_ms": statistics.median(times[FORWARD]) * 1e3, "backward_ms": backward_ms, "ratios": ratios,
            "vs_anchor": anchor, "vs_before": before}


def _backward_ratio(times: Dict[str, List[float]], name: str, over: str) -> float:
    """The median over rounds of ``name``'s backward over ``over``'s (each its step less that round's forward)."""
    return statistics.median((t - f) / (o - f) for t, f, o in zip(times[name], times[FORWARD], times[over]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--device", type=str, default="cpu")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(machine_description(device))
    result = run(args.rounds, args.layers, args.batch, args.width, device)
    rows = [[name, f"{result['backward_ms'][name]:.2f}", f"{ratio:.3f}"] for name, ratio in result["ratios"].items()]
    print(format_table(["backward", "ms (median)", f"/ {ONE}"], rows))
    threads = ", one intra-op thread" if device.type == "cpu" else ""
    print(f"(one stage on {device}: {args.layers} Linear+ReLU blocks, {args.width} wide, "
          f"micro-batch {args.batch}{threads}; "
          f"forward {result['forward_ms']:.2f} ms, subtracted; ratios: median over {args.rounds} rounds of "
          f"(variant - forward) / ({ONE} - forward) in the same round)")
    print(f"torchpipe's split over the split as it was before, round by round: {result['vs_before']:.3f}")
    if result["vs_anchor"] is not None:
        print(f"torchpipe's split over pipelining's, round by round: {result['vs_anchor']:.3f} (< 1: faster)")
    if args.json:
        save_json(args.json, result)


if __name__ == "__main__":
    main()
