"""``as_sequential``: any traceable module made into an ``nn.Sequential`` that GPipe can cut."""
from typing import Any, List, Optional, Sequence, Type, Union

from torch import Tensor, fx, nn

from torchpipe.sequential.build import build_layers
from torchpipe.sequential.layer import TracedLayer
from torchpipe.sequential.plan import called_split_points, plan
from torchpipe.sequential.trace import Traced, UntraceableError, trace

__all__ = ["as_sequential", "TracedLayer", "UntraceableError"]


def as_sequential(
    module: nn.Module,
    *example_args: Any,
    split_points: Optional[Sequence[str]] = None,
    leaf_modules: Optional[Sequence[Union[str, Type[nn.Module]]]] = None,
) -> nn.Sequential:
    """Makes ``module`` into an ``nn.Sequential`` that computes what ``module(*example_args)`` computes.

    ``module``'s ``forward`` is traced with ``torch.fx`` and cut into layers:
    one per call of a submodule that holds parameters (``layer1.0.conv1``),
    with the function calls around it folded in, so that
    :class:`~torchpipe.GPipe` and :mod:`torchpipe_balancing` have layers to
    balance. A value that a later layer needs travels as a
    :mod:`torchpipe.skip` stash and pop, straight from the layer that makes it
    to the one that uses it (inside GPipe: between their partitions); each
    layer passes on to the next only what later layers need. The layers hold
    ``module``'s own submodules, parameters and buffers, so training the
    Sequential trains ``module``, and ``module.state_dict()`` saves the result.

    The Sequential's input is the one tensor argument, or a tuple of the
    tensor arguments in ``forward``'s order; arguments that are not tensors
    (and parameters left at their defaults) are fixed at their example values.
    Its output is ``module``'s: a tensor or a tuple of tensors. ``module`` runs
    once on the example arguments, without grad and with its buffers and the
    random generators put back afterwards.

    Args:
        module: the module to convert (not changed, and not copied).
        example_args: the positional arguments of one call of ``module``.
        split_points: qualified names of submodules; if given, layers start
            only at calls of these (``['layer2', 'layer3', 'layer4']``), for
            coarser layers.
        leaf_modules: submodules kept whole, each call one operation, not
            traced into: qualified names (``'encoder.layers.0'``) or classes.
            Modules of ``torch.nn`` (but containers and the transformer
            stacks) and modules holding parameters only directly are kept
            whole anyway.

    Returns:
        An ``nn.Sequential`` of :class:`TracedLayer`.

    Raises:
        UntraceableError: ``forward`` cannot be traced (Python control flow on
            tensor values, say); the message names the submodule and the line
            and suggests ``leaf_modules``.
        TypeError: ``module`` does not return a tensor or a tuple of tensors
            (wrap it so that it does), an argument holds tensors inside a
            container, or no argument is a tensor.
        ValueError: a name in ``split_points`` or ``leaf_modules`` is not a
            submodule, or a split point is never called by ``forward``.

    Example::

        model = torchvision.models.resnet50()
        seq = torchpipe.as_sequential(model, torch.rand(1, 3, 224, 224))
        balance = torchpipe_balancing.balance_by_time(4, seq, torch.rand(32, 3, 224, 224))
        pipe = torchpipe.GPipe(seq, balance, chunks=8)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"as_sequential takes an nn.Module, got {type(module).__name__}")
    _check_arguments(module, example_args)
    leaves = _check_names(module, leaf_modules, "leaf_modules", allow_types=True)
    splits = None if split_points is None else [str(n) for n in _check_names(module, split_points, "split_points")]
    traced = trace(module, example_args, leaves)
    _check_output(module, traced)
    if splits is not None:
        _check_split_points(traced, splits)
    layers = build_layers(plan(traced, module, splits), traced, module)
    return nn.Sequential(*layers)


def _check_arguments(module: nn.Module, example_args: Sequence[Any]) -> None:
    problems = []
    for i, arg in enumerate(example_args):
        if isinstance(arg, Tensor):
            continue
        if _holds_tensor(arg):
            problems.append(f"argument {i} is a {type(arg).__name__} holding tensors")
    if problems:
        raise TypeError(
            f"as_sequential passes tensors between layers one by one, but {'; '.join(problems)}; "
            f"give {type(module).__name__} its tensors as separate arguments (wrap it in a module whose forward "
            "takes them so)"
        )
    if not any(isinstance(arg, Tensor) for arg in example_args):
        raise TypeError(
            f"as_sequential needs an example call of {type(module).__name__} with at least one tensor argument, "
            f"got {len(example_args)} argument(s) and none is a tensor"
        )


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    return False


def _check_names(
    module: nn.Module, names: Optional[Sequence[Any]], what: str, allow_types: bool = False
) -> List[Any]:
    if names is None:
        return []
    if isinstance(names, str):
        raise TypeError(f"{what} takes a list of qualified names, got the string {names!r}; write [{names!r}]")
    known = {name for name, _ in module.named_modules() if name}
    checked: List[Any] = []
    unknown: List[str] = []
    for name in names:
        if allow_types and isinstance(name, type):
            if not issubclass(name, nn.Module):
                raise TypeError(f"{what} takes qualified names or nn.Module classes, got the class {name.__name__}")
        elif not isinstance(name, str):
            kinds = "qualified names or nn.Module classes" if allow_types else "qualified names (strings)"
            raise TypeError(f"{what} takes {kinds}, got {name!r}")
        elif name not in known:
            unknown.append(name)
        checked.append(name)
    if unknown:
        top = ", ".join(repr(n) for n, _ in module.named_children())
        raise ValueError(
            f"{what} names no submodule of {type(module).__name__}: {', '.join(map(repr, unknown))} "
            f"(qualified names as in named_modules(), like 'layer1.0.conv1'; its children: {top})"
        )
    return checked


def _describe(traced: Traced, value: Any) -> str:
    """What an output is, in words: ``'a dict'``, ``'a tuple (Tensor, int)'``."""
    if isinstance(value, fx.Node):
        kind = traced.kinds.get(value)
        return f"a {getattr(kind, '__name__', kind)}"
    if value is None:
        return "None"
    if isinstance(value, dict):
        return "a dict"
    if isinstance(value, list):
        return "a list"
    if type(value) is tuple:
        return "a tuple (" + ", ".join(_describe(traced, v).split(" ", 1)[-1] for v in value) + ")"
    return f"a {type(value).__name__}"


def _check_output(module: nn.Module, traced: Traced) -> None:
    output = next(node for node in traced.graph.nodes if node.op == "output").args[0]
    values = list(output) if type(output) is tuple else [output]
    ok = all(isinstance(v, fx.Node) and traced.kinds.get(v) is Tensor for v in values)
    if ok and (type(output) is tuple or isinstance(output, fx.Node)):
        return
    raise TypeError(
        f"as_sequential needs a module that returns a tensor or a tuple of tensors (GPipe passes only those "
        f"between partitions), but {type(module).__name__}.forward returns {_describe(traced, output)}; "
        "wrap the module in one whose forward returns tensors, e.g. "
        "`def forward(self, x): return self.model(x)['out']`"
    )


def _check_split_points(traced: Traced, split_points: Sequence[str]) -> None:
    called = called_split_points(traced.graph)
    missing = [name for name in split_points if name not in called]
    if not missing:
        return
    leaves = {str(n.target) for n in traced.graph.nodes if n.op == "call_module"}
    reasons = []
    for name in missing:
        inside = [leaf for leaf in leaves if name.startswith(leaf + ".")]
        reasons.append(
            f"{name!r} is inside {inside[0]!r}, which is kept whole" if inside else f"{name!r} is never called"
        )
    raise ValueError(
        "as_sequential cannot cut at every split point: " + "; ".join(reasons) + " (split points are submodules "
        "that forward calls; a submodule of a module kept whole cannot be one)"
    )
