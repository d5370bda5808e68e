"""torchpipe_balancing: find a GPipe balance by profiling time or memory.

Three public functions:

* :func:`balance_cost` splits per-layer costs into contiguous partitions,
  minimising the largest partition's total, exactly (:mod:`.blockpartition`);
* :func:`balance_by_time` profiles each layer's forward and backward time and
  balances that (:func:`.profile.profile_times`);
* :func:`balance_by_size` measures each layer's memory (activations saved for
  backward plus scaled parameters) and balances that
  (:func:`.profile.profile_sizes`).

Example::

    from torchpipe import GPipe
    from torchpipe_balancing import balance_by_time

    sample = torch.rand(128, 3, 224, 224)
    balance = balance_by_time(4, model, sample)
    model = GPipe(model, balance, chunks=8)
"""
import inspect
import math
from numbers import Integral, Real
from typing import Any, Dict, List, Optional, Sequence, Tuple, overload

import torch
from torch import Tensor, nn

from torchpipe.transfer import move
from torchpipe.types import Device, TensorOrTensors
from torchpipe_balancing.blockpartition import Cost, check_partitions, solve
from torchpipe_balancing.profile import profile_sizes, profile_times
from torchpipe_balancing.sandbox import sandbox

__all__ = ["balance_cost", "balance_by_time", "balance_by_size"]


def balance_cost(costs: Sequence[Cost], partitions: int) -> List[int]:
    """The balance that minimises the largest partition's total cost, exactly.

    Splits ``costs`` (one per layer, in order) into ``partitions`` contiguous,
    non-empty partitions so that the most expensive partition is as cheap as
    possible. The answer is optimal, not a heuristic; floats are handled in
    exact arithmetic. Among several optimal balances a deterministic one is
    returned, with partitions as even as the optimum allows. 10,000 layers
    into 64 partitions take milliseconds.

    Args:
        costs: non-negative ints or floats (any real numbers), one per layer.
        partitions: how many partitions, from 1 to ``len(costs)``.

    Returns:
        The balance: ``partitions`` positive ints summing to ``len(costs)``.

    Raises:
        TypeError: ``partitions`` is not an int.
        ValueError: ``partitions`` is below 1 or above ``len(costs)``, or a
            cost is negative, NaN or infinite.

    Example::

        >>> balance_cost([1, 1, 1, 1, 8, 1, 1], 3)
        [4, 1, 2]
    """
    return solve(costs, partitions)


# --- argument handling shared by the two profilers --------------------------------------------


def _bind(
    function: str, third: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], options: Dict[str, Any]
) -> Tuple[Any, Any, Any, Dict[str, Any]]:
    """Sorts out the two call forms: ``(partitions, module, sample)`` and ``(module, sample, partitions=)``.

    The first is torchgpipe 0.0.7's (``torchgpipe.balance``), the second that
    of torchgpipe 0.0.3 and 0.0.4's ``torchgpipe_balancing``. Returns
    ``(partitions, module, sample, options)``. The form is told apart by the
    type of the first positional argument: a module means the older form.
    """
    order = ["module", third, "partitions"] if args and isinstance(args[0], nn.Module) else [
        "partitions", "module", third
    ]
    if len(args) > 3:
        raise TypeError(f"{function}() takes at most 3 positional arguments ({len(args)} given)")
    bound: Dict[str, Any] = {}
    for name, value in zip(order, args):
        bound[name] = value
    for name, value in kwargs.items():
        if name in bound:
            raise TypeError(f"{function}() got multiple values for argument {name!r}")
        if name in ("partitions", "module", third):
            bound[name] = value
        elif name in options:
            options[name] = value
        else:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    missing = [name for name in ("partitions", "module", third) if name not in bound]
    if missing:
        raise TypeError(
            f"{function}() missing required argument(s): {', '.join(map(repr, missing))}; "
            f"call it as {function}(partitions, module, {third}) or {function}(module, {third}, partitions=n)"
        )
    return bound["partitions"], bound["module"], bound[third], options


def _check(function: str, partitions: Any, module: Any, sample: Any, what: str) -> int:
    """Checks the common arguments up front and returns ``partitions``."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"{function}() needs an nn.Sequential module, got {type(module).__name__}; "
            "GPipe partitions a Sequential: make the model one with torchpipe.as_sequential(model, example_input)"
        )
    if len(module) == 0:
        raise ValueError(f"{function}() got an empty nn.Sequential; there are no layers to balance")
    check_partitions(partitions, len(module), what="layers of the module")
    if isinstance(sample, Tensor):
        tensors = [sample]
    elif isinstance(sample, tuple) and all(isinstance(t, Tensor) for t in sample):
        tensors = list(sample)
    else:
        raise TypeError(
            f"{function}() {what} must be a Tensor or a tuple of Tensors, got {type(sample).__name__}"
        )
    if not tensors:
        raise ValueError(f"{function}() got an empty {what} (an empty tuple); pass a sample batch")
    empty = [tuple(t.shape) for t in tensors if t.numel() == 0 or t.dim() == 0 or t.size(0) == 0]
    if empty:
        raise ValueError(
            f"{function}() got an empty {what} (shapes {empty}); pass a batch with at least one "
            "sample along dimension 0"
        )
    return int(partitions)


def _device(device: Optional[Device]) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# --- balance_by_time --------------------------------------------------------------------------


@overload
def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: TensorOrTensors,
    *,
    timeout: float = 1.0,
    device: Optional[Device] = None,
) -> List[int]: ...


@overload
def balance_by_time(
    module: nn.Sequential,
    sample: TensorOrTensors,
    *,
    partitions: int,
    timeout: float = 1.0,
    device: Optional[Device] = None,
) -> List[int]: ...


def balance_by_time(*args: Any, **kwargs: Any) -> List[int]:
    """A balance that evens out each partition's forward+backward time.

    Runs every layer of ``module`` forward and backward on ``sample`` (each
    layer on the previous layer's output) on ``device``, one warm-up pass and
    then as many timed passes as fit in ``timeout`` seconds, takes each
    layer's median time, and returns :func:`balance_cost` of those times. The
    module is left as it was found (device, train/eval mode, ``requires_grad``,
    ``.grad``, buffers such as BatchNorm's running statistics), also if a
    layer raises.

    The arguments come in torchgpipe 0.0.7's order; the older form of
    torchgpipe 0.0.3 and 0.0.4's ``torchgpipe_balancing``,
    ``balance_by_time(module, sample, partitions=4)``, works too.

    Args:
        partitions: the number of partitions (pipeline stages).
        module: the ``nn.Sequential`` to balance.
        sample: a Tensor or a tuple of Tensors: a mini-batch (or a
            micro-batch) as GPipe would feed the module.
        timeout: profiling time budget in seconds: timed passes repeat while
            the next one is expected to end within it. A warm-up pass and one
            timed pass always run, even when they alone take longer.
        device: where to profile; ``None`` means CUDA if available, else CPU.

    Returns:
        The balance: ``partitions`` positive ints summing to ``len(module)``.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, ``sample`` is not a
            Tensor or tuple of Tensors, or ``partitions`` is not an int.
        ValueError: ``partitions`` is below 1 or above ``len(module)``,
            ``sample`` is empty, or ``timeout`` is not positive.

    Example::

        balance = balance_by_time(4, model, torch.rand(128, 3, 224, 224))
        model = torchpipe.GPipe(model, balance, chunks=8)
    """
    partitions, module, sample, options = _bind(
        "balance_by_time", "sample", args, kwargs, {"timeout": 1.0, "device": None}
    )
    partitions = _check("balance_by_time", partitions, module, sample, "sample")
    timeout = options["timeout"]
    if isinstance(timeout, bool) or not isinstance(timeout, Real) or not float(timeout) > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    device = _device(options["device"])

    with sandbox(module, device):
        times = profile_times(module, move(sample, device), float(timeout), device)
    return solve(times, partitions)


# --- balance_by_size --------------------------------------------------------------------------


@overload
def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    input: TensorOrTensors,
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: Optional[Device] = None,
) -> List[int]: ...


@overload
def balance_by_size(
    module: nn.Sequential,
    input: TensorOrTensors,
    *,
    partitions: int,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: Optional[Device] = None,
) -> List[int]: ...


def balance_by_size(*args: Any, **kwargs: Any) -> List[int]:
    """A balance that evens out each partition's memory.

    A layer's memory is what a micro-batch makes it hold until backward: the
    tensors autograd saves for backward, measured with
    ``torch.autograd.graph.saved_tensors_hooks`` (PyTorch's own accounting,
    the same figure on CPU and CUDA; tensors sharing a storage count once;
    parameters and buffers excluded), plus the layer's parameter bytes times
    ``param_scale`` (the parameters themselves, their gradients and optimizer
    state: 2.0 for plain SGD, 3.0 for SGD with momentum, 4.0 for Adam; a
    parameter several layers hold, a tied weight, counts once). The micro-batch is
    the first of ``input`` split into ``chunks`` (like ``torch.chunk``). On
    CUDA the figure is cross-checked with the caching allocator
    (``memory_allocated`` / ``max_memory_allocated``): memory kept outside the
    hooks' view is added, with a warning.

    The module is left as it was found. The arguments come in torchgpipe
    0.0.7's order; the older form of torchgpipe 0.0.3 and 0.0.4's
    ``torchgpipe_balancing``, ``balance_by_size(module, input, partitions=4)``,
    works too.

    Args:
        partitions: the number of partitions (pipeline stages).
        module: the ``nn.Sequential`` to balance.
        input: a Tensor or tuple of Tensors: a mini-batch as GPipe would get it.
        chunks: the ``chunks`` you will give GPipe.
        param_scale: how many parameter-sized tensors each parameter costs
            in training (weights, gradients, optimizer state).
        device: where to profile; ``None`` means CUDA if available, else CPU.

    Returns:
        The balance: ``partitions`` positive ints summing to ``len(module)``.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, ``input`` is not a
            Tensor or tuple of Tensors, or ``partitions``/``chunks`` is not an int.
        ValueError: ``partitions`` is below 1 or above ``len(module)``,
            ``input`` is empty, ``chunks`` is below 1 or ``param_scale`` is
            negative or not finite.

    Example::

        balance = balance_by_size(4, model, torch.rand(128, 3, 224, 224), chunks=8)
        model = torchpipe.GPipe(model, balance, chunks=8)
    """
    partitions, module, input, options = _bind(
        "balance_by_size", "input", args, kwargs, {"chunks": 1, "param_scale": 2.0, "device": None}
    )
    partitions = _check("balance_by_size", partitions, module, input, "input")
    chunks, param_scale = options["chunks"], options["param_scale"]
    if isinstance(chunks, bool) or not isinstance(chunks, Integral):
        raise TypeError(f"chunks must be an int, got {type(chunks).__name__} ({chunks!r})")
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    chunks = int(chunks)
    if isinstance(param_scale, bool) or not isinstance(param_scale, Real) or not (
        float(param_scale) >= 0 and math.isfinite(param_scale)
    ):
        raise ValueError(f"param_scale must be a non-negative finite number, got {param_scale!r}")
    device = _device(options["device"])

    with sandbox(module, device):
        sizes = profile_sizes(module, move(input, device), chunks, device)
    return solve([size.cost(float(param_scale)) for size in sizes], partitions)


def _signature(third: str, options: Dict[str, Any]) -> inspect.Signature:
    """The documented signature, so ``help()`` and ``inspect`` show the primary call form."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    keyword = inspect.Parameter.KEYWORD_ONLY
    parameters = [
        inspect.Parameter("partitions", positional, annotation=int),
        inspect.Parameter("module", positional, annotation=nn.Sequential),
        inspect.Parameter(third, positional, annotation=TensorOrTensors),
    ] + [inspect.Parameter(name, keyword, default=value) for name, value in options.items()]
    return inspect.Signature(parameters, return_annotation=List[int])


balance_by_time.__signature__ = _signature(  # type: ignore[attr-defined]
    "sample", {"timeout": 1.0, "device": None}
)
balance_by_size.__signature__ = _signature(  # type: ignore[attr-defined]
    "input", {"chunks": 1, "param_scale": 2.0, "device": None}
)
