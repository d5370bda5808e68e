"""Tracing a module with ``torch.export`` for :func:`~torchpipe.as_sequential`, where ``torch.fx`` cannot.

[Note: export] ``torch.fx`` cannot trace code that branches on shapes, which
every Hugging Face ``transformers`` model does to build its attention masks
and position ids. ``torch.export`` can: it runs the code with fake tensors whose
sizes are symbols, follows Python's branches, and records where a branch
needed a size fixed (a guard), so the graph it returns is proven right for
every size in a domain (a range per dimension). Its graph is made of ATen
operators (``aten.linear``, ``aten.scaled_dot_product_attention``), not module
calls, so it differs from fx's in ways :func:`export_trace` deals with before
sequential/cuts.py cuts it:

* **Parameters and buffers** are graph inputs; they become ``get_attr`` nodes
  of the user's module, each named after the submodule that uses it: a tied
  weight is ``transformer.wte.weight`` in the embedding's layer and
  ``lm_head.weight`` in the head's, the same ``Parameter``. Constants made while
  tracing become top-level ``_tensor_constant<i>`` tensors.
* **Where layers start**: no module calls remain, so layers start at the
  first operator recorded in each call of a submodule fx would keep whole
  (:func:`~torchpipe.sequential.trace.layer_modules`), read from the
  ``nn_module_stack`` that export records per node.
* **Sizes** are symbolic ints read once from the inputs (``sym_size(input_ids,
  1)``). A size used in a later layer would drag the input there as a skip, so
  each use reads its size from the nearest tensor it derives from that has it
  (:func:`_localize_sizes`).
* **Devices** are constants of the trace (``arange(n, device='cpu')``); each
  layer uses its first input's device instead (see ``build.py``), so the
  layers run on whatever devices GPipe places them.
* **Random operators** (``aten.dropout``) are replaced by the ``torch``
  functions they come from (``torch.dropout``), which torchpipe's random
  streams ([Note: random streams]) intercept, so a recomputation draws what
  its forward drew. ``aten._assert_tensor_metadata`` (a check that a tensor
  is on the traced device) is dropped.
* **Modes**: export bakes ``self.training`` into the graph (dropout on or off,
  and whatever Python does with it), so the module is traced twice, once per
  mode; each layer runs the graph of its mode (see ``layer.py``).
* **Shapes**: the batch dimension (0) of every input is a named dimension, so
  export proves the graph for every batch size (micro-batches of 1 too) or
  fails, and the other dimensions are ``Dim.AUTO``, which export makes dynamic
  where the model allows (a sequence length, from 2) and fixes elsewhere. If
  the model needs the batch size fixed, export runs again with ``Dim.AUTO``
  everywhere. The domain becomes an :class:`~torchpipe.sequential.guard.InputGuard`
  on the first layer.
"""
import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from torchpipe.sequential.example import ExampleCall, OutputError, entry
from torchpipe.sequential.guard import Dimension, InputGuard
from torchpipe.sequential.sizes import SymbolicSizes, symbol_of
from torchpipe.sequential.trace import SCOPE, Scope, Traced, fetch, layer_modules, relative_name

__all__ = ["export_trace", "Exported", "ExportFailed"]

_OpOverload = torch._ops.OpOverload

#: Random ATen operators whose ``torch`` function differs in name from the operator's.
_RANDOM_FUNCTIONS: Dict[str, Callable[..., Any]] = {"scaled_dot_product_attention": F.scaled_dot_product_attention}

#: Operators dropped from the graph (see [Note: export]).
_DROPPED = {"_assert_tensor_metadata"}


class ExportFailed(Exception):
    """``torch.export`` could not trace the module; ``error`` is what it raised."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


@dataclasses.dataclass
class Exported:
    """The module traced in each mode it could be traced in."""

    #: ``module.training`` -> the graph traced in that mode; the module's own mode first.
    modes: Dict[bool, Traced]
    #: Why the other mode has no graph (None when both have one).
    missing: Optional[str]


# --- the export run --------------------------------------------------------------------------------


@contextlib.contextmanager
def _kept(module: nn.Module) -> Iterator[None]:
    """Puts back every buffer's value, every submodule's mode and the random generators' states."""
    modes = [(m, m.training) for m in module.modules()]
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for buffer, copy in saved:
                buffer.copy_(copy)
        for m, mode in modes:
            m.training = mode


def _dynamic_shapes(tensors: Sequence[Tensor], names: Sequence[str], named: bool) -> Dict[str, Any]:
    """Which dimensions export should make dynamic (see [Note: export]).

    ``named``: dimension 0 of every input that shares the first input's size
    there is ``Dim('batch')``, and the other dimensions of integer and boolean
    inputs (token ids, masks, labels) are named dimensions too, one per size in
    the example (so ``input_ids`` and ``attention_mask`` share their sequence
    length); the rest are ``Dim.AUTO``. Otherwise every dimension is AUTO.
    """
    from torch.export import Dim

    first = tensors[0].size(0) if tensors[0].dim() else None
    by_size: Dict[int, Any] = {}
    shapes: Dict[str, Any] = {}
    for name, tensor in zip(names, tensors):
        spec: Dict[int, Any] = {d: Dim.AUTO for d in range(tensor.dim())}
        if named:
            if tensor.dim() and tensor.size(0) == first:
                spec[0] = by_size.setdefault(-1, Dim("batch"))
            if not tensor.is_floating_point() and not tensor.is_complex():
                for d in range(1, tensor.dim()):
                    size = tensor.size(d)
                    spec[d] = by_size.setdefault(size, Dim(f"size{size}"))
        shapes[name] = spec
    return shapes


def _refined(error: Exception, shapes: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``shapes`` with the fixes export suggests for a constraint violation (a narrower range), or None."""
    message = str(error)
    if "Suggested fixes:" not in message:
        return None
    head, _, fixes = message.partition("Suggested fixes:")
    try:
        from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

        refined = refine_dynamic_shapes_from_suggested_fixes(head + "Suggested fixes:" + fixes.split("\n\n")[0], shapes)
    except Exception:  # noqa: BLE001 - a message it cannot read: go on without its fixes
        return None
    return refined if isinstance(refined, dict) else None


def _export(wrapper: nn.Module, call: ExampleCall, shapes: Optional[Dict[str, Any]] = None) -> Tuple[Any, Any]:
    """``torch.export.export`` of the entry: the program and the dynamic shapes it was exported with.

    Without ``shapes``, tries named dimensions, then those with the fixes
    export suggests, then ``Dim.AUTO`` everywhere (see :func:`_dynamic_shapes`);
    only a constraint violation moves on to the next.
    """
    tensors = call.tensors

    def run(candidate: Dict[str, Any]) -> Any:
        return torch.export.export(wrapper, tuple(tensors), dynamic_shapes=candidate, strict=False)

    candidate = shapes if shapes is not None else _dynamic_shapes(tensors, call.names, True)
    tried: List[Dict[str, Any]] = []
    while True:
        tried.append(candidate)
        try:
            return run(candidate), candidate
        except OutputError:
            raise
        except Exception as error:  # noqa: BLE001 - export raises many types; a constraint violation is one
            if shapes is not None or "Constraints violated" not in str(error):
                raise ExportFailed(error) from error
            following = _refined(error, candidate) if len(tried) == 1 else None
            if following is None or following in tried:
                following = _dynamic_shapes(tensors, call.names, False)
            if following in tried:
                raise ExportFailed(error) from error
            candidate = following


def export_trace(
    module: nn.Module, call: ExampleCall, leaf_modules: Sequence[Union[str, Type[nn.Module]]] = ()
) -> Exported:
    """Traces ``module`` called as ``call`` says with ``torch.export``, once per mode; see [Note: export].

    Raises:
        ExportFailed: ``torch.export`` cannot trace the module in its own mode.
        OutputError: the (selected) output is not a tensor or a tuple of tensors.
    """
    wrapper = entry(module, call, check_output=True)
    anchors = layer_modules(module, leaf_modules)
    devices = frozenset(t.device for t in itertools.chain(call.tensors, module.parameters(), module.buffers()))
    own = module.training
    modes: Dict[bool, Traced] = {}
    missing: Optional[str] = None
    shapes: Optional[Dict[str, Any]] = None
    for mode in (own, not own):
        with _kept(module):
            module.train(mode)
            try:
                program, shapes = _export(wrapper, call, shapes)
            except ExportFailed as failure:
                if mode == own:
                    raise
                missing = f"torch.export cannot trace it in {'training' if mode else 'eval'} mode: {failure}"
                continue
        modes[mode] = _convert(program, module, call, anchors, devices, mode)
    return Exported(modes, missing)


# --- from the exported program to a Traced graph ---------------------------------------------------


def _scope(node: fx.Node) -> Tuple[Scope, ...]:
    """The submodule calls a node was recorded in, outermost first, from export's ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack") or {}
    calls: List[Scope] = []
    for key, value in stack.items():
        path = value[0] if isinstance(value, tuple) else ""
        if not isinstance(path, str) or not (path == "module" or path.startswith("module.")):
            continue  # the entry itself, and export's own markers
        count = int(key.rpartition("@")[2]) if "@" in key and key.rpartition("@")[2].isdigit() else 0
        calls.append((relative_name(path), count))
    return tuple(calls)


def _kind(node: fx.Node) -> type:
    value = node.meta.get("val")
    if isinstance(value, Tensor):
        return Tensor
    if isinstance(value, torch.SymInt):
        return int
    if isinstance(value, torch.SymFloat):
        return float
    if isinstance(value, torch.SymBool):
        return bool
    return type(value)


def _random_function(op: _OpOverload) -> Optional[Callable[..., Any]]:
    """The ``torch`` function (or ``Tensor`` method) a random ATen operator comes from, if any."""
    name = op.overloadpacket.__name__
    if name in _RANDOM_FUNCTIONS:
        return _RANDOM_FUNCTIONS[name]
    function = getattr(torch, name, None) or getattr(Tensor, name, None)
    return function if callable(function) else None


def _aliases(module: nn.Module) -> Dict[int, List[str]]:
    """For every parameter and buffer, by id: every qualified name it has in ``module``."""
    names: Dict[int, List[str]] = {}
    for name, tensor in itertools.chain(
        module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
    ):
        names.setdefault(id(tensor), []).append(name)
    return names


def _alias_for(names: List[str], scope: Tuple[Scope, ...], fallback: str) -> str:
    """The name of a tensor in the innermost submodule call that holds it (``lm_head.weight`` in ``lm_head``)."""
    for call, _ in reversed(scope):
        for name in names:
            if name.rpartition(".")[0] == call:
                return name
    return fallback if fallback in names or not names else names[0]


class _Converter:
    """Copies an exported program's graph into one sequential/cuts.py cuts (see [Note: export])."""

    def __init__(self, program: Any, module: nn.Module, call: ExampleCall) -> None:
        self.program = program
        self.module = module
        self.call = call
        signature = program.graph_signature
        if getattr(signature, "buffers_to_mutate", None) or getattr(signature, "user_inputs_to_mutate", None):
            raise ExportFailed(RuntimeError(
                "the exported graph returns new values for buffers or inputs (a functional graph); as_sequential "
                "takes the graph that writes them in place"
            ))
        self.state = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
        self.constants = dict(signature.inputs_to_lifted_tensor_constants)
        self.user_inputs = list(signature.user_inputs)
        self.aliases = _aliases(module)
        self.graph = fx.Graph()
        self.env: Dict[fx.Node, fx.Node] = {}
        self.attrs: Dict[str, Any] = {}
        self.constant_names: Set[str] = set()
        self.kinds: Dict[fx.Node, type] = {}
        #: The placeholders of parameters and buffers, with their export targets.
        self.state_of: Dict[fx.Node, str] = {}
        #: The get_attr node of each parameter or buffer name used.
        self.reads: Dict[str, fx.Node] = {}
        self.unknown_random: Set[str] = set()

    def run(self) -> fx.Graph:
        for node in self.program.graph.nodes:
            if node.op == "placeholder":
                self.placeholder(node)
            elif node.op == "output":
                values = [self.env[v] for v in node.args[0]]
                spec = self.program.call_spec.out_spec
                self.graph.output(tuple(values) if spec is not None and spec.type is tuple else values[0])
            elif node.op == "get_attr":  # a subgraph of a higher-order operator
                target = str(node.target)
                self.attrs[target] = fetch(self.program.graph_module, target)
                self.constant_names.add(target)
                self.env[node] = self.graph.get_attr(target)
                self.kinds[self.env[node]] = type(self.attrs[target])
            else:
                self.operator(node)
        if self.unknown_random:
            raise ExportFailed(RuntimeError(
                f"the graph draws random numbers with {', '.join(sorted(self.unknown_random))}, which torchpipe's "
                "random streams cannot give a generator of their own (see docs/random.md)"
            ))
        return self.graph

    def placeholder(self, node: fx.Node) -> None:
        if node.name in self.state:
            self.state_of[node] = self.state[node.name]
            return
        if node.name in self.constants:
            target = f"_tensor_constant{len(self.constant_names)}"
            self.constant_names.add(target)
            self.attrs[target] = self.program.constants[self.constants[node.name]]
            self.env[node] = self.graph.get_attr(target)
            self.kinds[self.env[node]] = Tensor
            return
        if node.name not in self.user_inputs:
            raise ExportFailed(RuntimeError(
                f"the exported graph takes {node.name!r}, which as_sequential cannot give it (an opaque object "
                "or an effect token)"
            ))
        copy = self.graph.placeholder(self.call.names[self.user_inputs.index(node.name)])
        copy.meta = {"val": node.meta.get("val")}
        self.env[node] = copy
        self.kinds[copy] = Tensor

    def operator(self, node: fx.Node) -> None:
        target: Any = node.target
        if isinstance(target, _OpOverload):
            if target.overloadpacket.__name__ in _DROPPED:
                return
            if torch.Tag.nondeterministic_seeded in target.tags:
                function = _random_function(target)
                if function is None:
                    self.unknown_random.add(str(target))
                else:
                    target = function
        scope = _scope(node)
        args = fx.map_arg(node.args, lambda value: self.read(value, scope))
        kwargs = fx.map_arg(node.kwargs, lambda value: self.read(value, scope))
        copy = self.graph.create_node(node.op, target, args, kwargs, node.name)
        copy.meta = {"val": node.meta.get("val"), SCOPE: scope}
        self.env[node] = copy
        self.kinds[copy] = _kind(node)

    def read(self, value: fx.Node, scope: Tuple[Scope, ...]) -> fx.Node:
        """The copy of ``value``; for a parameter or buffer, a get_attr named after the submodule using it."""
        if value not in self.state_of:
            return self.env[value]
        target = relative_name(self.state_of[value])
        name = _alias_for(self.aliases.get(id(fetch(self.module, target)), []), scope, target)
        if name not in self.reads:
            self.reads[name] = self.graph.get_attr(name)
            self.attrs[name] = fetch(self.module, name)
            self.kinds[self.reads[name]] = Tensor
        return self.reads[name]


def _convert(
    program: Any,
    module: nn.Module,
    call: ExampleCall,
    anchors: List[str],
    devices: FrozenSet[torch.device],
    mode: bool,
) -> Traced:
    converter = _Converter(program, module, call)
    graph = converter.run()
    SymbolicSizes(graph, converter.kinds).localize()
    graph.lint()
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    return Traced(
        graph, converter.attrs, inputs, converter.kinds, converter.constant_names,
        tracer="export",
        anchors=anchors,
        devices=devices,
        guard=_guard(program, call, module),
        training=mode,
    )


# --- the domain of the inputs ----------------------------------------------------------------------


def _bound(value: Any) -> Optional[int]:
    text = str(value)
    if "oo" in text:
        return None
    return int(value)


def _guard(program: Any, call: ExampleCall, module: nn.Module) -> InputGuard:
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    shapes: List[List[Dimension]] = []
    dtypes: List[torch.dtype] = []
    for name in program.graph_signature.user_inputs:
        value = placeholders[name].meta["val"]
        dims: List[Dimension] = []
        for size in value.shape:
            expression = symbol_of(size)
            if expression is None or expression.is_number:
                dims.append(int(size))
            elif expression.is_Symbol:
                dims.append(str(expression))
            else:
                dims.append((str(expression),))
        shapes.append(dims)
        dtypes.append(value.dtype)
    ranges = {}
    for symbol, bounds in program.range_constraints.items():
        low = _bound(bounds.lower)
        ranges[str(symbol)] = (max(low if low is not None else 0, 0), _bound(bounds.upper))
    return InputGuard(call.names, dtypes, shapes, ranges, f"{type(module).__name__}")
