"""Building the layers: each planned layer's operations copied into an fx graph of its own, made a TracedLayer."""
from typing import Any, Dict, List, Set, Tuple

from torch import fx, nn

from torchpipe.sequential.effects import draws_random
from torchpipe.sequential.layer import TracedLayer
from torchpipe.sequential.plan import LayerPlan
from torchpipe.sequential.trace import Traced
from torchpipe.skip.namespace import Namespace

__all__ = ["build_layers"]


def _outputs(layer: LayerPlan) -> List[fx.Node]:
    """What the layer's code returns, flat: what it passes on (or the module's output), then what it stashes."""
    if layer.output is None:
        passed = list(layer.carried)
    elif isinstance(layer.output, tuple):
        passed = list(layer.output)
    else:
        passed = [layer.output]
    return passed + [value for _, value in layer.stashes]


def _graph(layer: LayerPlan) -> Tuple[fx.Graph, Set[str]]:
    """The layer's own graph: its inputs (received, then popped), its operations, its outputs; and the targets used."""
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    targets: Set[str] = set()
    for value in layer.received + [value for _, value in layer.pops]:
        env[value] = graph.placeholder(value.name)
    for value in layer.clones:  # see [Note: writes]
        env[value] = graph.call_method("clone", (env[value],))

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            # Parameters, buffers and constants are read where they are used, in every layer that uses them.
            assert node.op == "get_attr", f"{node.name} ({node.op}) is used by layer {layer.name} but not available"
            env[node] = graph.get_attr(str(node.target))
            targets.add(str(node.target))
        return env[node]

    for node in layer.nodes:
        env[node] = graph.node_copy(node, lookup)
        if node.op == "call_module":
            targets.add(str(node.target))
    graph.output(tuple(lookup(value) for value in _outputs(layer)))
    graph.lint()
    return graph, targets


def build_layers(plans: List[LayerPlan], traced: Traced, module: nn.Module) -> List[TracedLayer]:
    """One :class:`TracedLayer` per planned layer, with skip names in one fresh namespace."""
    namespace = Namespace()
    stashed_by = {name: k for k, layer in enumerate(plans) for name, _ in layer.stashes}
    popped_by = {name: k for k, layer in enumerate(plans) for name, _ in layer.pops}
    returns_tuple = isinstance(plans[-1].output, tuple)
    layers: List[TracedLayer] = []
    for k, layer in enumerate(plans):
        graph, targets = _graph(layer)
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
        last = k == len(plans) - 1
        layers.append(TracedLayer(
            layer.name,
            graph,
            attributes,
            borrowed,
            persistent=persistent,
            received=[node.name for node in graph.nodes if node.op == "placeholder"][: len(layer.received)],
            pops=[(name, stashed_by[name]) for name, _ in layer.pops],
            stashes=[(name, popped_by[name]) for name, _ in layer.stashes],
            carried=len(_outputs(layer)) - len(layer.stashes),
            returns_tuple=last and returns_tuple,
            draws_random=any(draws_random(node) for node in layer.nodes),
            namespace=namespace,
        ))
    return layers
