"""Tracing a module with ``torch.fx`` for :func:`~torchpipe.as_sequential`, and its failures as clear errors.

[Note: tracer] ``torch.fx`` symbolic tracing first, ``torch.export`` only
where fx cannot: fx keeps a call of a leaf submodule (``nn.Conv2d``,
``nn.BatchNorm2d``, ``nn.TransformerEncoderLayer``) as one call of that very
module object, so the generated layers hold the module's own submodules,
``.train()``/``.eval()``, hooks and ``DeferredBatchNorm`` keep working on them,
and each layer reads like the model's code. ``torch.export`` lowers everything
to ATen operators with train/eval, dtypes and devices baked into the graph,
and specialises shapes where the model needs it. The price of fx is that
Python control flow on tensor values (and on shapes) cannot be traced;
:class:`UntraceableError` says where, and ``leaf_modules`` keeps such a
submodule whole. Hugging Face language models all branch on shapes (their
masks), so :func:`~torchpipe.as_sequential` then traces with export, and
``export.py`` deals with what it bakes in (see [Note: export]).
"""
import contextlib
import dataclasses
import functools
import os
import traceback
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
from torch import Tensor, fx, nn
from torch.fx.proxy import Proxy, TraceError
from torch.overrides import TorchFunctionMode

from torchpipe.sequential.effects import call_draws_random
from torchpipe.sequential.example import ROOT, ExampleCall, entry

__all__ = ["UntraceableError", "Traced", "Scope", "trace", "layer_modules", "relative_name", "fetch", "SCOPE"]

#: ``node.meta[SCOPE]``: the submodule calls a node was recorded in, outermost first.
SCOPE = "torchpipe_scope"

#: One call of a submodule: its qualified name (``''`` for the module itself) and which call it is (0, 1, ...).
Scope = Tuple[str, int]

#: The name of the wrapper's child that holds the user's module while tracing.
_ROOT = ROOT

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_NN_DIR = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep
_THIS_DIR = os.path.dirname(__file__) + os.sep


class UntraceableError(TraceError, RuntimeError):
    """``as_sequential`` cannot trace a module's ``forward``.

    The message names the submodule and the line that failed and says how to
    go on. It is a ``ValueError`` (like ``torch.fx``'s own ``TraceError``, which
    it subclasses) and a ``RuntimeError`` (like the tracing errors of
    ``torch.export``), so code that catches either catches it.
    """


@dataclasses.dataclass
class Traced:
    """What tracing found: the graph, and what its nodes compute on the example arguments."""

    #: The fx graph; call_module and get_attr targets are qualified names in the user's module.
    graph: fx.Graph
    #: Every call_module and get_attr target, mapped to the object it names.
    attrs: Dict[str, Any]
    #: The placeholders, one per tensor argument, in ``forward``'s order.
    inputs: List[fx.Node]
    #: The type of each node's value on the example arguments (``Tensor`` for every tensor).
    kinds: Dict[fx.Node, type]
    #: Targets of get_attr nodes that hold constants made while tracing (not the module's own tensors).
    constants: Set[str]
    #: Which tracer made the graph: ``'fx'`` (calls of leaf submodules are call_module nodes) or
    #: ``'export'`` (ATen operators only; see [Note: export]).
    tracer: str = "fx"
    #: export: the submodules whose calls start layers (fx: the call_module nodes of modules with parameters).
    anchors: Optional[List[str]] = None
    #: export: the devices the graph's operators were traced with; each layer uses its input's device instead.
    devices: FrozenSet[torch.device] = frozenset()
    #: export: the check of the inputs for which the graph holds (shapes, dtypes).
    guard: Optional[Any] = None
    #: export: the mode (``module.training``) the graph was traced in; the graph holds for that mode only.
    training: Optional[bool] = None


# --- tracing rules for torch.nn containers whose forward fx cannot trace ---------------------------


def _encoder_forward(
    encoder: nn.TransformerEncoder,
    src: Any,
    mask: Any = None,
    src_key_padding_mask: Any = None,
    is_causal: Optional[bool] = None,
) -> Any:
    """``nn.TransformerEncoder.forward`` as a plain loop over its layers, which fx can trace.

    The original checks mask dtypes, detects causal masks by comparing values
    and converts to nested tensors, all Python control flow on tensors. Each
    layer does the same mask conversion itself, and the causal flag is only a
    hint for the attention kernel (an explicit mask gives the same numbers), so
    the layers compute what the original computes. Only the nested-tensor fast
    path (inference with a padding mask) is not taken: padded positions of the
    output then hold computed values instead of zeros.
    """
    output = src
    causal = bool(is_causal) if is_causal is not None else False
    for layer in encoder.layers:
        output = layer(output, src_mask=mask, is_causal=causal, src_key_padding_mask=src_key_padding_mask)
    if encoder.norm is not None:
        output = encoder.norm(output)
    return output


def _decoder_forward(
    decoder: nn.TransformerDecoder, tgt: Any, memory: Any, tgt_mask: Any = None, memory_mask: Any = None,
    tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None, tgt_is_causal: Optional[bool] = None,
    memory_is_causal: bool = False,
) -> Any:
    """``nn.TransformerDecoder.forward`` as a plain loop (see :func:`_encoder_forward`)."""
    output = tgt
    masks = {"tgt_mask": tgt_mask, "memory_mask": memory_mask, "tgt_key_padding_mask": tgt_key_padding_mask,
             "memory_key_padding_mask": memory_key_padding_mask}
    causal = bool(tgt_is_causal) if tgt_is_causal is not None else False
    for layer in decoder.layers:
        output = layer(output, memory, tgt_is_causal=causal, memory_is_causal=memory_is_causal, **masks)
    if decoder.norm is not None:
        output = decoder.norm(output)
    return output


def _transformer_forward(
    transformer: nn.Transformer, src: Any, tgt: Any, src_mask: Any = None, tgt_mask: Any = None,
    memory_mask: Any = None, src_key_padding_mask: Any = None, tgt_key_padding_mask: Any = None,
    memory_key_padding_mask: Any = None, src_is_causal: Optional[bool] = None, tgt_is_causal: Optional[bool] = None,
    memory_is_causal: bool = False,
) -> Any:
    """``nn.Transformer.forward`` without its shape checks (Python control flow on shapes)."""
    memory = transformer.encoder(
        src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal
    )
    return transformer.decoder(
        tgt,
        memory,
        tgt_mask=tgt_mask,
        memory_mask=memory_mask,
        tgt_key_padding_mask=tgt_key_padding_mask,
        memory_key_padding_mask=memory_key_padding_mask,
        tgt_is_causal=tgt_is_causal,
        memory_is_causal=memory_is_causal,
    )


#: torch.nn modules traced through with an equivalent forward, when their class's forward is torch's own.
_RULES: Dict[Type[nn.Module], Callable[..., Any]] = {
    nn.TransformerEncoder: _encoder_forward,
    nn.TransformerDecoder: _decoder_forward,
    nn.Transformer: _transformer_forward,
}

#: torch.nn containers: traced through, never kept whole.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _owns_parameters_directly(module: nn.Module) -> bool:
    """The module has parameters of its own and none in its children: the smallest unit that holds parameters."""
    own = any(p is not None for p in module._parameters.values())
    return own and not any(_holds_parameters(child) for child in module.children())


def _kept_whole(module: nn.Module, name: str, leaf_names: Set[str], leaf_types: Tuple[type, ...]) -> bool:
    """Whether tracing keeps a call of ``module`` (at qualified ``name``) as one operation: the leaf rule."""
    if name in leaf_names or (leaf_types and isinstance(module, leaf_types)):
        return True
    if isinstance(module, _CONTAINERS) or _rule(module) is not None:
        return False
    if module.__module__.startswith(("torch.nn", "torch.ao.nn")):
        return True
    return _owns_parameters_directly(module)


def layer_modules(module: nn.Module, leaf_modules: Sequence[Union[str, Type[nn.Module]]] = ()) -> List[str]:
    """The submodules whose calls start layers: those kept whole (the leaf rule) that hold parameters.

    Qualified names, in ``named_modules`` order; none is inside another. The
    fx tracer keeps these whole as call_module nodes; for a graph of ATen
    operators (``torch.export``) they are where layers start.
    """
    leaf_names = {n for n in leaf_modules if isinstance(n, str)}
    leaf_types = tuple(t for t in leaf_modules if isinstance(t, type))
    found: List[str] = []

    def visit(parent: nn.Module, prefix: str) -> None:
        for child_name, child in parent.named_children():
            name = f"{prefix}{child_name}"
            if _kept_whole(child, name, leaf_names, leaf_types):
                if _holds_parameters(child):
                    found.append(name)
            else:
                visit(child, name + ".")

    visit(module, "")
    return found


# --- the tracer ------------------------------------------------------------------------------------


class _Tracer(fx.Tracer):
    """fx's tracer with torchpipe's leaf rule, a record of the submodule calls, and the failing call."""

    def __init__(self, module: nn.Module, leaf_names: Set[str], leaf_types: Tuple[type, ...]) -> None:
        super().__init__()
        self.module = module
        self.leaf_names = leaf_names
        self.leaf_types = leaf_types
        self.stack: List[Scope] = []
        self.counts: Dict[str, int] = {}
        #: The calls being traced when the first exception was raised, outermost first.
        self.failed_in: Optional[Tuple[Scope, ...]] = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if m is self.module:
            return False
        return _kept_whole(m, relative_name(module_qualified_name), self.leaf_names, self.leaf_types)

    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> Any:
        name = relative_name(self.path_of_module(m))
        count = self.counts.get(name, 0)
        self.counts[name] = count + 1
        self.stack.append((name, count))
        try:
            rule = _rule(m)
            if rule is not None and not self.is_leaf_module(m, self.path_of_module(m)):
                forward = functools.partial(rule, m)
            return super().call_module(m, forward, args, kwargs)
        except BaseException:
            if self.failed_in is None:
                self.failed_in = tuple(self.stack)
            raise
        finally:
            self.stack.pop()

    def create_node(
        self,
        kind: str,
        target: Any,
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        name: Optional[str] = None,
        type_expr: Optional[Any] = None,
    ) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta[SCOPE] = tuple(self.stack)
        return node


class _RandomCalls(TorchFunctionMode):
    """Records random calls that take no traced value (``torch.randn(3)``) instead of running them once.

    fx runs a torch function whose arguments hold no ``Proxy`` while it
    traces, and keeps the result as a constant: the layers would then add the
    same "random" tensor to every batch.
    """

    def __init__(self, tracer: fx.Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None
    ) -> Any:
        kwargs = kwargs or {}
        if not _holds_proxy((args, kwargs)) and call_draws_random("call_function", func, args, kwargs) and (
            getattr(func, "__module__", "") or ""
        ).startswith("torch"):
            return self.tracer.create_proxy("call_function", func, tuple(args), kwargs)
        return func(*args, **kwargs)


def _holds_proxy(value: Any) -> bool:
    if isinstance(value, Proxy):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_proxy(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_proxy(v) for v in value.values())
    return False


def _rule(module: nn.Module) -> Optional[Callable[..., Any]]:
    """The tracing rule for ``module``: one of :data:`_RULES` if its class runs torch's own forward."""
    for cls, rule in _RULES.items():
        if isinstance(module, cls) and type(module).forward is cls.forward:
            return rule
    return None


def relative_name(qualified_name: str) -> str:
    """A qualified name in the tracing wrapper, as a qualified name in the user's module."""
    if qualified_name == _ROOT:
        return ""
    if qualified_name.startswith(_ROOT + "."):
        return qualified_name[len(_ROOT) + 1 :]
    return qualified_name


# --- errors ----------------------------------------------------------------------------------------


def _user_frame(error: BaseException) -> Optional[traceback.FrameSummary]:
    """The innermost frame of the traceback in the user's code (torch.nn's module forwards count as user code)."""
    found: Optional[traceback.FrameSummary] = None
    for frame in traceback.extract_tb(error.__traceback__):
        filename = os.path.abspath(frame.filename) if not frame.filename.startswith("<") else frame.filename
        if filename.startswith("<torchpipe") or filename.startswith(_THIS_DIR):
            continue
        if filename.startswith(_TORCH_DIR) and not filename.startswith(_TORCH_NN_DIR):
            continue
        found = frame
    return found


def _untraceable(module: nn.Module, tracer: _Tracer, error: BaseException) -> UntraceableError:
    failed_in = tracer.failed_in or (("", 0),)
    name = failed_in[-1][0]
    submodule = module.get_submodule(name) if name else module
    what = f"submodule {name!r} ({type(submodule).__name__})" if name else f"{type(module).__name__}.forward"
    frame = _user_frame(error)
    where = f"{frame.filename}:{frame.lineno}, in {frame.name}" if frame else "an unknown line"
    code = f"\n    {frame.line.strip()}" if frame and frame.line else ""
    if name:
        how = (
            f"keep it whole as one layer with as_sequential(..., leaf_modules=[{name!r}]), or rewrite that code "
            "without Python control flow on tensor values"
        )
    else:
        how = (
            "move that code into a submodule and keep it whole with as_sequential(..., leaf_modules=[...]), "
            "or decorate the function it calls with torch.fx.wrap, or rewrite it without Python control flow "
            "on tensor values"
        )
    message = (
        f"as_sequential cannot trace {what} with torch.fx: {type(error).__name__}: {error}\n"
        f"  at {where}:{code}\n"
        f"To go on, {how}."
    )
    return UntraceableError(message)


# --- the example run -------------------------------------------------------------------------------


@contextlib.contextmanager
def _state_kept(module: nn.Module, devices: Sequence[torch.device]) -> Iterator[None]:
    """Runs the block without grad and puts back every buffer and the random generators' states."""
    saved: List[Tuple[nn.Module, str, Tensor, Tensor]] = []
    for owner in module.modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                saved.append((owner, name, buffer, buffer.detach().clone()))
    cuda = sorted({d.index if d.index is not None else 0 for d in devices if d.type == "cuda"})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            yield
    finally:
        with torch.no_grad():
            for owner, name, buffer, copy in saved:
                owner._buffers[name] = buffer
                buffer.copy_(copy)


class _Recorder(fx.Interpreter):
    """Runs the graph and records the type of every node's value."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.kinds: Dict[fx.Node, type] = {}

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        self.kinds[n] = Tensor if isinstance(value, Tensor) else type(value)
        return value


# --- the entry point -------------------------------------------------------------------------------


def trace(
    module: nn.Module,
    call: ExampleCall,
    leaf_modules: Sequence[Union[str, Type[nn.Module]]] = (),
) -> Traced:
    """Traces ``module`` called as ``call`` says, and runs the graph once on the example inputs.

    The run records what each node computes (a tensor or something else); it
    runs without grad, and every buffer and the random generators are put back
    as they were, so BatchNorm statistics and the random stream do not move.

    Raises:
        UntraceableError: the forward cannot be traced.
    """
    leaf_names = {n for n in leaf_modules if isinstance(n, str)}
    leaf_types = tuple(t for t in leaf_modules if isinstance(t, type))
    wrapper = entry(module, call)
    tracer = _Tracer(module, leaf_names, leaf_types)
    try:
        with _RandomCalls(tracer):
            graph = tracer.trace(wrapper)
    except Exception as error:
        raise _untraceable(module, tracer, error) from error

    graph, attrs, constants = _relative_graph(graph, wrapper)
    inputs = [node for node in graph.nodes if node.op == "placeholder"]

    runnable = fx.GraphModule(attrs, graph)
    recorder = _Recorder(runnable)
    tensors = call.tensors
    devices = [t.device for t in tensors] + [p.device for p in module.parameters()]
    with _state_kept(module, devices):
        recorder.run(*tensors)
    return Traced(graph, attrs, inputs, recorder.kinds, constants)


def _relative_graph(graph: fx.Graph, entry: nn.Module) -> Tuple[fx.Graph, Dict[str, Any], Set[str]]:
    """The traced graph with targets and node names relative to the user's module, not the tracing wrapper.

    Also returns every call_module and get_attr target with the object it
    names, and the targets of the constants fx made while tracing (they live on
    the wrapper).
    """
    relative = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    attrs: Dict[str, Any] = {}
    constants: Set[str] = set()
    prefix = _ROOT + "_"
    for node in graph.nodes:
        target = node.target
        if node.op in ("call_module", "get_attr"):
            assert isinstance(target, str), f"fx target {target!r} is not a qualified name"
            attrs[relative_name(target)] = fetch(entry, target)
            if relative_name(target) == target:
                constants.add(target)
            target = relative_name(target)
        name = node.name
        if node.op in ("call_module", "get_attr") and name.startswith(prefix):
            name = name[len(prefix) :]
        copy = relative.create_node(
            node.op, target, fx.map_arg(node.args, env.__getitem__), fx.map_arg(node.kwargs, env.__getitem__),
            name, node.type,
        )
        copy.meta = dict(node.meta)
        env[node] = copy
    return relative, attrs, constants


def fetch(root: nn.Module, target: str) -> Any:
    value: Any = root
    for atom in target.split("."):
        value = getattr(value, atom)
    return value
