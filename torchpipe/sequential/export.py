"""Tracing a module with ``torch.export`` for :func:`~torchpipe.as_sequential`, where ``torch.fx`` cannot.

[Note: export] ``torch.fx`` cannot trace code that branches on shapes, which
every Hugging Face ``transformers`` model does to build its attention masks
and position ids. ``torch.export`` can: it runs the code with fake tensors whose
sizes are symbols, follows Python's branches, and records where a branch
needed a size fixed (a guard), so the graph it returns is proven right for
every size in a domain (a range per dimension). Its graph is made of ATen
operators (``aten.linear``, ``aten.scaled_dot_product_attention``), not module
calls, so it differs from fx's in ways :func:`export_trace` deals with before
the planner cuts it:

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
import heapq
import itertools
import operator
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from torchpipe.sequential.example import ExampleCall, OutputError, entry
from torchpipe.sequential.guard import Dimension, InputGuard
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


def _dynamic_shapes(tensors: Sequence[Tensor], names: Sequence[str], batch: bool) -> Dict[str, Any]:
    """Dimension 0 of every input that shares the first input's size there is ``Dim('batch')``; the rest AUTO."""
    from torch.export import Dim

    shared = Dim("batch") if batch else None
    first = tensors[0].size(0) if tensors[0].dim() else None
    shapes: Dict[str, Any] = {}
    for name, tensor in zip(names, tensors):
        spec: Dict[int, Any] = {d: Dim.AUTO for d in range(tensor.dim())}
        if shared is not None and tensor.dim() and tensor.size(0) == first:
            spec[0] = shared
        shapes[name] = spec
    return shapes


def _export(wrapper: nn.Module, call: ExampleCall) -> Any:
    """``torch.export.export`` of the entry, with the batch dimension named if the model allows."""
    tensors = call.tensors
    try:
        return torch.export.export(
            wrapper, tuple(tensors), dynamic_shapes=_dynamic_shapes(tensors, call.names, True), strict=False
        )
    except OutputError:
        raise
    except Exception as error:  # noqa: BLE001 - export raises many types; a fixed batch size is one of them
        if "Constraints violated" not in str(error):
            raise ExportFailed(error) from error
    try:
        return torch.export.export(
            wrapper, tuple(tensors), dynamic_shapes=_dynamic_shapes(tensors, call.names, False), strict=False
        )
    except OutputError:
        raise
    except Exception as error:  # noqa: BLE001
        raise ExportFailed(error) from error


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
    for mode in (own, not own):
        with _kept(module):
            module.train(mode)
            try:
                program = _export(wrapper, call)
            except ExportFailed as failure:
                if mode == own:
                    raise
                missing = f"torch.export cannot trace it in {'training' if mode else 'eval'} mode: {failure}"
                continue
        modes[mode] = _convert(program, module, wrapper, call, anchors, devices, mode)
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


def _convert(
    program: Any,
    module: nn.Module,
    wrapper: nn.Module,
    call: ExampleCall,
    anchors: List[str],
    devices: Any,
    mode: bool,
) -> Traced:
    signature = program.graph_signature
    if getattr(signature, "buffers_to_mutate", None) or getattr(signature, "user_inputs_to_mutate", None):
        raise ExportFailed(RuntimeError(
            "the exported graph returns new values for buffers or inputs (a functional graph); as_sequential "
            "takes the graph that writes them in place"
        ))
    state = dict(signature.inputs_to_parameters)
    state.update(signature.inputs_to_buffers)
    constants = dict(signature.inputs_to_lifted_tensor_constants)
    user_inputs = list(signature.user_inputs)
    aliases = _aliases(module)

    graph = fx.Graph()
    env: Dict[fx.Node, Any] = {}
    attrs: Dict[str, Any] = {}
    constant_names: Set[str] = set()
    kinds: Dict[fx.Node, type] = {}
    state_of: Dict[fx.Node, str] = {}  # the placeholders of parameters and buffers: their export target
    made: Dict[str, fx.Node] = {}  # the get_attr node of each parameter and buffer name used
    unknown_random: List[str] = []

    for node in program.graph.nodes:
        if node.op == "placeholder":
            if node.name in state:
                state_of[node] = state[node.name]
                continue
            if node.name in constants:
                target = f"_tensor_constant{len(constant_names)}"
                constant_names.add(target)
                attrs[target] = program.constants[constants[node.name]]
                env[node] = graph.get_attr(target)
                kinds[env[node]] = Tensor
                continue
            if node.name not in user_inputs:
                raise ExportFailed(RuntimeError(f"the exported graph takes {node.name!r}, which as_sequential cannot "
                                                "give it (an opaque object or an effect token)"))
            copy = graph.placeholder(call.names[user_inputs.index(node.name)])
            copy.meta = dict(node.meta)
            env[node] = copy
            kinds[copy] = Tensor
            continue
        if node.op == "output":
            outputs = node.args[0]
            spec = program.call_spec.out_spec
            values = [env[v] for v in outputs]
            result: Any = tuple(values) if spec is not None and spec.type is tuple else values[0]
            graph.output(result)
            continue
        if node.op == "get_attr":  # a subgraph of a higher-order operator
            target = str(node.target)
            attrs[target] = fetch(program.graph_module, target)
            constant_names.add(target)
            env[node] = graph.get_attr(target)
            kinds[env[node]] = type(attrs[target])
            continue
        target = node.target
        if isinstance(target, _OpOverload):
            name = target.overloadpacket.__name__
            if name in _DROPPED:
                continue
            if torch.Tag.nondeterministic_seeded in target.tags:
                function = _random_function(target)
                if function is None:
                    unknown_random.append(str(target))
                else:
                    target = function
        scope = _scope(node)

        def lookup(value: fx.Node) -> fx.Node:
            if value in state_of:  # see [Note: export]: named after the submodule that uses it
                target = relative_name(state_of[value])
                name = _alias_for(aliases.get(id(fetch(module, target)), []), scope, target)
                if name not in made:
                    made[name] = graph.get_attr(name)
                    attrs[name] = fetch(module, name)
                    kinds[made[name]] = Tensor
                return made[name]
            return env[value]

        copy = graph.create_node(
            node.op, target, fx.map_arg(node.args, lookup), fx.map_arg(node.kwargs, lookup), node.name
        )
        copy.meta = {"val": node.meta.get("val"), SCOPE: scope}
        env[node] = copy
        kinds[copy] = _kind(node)

    if unknown_random:
        raise ExportFailed(RuntimeError(
            f"the graph draws random numbers with {', '.join(sorted(set(unknown_random)))}, which torchpipe's "
            "random streams cannot give a generator of their own (see docs/random.md)"
        ))
    _localize_sizes(graph, kinds)
    graph.lint()
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    return Traced(
        graph, attrs, inputs, kinds, constant_names,
        tracer="export",
        anchors=anchors,
        devices=frozenset(devices),
        guard=_guard(program, call, module),
        training=mode,
    )


# --- sizes -----------------------------------------------------------------------------------------


def _symbol(value: Any) -> Any:
    """The sympy expression of a symbolic int, or None."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return None


def _nearest_with(
    consumer: fx.Node, symbol: Any, order: Dict[fx.Node, int], limit: int = 400
) -> Optional[Tuple[fx.Node, int]]:
    """The tensor nearest before ``consumer`` among its ancestors that has ``symbol`` as a size: (node, dim)."""
    heap = [(-order[n], id(n), n) for n in consumer.all_input_nodes if n in order]
    heapq.heapify(heap)
    seen: Set[fx.Node] = set()
    while heap and len(seen) < limit:
        _, _, node = heapq.heappop(heap)
        if node in seen:
            continue
        seen.add(node)
        value = node.meta.get("val")
        if isinstance(value, Tensor) and node.op != "get_attr":
            for d, size in enumerate(value.shape):
                if _symbol(size) is not None and _symbol(size) == symbol:
                    return node, d
        for parent in node.all_input_nodes:
            if parent not in seen and parent in order:
                heapq.heappush(heap, (-order[parent], id(parent), parent))
    return None


def _localize_sizes(graph: fx.Graph, kinds: Dict[fx.Node, type]) -> None:
    """Each tensor operator reads the symbolic sizes it uses from the nearest tensor that has them.

    See [Note: export]. A size expression (``s0 * s1``) is rebuilt from its
    symbols; one that is not made of ``sym_size`` reads and arithmetic is
    left as it is. Size reads no longer used are removed.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    sym_size = torch.ops.aten.sym_size.int

    def symbolic(node: fx.Node) -> bool:
        return node.op == "call_function" and kinds.get(node) is int and _symbol(node.meta.get("val")) is not None

    for consumer in list(graph.nodes):
        if consumer.op != "call_function" or symbolic(consumer):
            continue
        used = [n for n in consumer.all_input_nodes if symbolic(n)]
        if not used:
            continue
        made: Dict[fx.Node, Optional[fx.Node]] = {}

        def rebuild(node: fx.Node) -> Optional[fx.Node]:
            if node in made:
                return made[node]
            result: Optional[fx.Node] = None
            if node.target is sym_size:
                expression = _symbol(node.meta.get("val"))
                if expression is not None and expression.is_Symbol:
                    found = _nearest_with(consumer, expression, order)
                    if found is not None:
                        if found == (node.args[0], node.args[1]):
                            result = node
                        else:
                            with graph.inserting_before(consumer):
                                result = graph.call_function(sym_size, found)
            elif all(not isinstance(a, fx.Node) or symbolic(a) for a in node.args) and not node.kwargs:
                rebuilt = [rebuild(a) if isinstance(a, fx.Node) else a for a in node.args]
                if all(r is not None for r in rebuilt):
                    if all(r is a for r, a in zip(rebuilt, node.args)):
                        result = node
                    else:
                        with graph.inserting_before(consumer):
                            result = graph.call_function(node.target, tuple(rebuilt))  # type: ignore[arg-type]
            if result is not None and result is not node:
                result.meta = {"val": node.meta.get("val"), SCOPE: consumer.meta.get(SCOPE, ())}
                kinds[result] = int
                order[result] = order[consumer] - 0.5  # type: ignore[assignment]
            made[node] = result
            return result

        for node in used:
            new = rebuild(node)
            if new is not None and new is not node:
                consumer.replace_input_with(node, new)

    for node in reversed(list(graph.nodes)):
        if symbolic(node) and not node.users and (node.target is sym_size or node.target in _ARITHMETIC):
            graph.erase_node(node)


_ARITHMETIC = frozenset({
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod, operator.neg,
    operator.pow,
})


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
            expression = _symbol(size)
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
