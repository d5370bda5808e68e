"""``as_sequential``: any traceable module made into an ``nn.Sequential`` that GPipe can cut."""
from typing import Any, List, Optional, Sequence, Type, Union

from torch import Tensor, fx, nn

from torchpipe.sequential.build import Cuts, build_layers
from torchpipe.sequential.cuts import called_split_points, cut_layers
from torchpipe.sequential.example import ExampleCall, Output, OutputError, example_call
from torchpipe.sequential.export import ExportFailed, export_trace
from torchpipe.sequential.guard import InputGuard
from torchpipe.sequential.layer import TracedLayer
from torchpipe.sequential.trace import Traced, UntraceableError, trace

__all__ = ["as_sequential", "TracedLayer", "UntraceableError", "InputGuard"]

#: The values ``tracer=`` takes.
_TRACERS = (None, "fx", "export")


def as_sequential(
    module: nn.Module,
    *example_args: Any,
    tracer: Optional[str] = None,
    output: Optional[Output] = None,
    split_points: Optional[Sequence[str]] = None,
    leaf_modules: Optional[Sequence[Union[str, Type[nn.Module]]]] = None,
    **example_kwargs: Any,
) -> nn.Sequential:
    """Makes ``module`` into an ``nn.Sequential`` that computes what ``module(*example_args, **example_kwargs)`` does.

    ``module``'s ``forward`` is traced with ``torch.fx`` or, where fx cannot
    (code that branches on shapes, as the mask code of Hugging Face
    ``transformers`` models does), with ``torch.export``, and cut into layers:
    one per call of a submodule that holds parameters (``layer1.0.conv1``,
    ``transformer.h.3.attn.c_attn``), with the function calls around it
    folded in, so that :class:`~torchpipe.GPipe` and :mod:`torchpipe_balancing`
    have layers to balance. A value that a later layer needs travels as a
    :mod:`torchpipe.skip` stash and pop, straight from the layer that makes it
    to the one that uses it (inside GPipe: between their partitions); each
    layer passes on to the next only what later layers need. The layers hold
    ``module``'s own parameters and buffers (and, traced by fx, submodules),
    so training the Sequential trains ``module``, and ``module.state_dict()``
    saves the result. A parameter used at two places (tied input and output
    embeddings) is held by both layers: the same ``Parameter`` object.

    The Sequential's input is the one tensor argument, or a tuple of the
    tensor arguments: the positional ones in ``forward``'s order, then the
    keyword ones in the order given. Arguments that are not tensors (and
    parameters left at their defaults) are fixed at their example values.
    Its output is ``module``'s, which must be a tensor or a tuple of tensors;
    ``output=`` says what to take from a dict or a ``ModelOutput``. Tracing
    leaves ``module``, its buffers and the random generators as they were.

    Traced by ``torch.export``, the Sequential checks in its first layer that
    its inputs are in the domain the graph holds for (any batch size; other
    sizes as export found the model allows) and refuses others with a
    ``ValueError``; it runs in both modes (``.train()``, ``.eval()``) where
    export can trace both, and for the dtypes it was traced with. See
    ``docs/language_models.md``.

    Args:
        module: the module to convert (not changed, and not copied).
        example_args: the positional arguments of one call of ``module``.
        tracer: ``'fx'`` or ``'export'`` to use that tracer only; None (the
            default) tries fx, then export.
        output: what to return from ``module``'s output: a key
            (``'logits'``), or a function of the output that returns a tensor
            or a tuple of tensors.
        split_points: qualified names of submodules; if given, layers start
            only at calls of these (``['layer2', 'layer3', 'layer4']``), for
            coarser layers.
        leaf_modules: submodules kept whole, each call one operation, not
            traced into: qualified names (``'encoder.layers.0'``) or classes.
            Modules of ``torch.nn`` (but containers and the transformer
            stacks) and modules holding parameters only directly are kept
            whole anyway. (torch.export traces into every module; there a
            leaf module starts a layer, and no layer starts inside it.)
        example_kwargs: the keyword arguments of the call
            (``input_ids=ids, attention_mask=mask, use_cache=False``).

    Returns:
        An ``nn.Sequential`` of :class:`TracedLayer`.

    Raises:
        UntraceableError: ``forward`` cannot be traced (Python control flow on
            tensor values, say); the message says what each tracer met, names
            the submodule and the line fx failed at, and suggests
            ``leaf_modules``.
        TypeError: ``module`` does not return a tensor or a tuple of tensors
            (pass ``output=``, or wrap it so that it does), an argument holds
            tensors inside a container, or no argument is a tensor.
        ValueError: ``tracer`` is not one of the above, a name in
            ``split_points`` or ``leaf_modules`` is not a submodule, or a
            split point is never called by ``forward``.

    Example::

        model = torchvision.models.resnet50()
        seq = torchpipe.as_sequential(model, torch.rand(1, 3, 224, 224))
        balance = torchpipe_balancing.balance_by_time(4, seq, torch.rand(32, 3, 224, 224))
        pipe = torchpipe.GPipe(seq, balance, chunks=8)

        lm = transformers.GPT2LMHeadModel(config)
        seq = torchpipe.as_sequential(lm, input_ids=ids, use_cache=False, output="logits")
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"as_sequential takes an nn.Module, got {type(module).__name__}")
    if tracer not in _TRACERS:
        raise ValueError(f"tracer takes 'fx', 'export' or None (fx, then export), got {tracer!r}")
    call = example_call(module, example_args, example_kwargs, output)
    leaves = _check_names(module, leaf_modules, "leaf_modules", allow_types=True)
    splits = None if split_points is None else [str(n) for n in _check_names(module, split_points, "split_points")]

    fx_error: Optional[UntraceableError] = None
    if tracer in (None, "fx"):
        try:
            traced = trace(module, call, leaves)
        except UntraceableError as error:
            if tracer == "fx":
                raise
            fx_error = error
        else:
            _check_output(module, traced, call)
            if splits is not None:
                _check_split_points(traced, splits)
            return _in_mode(
                nn.Sequential(*build_layers([Cuts(traced, cut_layers(traced, module, splits))], module)), module
            )

    try:
        exported = export_trace(module, call, leaves)
    except OutputError as error:
        raise TypeError(_output_message(module, str(error), call)) from None
    except ExportFailed as failure:
        raise _untraceable_by_both(module, fx_error, failure) from failure.error
    traced_cuts = []
    for traced in exported.modes.values():
        if splits is not None:
            _check_split_points(traced, splits)
        traced_cuts.append(Cuts(traced, cut_layers(traced, module, splits)))
    return _in_mode(nn.Sequential(*build_layers(traced_cuts, module, exported.missing)), module)


def _in_mode(seq: nn.Sequential, module: nn.Module) -> nn.Sequential:
    """The Sequential and its layers in ``module``'s mode; the model's submodules the layers hold keep theirs."""
    seq.training = module.training
    for layer in seq:
        layer.training = module.training
    return seq


def _untraceable_by_both(
    module: nn.Module, fx_error: Optional[UntraceableError], failure: ExportFailed
) -> UntraceableError:
    name = type(module).__name__
    if fx_error is None:
        return UntraceableError(
            f"as_sequential cannot trace {name} with torch.export: {failure}\n"
            "To go on, try tracer=None (fx, then export), or make the code torch.export can trace (see its "
            "documentation for the error above: data-dependent control flow needs torch.cond or torch._check)."
        )
    return UntraceableError(
        f"{fx_error}\ntorch.export cannot trace it either: {failure}\n"
        "To go on with torch.fx, change the code at the line it names or keep that submodule whole with "
        "leaf_modules=[...]; to go on with torch.export, make the code it rejects traceable (data-dependent "
        "control flow: torch.cond or torch._check)."
    )


def _output_message(module: nn.Module, described: str, call: ExampleCall) -> str:
    if call.output is None:
        how = (
            "pass output= with a key of it (output='logits') or a function that returns a tensor or a tuple "
            "of tensors (output=lambda out: (out.loss, out.logits))"
        )
        returns = f"{type(module).__name__}.forward returns {described}"
    else:
        how = "pass an output= that selects a tensor or a tuple of tensors"
        returns = f"{type(module).__name__}.forward with output={call.output!r} returns {described}"
    return (
        f"as_sequential needs a module that returns a tensor or a tuple of tensors (GPipe passes only those "
        f"between partitions), but {returns}; {how}, or wrap the module in one whose forward returns tensors"
    )


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


def _check_output(module: nn.Module, traced: Traced, call: ExampleCall) -> None:
    output = next(node for node in traced.graph.nodes if node.op == "output").args[0]
    values = list(output) if type(output) is tuple else [output]
    ok = all(isinstance(v, fx.Node) and traced.kinds.get(v) is Tensor for v in values)
    if ok and (type(output) is tuple or isinstance(output, fx.Node)):
        return
    raise TypeError(_output_message(module, _describe(traced, output), call))


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
