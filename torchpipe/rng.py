"""Random numbers in pipelined and data-parallel steps: reproducible whatever the threads' timing.

[Note: random streams] PyTorch's layers draw from one generator per device:
all CPU work shares the CPU generator, all work on one GPU shares that GPU's.
Partitions (and data-parallel replicas) run concurrently on worker threads, so
if they drew from those generators, each one's numbers would depend on the
others' timing (and on any other thread drawing meanwhile): runs from the same
seed would differ, and a recomputation that replayed "the generator's state
before the forward" would draw other numbers than the forward did.

So each task that may draw runs on random streams of its own. At the start of
a step one 63-bit seed is drawn from the caller's CPU generator (only when
some partition may draw, so a pipeline without random layers leaves the
caller's generator as it was). A task that may draw — stage ``s``'s forward of
micro-batch ``i``, its recomputation, replica ``r``'s forward — runs under a
thread-local :class:`torch.overrides.TorchFunctionMode` that gives every random
function it calls a ``torch.Generator`` of the task's own, seeded from the
step's seed and ``(s, i)`` (or ``r``): ``torch.rand``/``randn``/``randint``/
``randperm`` and their ``*_like`` forms, ``bernoulli``, ``multinomial``,
``normal``, ``poisson``, the in-place ``Tensor`` samplers (``uniform_``,
``normal_``, ``bernoulli_``, ``exponential_``, …), and the dropout family,
``rrelu`` and the dropout of ``scaled_dot_product_attention``, which take no
generator and are computed here from a generator's mask (same distribution as
PyTorch's kernels; different numbers). The numbers a task draws then depend
only on the seed and the task, not on which thread ran first or what other
threads draw, a recomputation draws exactly what its forward drew, and tasks
need no lock: they run concurrently.

What equals what: two runs from the same ``torch.manual_seed`` give the same
outputs and gradients, whatever the timing; a recomputation draws what its
first forward drew; the masks are not those of the unpartitioned module
(which draws for the whole batch in one go), nor those of another ``chunks``.

Whether a module may draw is decided from its class (:func:`may_draw`): torch's
own layers by rule (``nn.Dropout`` with ``p > 0`` in training draws,
``nn.Linear`` never does); any other ``forward`` is assumed to draw, unless its
module says otherwise with ``torchpipe_draws_random = False`` (a class or
instance attribute: "my own ``forward`` draws no random numbers"; submodules are
judged on their own). Tasks of modules that cannot draw run with no mode at all.
Random numbers drawn inside compiled code that Python does not see (a
TorchScript module, a C++ extension) come from PyTorch's global generators and
are not replayed.
"""
import contextlib
import math
import weakref
import zlib
from typing import Any, Callable, ContextManager, Dict, FrozenSet, List, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["may_draw", "step_seed", "task_seed", "streams", "DRAWS_RANDOM", "RandomStreams"]

#: The attribute a module sets to say whether its own ``forward`` draws random numbers.
DRAWS_RANDOM = "torchpipe_draws_random"


def _classes(*names: str) -> FrozenSet[Type[nn.Module]]:
    found = [getattr(nn, name, None) for name in names]
    return frozenset(c for c in found if isinstance(c, type))


#: torch.nn layers whose own forward never draws random numbers.
_NEVER = _classes(
    "Module", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict", "Identity",
    "Linear", "Bilinear", "LazyLinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
    "ConvTranspose3d", "LazyConv1d", "LazyConv2d", "LazyConv3d", "LazyConvTranspose1d", "LazyConvTranspose2d",
    "LazyConvTranspose3d", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LazyBatchNorm1d", "LazyBatchNorm2d",
    "LazyBatchNorm3d", "SyncBatchNorm", "GroupNorm", "LayerNorm", "RMSNorm", "InstanceNorm1d", "InstanceNorm2d",
    "InstanceNorm3d", "LazyInstanceNorm1d", "LazyInstanceNorm2d", "LazyInstanceNorm3d", "LocalResponseNorm",
    "CrossMapLRN2d", "Embedding", "EmbeddingBag", "ReLU", "ReLU6", "LeakyReLU", "PReLU", "ELU", "SELU", "CELU",
    "GELU", "SiLU", "Mish", "Sigmoid", "Tanh", "Softplus", "Softsign", "Hardtanh", "Hardswish", "Hardsigmoid",
    "Hardshrink", "Softshrink", "Tanhshrink", "Threshold", "LogSigmoid", "Softmax", "Softmin", "LogSoftmax",
    "Softmax2d", "GLU", "MaxPool1d", "MaxPool2d", "MaxPool3d", "MaxUnpool1d", "MaxUnpool2d", "MaxUnpool3d",
    "AvgPool1d", "AvgPool2d", "AvgPool3d", "LPPool1d", "LPPool2d", "LPPool3d", "AdaptiveMaxPool1d",
    "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "Flatten", "Unflatten", "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d", "PixelShuffle",
    "PixelUnshuffle", "ChannelShuffle", "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d",
    "ConstantPad3d", "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d", "ReplicationPad1d",
    "ReplicationPad2d", "ReplicationPad3d", "CircularPad1d", "CircularPad2d", "CircularPad3d", "Fold", "Unfold",
    "CosineSimilarity", "PairwiseDistance", "TransformerEncoder", "TransformerDecoder", "TransformerEncoderLayer",
    "TransformerDecoderLayer", "Transformer",
)

#: torch.nn layers that draw in training when their dropout probability is positive.
_DROPOUT = _classes("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout")


#: Per class (held weakly: classes made on the fly come and go), its forward when last looked at and the class
#: that defines it: a class whose forward is replaced is looked at anew.
_OWNERS: "weakref.WeakKeyDictionary[type, Tuple[Any, type]]" = weakref.WeakKeyDictionary()


def _forward_owner(cls: type) -> type:
    """The class whose forward runs for ``cls``: a subclass that keeps its base's forward is judged as the base
    (looked up once per class: every step asks for every module of every stage)."""
    forward = getattr(cls, "forward", None)
    known = _OWNERS.get(cls)
    if known is not None and known[0] is forward:
        return known[1]
    owner = next((c for c in cls.__mro__ if "forward" in c.__dict__), nn.Module)
    _OWNERS[cls] = (forward, owner)
    return owner


def _own_draws(module: nn.Module) -> bool:
    """Whether ``module``'s own ``forward`` (not its submodules') may draw random numbers."""
    declared = getattr(module, DRAWS_RANDOM, None)
    if isinstance(declared, bool):
        return declared
    owner = _forward_owner(type(module))
    if owner in _NEVER:
        return False
    if owner in _DROPOUT:
        return module.training and float(getattr(module, "p", 0.0)) > 0.0
    if owner is nn.RReLU:
        return module.training
    if owner is nn.MultiheadAttention:
        return module.training and float(getattr(module, "dropout", 0.0)) > 0.0
    if isinstance(module, nn.RNNBase) and owner in (nn.RNN, nn.LSTM, nn.GRU, nn.RNNBase):
        return module.training and float(module.dropout) > 0.0 and module.num_layers > 1
    return True


def may_draw(module: nn.Module) -> bool:
    """Whether running ``module`` may draw random numbers (from its classes and state; see the module notes).

    Example::

        >>> may_draw(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        False
        >>> may_draw(nn.Dropout(0.1))
        True
        >>> may_draw(nn.Dropout(0.1).eval())
        False
    """
    return any(_own_draws(m) for m in module.modules())


def step_seed() -> int:
    """A seed for one step's random streams, drawn from the caller's CPU generator."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())


_MASK = (1 << 64) - 1


def task_seed(seed: int, *keys: int) -> int:
    """A seed for one task, mixed from the step's ``seed`` and the task's keys (SplitMix64)."""
    value = seed & _MASK
    for key in keys:
        value = (value + 0x9E3779B97F4A7C15 + (key & _MASK)) & _MASK
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
        value ^= value >> 31
    return value & ((1 << 63) - 1)


# --- the mode that gives random functions the task's generators ---------------------------------------------

#: Functions and methods that take ``generator=``: the generator is that of the device of this argument
#: (an index into the positional arguments), or, for factories (None), of their ``device=`` keyword.
_TAKES_GENERATOR: Dict[Any, Optional[int]] = {
    torch.rand: None, torch.randn: None, torch.randint: None, torch.randperm: None,
    torch.bernoulli: 0, torch.multinomial: 0, torch.poisson: 0, torch.normal: 0,
    Tensor.bernoulli: 0, Tensor.bernoulli_: 0, Tensor.uniform_: 0, Tensor.normal_: 0, Tensor.random_: 0,
    Tensor.exponential_: 0, Tensor.geometric_: 0, Tensor.log_normal_: 0, Tensor.cauchy_: 0, Tensor.multinomial: 0,
}


def _device_of(args: Tuple[Any, ...], kwargs: Dict[str, Any], position: Optional[int]) -> torch.device:
    if position is not None:
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, Tensor):
                return value.device
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    default = getattr(torch, "get_default_device", None)
    return default() if default is not None else torch.device("cpu")


class RandomStreams(TorchFunctionMode):
    """Gives the random functions called in its block generators of their own, seeded from ``seed``.

    One generator per device, made on first use. See [Note: random streams].
    """

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.generators: Dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        generator = self.generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            # A stable number per device (Python's hash of a string changes from process to process).
            generator.manual_seed(task_seed(self.seed, zlib.crc32(str(device).encode())))
            self.generators[device] = generator
        return generator

    def __torch_function__(
        self, func: Any, types: Any, args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in _TAKES_GENERATOR:
            given = kwargs.get("generator") if func is not torch.poisson or len(args) < 2 else args[1]
            if given is None:
                kwargs["generator"] = self.generator(_device_of(args, kwargs, _TAKES_GENERATOR[func]))
            return func(*args, **kwargs)
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(self, func, args, kwargs)
        return func(*args, **kwargs)


def streams(seed: Optional[int]) -> ContextManager[Any]:
    """Runs the block on random streams of its own seeded from ``seed`` (None: as it is, at next to no cost: a
    do-nothing context manager, no generator, as a task that draws nothing enters it once per action)."""
    if seed is None:
        return contextlib.nullcontext()
    return RandomStreams(seed)


# --- random functions that take no generator: computed from one ---------------------------------------------


def _arguments(
    names: Tuple[str, ...], defaults: Tuple[Any, ...], args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> List[Any]:
    """The values of a call's parameters ``names``, positional or keyword (``train`` counts as ``training``)."""
    if "train" in kwargs and "training" in names:
        kwargs = {**kwargs, "training": kwargs["train"]}
    return list(args[: len(names)]) + [kwargs.get(n, d) for n, d in zip(names[len(args) :], defaults[len(args) :])]


def _keep(input: Tensor, mask: Tensor, scale: float, inplace: bool) -> Tensor:
    if inplace:
        return input.mul_(mask).mul_(scale)
    return input * (mask * scale)


def _bernoulli_like(streams: RandomStreams, shape: Any, keep: float, like: Tensor) -> Tensor:
    mask = torch.empty(shape, dtype=like.dtype, device=like.device)
    return mask.bernoulli_(keep, generator=streams.generator(like.device))


def _feature_shape(input: Tensor, batched_dims: int) -> Tuple[int, ...]:
    """Dropout masks per channel: ``(N, C, 1, …)`` for batched input, ``(C, 1, …)`` for unbatched."""
    leading = 2 if input.dim() > batched_dims else 1
    return tuple(input.shape[:leading]) + (1,) * (input.dim() - leading)


def _dropout(streams: RandomStreams, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    names = ("input", "p", "training", "inplace")
    input, p, training, inplace = _arguments(names, (None, 0.5, True, False), args, kwargs)
    if not training or p == 0.0 or not 0.0 <= p <= 1.0 or not isinstance(input, Tensor):
        return func(*args, **kwargs)  # nothing drawn (or PyTorch's own error for a bad p)
    if p == 1.0:
        return input.mul_(0.0) if inplace else input * 0.0
    if func in (F.dropout, torch.dropout):
        shape = tuple(input.shape)
    else:
        shape = _feature_shape(input, {F.dropout1d: 2, F.dropout2d: 3, F.dropout3d: 4}.get(func, 2))
    return _keep(input, _bernoulli_like(streams, shape, 1.0 - p, input), 1.0 / (1.0 - p), inplace)


def _alpha_dropout(streams: RandomStreams, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    names = ("input", "p", "training", "inplace")
    input, p, training, inplace = _arguments(names, (None, 0.5, False, False), args, kwargs)
    if not training or p == 0.0 or not 0.0 <= p <= 1.0 or not isinstance(input, Tensor):
        return func(*args, **kwargs)
    if p == 1.0:
        return input.mul_(0.0) if inplace else input * 0.0
    feature = func in (F.feature_alpha_dropout, torch.feature_alpha_dropout)
    shape = _feature_shape(input, 2) if feature else tuple(input.shape)
    keep = _bernoulli_like(streams, shape, 1.0 - p, input)
    alpha = -1.7580993408473766  # SELU's negative saturation value, as PyTorch's alpha dropout
    a = 1.0 / math.sqrt((1.0 - p) * (1.0 + p * alpha * alpha))
    b = -a * alpha * p
    fill = (1.0 - keep) * (a * alpha) + b
    if inplace:
        return input.mul_(keep * a).add_(fill)
    return input * (keep * a) + fill


def _rrelu(streams: RandomStreams, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    input, lower, upper, training, inplace = _arguments(
        ("input", "lower", "upper", "training", "inplace"), (None, 1.0 / 8, 1.0 / 3, False, False), args, kwargs
    )
    if not training or not isinstance(input, Tensor):
        return func(*args, **kwargs)
    slope = torch.empty_like(input).uniform_(lower, upper, generator=streams.generator(input.device))
    scaled = torch.where(input >= 0, torch.ones_like(input), slope)
    return input.mul_(scaled) if inplace else input * scaled


def _like(streams: RandomStreams, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``rand_like`` and friends, as their factories with the input's shape (older PyTorch has no generator=)."""
    if kwargs.get("generator") is not None:
        return func(*args, **kwargs)
    input = args[0] if args else kwargs["input"]
    options = {k: v for k, v in kwargs.items() if k not in ("input", "memory_format", "low", "high")}
    options.setdefault("dtype", input.dtype)
    options.setdefault("device", input.device)
    options["generator"] = streams.generator(torch.device(options["device"]))
    shape = tuple(input.shape)
    if func is torch.randint_like:
        bounds = list(args[1:3])  # randint_like(input, high) or randint_like(input, low, high)
        if len(bounds) == 1:
            bounds = [kwargs.get("low", 0), bounds[0]]
        elif not bounds:
            bounds = [kwargs.get("low", 0), kwargs["high"]]
        return torch.randint(bounds[0], bounds[1], shape, **options)
    return (torch.rand if func is torch.rand_like else torch.randn)(shape, **options)


def _attention(streams: RandomStreams, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``scaled_dot_product_attention`` with dropout, computed step by step with the task's generator."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    query, key, value, mask, dropout_p, is_causal, scale, gqa = _arguments(
        names, (None, None, None, None, 0.0, False, None, False), args, kwargs
    )
    if not dropout_p or any(k not in names for k in kwargs):
        return func(*args, **kwargs)
    if gqa and key.size(-3) != query.size(-3):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    length, source = query.size(-2), key.size(-2)
    factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = query @ key.transpose(-2, -1) * factor
    if is_causal:
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1)
    keep = _bernoulli_like(streams, tuple(weights.shape), 1.0 - dropout_p, weights)
    return _keep(weights, keep, 1.0 / (1.0 - dropout_p), False) @ value


_HANDLERS: Dict[Any, Callable[[RandomStreams, Any, Tuple[Any, ...], Dict[str, Any]], Any]] = {
    F.dropout: _dropout, F.dropout1d: _dropout, F.dropout2d: _dropout, F.dropout3d: _dropout,
    torch.dropout: _dropout, torch.feature_dropout: _dropout,
    F.alpha_dropout: _alpha_dropout, F.feature_alpha_dropout: _alpha_dropout,
    torch.alpha_dropout: _alpha_dropout, torch.feature_alpha_dropout: _alpha_dropout,
    F.rrelu: _rrelu, torch.rrelu: _rrelu,
    torch.rand_like: _like, torch.randn_like: _like, torch.randint_like: _like,
    F.scaled_dot_product_attention: _attention,
}
