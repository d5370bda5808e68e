"""``TracedLayer``: one layer of a Sequential made by ``as_sequential``, running code generated from the graph."""
import dataclasses
import itertools
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch
from torch import Tensor, fx, nn

from torchpipe.compiling import in_random_streams
from torchpipe.rng import may_draw
from torchpipe.sequential.codegen import compile_forward, computation_function
from torchpipe.skip.namespace import Namespace
from torchpipe.skip.skippable import Skippable, current_tracker
from torchpipe.types import TensorOrTensors

__all__ = ["TracedLayer", "LayerCode"]

#: (path of the attribute in the layer, the module that owns the original, its name there)
_Borrowed = Tuple[str, nn.Module, str]


@dataclasses.dataclass
class LayerCode:
    """A layer's computation in one mode: its graph and how it takes, passes on, stashes and pops values."""

    #: Placeholders: the received values, then the popped ones; output: a flat tuple of the values passed
    #: on (or the module's output), then the stashed ones.
    graph: fx.Graph
    #: The names of the received values.
    received: List[str]
    #: The skip names popped, in the order of the graph's placeholders after the received ones.
    pops: List[str]
    #: The skip names stashed, in the order of the graph's outputs after the ones passed on.
    stashes: List[str]
    #: How many of the outputs are passed on.
    carried: int
    #: Whether the layer returns a tuple (the last layer of a module that returns one).
    returns_tuple: bool


class _Op:
    """An ATen operator by name, for pickling (``torch._ops.OpOverload`` objects cannot be pickled)."""

    def __init__(self, op: Any) -> None:
        self.namespace, _, self.op = op._schema.name.partition("::")
        self.overload = op._overloadname

    def resolve(self) -> Any:
        return getattr(getattr(getattr(torch.ops, self.namespace), self.op), self.overload)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # fx checks that targets are callable
        return self.resolve()(*args, **kwargs)


def _copy(graph: fx.Graph, target: Callable[[Any], Any]) -> fx.Graph:
    """A fresh copy of ``graph`` (no state from code generated before) with every target passed through ``target``."""
    copied = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        args = fx.map_arg(node.args, env.__getitem__)
        kwargs = fx.map_arg(node.kwargs, env.__getitem__)
        if node.op == "output":
            copied.output(args[0])
            continue
        env[node] = copied.create_node(node.op, target(node.target), args, kwargs, node.name)
    return copied


def _portable(code: LayerCode) -> LayerCode:
    """``code`` for pickling: ATen operators by name (``OpOverload`` objects cannot be pickled)."""
    return dataclasses.replace(
        code, graph=_copy(code.graph, lambda t: _Op(t) if isinstance(t, torch._ops.OpOverload) else t)
    )


def _restored(code: LayerCode) -> LayerCode:
    return dataclasses.replace(code, graph=_copy(code.graph, lambda t: t.resolve() if isinstance(t, _Op) else t))


# [Note: compiled layers] ``torch.compile`` cannot trace a layer's generated
# forward as one graph: the skip tracker looks up the frame of the forward's
# caller (``sys._getframe``), and an exported graph's ATen operators are called
# through the C++ functions their ``OpOverload`` objects hold, which dynamo does
# not know; each is a graph break. So a compiled layer (:meth:`TracedLayer.compile`)
# keeps its forward in Python (the input checks, the guard, the pops and the
# stashes) and compiles only its computation, the graph's code as fx writes it
# for a ``GraphModule`` (:func:`~torchpipe.sequential.codegen.computation_function`):
# the received and popped tensors in, the outputs out, ATen operators called
# through their ``OpOverload``, one graph per mode. Each layer has functions of
# its own, so each has its own cache of compiled code and its own recompile
# limit. Unless ``dynamic=`` is given, dimension 0 of every input is marked
# dynamic (``torch._dynamo.maybe_mark_dynamic``; the batch dimension, which
# ``as_sequential`` traces for any size), so micro-batches of other sizes run
# the graph compiled first (a size of 1 gets one of its own: dynamo specializes
# sizes 0 and 1). Random numbers: inside a pipeline task's random streams
# ([Note: random streams]) a layer that may draw runs its computation
# uncompiled, so that it draws from the task's generators and a recomputation
# replays its draws; elsewhere compiled code draws from PyTorch's generators,
# as the uncompiled code does (other numbers than eager under ``aot_eager`` and
# ``inductor``, from the same distribution).


class TracedLayer(Skippable):
    """One layer of an ``as_sequential`` Sequential: a call of a submodule and the code around it.

    It holds the module's own submodules, parameters and buffers (the same
    objects) under their qualified names, so
    ``layer.get_submodule('layer1.0.conv1')`` is the model's
    ``layer1[0].conv1``. Its ``forward`` takes and returns a tensor or
    a tuple of tensors and runs Python code generated from the traced graph
    (see :attr:`code`); values that later layers need travel as
    :mod:`torchpipe.skip` stashes and pops, so the layer also works in a
    plain ``nn.Sequential``.

    A layer of a module traced by ``torch.export`` holds the parameters and
    buffers it reads (its code calls ATen operators, not submodules) and has
    code for each mode (see [Note: two modes]); the first layer checks that its
    inputs are in the domain the graph holds for.

    :meth:`compile` (which :func:`torchpipe.compiling.compile_layers` calls)
    compiles the layer's computation in place with ``torch.compile``, one graph
    per mode (see [Note: compiled layers]).

    Attributes:
        name: the qualified name of the submodule call that starts the layer
            (``'layer1.0.conv1'``).

    Example::

        seq = torchpipe.as_sequential(model, torch.rand(2, 3, 32, 32))
        print(seq[1])        # which values it takes, pops, returns and stashes
        print(seq[1].code)   # the code it runs
    """

    name: str

    def __init__(
        self,
        name: str,
        codes: Dict[Optional[bool], LayerCode],
        attributes: Dict[str, Any],
        borrowed: Sequence[_Borrowed],
        *,
        persistent: Set[str],
        pops: Sequence[Tuple[str, int]],
        stashes: Sequence[Tuple[str, int]],
        draws_random: Dict[Optional[bool], bool],
        namespace: Namespace,
        guards: Optional[Dict[bool, Callable[[Any], None]]] = None,
        missing: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.name = name
        #: The code per mode: one entry, None, for an fx graph; True and False for an exported one.
        self._codes = dict(codes)
        self._draws = dict(draws_random)
        #: (skip name, the layer that stashes it)
        self._pops = tuple(pops)
        #: (skip name, the layer that pops it)
        self._stashes = tuple(stashes)
        self._borrowed: List[_Borrowed] = list(borrowed)
        self._guards = dict(guards or {})
        #: Why the layer has no code for a mode (export only).
        self._missing = missing
        #: Set when the layer's tensors were converted to dtypes the graph was not traced with (export only).
        self._stale: Optional[str] = None
        # Skippable reads its skip names from these; they differ per layer, so they live on the instance.
        self.__dict__["stashable_names"] = frozenset(n for n, _ in stashes)
        self.__dict__["poppable_names"] = frozenset(n for n, _ in pops)
        if pops or stashes:
            self.isolate(namespace)
        self._install(attributes, persistent)
        self._dtypes = {} if None in self._codes else self._floating_dtypes()
        #: ``torch.compile``'s keyword arguments once :meth:`compile` was called (see [Note: compiled layers]).
        self._compile_options: Optional[Dict[str, Any]] = None
        self._make_forward()

    # --- construction ---

    def _install(self, attributes: Dict[str, Any], persistent: Set[str]) -> None:
        """Puts every module, parameter and tensor the code uses at its qualified name in this layer.

        Tensors in ``persistent`` (the module's persistent buffers) are in the
        layer's state dict; constants and plain tensor attributes are not.
        """
        for path, value in sorted(attributes.items(), key=lambda kv: (not isinstance(kv[1], nn.Module), kv[0])):
            parent_path, _, attr = path.rpartition(".")
            parent: nn.Module = self
            for atom in parent_path.split(".") if parent_path else []:
                child = parent._modules.get(atom)
                if child is None:
                    child = _Path()
                    parent.add_module(atom, child)
                parent = child
            if isinstance(value, nn.Module):
                parent.add_module(attr, value)
            elif isinstance(value, nn.Parameter):
                if parent._parameters.get(attr) is not value:
                    parent.register_parameter(attr, value)
            elif parent._buffers.get(attr) is not value:
                parent.register_buffer(attr, value, persistent=path in persistent)

    def _slot(self, target: str) -> Optional[str]:
        """Which dictionary of its parent module holds ``target`` (``'_parameters'``), for the generated code."""
        parent_path, _, attr = target.rpartition(".")
        parent: Optional[nn.Module] = self
        for atom in parent_path.split(".") if parent_path else []:
            parent = parent._modules.get(atom) if parent is not None else None
        if parent is None:
            return None
        for slot in ("_parameters", "_buffers", "_modules"):
            if attr in getattr(parent, slot):
                return slot
        return None

    def _make_forward(self) -> None:
        """Generates the layer's forward from its graphs: the plain one, or the compiled one after :meth:`compile`."""
        runs: Dict[Optional[bool], Callable[..., Any]] = {}
        sources: Dict[Optional[bool], str] = {}
        for mode, code in self._codes.items():
            sources[mode], runs[mode] = compile_forward(
                code.graph,
                self.name,
                received=len(code.received),
                pops=code.pops,
                stashes=code.stashes,
                carried=code.carried,
                returns_tuple=code.returns_tuple,
                slot=self._slot,
            )
        self.__dict__["_sources"] = sources
        if self._compile_options is not None:
            self.__dict__["forward"] = types.MethodType(self._compiled_forward(self._compile_options), self)
            return
        if None in runs and not self._guards:
            # The generated function is the forward itself: no trampoline for the many small layers of a
            # pipeline. Copies and unpickled layers make their own (see __getstate__).
            self.__dict__["forward"] = types.MethodType(runs[None], self)
            return

        def forward(layer: "TracedLayer", input: Any) -> Any:
            return runs[layer._checked_mode(input, runs)](layer, input)

        self.__dict__["forward"] = types.MethodType(forward, self)

    def _checked_mode(self, input: Any, modes: Dict[Optional[bool], Any]) -> Optional[bool]:
        """The mode whose code runs ``input`` (None: the one code of an fx graph), after the checks every forward
        makes first: code for the module's mode, the dtypes it was traced with, inputs in its domain."""
        mode = self.training if None not in modes else None
        if mode not in modes:
            raise RuntimeError(self._refusal())
        if self._stale is not None:
            raise RuntimeError(self._stale)
        guard = self._guards.get(self.training)
        if guard is not None:
            guard(input)
        return mode

    def _compiled_forward(self, options: Dict[str, Any]) -> Callable[..., Any]:
        """The forward that runs each mode's computation compiled with ``torch.compile(**options)``.

        See [Note: compiled layers].
        """
        plain: Dict[Optional[bool], Callable[..., Any]] = {}
        compiled: Dict[Optional[bool], Callable[..., Any]] = {}
        for mode, code in self._codes.items():
            _, plain[mode] = computation_function(code.graph, self.name)
            compiled[mode] = torch.compile(plain[mode], **options)
        codes = self._codes
        # torch._dynamo is imported only here: it takes seconds. (maybe_mark_dynamic is missing before 2.3.)
        mark = getattr(torch._dynamo, "maybe_mark_dynamic", None) if "dynamic" not in options else None

        def forward(layer: "TracedLayer", input: Any) -> Any:
            mode = layer._checked_mode(input, codes)
            code = codes[mode]
            values: Tuple[Optional[Tensor], ...] = layer._arguments(input)
            if code.pops or code.stashes:
                skips = current_tracker()  # the frame of this forward's caller, as in the generated forward
                values += tuple(skips.load(layer, *layer.namespaced(name)) for name in code.pops)
            if in_random_streams() and may_draw(layer):
                outputs = plain[mode](layer, *values)
            else:
                if mark is not None:
                    for value in values:
                        if isinstance(value, Tensor) and value.dim():
                            mark(value, 0)
                outputs = compiled[mode](layer, *values)
            for name, value in zip(code.stashes, outputs[code.carried :]):
                skips.save(layer, *layer.namespaced(name), value)
            passed = outputs[: code.carried]
            return tuple(passed) if code.returns_tuple or len(passed) != 1 else passed[0]

        return forward

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compiles the layer's computation in place with ``torch.compile(**kwargs)``, one graph per mode.

        The layer stays the same module (its parameters, buffers and state
        dict keys unchanged; nothing is wrapped); its forward then runs the
        compiled code of its traced graph, and keeps in Python what dynamo
        cannot trace: the input checks, the guard of an exported graph, and
        the stashes and pops of its skips (see [Note: compiled layers]).
        Unless ``dynamic=`` is given, dimension 0 of every input is marked
        dynamic, so micro-batches of other sizes do not compile again. Copies
        and unpickled layers are compiled with the same arguments. Calling it
        again compiles anew with the new arguments.

        Args:
            kwargs: ``torch.compile``'s keyword arguments (``backend=``,
                ``mode=``, ``dynamic=``, ``fullgraph=``, ``options=``).

        Raises:
            TypeError: a positional argument is given (the module to compile
                is the layer itself).
        """
        if args:
            raise TypeError(
                f"TracedLayer.compile takes torch.compile's keyword arguments only (backend=..., mode=...), "
                f"got {len(args)} positional argument{'s' if len(args) != 1 else ''}"
            )
        self._compile_options = dict(kwargs)
        self._make_forward()

    def _refusal(self) -> str:
        traced = next(iter(self._codes))
        mode, other = ("training", "eval") if traced else ("eval", "training")
        call = "model.eval()" if traced else "model.train()"
        return (
            f"layer {self.name!r} runs the graph torch.export traced in {mode} mode and has none for {other} "
            f"mode: {self._missing}. Convert the model again in {other} mode, "
            f"as_sequential({call}, ...): the two Sequentials share the model's parameters"
        )

    def _floating_dtypes(self) -> Dict[str, torch.dtype]:
        tensors = itertools.chain(self.named_parameters(), self.named_buffers())
        return {name: t.dtype for name, t in tensors if t.is_floating_point()}

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        for made in ("forward", "_sources"):  # made by exec (and torch.compile); rebuilt from the graph
            state.pop(made, None)
        state["_codes"] = {mode: _portable(code) for mode, code in self._codes.items()}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state["_codes"] = {mode: _restored(code) for mode, code in state["_codes"].items()}
        state.setdefault("_compile_options", None)
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._make_forward()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "TracedLayer":
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        # A buffer the module's own code reads directly is registered here too; moving the layer
        # replaces the tensor here, so the owner gets the moved one and its state_dict stays right.
        for path, owner, attr in self._borrowed:
            parent_path, _, name = path.rpartition(".")
            parent = self.get_submodule(parent_path) if parent_path else self
            if name in parent._buffers:
                owner._buffers[attr] = parent._buffers[name]
        if self._dtypes:
            # An exported graph has the traced dtypes in it (``.to(torch.float64)``); see [Note: export].
            changed = {n: d for n, d in self._floating_dtypes().items() if self._dtypes.get(n, d) != d}
            self._stale = None if not changed else (
                f"layer {self.name!r} runs a graph torch.export traced with "
                f"{self._dtypes[next(iter(changed))]} tensors, but {', '.join(sorted(changed))} "
                f"{'is' if len(changed) == 1 else 'are'} now {next(iter(changed.values()))}; exported graphs "
                "hold for the dtypes they were traced with: convert the model first, then call as_sequential"
            )
        return self

    # --- the code of the current mode ---

    def _code(self) -> LayerCode:
        codes = self._codes
        if None in codes:
            return codes[None]
        return codes.get(self.training) or next(iter(codes.values()))

    @property
    def code(self) -> str:
        """The generated source of the layer's computation (for an exported module: of its current mode)."""
        sources = self.__dict__["_sources"]
        if None in sources:
            return str(sources[None])
        return str(sources.get(self.training) or next(iter(sources.values())))

    @property
    def torchpipe_draws_random(self) -> bool:
        """Whether the layer's own code (not the submodules it calls) may draw random numbers, in any mode."""
        return any(self._draws.values())

    @property
    def _graph(self) -> fx.Graph:
        return self._code().graph

    @property
    def _received(self) -> Tuple[str, ...]:
        return tuple(self._code().received)

    @property
    def _carried(self) -> int:
        return self._code().carried

    @property
    def _returns_tuple(self) -> bool:
        return self._code().returns_tuple

    # --- running ---

    def _arguments(self, input: Any) -> Tuple[Tensor, ...]:
        """The values in ``input``, checked (the generated code calls this when a quick check fails)."""
        count = len(self._received)
        if isinstance(input, Tensor):
            if count == 1:
                return (input,)
        elif isinstance(input, tuple) and len(input) == count and all(isinstance(t, Tensor) for t in input):
            return input
        expected = "a tensor" if count == 1 else f"a tuple of {count} tensors ({', '.join(self._received)})"
        got = f"a tuple of {len(input)}" if isinstance(input, tuple) else type(input).__name__
        raise TypeError(f"layer {self.name!r} takes {expected}, got {got}")

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        # Every instance replaces this with its generated code (see _make_forward).
        return cast(TensorOrTensors, self.__dict__["forward"](input))

    # --- reading ---

    def __repr__(self) -> str:
        lines = [f"TracedLayer[{self.name}]("]
        takes = ", ".join(self._received)
        pops = ", ".join(f"{name.rpartition('@')[0]} (from layer {source})" for name, source in self._pops)
        lines.append(f"  takes: {takes}" + (f"; pops: {pops}" if pops else ""))
        for path, value in self._held():
            text = repr(value).replace("\n", "\n  ")
            lines.append(f"  ({path}): {text}")
        returns = self._output_names()
        stashes = ", ".join(f"{name.rpartition('@')[0]} (for layer {target})" for name, target in self._stashes)
        lines.append(f"  returns: {returns}" + (f"; stashes: {stashes}" if stashes else ""))
        lines.append(")")
        return "\n".join(lines)

    def _held(self) -> List[Tuple[str, Any]]:
        """The modules, parameters and tensors of the model this layer holds, by qualified name."""
        held: List[Tuple[str, Any]] = []

        def visit(module: nn.Module, prefix: str) -> None:
            for name, p in module._parameters.items():
                held.append((prefix + name, _Shape("Parameter", p)))
            for name, b in module._buffers.items():
                held.append((prefix + name, _Shape("Tensor", b)))
            for name, child in module._modules.items():
                if child is None:
                    continue
                if type(child) is _Path:
                    visit(child, f"{prefix}{name}.")
                else:
                    held.append((prefix + name, child))

        visit(self, "")
        return held

    def _output_names(self) -> str:
        output = next(node for node in self._graph.nodes if node.op == "output")
        values = output.args[0]
        nodes = list(values) if isinstance(values, (tuple, list)) else [values]
        names = [str(n) for n in nodes[: self._carried]]
        if self._returns_tuple:
            return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"
        return ", ".join(names)


class _Path(nn.Module):
    """Holds submodules at their qualified path in a layer (``layer1`` in ``layer1.0.conv1``); never called."""

    def __init__(self) -> None:
        super().__init__()
        # Code of its own that draws random numbers: none (see TracedLayer.torchpipe_draws_random).
        self.torchpipe_draws_random = False


class _Shape:
    """Shows a tensor in a repr by its kind and shape."""

    def __init__(self, kind: str, tensor: Optional[Tensor]) -> None:
        self.text = f"{kind}{tuple(tensor.shape)}" if tensor is not None else "None"

    def __repr__(self) -> str:
        return self.text
