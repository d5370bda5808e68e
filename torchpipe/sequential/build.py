"""Building the layers: each traced_cuts layer's operations copied into an fx graph of its own, made a TracedLayer.

[Note: two modes] An exported graph holds for the mode it was traced in
([Note: export]), so a module traced by export is traced_cuts once per mode and
each layer gets the code of both: it runs the one of its own ``training``
flag. The two cuts must cut the same layers (the same names) and pass the
same number of skips between the same layers; the skips of the other mode are
renamed after the first's, so the skip layout GPipe and Pipeline compute once
holds in both modes. When the cuts differ, or export could not trace the other
mode, the layers refuse to run in it, with a message that says how to go on.
"""
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import fx, nn

from torchpipe.sequential.cuts import LayerCut
from torchpipe.sequential.effects import draws_random
from torchpipe.sequential.layer import LayerCode, TracedLayer
from torchpipe.sequential.trace import Traced
from torchpipe.skip.namespace import Namespace

__all__ = ["build_layers", "Cuts"]


@dataclasses.dataclass
class Cuts:
    """A traced graph and its layers' cuts."""

    traced: Traced
    cuts: List[LayerCut]


def _outputs(layer: LayerCut) -> List[fx.Node]:
    """What the layer's code returns, flat: what it passes on (or the module's output), then what it stashes."""
    if layer.output is None:
        passed = list(layer.carried)
    elif isinstance(layer.output, tuple):
        passed = list(layer.output)
    else:
        passed = [layer.output]
    return passed + [value for _, value in layer.stashes]


def _holds_device(value: Any, devices: Set[torch.device]) -> bool:
    if isinstance(value, torch.device):
        return value in devices
    if isinstance(value, (tuple, list)):
        return any(_holds_device(v, devices) for v in value)
    if isinstance(value, dict):
        return any(_holds_device(v, devices) for v in value.values())
    return False


def _replace_devices(value: Any, devices: Set[torch.device], device: fx.Node) -> Any:
    if isinstance(value, torch.device):
        return device if value in devices else value
    if isinstance(value, (tuple, list)):
        return type(value)(_replace_devices(v, devices, device) for v in value)
    if isinstance(value, dict):
        return {k: _replace_devices(v, devices, device) for k, v in value.items()}
    return value


def _graph(layer: LayerCut, traced: Traced) -> Tuple[fx.Graph, Set[str]]:
    """The layer's own graph: its inputs (received, then popped), its operations, its outputs; and the targets used."""
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    targets: Set[str] = set()
    for value in layer.received + [value for _, value in layer.pops]:
        env[value] = graph.placeholder(value.name)
    for value in layer.clones:  # see [Note: writes]
        env[value] = graph.call_method("clone", (env[value],))
    devices = set(traced.devices)
    device: Optional[fx.Node] = None
    if devices and any(_holds_device((n.args, n.kwargs), devices) for n in layer.nodes):
        # See [Note: export]: the devices of the trace are the layer's, which its first input is on.
        first = next(n for n in graph.nodes if n.op == "placeholder")
        device = graph.call_function(getattr, (first, "device"))

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            # Parameters, buffers and constants are read where they are used, in every layer that uses them.
            assert node.op == "get_attr", f"{node.name} ({node.op}) is used by layer {layer.name} but not available"
            env[node] = graph.get_attr(str(node.target))
            targets.add(str(node.target))
        return env[node]

    for node in layer.nodes:
        copy = graph.node_copy(node, lookup)
        copy.meta = {}  # export's fake tensors and symbols stay out of the layer (and its pickles)
        if device is not None and _holds_device((copy.args, copy.kwargs), devices):
            copy.args = _replace_devices(copy.args, devices, device)
            copy.kwargs = _replace_devices(copy.kwargs, devices, device)
        env[node] = copy
        if node.op == "call_module":
            targets.add(str(node.target))
    graph.output(tuple(lookup(value) for value in _outputs(layer)))
    graph.lint()
    return graph, targets


def _skip_names(cuts: List[LayerCut]) -> Dict[Tuple[int, int], List[str]]:
    """The skips between each pair of layers (stashing, popping), in the order the stashing layer makes them."""
    popped_by = {name: k for k, layer in enumerate(cuts) for name, _ in layer.pops}
    pairs: Dict[Tuple[int, int], List[str]] = {}
    for k, layer in enumerate(cuts):
        for name, _ in layer.stashes:
            pairs.setdefault((k, popped_by[name]), []).append(name)
    return pairs


def _align(first: List[LayerCut], second: List[LayerCut]) -> Tuple[Optional[Dict[str, str]], str]:
    """Skip names of ``second`` renamed after ``first``'s, or None and why the two cuts cannot share layers."""
    names, other_names = [p.name for p in first], [p.name for p in second]
    if names != other_names:
        return None, f"the two modes' graphs cut into different layers ({names} and {other_names})"
    pairs, other_pairs = _skip_names(first), _skip_names(second)
    if {k: len(v) for k, v in pairs.items()} != {k: len(v) for k, v in other_pairs.items()}:
        return None, "the two modes' graphs pass different values between layers"
    renamed = {o: n for pair, other in other_pairs.items() for o, n in zip(other, pairs[pair])}
    return renamed, ""


def _code(cut: LayerCut, traced: Traced, renamed: Optional[Dict[str, str]], last: bool) -> Tuple[LayerCode, Set[str]]:
    graph, targets = _graph(cut, traced)
    rename = renamed or {}
    code = LayerCode(
        graph=graph,
        received=[node.name for node in graph.nodes if node.op == "placeholder"][: len(cut.received)],
        pops=[rename.get(name, name) for name, _ in cut.pops],
        stashes=[rename.get(name, name) for name, _ in cut.stashes],
        carried=len(_outputs(cut)) - len(cut.stashes),
        returns_tuple=last and isinstance(cut.output, tuple),
    )
    return code, targets


def _attributes(
    targets: Set[str], traced: Traced, module: nn.Module
) -> Tuple[Dict[str, Any], List[Tuple[str, nn.Module, str]], Set[str]]:
    """The objects the layer holds, the module's buffers among them (borrowed) and which of those persist."""
    attributes: Dict[str, Any] = {target: traced.attrs[target] for target in targets}
    borrowed: List[Tuple[str, nn.Module, str]] = []
    persistent: Set[str] = set()
    for target in targets:
        if target in traced.constants or isinstance(attributes[target], (nn.Module, nn.Parameter)):
            continue
        parent, _, attr = target.rpartition(".")
        owner = module.get_submodule(parent)
        if attr in owner._buffers:
            borrowed.append((target, owner, attr))
            if attr not in owner._non_persistent_buffers_set:
                persistent.add(target)
    return attributes, borrowed, persistent


def build_layers(
    traced_cuts: Sequence[Cuts], module: nn.Module, missing: Optional[str] = None
) -> List[TracedLayer]:
    """One :class:`TracedLayer` per traced_cuts layer, with skip names in one fresh namespace.

    ``traced_cuts`` holds one traced graph (fx) or one per mode (export, the
    module's own mode first; see [Note: two modes]); ``missing`` says why an
    exported module has no graph for its other mode.
    """
    first = traced_cuts[0]
    cuts = first.cuts
    others: List[Cuts] = []
    renamed: Optional[Dict[str, str]] = None
    if len(traced_cuts) > 1:
        renamed, why = _align(cuts, traced_cuts[1].cuts)
        if renamed is None:
            missing = why
        else:
            others = [traced_cuts[1]]
    namespace = Namespace()
    stashed_by = {name: k for k, layer in enumerate(cuts) for name, _ in layer.stashes}
    popped_by = {name: k for k, layer in enumerate(cuts) for name, _ in layer.pops}
    layers: List[TracedLayer] = []
    for k, cut in enumerate(cuts):
        last = k == len(cuts) - 1
        code, targets = _code(cut, first.traced, None, last)
        codes: Dict[Optional[bool], LayerCode] = {first.traced.training: code}
        draws = {first.traced.training: any(draws_random(node) for node in cut.nodes)}
        attributes, borrowed, persistent = _attributes(targets, first.traced, module)
        for other in others:
            other_cut = other.cuts[k]
            other_code, other_targets = _code(other_cut, other.traced, renamed, last)
            codes[other.traced.training] = other_code
            draws[other.traced.training] = any(draws_random(node) for node in other_cut.nodes)
            more = _attributes(other_targets - targets, other.traced, module)
            attributes.update(more[0])
            borrowed += more[1]
            persistent |= more[2]
        guards = {
            p.traced.training: p.traced.guard
            for p in [first, *others]
            if k == 0 and p.traced.training is not None and p.traced.guard is not None
        }
        layers.append(TracedLayer(
            cut.name,
            codes,
            attributes,
            borrowed,
            persistent=persistent,
            pops=[(name, stashed_by[name]) for name, _ in cut.pops],
            stashes=[(name, popped_by[name]) for name, _ in cut.stashes],
            draws_random=draws,
            namespace=namespace,
            guards=guards,
            missing=missing if first.traced.training is not None else None,
        ))
    return layers
