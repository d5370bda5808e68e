"""A stage's backward split in two (zero-bubble schedules): input gradients now, weight gradients later.

[Note: zero-bubble] The ``I`` action computes the gradients of the stage's
inputs (and of the skips it popped), which the previous stage is waiting for,
and keeps the graph; the ``W`` action, placed where the worker would idle,
computes the parameters' gradients and frees the graph. Done naively, ``W``
would run the whole backward again. Instead, ``I`` finds where each
parameter's gradient leaves the path to the inputs:

::

    inputs ──► ... ──► [node C] ──► ... ──► outputs        C: an "intermediate": on the path to the
                          ▲                                   inputs, and the first such node that
    weight ──► (param-only nodes) ┘                          uses the weight

and records the gradient flowing into each intermediate as ``I`` passes
through it (a node pre-hook). ``W`` then starts the engine at the
intermediates (``torch.autograd.graph.GradientEdge``) with those gradients,
asking only for the parameters, so it runs just the weight-gradient parts
(for ``nn.Linear``: ``grad_output.T @ input``). Parameters that share an
intermediate are done in one call; when one intermediate of a call lies
downstream of another, a pre-hook pins it to its recorded gradient so that the
flow from the other is not counted twice. A parameter whose path reaches an
output without meeting the inputs' path starts from that output, with its
gradient.

``W`` runs its groups newest capture first: ``I`` reached the first layers'
intermediates last, so their gradients (and the inputs they multiply) are the
ones still in the CPU's caches; the order of the runs changes no sum, since
each group accumulates into its own parameters. Each run enters the engine
below ``torch.autograd.backward``, whose Python checks of the seeds are moot
here (the engine made them).
"""
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

__all__ = ["WeightGradient", "backward_input", "backward_weight", "supported"]

_graph = torch.autograd.graph
#: The engine's entry below ``torch.autograd.backward`` (PyTorch 2.3 and later), or None.
_engine_run_backward: Optional[Any] = getattr(_graph, "_engine_run_backward", None)


def supported() -> bool:
    """Whether this PyTorch can start a backward at a graph node (``GradientEdge``), which ``W`` needs."""
    return hasattr(_graph, "GradientEdge") and hasattr(_graph, "get_gradient_edge")


class _Group:
    """Parameters whose gradients come from the same intermediates, with what ``I`` recorded there."""

    __slots__ = ("params", "intermediates", "captured", "roots")

    def __init__(self) -> None:
        self.params: List[Tensor] = []
        self.intermediates: List[Any] = []
        self.captured: Dict[Any, Tuple[Optional[Tensor], ...]] = {}
        #: Outputs outside the inputs' path that lead to these parameters, with their gradients.
        self.roots: List[Tuple[Tensor, Tensor]] = []


class WeightGradient:
    """What a ``W`` action needs from its ``I`` action: parameter groups, or a whole backward to run."""

    __slots__ = ("groups", "whole")

    def __init__(self, groups: List[_Group], whole: Optional[Tuple[List[Tensor], List[Tensor]]]) -> None:
        self.groups = groups
        #: When no input needed a gradient, ``I`` did nothing and ``W`` runs the whole backward.
        self.whole = whole

    def seeds(self) -> List[Tensor]:
        """The gradients ``W`` starts from, which live from ``I`` to ``W`` (see [Note: held bytes])."""
        found: List[Tensor] = []
        for group in self.groups:
            found += [g for captured in group.captured.values() for g in captured if g is not None]
            found += [grad for _, grad in group.roots]
        if self.whole is not None:
            found += self.whole[1]
        return found


def _node(tensor: Tensor) -> Any:
    return _graph.get_gradient_edge(tensor).node


def backward_input(
    roots: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor]
) -> Tuple[List[Optional[Tensor]], Optional[WeightGradient]]:
    """The gradients of ``inputs`` (None where unused), and what :func:`backward_weight` needs.

    ``roots`` are the stage's outputs (or loss) that require grad and
    ``grads`` their gradients. The weights are every other leaf of the graph
    that requires grad: the stage's parameters, and any tensor a layer uses
    that requires grad. Without any, the graph is freed here and the second
    result is None.
    """
    roots, grads = list(roots), list(grads)
    if not roots:
        return [None] * len(inputs), None
    wanted = [k for k, x in enumerate(inputs) if x.requires_grad]
    if not wanted:  # nothing to hand back: W runs the whole backward
        return [None] * len(inputs), WeightGradient([], (roots, grads))
    groups = _param_groups(roots, grads, [inputs[k] for k in wanted])
    if not groups:
        found = torch.autograd.grad(roots, [inputs[k] for k in wanted], grads, allow_unused=True)
        return _place(found, wanted, len(inputs)), None
    handles = []
    fired: List[_Group] = []  # the group of each capture, in the order I made them
    try:
        for group in groups:
            for node in group.intermediates:
                handles.append(node.register_prehook(_capture(group, node, fired)))
        found = torch.autograd.grad(roots, [inputs[k] for k in wanted], grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return _place(found, wanted, len(inputs)), WeightGradient(_newest_first(groups, fired), None)


def backward_weight(state: WeightGradient) -> None:
    """Accumulates the parameters' gradients into ``.grad`` and frees the graph."""
    if state.whole is not None:
        roots, grads = state.whole
        state.whole = None
        torch.autograd.backward(roots, grads)
        return
    groups, state.groups = state.groups, []
    for group in groups:
        edges: List[Any] = []
        seeds: List[Tensor] = []
        for node in group.intermediates:
            captured = group.captured.get(node)
            if captured is None:  # no gradient reached it in the input half: it adds nothing
                continue
            for index, grad in enumerate(captured):
                if grad is not None:
                    edges.append(_graph.GradientEdge(node, index))
                    seeds.append(grad)
        for root, grad in group.roots:
            edges.append(_graph.get_gradient_edge(root))
            seeds.append(grad)
        if not edges:
            continue
        pins = []
        if len(group.intermediates) > 1:
            for node in group.intermediates:
                captured = group.captured.get(node)
                if captured is not None:
                    pins.append(node.register_prehook(_pin(captured)))
        try:
            _run_engine(edges, seeds, group.params)
        finally:
            for pin in pins:
                pin.remove()


def _run_engine(edges: List[Any], seeds: List[Tensor], params: List[Tensor]) -> None:
    """Runs the engine from ``edges``, seeded with ``seeds``, accumulating into ``params``' ``.grad``.

    ``W`` makes one such run per parameter group. The seeds are the gradients the engine itself delivered in ``I`` (or
    the ones ``I``'s own call checked), so where this PyTorch exposes the engine's entry, the checks
    ``torch.autograd.backward`` would make again in Python are skipped: work on every call that finds nothing new.
    """
    if _engine_run_backward is None:
        torch.autograd.backward(edges, seeds, inputs=params)
    else:
        _engine_run_backward(
            tuple(edges), tuple(seeds), False, False, tuple(params), allow_unreachable=True, accumulate_grad=True
        )


def _place(found: Sequence[Optional[Tensor]], wanted: List[int], count: int) -> List[Optional[Tensor]]:
    result: List[Optional[Tensor]] = [None] * count
    for k, grad in zip(wanted, found):
        result[k] = grad
    return result


def _capture(group: _Group, node: Any, fired: List[_Group]) -> Any:
    def hook(grad_outputs: Tuple[Optional[Tensor], ...]) -> None:
        group.captured[node] = tuple(grad_outputs)
        fired.append(group)

    return hook


def _newest_first(groups: List[_Group], fired: List[_Group]) -> List[_Group]:
    """``groups`` by their last capture, newest first; those ``I`` captured nothing for (an output's own) last."""
    order = list(dict.fromkeys(reversed(fired)))  # a group's first place from the end: its newest capture
    return order + [group for group in groups if group not in order]


def _pin(captured: Tuple[Optional[Tensor], ...]) -> Any:
    def hook(grad_outputs: Tuple[Optional[Tensor], ...]) -> Tuple[Optional[Tensor], ...]:
        return captured

    return hook


def _param_groups(roots: List[Tensor], grads: List[Tensor], inputs: List[Tensor]) -> List[_Group]:
    """Groups the graph's weights by the intermediates where their gradients leave the inputs' path."""
    root_nodes = [_node(r) for r in roots]
    # consumers[n]: the nodes whose backward sends a gradient into n (the graph, walked from the outputs).
    consumers: Dict[Any, List[Any]] = {}
    frontier = [n for n in root_nodes if n is not None]
    for n in frontier:
        consumers.setdefault(n, [])
    while frontier:
        node = frontier.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in consumers:
                consumers[child] = []
                frontier.append(child)
            consumers[child].append(node)
    # The inputs' path: every node whose backward leads to an input.
    on_path: Set[Any] = set()
    input_nodes = [_node(x) for x in inputs]
    frontier = [n for n in input_nodes if n in consumers]
    on_path.update(frontier)
    while frontier:
        node = frontier.pop()
        for user in consumers[node]:
            if user not in on_path:
                on_path.add(user)
                frontier.append(user)
    # The outputs by node (several outputs of one node, e.g. of a split, are each their own root).
    root_grad: Dict[int, List[Tuple[Tensor, Tensor]]] = {}
    for n, r, g in zip(root_nodes, roots, grads):
        root_grad.setdefault(id(n), []).append((r, g))
    # Union-find of parameters over shared intermediates and shared outputs.
    owner: Dict[Any, int] = {}
    parent: List[int] = []
    found: List[Tuple[Tensor, Set[Any], List[Tuple[Tensor, Tensor]]]] = []

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    # The weights: the graph's other leaves that require grad (their gradient accumulators hold them).
    leaves = [n for n in consumers if hasattr(n, "variable") and n not in input_nodes]
    for start in leaves:
        param: Tensor = start.variable
        intermediates: Set[Any] = set()
        outputs: List[Tuple[Tensor, Tensor]] = []
        seen = {start}
        walk = [start]
        while walk:
            node = walk.pop()
            if id(node) in root_grad and node not in on_path:
                outputs.extend(root_grad[id(node)])
            for user in consumers[node]:
                if user in seen:
                    continue
                seen.add(user)
                if user in on_path:
                    intermediates.add(user)
                else:
                    walk.append(user)
        k = len(found)
        found.append((param, intermediates, outputs))
        parent.append(k)
        for key in list(intermediates) + [id(r) for r, _ in outputs]:
            if key in owner:
                parent[find(k)] = find(owner[key])
            else:
                owner[key] = k
    groups: Dict[int, _Group] = {}
    for k, (param, intermediates, outputs) in enumerate(found):
        group = groups.setdefault(find(k), _Group())
        group.params.append(param)
        for node in intermediates:
            if node not in group.intermediates:
                group.intermediates.append(node)
        for root, grad in outputs:
            if all(root is not r for r, _ in group.roots):
                group.roots.append((root, grad))
    return list(groups.values())
