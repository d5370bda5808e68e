"""``compile_layers``: regional compilation, each layer of a stage compiled in place with ``torch.compile``.

Compiling each layer, not the stage or the model whole, is how transformer
models are compiled in practice (each block its own graph, compiled once and
run for every micro-batch): a stage is a Python loop over its layers, the
pipeline's schedule and transfers run between them, and a layer's graph is
small enough to compile in seconds. Each layer is compiled in place
(``nn.Module.compile``), not replaced by the ``OptimizedModule`` that
``torch.compile(layer)`` returns, so the stage's modules, parameters and state
dict keys stay the plain module's (no ``_orig_mod.``). A layer made by
:func:`torchpipe.as_sequential` compiles its traced graph
(:meth:`torchpipe.sequential.TracedLayer.compile`, see [Note: compiled layers]
in ``sequential/layer.py``).
"""
import inspect
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

from torchpipe.sequential.layer import TracedLayer
from torchpipe.skip.skippable import Skippable

__all__ = ["compile_layers", "compile_options", "CompileOptions"]

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
            f"torch.compile does not work with this Python ({'.'.join(map(str, __import__('sys').version_info[:3]))}) "
            f"and PyTorch ({torch.__version__}); run without compile=, or with a Python that this PyTorch compiles for"
        )


def compile_layers(stage: nn.Sequential, options: CompileOptions = True) -> None:
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
    * a skippable layer written by the user (``@skippable``: a generator
      forward that torchpipe drives, which dynamo cannot trace as a whole)
      stays eager and its submodules are compiled instead;
    * any other layer is compiled by ``nn.Module.compile`` (its ``__call__``
      compiled in place), its dynamic dimensions left to ``torch.compile``
      (a dimension that changes size is made dynamic on the second size it
      sees).

    Compiling is lazy: each layer compiles on its first call, for the device,
    dtypes and mode of that call. Call it on a stage after its layers are
    built and on their device. Loss and gradients equal the eager layers'
    within float tolerance; random numbers (dropout) are drawn as
    [Note: compiled layers] says.

    Args:
        stage: the layers to compile (a stage of a pipeline, or any
            ``nn.Sequential``).
        options: True (``torch.compile``'s defaults), False (nothing
            compiled) or a dict of ``torch.compile`` keyword arguments
            (``{'backend': 'aot_eager'}``, ``{'mode': 'max-autotune'}``).

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
    for layer in stage:
        _compile_layer(layer, checked)


def _compile_layer(layer: nn.Module, options: Dict[str, Any]) -> None:
    if isinstance(layer, TracedLayer):
        layer.compile(**options)
    elif isinstance(layer, Skippable):
        # Dynamo would trace into the tracker that serves the stashes and pops (the pipeline's runtime) and
        # break there; the layer's own computation is in its submodules.
        for child in layer.children():
            _compile_module(child, options)
    else:
        _compile_module(layer, options)


def _compile_module(module: nn.Module, options: Dict[str, Any]) -> None:
    if hasattr(nn.Module, "compile"):
        module.compile(**options)
    else:
        # PyTorch 2.1 has no nn.Module.compile: the instance's forward is compiled instead (hooks stay eager).
        module.forward = torch.compile(module.forward, **options)
