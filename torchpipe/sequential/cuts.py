"""How the traced graph is cut into layers, and what each layer receives, passes on, stashes and pops.

A *segment* is a run of consecutive operations of the graph; each becomes one
layer. The first cut is one segment per call of a submodule that holds
parameters (or per call of a split point), with the operations between calls
in the segment of the call before them. Then segments are merged where a
Sequential layer boundary cannot pass (see [Note: merging]), and the values
that cross boundaries are sorted into the ones passed to the next layer and
the skips ([Note: tensor liveness]).

[Note: merging] Two segments, and every one between them, become one layer
when:

* they call the same submodule (a module called twice) or use the same
  buffer: its state (running statistics, hooks, a buffer written in place)
  would be in two places once the layers are on different stages;
* a value that is not a tensor (a size, a tuple a module returned) is made in
  one and used in the other, and cannot be recomputed where it is used (it is
  recomputed when it comes from a plain function call such as ``x.size(0)``);
* a segment writes in place a tensor that it received, and a later segment
  reads that tensor too (see [Note: writes]);
* nothing passes from a segment to the next one (a layer must return a
  tensor) and no tensor of the earlier one can be relayed ([Note: tensor liveness]).

[Note: ties] Segments that use the same *parameter* are not merged: a language
model's token embedding and output projection share one ``Parameter``
(``lm_head.weight is transformer.wte.weight``), and merging everything between
its two uses would make the whole model one layer. Each layer holds that very
``Parameter`` object, under the name the submodule that uses it gives it
(``transformer.wte.weight`` in the embedding's layer, ``lm_head.weight`` in the
head's), so the Sequential's ``parameters()`` are the model's; the runtime
keeps the holders' copies in step when they are on different stages.

[Note: writes] A layer never writes in place a tensor it received: inside
GPipe a received tensor is the partition's input or a skip, which a
checkpointed partition reads again when it recomputes. A layer that would
(``nn.ReLU(inplace=True)`` on a tensor from the previous layer) copies it
first; the later segments that read the same tensor are merged in, so that
they see the written values as the module's own code does.

[Note: tensor liveness] A tensor made in layer ``p`` and used in layer ``c``: if
``c == p + 1`` it is part of what ``p`` returns; otherwise ``p`` stashes it
and ``c`` pops it, one skip name per (tensor, layer that uses it), so inside
GPipe it goes straight to ``c``'s partition. If ``p + 1`` uses it too, ``p + 1``
stashes it instead: it has the tensor already, so a tensor crosses a
partition boundary once, not once as an input and once more as a skip (a
ResNet block's input goes to its first convolution and to its residual add). A layer returns only what the
next layer uses; the module's inputs count as made in layer 0. When a layer
uses nothing of the previous one (a ResNet downsample convolution reads the
block's input, not the previous layer's output), it *relays* a tensor of the
previous layer that a later layer needs, the one needed soonest: it receives
it and hands it on as if it had made it, so every layer returns a tensor.
"""
import dataclasses
import operator
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from torch import Tensor, fx, nn

from torchpipe.sequential.effects import aliased_input, draws_random, written_input
from torchpipe.sequential.trace import SCOPE, Traced

__all__ = ["LayerCut", "cut_layers", "called_split_points"]

_CALLS = ("call_function", "call_method", "call_module")


@dataclasses.dataclass
class LayerCut:
    """One layer: the operations it runs and the values that enter and leave it."""

    #: The qualified name of the submodule call that starts it (``layer1.0.conv1``).
    name: str
    #: The operations it runs, in graph order (recomputed non-tensor values included).
    nodes: List[fx.Node]
    #: The values it gets from the previous layer (the module's inputs for the first layer), in order.
    received: List[fx.Node]
    #: The values it pops, with their skip names.
    pops: List[Tuple[str, fx.Node]]
    #: The values it passes on to the next layer, in order (empty for the last layer).
    carried: List[fx.Node]
    #: The values it stashes for later layers, with their skip names.
    stashes: List[Tuple[str, fx.Node]]
    #: Received or popped values it writes in place, so copies first (see [Note: writes]).
    clones: List[fx.Node]
    #: The last layer: the module's output (a node or a tuple of nodes); None for the others.
    output: Any


@dataclasses.dataclass
class _Segment:
    nodes: List[fx.Node]
    names: List[str]

    @property
    def name(self) -> str:
        return self.names[0] if len(self.names) == 1 else f"{self.names[0]}..{self.names[-1]}"


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _has_state(module: nn.Module) -> bool:
    """The module itself holds a parameter or buffer (a module without, called twice, may be split)."""
    return any(t is not None for t in (*module._parameters.values(), *module._buffers.values()))


def _anchors(ops: Sequence[fx.Node], traced: Traced, split_points: Optional[Sequence[str]]) -> List[
    Tuple[int, str]
]:
    """Where segments start: (position in ``ops``, name), one per call of a parameter module or split point.

    In an fx graph a call of a parameter module is a call_module node; in an
    exported graph (see [Note: export]) it is the first operator recorded in a
    call of one of ``traced.anchors``.
    """
    anchors: List[Tuple[int, str]] = []
    if split_points is None and traced.anchors is None:
        for position, node in enumerate(ops):
            if node.op == "call_module" and _holds_parameters(traced.attrs[str(node.target)]):
                anchors.append((position, str(node.target)))
        return anchors
    wanted = set(split_points if split_points is not None else traced.anchors or ())
    seen: Set[Tuple[str, int]] = set()
    for position, node in enumerate(ops):
        for call in node.meta.get(SCOPE, ()):
            if call[0] in wanted and call not in seen:
                seen.add(call)
                if not anchors or anchors[-1][0] != position:  # the outermost call names the layer
                    anchors.append((position, call[0]))
    return anchors


def called_split_points(graph: fx.Graph) -> Set[str]:
    """Every submodule whose call recorded at least one operation."""
    return {call[0] for node in graph.nodes if node.op in _CALLS for call in node.meta.get(SCOPE, ())}


def _first_segments(traced: Traced, split_points: Optional[Sequence[str]], default_name: str) -> List[_Segment]:
    ops = [node for node in traced.graph.nodes if node.op in _CALLS]
    anchors = _anchors(ops, traced, split_points)
    if not ops:
        return [_Segment([], [default_name])]
    if not anchors:
        return [_Segment(list(ops), [default_name])]
    if split_points is not None and anchors[0][0] > 0:
        # The user cuts at the first split point: what comes before it is a layer of its own, named
        # after its first submodule call.
        calls = [str(node.target) for node in ops[: anchors[0][0]] if node.op == "call_module"]
        anchors.insert(0, (0, calls[0] if calls else default_name))
    starts = [0] + [position for position, _ in anchors[1:]]
    ends = starts[1:] + [len(ops)]
    segments = [_Segment(list(ops[a:b]), [name]) for a, b, (_, name) in zip(starts, ends, anchors)]

    # A getitem that unpacks a non-tensor value (the tuple a module returned) joins the segment that made
    # the value, so that the tuple need not cross a layer boundary.
    home = {node: k for k, segment in enumerate(segments) for node in segment.nodes}
    for node in ops:
        source = node.args[0] if node.args else None
        if (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(source, fx.Node)
            and source in home
            and traced.kinds.get(source) is not Tensor
            and not any(isinstance(a, fx.Node) for a in node.args[1:])
        ):
            home[node] = home[source]
    regrouped = [_Segment([], segment.names) for segment in segments]
    for node in ops:
        regrouped[home[node]].nodes.append(node)
    return [segment for segment in regrouped if segment.nodes]


class _Analysis:
    """What crosses the boundaries between the current segments, or the first merge they need."""

    def __init__(
        self,
        traced: Traced,
        segments: List[_Segment],
        owners: Mapping[str, Tuple[nn.Module, str]],
        relays: Dict[fx.Node, Set[int]],
    ) -> None:
        self.traced = traced
        #: For a value, the segments that relay it (see [Note: tensor liveness]).
        self.relays = relays
        self.segments = segments
        self.order = {node: i for i, node in enumerate(traced.graph.nodes)}
        self.output = next(node for node in traced.graph.nodes if node.op == "output")
        self.home: Dict[fx.Node, int] = {node: k for k, s in enumerate(segments) for node in s.nodes}
        for node in traced.inputs:
            self.home[node] = 0
        self.owners = owners
        self.runs: List[List[fx.Node]] = []
        #: For each segment, the values it uses from earlier ones (relayed ones too), in graph order.
        self.needs: List[List[fx.Node]] = []
        self._needed: List[Set[fx.Node]] = []
        self.clones: List[List[fx.Node]] = []

    def next_change(self) -> Optional[Tuple[int, int]]:
        """What the segments need before they can be layers, or None when they can be.

        ``(first, last)``: segments ``first`` to ``last`` must become one (see
        [Note: merging]). ``(k, k)``: segment ``k`` now relays a tensor (see
        [Note: tensor liveness]). Either way the caller analyses again.
        """
        return self._shared_state() or self._recompute_or_merge() or self._writes() or self._empty_boundary()

    def producer(self, value: fx.Node, user: int) -> int:
        """The segment that hands ``value`` to segment ``user`` (see [Note: tensor liveness]).

        The last segment before ``user`` that has it: where it is made, the
        next segment if that one uses it too, or a relay.
        """
        home = self.home[value]
        holders = [k for k in self.relays.get(value, ()) if k < user]
        if home + 1 < user and value in self._needed[home + 1]:
            holders.append(home + 1)
        return max(holders) if holders else home

    # --- shared modules and buffers ---

    def _state_of(self, node: fx.Node) -> List[int]:
        """What a node uses that two layers cannot both hold: submodules it calls and buffers (see [Note: ties])."""
        value = self.traced.attrs.get(str(node.target))
        if node.op == "call_module":
            assert isinstance(value, nn.Module)
            stateful = [m for m in value.modules() if _has_state(m)]
            return [id(m) for m in stateful] + [id(t) for t in value.buffers()]
        if node.op == "get_attr" and str(node.target) in self.owners and not isinstance(value, nn.Parameter):
            return [id(value)]
        return []

    def _shared_state(self) -> Optional[Tuple[int, int]]:
        first: Dict[int, int] = {}
        for k, segment in enumerate(self.segments):
            for node in segment.nodes:
                for arg in [node] + [a for a in node.all_input_nodes if a.op == "get_attr"]:
                    for key in self._state_of(arg):
                        if first.setdefault(key, k) != k:
                            return first[key], k
        return None

    # --- values that are not tensors ---

    def _recomputable(self, node: fx.Node) -> bool:
        return (
            node.op in ("call_function", "call_method")
            and not draws_random(node)
            and written_input(node, self.traced.attrs) is None
        )

    def _recompute_or_merge(self) -> Optional[Tuple[int, int]]:
        """Fills ``runs`` (each segment's nodes plus recomputed non-tensor values) and ``needs``."""
        self.runs, self.needs, self._needed = [], [], []
        last = len(self.segments) - 1
        for k, segment in enumerate(self.segments):
            local: Set[fx.Node] = set(segment.nodes)
            if k == 0:
                local.update(self.traced.inputs)
            needed: Set[fx.Node] = set()
            work = list(segment.nodes) + ([self.output] if k == last else [])
            extra: List[fx.Node] = []
            while work:
                user = work.pop()
                for value in user.all_input_nodes:
                    if value in local or value.op == "get_attr":
                        continue
                    if value.op == "placeholder" or self.traced.kinds.get(value) is Tensor:
                        needed.add(value)
                    elif self._recomputable(value):
                        local.add(value)
                        extra.append(value)
                        work.append(value)
                    else:
                        return self.home[value], k
            needed.update(value for value, relays in self.relays.items() if k in relays)
            self.runs.append(sorted(segment.nodes + extra, key=self.order.__getitem__))
            self.needs.append(sorted(needed, key=self.order.__getitem__))
            self._needed.append(needed)
        return None

    # --- writes to received tensors ---

    def _writes(self) -> Optional[Tuple[int, int]]:
        self.clones = []
        for k in range(len(self.segments)):
            incoming = set(self.needs[k]) | (set(self.traced.inputs) if k == 0 else set())
            local = set(self.runs[k])
            clones: List[fx.Node] = []
            for node in self.runs[k]:
                target = written_input(node, self.traced.attrs)
                while target is not None and target not in incoming and target in local:
                    target = aliased_input(target, self.traced.attrs)
                if target is None or target not in incoming or target in clones:
                    continue
                clones.append(target)
                readers = [d for d in range(k + 1, len(self.segments)) if target in self._needed[d]]
                if readers:
                    return k, max(readers)
            self.clones.append(sorted(clones, key=self.order.__getitem__))
        return None

    # --- boundaries nothing crosses ---

    def _empty_boundary(self) -> Optional[Tuple[int, int]]:
        """Relays a tensor across a boundary that nothing crosses, or merges the two segments if none can be."""
        for k in range(1, len(self.segments)):
            if any(self.producer(value, k) == k - 1 for value in self.needs[k]):
                continue
            later = [
                (d, self.order[value], value)
                for d in range(k + 1, len(self.segments))
                for value in self.needs[d]
                if self.producer(value, d) == k - 1
            ]
            if not later:
                return k - 1, k
            _, _, value = min(later, key=lambda item: (item[0], item[1]))
            self.relays.setdefault(value, set()).add(k)
            return k, k  # nothing to merge; analyse again with the relay
        return None

    # --- the layers ---

    def layers(self) -> List[LayerCut]:
        count = len(self.segments)
        stashes: List[List[Tuple[str, fx.Node]]] = [[] for _ in range(count)]
        cuts: List[LayerCut] = []
        for k, segment in enumerate(self.segments):
            pops: List[Tuple[str, fx.Node]] = []
            for value in self.needs[k]:
                source = self.producer(value, k)
                if source < k - 1:
                    name = f"{value.name}@{k}"
                    pops.append((name, value))
                    stashes[source].append((name, value))
            received = (
                list(self.traced.inputs) if k == 0 else [v for v in self.needs[k] if self.producer(v, k) == k - 1]
            )
            cuts.append(LayerCut(
                name=segment.name, nodes=self.runs[k], received=received, pops=pops, carried=[],
                stashes=stashes[k], clones=self.clones[k], output=self.output.args[0] if k == count - 1 else None,
            ))
        for k in range(count - 1):
            cuts[k].carried = list(cuts[k + 1].received)
        return cuts


def _state_owners(traced: Traced, module: nn.Module) -> Dict[str, Tuple[nn.Module, str]]:
    """For every get_attr target that is a parameter or a registered buffer: its module and attribute name."""
    owners: Dict[str, Tuple[nn.Module, str]] = {}
    for node in traced.graph.nodes:
        if node.op != "get_attr" or str(node.target) in traced.constants:
            continue
        parent, _, attr = str(node.target).rpartition(".")
        owner = module.get_submodule(parent)
        if attr in owner._parameters or attr in owner._buffers:
            owners[str(node.target)] = (owner, attr)
    return owners


def cut_layers(traced: Traced, module: nn.Module, split_points: Optional[Sequence[str]]) -> List[LayerCut]:
    """Cuts the traced graph into layers; see the module's notes."""
    segments = _first_segments(traced, split_points, type(module).__name__)
    owners = _state_owners(traced, module)
    relays: Dict[fx.Node, Set[int]] = {}
    while True:
        analysis = _Analysis(traced, segments, owners, relays)
        change = analysis.next_change()
        if change is None:
            break
        first, last = change
        if first == last:
            continue  # a relay was added
        # Relays are indices of segments that are about to shift: start over without them.
        relays.clear()
        joined = _Segment(
            [n for s in segments[first : last + 1] for n in s.nodes],
            [n for s in segments[first : last + 1] for n in s.names],
        )
        segments = segments[:first] + [joined] + segments[last + 1 :]
    layers = analysis.layers()
    _unique_names(layers)
    return layers


def _unique_names(layers: List[LayerCut]) -> None:
    """``pool``, ``pool#2``, ... for a name that starts several layers (a module without parameters called twice)."""
    counts: Dict[str, int] = {}
    for layer in layers:
        counts[layer.name] = counts.get(layer.name, 0) + 1
        if counts[layer.name] > 1:
            layer.name = f"{layer.name}#{counts[layer.name]}"
