"""Generating a layer's Python code from its fx graph: the layer's own ``forward``, skips included.

fx writes the computation; :class:`_LayerCodeGen` writes around it what makes
it a Sequential layer: the unpacking of its input, the pops (the function is
then a generator that :class:`~torchpipe.skip.skippable.Skippable` drives),
the stashes and what it returns. For ``layer1.0.bn3`` of a ResNet::

    def forward(self, input):
        layer1_0_conv3 = input if isinstance(input, torch.Tensor) else self._arguments(input)[0]
        layer1_0_downsample_1 = yield _torchpipe_pop('layer1_0_downsample_1@9')
        self_layer1_0__bn3 = self._modules['layer1']._modules['0']._modules['bn3']
        ...
        yield _torchpipe_stash('layer1_0_relu_2@15', layer1_0_relu_2)
        return layer1_0_relu_2

For ``torch.compile``, :func:`computation_function` writes the graph's
computation alone, as fx writes a ``GraphModule``'s code: tensors in (the
received values, then the popped ones), the flat tuple of outputs out, no skip
plumbing (see [Note: compiled layers] in ``layer.py``).
"""
import hashlib
import linecache
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import fx
from torch.fx.graph import CodeGen

from torchpipe.skip.skippable import current_tracker

__all__ = ["compile_forward", "computation_function"]

#: Names the generated code uses besides fx's (``torch`` is one of those); fx names values after
#: operations, never like these.
_GLOBALS = {"_torchpipe_tracker": current_tracker}


class _LayerCodeGen(CodeGen):
    """fx's code generator with a layer's calling convention (see the module docstring)."""

    def __init__(
        self, received: int, pops: Sequence[str], stashes: Sequence[str], carried: int, returns_tuple: bool
    ) -> None:
        super().__init__()
        self.received = received
        self.pops = list(pops)
        self.stashes = list(stashes)
        self.carried = carried
        self.returns_tuple = returns_tuple

    def gen_fn_def(self, free_vars: List[str], maybe_return_annotation: str, *args: Any, **kwargs: Any) -> str:
        names = [v for v in free_vars if v != "self"]
        received, popped = names[: self.received], names[self.received :]
        lines = ["def forward(self, input):"]
        if len(received) == 1:
            lines.append(
                f"    {received[0]} = input if isinstance(input, torch.Tensor) else self._arguments(input)[0]"
            )
        else:
            lines.append(
                f"    {', '.join(received)}, = input if type(input) is tuple and len(input) == {len(received)} "
                "else self._arguments(input)"
            )
        if self.pops or self.stashes:
            lines.append("    _torchpipe_skips = _torchpipe_tracker()")
        for name, value in zip(self.pops, popped):
            lines.append(f"    {value} = _torchpipe_skips.load(self, *self.namespaced({name!r}))")
        return "\n".join(lines)

    def generate_output(self, output_args: Any, *args: Any, **kwargs: Any) -> str:
        values = [str(v) for v in output_args]
        lines = [
            f"_torchpipe_skips.save(self, *self.namespaced({name!r}), {value})"
            for name, value in zip(self.stashes, values[self.carried :])
        ]
        passed = values[: self.carried]
        if self.returns_tuple or len(passed) != 1:
            lines.append(f"return ({', '.join(passed)}{',' if len(passed) == 1 else ''})")
        else:
            lines.append(f"return {passed[0]}")
        return "\n".join(lines)

    def additional_globals(self) -> List[Tuple[str, Any]]:
        return list(_GLOBALS.items())


def _attribute_path(base: str, target: str) -> str:
    """How fx's code generator writes a qualified attribute of ``base`` (``getattr(self.layer1, "0").conv1``)."""
    for atom in target.split("."):
        base = f"{base}.{atom}" if atom.isidentifier() else f'getattr({base}, "{atom}")'
    return base


def _fast_module_calls(
    source: str, graph: fx.Graph, header: int, slot: Optional[Callable[[str], Optional[str]]] = None
) -> str:
    """``source`` with each submodule looked up once per call through ``_modules``, and attributes likewise.

    fx writes a submodule call as ``getattr(self.layer1, "0").conv1(x)``: one
    ``nn.Module.__getattr__`` per name, about a microsecond each, which adds
    up over the many small layers of a pipelined model. Reading ``_modules``
    is twenty times faster and still finds a submodule replaced after the code
    was made (``DeferredBatchNorm.convert`` does that). The lookups go after
    the ``header`` lines that open the function. A parameter or buffer the
    code reads (``get_attr``) is read through ``_modules`` and its parent's
    ``_parameters`` or ``_buffers``, as ``slot`` says where it lives. If fx
    writes calls in another form, the source is returned as fx wrote it.
    """
    lines = source.strip("\n").split("\n")
    if not lines[0].startswith("def forward(self, input):") or len(lines) <= header:
        return source
    body = "\n".join(lines[header:])
    lookups: List[str] = []
    used: Set[str] = set()
    for target in sorted({str(node.target) for node in graph.nodes if node.op == "call_module"}):
        alias = "self_" + "_".join(target.split("."))
        while alias in used or alias in source:  # another module's alias, or a name fx chose
            alias += "_"
        used.add(alias)
        call = _attribute_path("self", target) + "("
        if not alias.isidentifier() or call not in body:
            return source
        body = body.replace(call, alias + "(")
        lookups.append(f"    {alias} = self" + "".join(f"._modules[{atom!r}]" for atom in target.split(".")))
    if slot is not None:
        for node in graph.nodes:
            if node.op != "get_attr":
                continue
            target = str(node.target)
            where = slot(target)
            read = f" = {_attribute_path('self', target)}\n"
            if where is None or read not in body + "\n":
                continue
            parent, _, attr = target.rpartition(".")
            path = "self" + "".join(f"._modules[{atom!r}]" for atom in parent.split(".") if parent)
            body = (body + "\n").replace(read, f" = {path}.{where}[{attr!r}]\n").rstrip("\n")
    return "\n".join(line.rstrip() for line in lines[:header] + lookups + body.split("\n"))


def _direct_operator_calls(source: str, graph: fx.Graph) -> Tuple[str, Dict[str, Any]]:
    """``source`` with each ATen operator called directly rather than through its ``OpOverload``.

    A graph traced by ``torch.export`` calls ATen operators, which fx writes
    as ``torch.ops.aten.view.default(x, ...)``: four attribute lookups and a
    Python ``OpOverload.__call__`` that only forwards to the C++ function it
    holds (``OpOverload._op``), about a microsecond per operator and over a
    hundred operators per transformer block. The code calls that function
    under a name of its own instead. Returns the source and the names to add
    to its globals.
    """
    operators: Dict[str, Any] = {}
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        function = getattr(target, "_op", None)
        namespace, _, name = target._schema.name.partition("::")
        written = f"torch.ops.{namespace}.{name}.{target._overloadname}("
        alias = f"_op_{namespace}_{name}_{target._overloadname}"
        if function is None or written not in source or not alias.isidentifier() or alias in operators:
            continue
        source = source.replace(written, alias + "(")
        operators[alias] = function
    return source, operators


def compile_forward(
    graph: fx.Graph,
    name: str,
    *,
    received: int,
    pops: Sequence[str],
    stashes: Sequence[str],
    carried: int,
    returns_tuple: bool,
    slot: Optional[Callable[[str], Optional[str]]] = None,
) -> Tuple[str, Callable[..., Any]]:
    """The ``forward(self, input)`` of layer ``name`` for ``graph``: its source and the function.

    ``graph``'s placeholders are the received values, then the popped ones;
    its output is a flat tuple: the values passed on (``carried`` of them, or
    the module's output), then the stashed ones.
    """
    graph.set_codegen(_LayerCodeGen(received, pops, stashes, carried, returns_tuple))
    python = graph.python_code(root_module="self")
    header = 2 + (1 if pops or stashes else 0) + len(pops)
    source = _fast_module_calls(python.src, graph, header, slot).strip("\n") + "\n"
    source, operators = _direct_operator_calls(source, graph)
    scope: Dict[str, Any] = dict(python.globals)
    scope.update(operators)
    return source, _define(source, f"layer {name}", scope, "forward")


def computation_function(graph: fx.Graph, name: str) -> Tuple[str, Callable[..., Any]]:
    """The computation of layer ``name`` alone, ``computation(self, *values)``: its source and the function.

    It takes ``graph``'s placeholders (the received values, then the popped
    ones) and returns its flat tuple of outputs; the layer stashes and pops
    around it. ATen operators are called through their ``OpOverload``
    (``torch.ops.aten.mm.default``), which ``torch.compile`` traces, and
    attributes are read as ``self.layer1.weight``, as in a ``GraphModule``.
    """
    previous = graph._codegen
    graph.set_codegen(CodeGen())
    try:
        python = graph.python_code(root_module="self")
    finally:
        graph.set_codegen(previous)
    source = python.src.strip("\n").replace("def forward(self", "def computation(self", 1)
    source = "\n".join(line.rstrip() for line in source.split("\n")) + "\n"
    return source, _define(source, f"layer {name} computation", dict(python.globals), "computation")


def _define(source: str, what: str, scope: Dict[str, Any], function: str) -> Callable[..., Any]:
    """Runs ``source`` in ``scope`` and returns its function ``function``."""
    # Registered so that a traceback through a layer shows the generated line; named after the code, so
    # that copies of a layer share one entry.
    filename = f"<torchpipe.as_sequential {what} {hashlib.sha1(source.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), scope)  # noqa: S102 - code generated from the graph
    defined: Callable[..., Any] = scope[function]
    return defined
