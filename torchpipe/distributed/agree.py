"""Ranks that agree on the pipeline they build: a fingerprint of its arguments and model, compared at construction.

[Note: ranks agree] Every rank of a multi-process Pipeline builds it from its
own arguments, and a rank only runs its own stages: ranks that were given
different balances would each run the layers they think are theirs, a layer
held by no rank would be skipped, and the loss would be that of another model,
silently. So as the pipeline is made, every rank (of every replica, on a mesh)
publishes a fingerprint of what it was given (the balance, chunks, schedule,
checkpoint mode, loss reduction and the other arguments every rank must share,
and a digest of each layer: its type and its parameters' names, shapes and
dtypes) and compares it with every other rank's, in one exchange through the
store. A difference is a ``ValueError`` on every rank, with the same message:
the first argument that differs and which ranks have which value. Where only a
layer differs, a second exchange tells each rank's description of the first
such layer, so the message names the parameter. A layer's digest needs only
its parameters' metadata, so a model built on the meta device costs nothing.
"""
import hashlib
import json
from typing import Any, Dict, List, Sequence

from torch import nn

from torchpipe.distributed.channel import Channel

__all__ = ["fingerprint", "verify_agreement"]


def _layer_text(layer: nn.Module) -> str:
    """A layer as the fingerprint describes it: its type, then each parameter's name, shape and dtype."""
    params = ", ".join(
        f"{name} {tuple(param.shape)} {str(param.dtype).replace('torch.', '')}"
        for name, param in layer.named_parameters()
    )
    return f"{type(layer).__qualname__}({params})"


def fingerprint(module: nn.Sequential, arguments: Dict[str, Any]) -> Dict[str, Any]:
    """What every rank must agree on: ``arguments`` (name to a value whose ``repr`` is the same on every rank that
    was given the same), the number of layers and a digest of each."""
    layers = [_layer_text(layer) for layer in module]
    return {
        "layers": f"{len(layers)} layers",
        **{name: repr(value) for name, value in arguments.items()},
        "digests": [hashlib.sha1(text.encode()).hexdigest()[:16] for text in layers],
    }


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _disagreement(noun: str, values: Sequence[str], ranks: Sequence[int]) -> str:
    """Which ranks have which value, in the order of the first rank that has it:
    ``'rank 0 has balance [2, 3], rank 1 has [3, 2]'``."""
    groups: Dict[str, List[int]] = {}
    for value, rank in zip(values, ranks):
        groups.setdefault(value, []).append(rank)
    return ", ".join(
        f"{_ranks(members)} {'has' if len(members) == 1 else 'have'} {noun + ' ' if k == 0 else ''}{value}"
        for k, (value, members) in enumerate(groups.items())
    )


def verify_agreement(channel: Channel, module: nn.Sequential, arguments: Dict[str, Any]) -> None:
    """Raises ``ValueError`` on every rank if the ranks of ``channel`` (every replica's) built their pipeline from
    different arguments or models (see [Note: ranks agree]). A collective: every rank calls it once, as the
    pipeline is made.

    Raises:
        ValueError: the first difference, naming the ranks (global ranks) and their values.
    """
    mine = fingerprint(module, arguments)
    every = [json.loads(text) for text in channel.exchange_text(json.dumps(mine), key="agree")]
    ranks = list(channel.mesh_ranks)
    for name in mine:
        if name == "digests":
            continue
        values = [str(prints.get(name)) for prints in every]
        if any(v != values[0] for v in values):
            noun = "a model of" if name == "layers" else name
            what = "build the same model" if name == "layers" else f"pass the same {name}"
            raise ValueError(f"{_disagreement(noun, values, ranks)}: every rank must {what}")
    digests = [prints["digests"] for prints in every]
    differing = next((k for k in range(len(digests[0])) if any(d[k] != digests[0][k] for d in digests)), None)
    if differing is None:
        return
    # Everyone knows which layer differs: a second exchange tells its descriptions.
    texts = channel.exchange_text(_layer_text(module[differing]), key="agree-layer")
    name = list(module._modules)[differing]
    raise ValueError(
        f"{_disagreement(f'layer {name!r} as', texts, ranks)}: every rank must build the same model"
    )
