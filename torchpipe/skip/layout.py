"""Which layer stashes and pops what: ``verify_skippables`` and the partition layout of skips."""
from typing import Dict, List, NamedTuple, Sequence, Tuple

from torch import nn

from torchpipe.skip.namespace import Namespace
from torchpipe.skip.skippable import Skippable

__all__ = ["verify_skippables", "SkipLayout", "inspect_skip_layout"]


def _skippables(module: nn.Sequential) -> List[Tuple[int, str, Skippable]]:
    """Every skippable layer with the index of the top-level layer it belongs to, in forward order."""
    found = []
    for index, (name, child) in enumerate(module.named_children()):
        for sub_name, layer in child.named_modules(prefix=name):
            if isinstance(layer, Skippable):
                found.append((index, sub_name, layer))
    return found


def verify_skippables(module: nn.Sequential) -> None:
    """Checks the skip connections of ``module``; raises ``TypeError`` naming every problem.

    A problem is a name stashed but never popped, popped but never stashed (or
    popped before it is stashed), or stashed or popped twice in one namespace.
    """
    stashed: Dict[Tuple[Namespace, str], List[str]] = {}
    popped: Dict[Tuple[Namespace, str], List[str]] = {}
    problems: List[str] = []
    for _, where, layer in _skippables(module):
        label = f"layer {where} ({type(layer).__name__})"
        for key in layer.popped():
            if key not in stashed:
                problems.append(
                    f"{key[1]!r} ({key[0]}) is popped but never stashed: {label} pops it and "
                    "no earlier layer stashes it"
                )
            popped.setdefault(key, []).append(label)
        for key in layer.stashed():
            stashed.setdefault(key, []).append(label)
    for key, labels in stashed.items():
        if len(labels) > 1:
            problems.append(
                f"{key[1]!r} ({key[0]}) is stashed twice, by {' and '.join(labels)}; "
                "give each use its own namespace with .isolate(Namespace())"
            )
        if key not in popped:
            problems.append(
                f"{key[1]!r} ({key[0]}) is stashed but never popped: {labels[0]} stashes it and no later layer pops it"
            )
    for key, labels in popped.items():
        if len(labels) > 1:
            problems.append(
                f"{key[1]!r} ({key[0]}) is popped twice, by {' and '.join(labels)}; "
                "give each use its own namespace with .isolate(Namespace())"
            )
    if problems:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise TypeError(f"{count} with skip connections:\n  - " + "\n  - ".join(problems))


class SkipRoute(NamedTuple):
    """The partitions at the two ends of a skip connection."""

    stash: int
    pop: int


class SkipLayout:
    """Where each skip connection of a partitioned module starts and ends.

    ``routes`` are in the order of the layers that stash them (then by name), an order every process that
    builds the same model agrees on (namespaces are random values); messages between ranks follow it.
    """

    def __init__(self, routes: Dict[Tuple[Namespace, str], SkipRoute], partitions: int) -> None:
        self.routes = routes
        #: For each partition, the skips it pops that were stashed by an earlier partition.
        self.pops_from_before: List[List[Tuple[Namespace, str]]] = [[] for _ in range(partitions)]
        #: For each partition, the skips it stashes that a later partition pops.
        self.stashes_for_later: List[List[Tuple[Namespace, str]]] = [[] for _ in range(partitions)]
        for key, route in routes.items():
            if route.stash != route.pop:
                self.pops_from_before[route.pop].append(key)
                self.stashes_for_later[route.stash].append(key)

    def __bool__(self) -> bool:
        return bool(self.routes)

    def route(self, ns: Namespace, name: str) -> SkipRoute:
        return self.routes[(ns, name)]


def inspect_skip_layout(partitions: Sequence[nn.Sequential]) -> SkipLayout:
    """Finds, for every skip connection, the partitions that stash and pop it."""
    stash_at: Dict[Tuple[Namespace, str], int] = {}
    pop_at: Dict[Tuple[Namespace, str], int] = {}
    for j, partition in enumerate(partitions):
        for _, _, layer in _skippables(partition):
            for key in sorted(layer.stashed(), key=lambda k: k[1]):
                stash_at[key] = j
            for key in layer.popped():
                pop_at[key] = j
    # In the stashing layers' order (dicts keep insertion order).
    routes = {key: SkipRoute(stash_at[key], pop_at[key]) for key in stash_at if key in pop_at}
    return SkipLayout(routes, len(partitions))
