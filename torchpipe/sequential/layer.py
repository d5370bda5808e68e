"""``TracedLayer``: one layer of a Sequential made by ``as_sequential``, running code generated from the graph."""
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, cast

from torch import Tensor, fx, nn

from torchpipe.sequential.codegen import compile_forward
from torchpipe.skip.namespace import Namespace
from torchpipe.skip.skippable import Skippable
from torchpipe.types import TensorOrTensors

__all__ = ["TracedLayer"]

#: (path of the attribute in the layer, the module that owns the original, its name there)
_Borrowed = Tuple[str, nn.Module, str]


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

    Attributes:
        name: the qualified name of the submodule call that starts the layer
            (``'layer1.0.conv1'``).
        code: the generated source of the layer's computation.
        torchpipe_draws_random: whether the layer's own code (not the
            submodules it calls) may draw random numbers.

    Example::

        seq = torchpipe.as_sequential(model, torch.rand(2, 3, 32, 32))
        print(seq[1])        # which values it takes, pops, returns and stashes
        print(seq[1].code)   # the code it runs
    """

    name: str
    code: str
    torchpipe_draws_random: bool

    def __init__(
        self,
        name: str,
        graph: fx.Graph,
        attributes: Dict[str, Any],
        borrowed: Sequence[_Borrowed],
        *,
        persistent: Set[str],
        received: Sequence[str],
        pops: Sequence[Tuple[str, int]],
        stashes: Sequence[Tuple[str, int]],
        carried: int,
        returns_tuple: bool,
        draws_random: bool,
        namespace: Namespace,
    ) -> None:
        super().__init__()
        self.name = name
        self.torchpipe_draws_random = draws_random
        self._graph = graph
        self._received = tuple(received)
        #: (skip name, the layer that stashes it)
        self._pops = tuple(pops)
        #: (skip name, the layer that pops it)
        self._stashes = tuple(stashes)
        self._carried = carried
        self._returns_tuple = returns_tuple
        self._borrowed: List[_Borrowed] = list(borrowed)
        # Skippable reads its skip names from these; they differ per layer, so they live on the instance.
        self.__dict__["stashable_names"] = frozenset(n for n, _ in stashes)
        self.__dict__["poppable_names"] = frozenset(n for n, _ in pops)
        if pops or stashes:
            self.isolate(namespace)
        self._install(attributes, persistent)
        self._compile()

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

    def _compile(self) -> None:
        source, run = compile_forward(
            self._graph,
            self.name,
            received=len(self._received),
            pops=[name for name, _ in self._pops],
            stashes=[name for name, _ in self._stashes],
            carried=self._carried,
            returns_tuple=self._returns_tuple,
        )
        self.__dict__["code"] = source
        # The generated function is the forward itself: no trampoline for the many small layers of a
        # pipeline. Copies and unpickled layers make their own (see __getstate__).
        self.__dict__["forward"] = types.MethodType(run, self)

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        for made in ("forward", "code"):  # made by exec; rebuilt from the graph
            state.pop(made, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._compile()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "TracedLayer":
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        # A buffer the module's own code reads directly is registered here too; moving the layer
        # replaces the tensor here, so the owner gets the moved one and its state_dict stays right.
        for path, owner, attr in self._borrowed:
            parent_path, _, name = path.rpartition(".")
            parent = self.get_submodule(parent_path) if parent_path else self
            if name in parent._buffers:
                owner._buffers[attr] = parent._buffers[name]
        return self

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
        # Every instance replaces this with its generated code (see _compile).
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
