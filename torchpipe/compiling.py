"""``compile_layers``: regional compilation, each layer of a stage compiled in place with ``torch.compile``.

Compiling each layer, not the stage or the model whole, is how transformer
models are compiled in practice (each block its own graph, compiled once and
run for every micro-batch): a stage is a Python loop over its layers, with the
pipeline's schedule and transfers around them, and one layer's graph compiles
in seconds. Each layer is compiled in place, not replaced by the
``OptimizedModule`` that ``torch.compile(layer)`` returns, so the stage's
modules, parameters and state dict keys stay the plain module's (no
``_orig_mod.``).

* A layer made by :func:`torchpipe.as_sequential` compiles the computation of
  its traced graph (:meth:`torchpipe.sequential.TracedLayer.compile`; see
  [Note: compiled layers] in ``sequential/layer.py``).
* Any other layer gets a ``forward`` of its own that calls its class's
  ``forward`` through ``torch.compile``; its hooks stay eager. Not
  ``nn.Module.compile``: that compiles ``nn.Module._call_impl``, a frame that
  dynamo skips (it is in ``torch.nn``, in dynamo's skip files), and for the
  layers of ``torch.nn`` (``nn.Linear``, ``nn.Sequential``) the ``forward``
  it calls is skipped too, so nothing is compiled. The compiled function has
  a code object of its own per layer, since dynamo keeps compiled code and
  counts recompilations per code object. A dimension that changes size is
  made dynamic by ``torch.compile`` on the second size it sees.
* A skippable layer written by the user (``@skippable``: a generator
  ``forward`` that torchpipe drives) is not compiled whole: dynamo would
  trace into the tracker that serves its stashes and pops. Its submodules are
  compiled instead.

Inside a pipeline task's random streams ([Note: random streams]), a layer
that may draw random numbers runs uncompiled, so that it draws from the
task's generators and a recomputation replays its draws.
"""
import inspect
import sys
import types
import warnings
from typing import Any, Collection, Dict, List, Optional, Union

import torch
from torch import nn

from torchpipe.rng import RandomStreams, may_draw
from torchpipe.skip.skippable import Skippable

__all__ = ["compile_layers", "compile_options", "in_random_streams", "CompileOptions"]

#: What ``compile=`` takes: True (``torch.compile``'s defaults), False (nothing compiled) or its keyword arguments.
CompileOptions = Union[bool, Dict[str, Any]]

#: ``torch.compile``'s keyword arguments that ``compile=`` takes: all but the model.
_NOT_OPTIONS = {"model"}


def _keywords() -> List[str]:
    parameters = inspect.signature(torch.compile).parameters
    return [name for name, p in parameters.items() if name not in _NOT_OPTIONS and p.kind != p.VAR_KEYWORD]


def compile_options(options: Any) -> Optional[Dict[str, Any]]:
    """The ``torch.compile`` keyword arguments that ``options`` stands for, checked; None for False.

    Args:
        options: True (``torch.compile``'s defaults: ``{}``), False (None:
            nothing to compile) or a dict of ``torch.compile`` keyword
            arguments (``{'backend': 'aot_eager'}``, ``{'mode':
            'max-autotune', 'dynamic': False}``).

    Returns:
        The keyword arguments (a new dict), or None for False.

    Raises:
        TypeError: ``options`` is not a bool or a dict, a key is not a string,
            or ``fullgraph``, ``dynamic``, ``mode``, ``backend`` or
            ``options`` has the wrong type.
        ValueError: a key is not a keyword argument of ``torch.compile``, or
            ``torch.compile`` refuses a value (an unknown backend or mode;
            ``mode`` and ``options`` together).
        RuntimeError: ``torch.compile`` does not work with this Python and
            PyTorch.
    """
    if isinstance(options, bool):
        if not options:
            return None
        checked: Dict[str, Any] = {}
    elif isinstance(options, dict):
        checked = dict(options)
    else:
        hint = f"; to choose a backend, write {{'backend': {options!r}}}" if isinstance(options, str) else ""
        raise TypeError(
            "compile takes True, False or a dict of torch.compile keyword arguments "
            f"(backend=, mode=, dynamic=, fullgraph=, options=), got {options!r} ({type(options).__name__}){hint}"
        )
    keywords = _keywords()
    not_strings = [k for k in checked if not isinstance(k, str)]
    if not_strings:
        raise TypeError(f"compile's keys are torch.compile keyword names (strings), got {not_strings!r}")
    unknown = [k for k in checked if k not in keywords]
    if unknown:
        raise ValueError(
            f"compile={options!r} has {', '.join(map(repr, unknown))}, which torch.compile does not take; "
            f"its keyword arguments are {', '.join(keywords)}"
        )
    problems = []
    for name, kinds, what in (
        ("fullgraph", (bool,), "a bool"),
        ("dynamic", (bool, type(None)), "True, False or None"),
        ("mode", (str, type(None)), "a string or None"),
        ("options", (dict, type(None)), "a dict or None"),
    ):
        if name in checked and not isinstance(checked[name], kinds):
            problems.append(f"{name} takes {what}, got {checked[name]!r}")
    backend = checked.get("backend")
    if backend is not None and not isinstance(backend, str) and not callable(backend):
        problems.append(f"backend takes a backend's name or a callable, got {backend!r}")
    if problems:
        raise TypeError(f"compile={options!r}: " + "; ".join(problems))
    _check_supported()
    try:  # torch.compile checks the backend and the mode when it is called, before anything is traced
        torch.compile(_probe, **checked)
    except Exception as error:  # an InvalidBackend, a RuntimeError for a mode: torch's message says which
        names = ", ".join(torch._dynamo.list_backends())
        raise ValueError(
            f"torch.compile refuses compile={options!r}: {error} (backends here: {names})"
        ) from error
    return checked


def _probe() -> None:
    """A function to hand ``torch.compile`` so that it checks its arguments (never called)."""


def _check_supported() -> None:
    supported = getattr(torch._dynamo, "is_dynamo_supported", None)
    if supported is not None and not supported():
        raise RuntimeError(
            f"torch.compile does not work with this Python ({'.'.join(map(str, sys.version_info[:3]))}) "
            f"and PyTorch ({torch.__version__}); run without compile=, or with a Python that this PyTorch compiles for"
        )


def compile_layers(stage: nn.Sequential, options: CompileOptions = True, eager: Collection[str] = ()) -> None:
    """Compiles each layer of ``stage`` in place with ``torch.compile``: regional compilation.

    Each layer (each child of ``stage``) is compiled on its own, as one
    compiles each block of a transformer, and stays the same module: its
    parameters, buffers and state dict keys are unchanged, so checkpoints and
    the pipeline's parameter bookkeeping see the plain module. How:

    * a :class:`~torchpipe.sequential.TracedLayer` (a layer of
      :func:`torchpipe.as_sequential`) compiles the computation of its traced
      graph, one graph per mode, with no graph break on its operations and
      dimension 0 of its inputs dynamic unless ``dynamic=`` is given (see
      [Note: compiled layers] in ``sequential/layer.py``);
    * a skippable layer written by the user (``@skippable``) stays eager and
      its submodules are compiled instead;
    * any other layer runs its ``forward`` compiled; its hooks stay eager.

    Compiling is lazy: each layer compiles on its first call, for the device,
    dtypes and mode of that call. Call it on a stage after its layers are
    built and on their device. Loss and gradients equal the eager layers'
    within float tolerance; random numbers (dropout) are drawn as
    [Note: compiled layers] says. Every call of a compiled layer costs a
    fixed time besides its computation (dynamo's guards, AOT autograd's
    wrappers), so compiling pays where layers are large: for a model of
    :func:`torchpipe.as_sequential`, whose layers are single linear layers and
    norms by default, cut at the transformer blocks
    (``split_points=['model.layers.0', ...]``).

    Args:
        stage: the layers to compile (a stage of a pipeline, or any
            ``nn.Sequential``).
        options: True (``torch.compile``'s defaults), False (nothing
            compiled) or a dict of ``torch.compile`` keyword arguments
            (``{'backend': 'aot_eager'}``, ``{'mode': 'max-autotune'}``).
        eager: names of layers that stay uncompiled, with a warning that
            names them (a tensor-parallel stage's embedding split on its
            vocabulary, which ``torch.compile`` cannot trace through DTensor).

    Raises:
        TypeError: ``stage`` is not an ``nn.Sequential``, or ``options`` is
            not a bool or a dict (see :func:`compile_options`).
        ValueError: ``options`` holds an argument ``torch.compile`` does not
            take or refuses (see :func:`compile_options`).
        RuntimeError: ``torch.compile`` does not work with this Python and
            PyTorch.

    Example::

        seq = torchpipe.as_sequential(model, input_ids=ids, use_cache=False, output="logits")
        compile_layers(seq, {"backend": "inductor"})
        logits = seq(ids)   # each layer compiles on its first call
    """
    if not isinstance(stage, nn.Sequential):
        raise TypeError(
            f"compile_layers takes an nn.Sequential (a stage), got {type(stage).__name__}; "
            "torchpipe.as_sequential makes one of a model"
        )
    checked = compile_options(options)
    if checked is None:
        return
    if eager:
        warnings.warn(
            f"compile= leaves layer(s) {', '.join(eager)} uncompiled: each holds an embedding that tensor_parallel "
            "splits on its vocabulary, which torch.compile does not trace (DTensor's masked partial lookup); the "
            "other layers compile",
            stacklevel=3,
        )
    for name, layer in stage.named_children():
        if name not in eager:
            _compile_layer(layer, checked)


def in_random_streams() -> bool:
    """Whether a pipeline task's random streams give the random functions called now their generators.

    A compiled layer that may draw random numbers runs uncompiled then (see [Note: compiled layers]).
    """
    stack = torch.overrides._get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    return any(isinstance(mode, RandomStreams) for mode in stack)


def _compile_layer(layer: nn.Module, options: Dict[str, Any]) -> None:
    if getattr(type(layer), "compile", None) is not getattr(nn.Module, "compile", None):
        layer.compile(**options)  # a layer that compiles itself: TracedLayer
    elif isinstance(layer, Skippable):
        # Dynamo would trace into the tracker that serves the stashes and pops (the pipeline's runtime) and
        # break there; the layer's own computation is in its submodules.
        for child in layer.children():
            _compile_layer(child, options)
    else:
        _compile_module(layer, options)


def _compile_module(module: nn.Module, options: Dict[str, Any]) -> None:
    """Gives ``module`` a forward of its own that runs its class's forward compiled (see the module docstring)."""
    defined = type(module).forward

    def compiled_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return defined(self, *args, **kwargs)

    # A code object of its own: dynamo keeps compiled code and counts recompilations per code object, so
    # each module has a cache of its own (one shared by every layer would hit the recompile limit).
    compiled_forward.__code__ = compiled_forward.__code__.replace()
    compiled = torch.compile(compiled_forward, **options)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if in_random_streams() and may_draw(self):
            return defined(self, *args, **kwargs)
        return compiled(self, *args, **kwargs)

    # Bound to the module, not closed over it: a deep copy's forward is bound to the copy.
    module.__dict__["forward"] = types.MethodType(forward, module)
