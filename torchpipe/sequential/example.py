"""The example call of a module for :func:`~torchpipe.as_sequential`: its inputs, its fixed arguments, its output.

A Sequential layer takes a tensor or a tuple of tensors, so the converted
module is called through an *entry*: a wrapper whose ``forward`` takes the
tensor arguments only, positional ones first and then keyword ones in the
order given, calls the module with them and with every other argument fixed at
its example value, and returns what ``output=`` selects from the module's
result. Both tracers trace the entry, so both see the same call.
"""
import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from torch import Tensor, nn

__all__ = ["ExampleCall", "Output", "example_call", "entry", "describe", "ROOT"]

#: What ``output=`` takes: a key of the module's output, or a function of it.
Output = Union[str, Callable[[Any], Any]]

#: The name of the entry's child that holds the user's module.
ROOT = "module"

#: Names the entry's code uses itself; an argument with one of these names gets a placeholder name instead.
_RESERVED = frozenset({"self", "arguments", "select", "torch"})


@dataclasses.dataclass
class ExampleCall:
    """One call of the module: which values are the Sequential's inputs and which are fixed."""

    #: The positional arguments, as given.
    args: List[Any]
    #: The keyword arguments, in the order given.
    kwargs: Dict[str, Any]
    #: For each input, in order: its position in ``args`` (int) or its keyword (str).
    slots: List[Union[int, str]]
    #: For each input: the name of its placeholder (the forward parameter's name where known).
    names: List[str]
    #: What to return from the module's output (None: the output as it is).
    output: Optional[Output]

    @property
    def tensors(self) -> List[Tensor]:
        """The example inputs, in the Sequential's order."""
        return [self.args[s] if isinstance(s, int) else self.kwargs[s] for s in self.slots]


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    return False


def _parameter_names(module: nn.Module) -> List[str]:
    try:
        return [
            p.name
            for p in inspect.signature(module.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return []


def example_call(
    module: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], output: Optional[Output]
) -> ExampleCall:
    """Checks the example arguments and sorts them into inputs (tensors) and fixed values.

    Raises:
        TypeError: an argument holds tensors inside a container, no argument
            is a tensor, or ``output`` is neither a string nor callable.
    """
    problems = [
        f"argument {i} is a {type(a).__name__} holding tensors"
        for i, a in enumerate(args)
        if not isinstance(a, Tensor) and _holds_tensor(a)
    ]
    problems += [
        f"keyword argument {k!r} is a {type(v).__name__} holding tensors"
        for k, v in kwargs.items()
        if not isinstance(v, Tensor) and _holds_tensor(v)
    ]
    if problems:
        raise TypeError(
            f"as_sequential passes tensors between layers one by one, but {'; '.join(problems)}; "
            f"give {type(module).__name__} its tensors as separate arguments (wrap it in a module whose forward "
            "takes them so)"
        )
    slots: List[Union[int, str]] = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
    slots += [k for k, v in kwargs.items() if isinstance(v, Tensor)]
    if not slots:
        raise TypeError(
            f"as_sequential needs an example call of {type(module).__name__} with at least one tensor argument, "
            f"got {len(args) + len(kwargs)} argument(s) and none is a tensor"
        )
    if output is not None and not isinstance(output, str) and not callable(output):
        raise TypeError(
            f"output takes a key of the module's output (output='logits') or a function of it, got {output!r}"
        )
    parameters = _parameter_names(module)
    names: List[str] = []
    for slot in slots:
        if isinstance(slot, str):
            name = slot
        else:
            name = parameters[slot] if slot < len(parameters) else f"input{slot}"
        if not name.isidentifier() or name in _RESERVED or name in names:
            name = f"input{len(names)}"
        names.append(name)
    return ExampleCall(list(args), dict(kwargs), slots, names, output)


def _selector(output: Optional[Output]) -> Callable[[Any], Any]:
    if output is None:
        return lambda value: value
    if isinstance(output, str):
        key = output

        def select(value: Any) -> Any:
            try:
                return value[key]
            except (KeyError, IndexError, TypeError) as error:
                raise TypeError(
                    f"as_sequential cannot take output={key!r} from the module's output, "
                    f"{describe(value)}: {type(error).__name__}: {error}"
                ) from None

        return select
    return output


class OutputError(TypeError):
    """The module (with ``output=``) returns something other than a tensor or a tuple of tensors."""


def entry(module: nn.Module, call: ExampleCall, *, check_output: bool = False) -> nn.Module:
    """A wrapper whose ``forward`` takes the inputs only and calls ``module`` with all the arguments.

    Tracers make one placeholder per parameter of the traced ``forward``; the
    entry's ``forward`` is written for the inputs, so the other arguments (and
    the defaults of parameters not given) reach ``module`` as the plain Python
    values they are, and tracing specialises on them. ``check_output`` raises
    :class:`OutputError` when the selected output is not a tensor or a tuple of
    tensors (for a tracer that sees tensors, not proxies).
    """
    fixed_args, fixed_kwargs, slots = list(call.args), dict(call.kwargs), list(call.slots)
    select = _selector(call.output)

    def arguments(tensors: Sequence[Any]) -> Any:
        args, kwargs = list(fixed_args), dict(fixed_kwargs)
        for slot, tensor in zip(slots, tensors):
            if isinstance(slot, int):
                args[slot] = tensor
            else:
                kwargs[slot] = tensor
        return args, kwargs

    def finish(value: Any) -> Any:
        chosen = select(value)
        if check_output and not (
            isinstance(chosen, Tensor)
            or (type(chosen) is tuple and chosen and all(isinstance(v, Tensor) for v in chosen))
        ):
            raise OutputError(describe(chosen))
        return chosen

    parameters = ", ".join(call.names)
    source = (
        f"def forward(self, {parameters}):\n"
        f"    args, kwargs = arguments(({parameters},))\n"
        f"    return select(self.{ROOT}(*args, **kwargs))\n"
    )
    scope: Dict[str, Any] = {"arguments": arguments, "select": finish}
    exec(compile(source, "<torchpipe.as_sequential entry>", "exec"), scope)  # noqa: S102 - our own code
    entry_type = type("AsSequentialEntry", (nn.Module,), {"forward": scope["forward"]})
    wrapper: nn.Module = entry_type()
    wrapper.add_module(ROOT, module)
    return wrapper


def describe(value: Any) -> str:
    """What a value is, in words: ``'a dict'``, ``'a tuple (Tensor, int)'``, ``'a CausalLMOutput'``."""
    if isinstance(value, Tensor):
        return "a Tensor"
    if value is None:
        return "None"
    if type(value) is tuple:
        return "a tuple (" + ", ".join(describe(v).split(" ", 1)[-1] for v in value) + ")"
    if type(value) is dict:
        return "a dict"
    if type(value) is list:
        return "a list"
    return f"a {type(value).__name__}"
