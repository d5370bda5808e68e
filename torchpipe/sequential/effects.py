"""What a graph node does besides computing its value: drawing random numbers, writing or aliasing a tensor."""
import inspect
import operator
from typing import Any, Callable, Dict, FrozenSet, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["draws_random", "call_draws_random", "written_input", "aliased_input"]

# --- random numbers --------------------------------------------------------------------------------


def _existing(*names: str, module: Any = torch) -> FrozenSet[Callable[..., Any]]:
    """The functions of ``module`` with these names (some exist only in some PyTorch versions)."""
    return frozenset(getattr(module, name) for name in names if hasattr(module, name))


#: Functions that always draw random numbers.
_RANDOM_FUNCTIONS = _existing(
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
    "bernoulli", "multinomial", "normal", "poisson", "native_dropout",
) | _existing(
    "gumbel_softmax", "fractional_max_pool2d", "fractional_max_pool3d",
    "fractional_max_pool2d_with_indices", "fractional_max_pool3d_with_indices", module=F,
) | _existing(
    "uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
    "kaiming_normal_", "orthogonal_", "sparse_", module=nn.init,
)

#: Functions that draw unless an argument says they do not: (argument name, position, default, value that
#: means no draw). Dropouts draw in training; RReLU draws in training (off by default);
#: scaled_dot_product_attention draws when dropout_p is not 0.
_CONDITIONAL: Dict[Callable[..., Any], Tuple[str, int, Any, Any]] = {}
for _function in _existing("dropout", "dropout1d", "dropout2d", "dropout3d", module=F):
    _CONDITIONAL[_function] = ("training", 2, True, False)
for _function in _existing("alpha_dropout", "feature_alpha_dropout", module=F):
    _CONDITIONAL[_function] = ("training", 2, False, False)
for _function in _existing("rrelu", "rrelu_", module=F) | _existing("rrelu", "rrelu_"):
    _CONDITIONAL[_function] = ("training", 3, False, False)
for _function in _existing("dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "feature_dropout",
                           "feature_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_"):
    _CONDITIONAL[_function] = ("train", 2, None, False)
for _function in _existing("scaled_dot_product_attention", module=F):
    _CONDITIONAL[_function] = ("dropout_p", 4, 0.0, 0.0)

#: Dropouts draw nothing when their probability is statically 0: PyTorch returns the input as it is (a model
#: configured without dropout, as Hugging Face's are with ``*_pdrop=0.0``, still calls them). (argument name,
#: position, default)
_PROBABILITY: Dict[Callable[..., Any], Tuple[str, int, Any]] = {}
for _function in _existing("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                           module=F):
    _PROBABILITY[_function] = ("p", 1, 0.5)
for _function in _existing("dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "feature_dropout",
                           "feature_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_"):
    _PROBABILITY[_function] = ("p", 1, None)

#: Tensor methods that draw random numbers.
_RANDOM_METHODS = frozenset({
    "bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_",
    "log_normal_", "cauchy_", "multinomial",
})

#: Modules whose functions are known not to draw: Python's operators and builtins, and math.
_SAFE_MODULES = frozenset({"_operator", "operator", "builtins", "math"})


def _argument(args: Sequence[Any], kwargs: Mapping[str, Any], name: str, position: int, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    if len(args) > position:
        return args[position]
    return default


def _from_torch(function: Callable[..., Any]) -> bool:
    module = getattr(function, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")


def call_draws_random(op: str, target: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a call (an fx node's ``op``, ``target``, ``args`` and ``kwargs``) may draw random numbers.

    See :func:`draws_random`; an argument that is an ``fx.Node`` (or a
    ``Proxy``) is not static, so a dropout whose ``training`` is one draws.
    """
    if op == "call_method":
        return target in _RANDOM_METHODS
    if op != "call_function":
        return False
    if target in _RANDOM_FUNCTIONS:
        return True
    if target in _CONDITIONAL:
        name, position, default, off = _CONDITIONAL[target]
        value = _argument(args, kwargs, name, position, default)
        if isinstance(value, (bool, int, float)) and value == off:
            return False
        if target in _PROBABILITY:
            name, position, default = _PROBABILITY[target]
            p = _argument(args, kwargs, name, position, default)
            return not (isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0)
        return True
    if _from_torch(target):
        return False
    return (getattr(target, "__module__", None) or "") not in _SAFE_MODULES


def draws_random(node: fx.Node) -> bool:
    """Whether the node's own code may draw random numbers (the modules it calls are not looked into).

    True for the random functions and methods of PyTorch, for dropouts unless
    ``training`` is statically False or ``p`` statically 0 (and
    ``scaled_dot_product_attention`` unless ``dropout_p`` is statically 0),
    and for any function that is not
    PyTorch's, Python's operators and builtins or ``math``'s: unknown code may
    draw.
    """
    return call_draws_random(node.op, node.target, node.args, node.kwargs)


# --- writing in place and aliasing -----------------------------------------------------------------

_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul, operator.setitem,
})

#: Methods whose names end in ``_`` but that write no tensor data.
_NOT_WRITING = frozenset({"requires_grad_", "share_memory_", "retain_grad"})

#: Methods that may return (a view of) their tensor rather than a new one.
_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "t", "permute", "narrow", "select", "expand",
    "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "unfold", "diagonal", "as_strided", "detach",
    "chunk", "split", "tensor_split", "unbind", "swapaxes", "swapdims", "movedim", "moveaxis", "contiguous",
    "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool", "cpu", "cuda",
    "__getitem__", "real", "imag", "view_as_real", "view_as_complex", "align_as", "refine_names", "rename",
})

_VIEW_FUNCTIONS = frozenset(
    {operator.getitem, getattr}
    | set(_existing(
        "reshape", "flatten", "squeeze", "unsqueeze", "transpose", "permute", "narrow", "select", "chunk",
        "split", "tensor_split", "unbind", "t", "movedim", "moveaxis", "swapaxes", "swapdims", "diagonal",
        "as_strided", "detach", "view_as_real", "view_as_complex", "hsplit", "vsplit", "dsplit", "real", "imag",
        "unflatten", "atleast_1d", "atleast_2d", "atleast_3d", "broadcast_to",
    ))
)

#: Parameter-free modules that may return their input itself (Dropout does in eval mode).
_ALIASING_MODULES: Tuple[type, ...] = (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd)


def _first_node(node: fx.Node) -> Optional[fx.Node]:
    first = node.args[0] if node.args else None
    return first if isinstance(first, fx.Node) else None


def _inplace_argument(target: Callable[..., Any], node: fx.Node) -> bool:
    """Whether a ``torch.nn.functional`` call passes ``inplace=True``."""
    if node.kwargs.get("inplace") is True:
        return True
    if not getattr(target, "__module__", "").startswith("torch.nn.functional"):
        return False
    try:
        bound = inspect.signature(target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return False
    return bound.arguments.get("inplace") is True


def written_input(node: fx.Node, modules: Mapping[str, Any]) -> Optional[fx.Node]:
    """The argument that ``node`` writes in place, if it writes one.

    In-place methods and functions (a name ending in ``_``), ``inplace=True``,
    modules with ``inplace=True`` (``nn.ReLU(inplace=True)``), in-place
    operators and item assignment write their first argument.
    """
    if node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITING:
            return _first_node(node)
        return None
    if node.op == "call_module":
        return _first_node(node) if getattr(modules[str(node.target)], "inplace", False) is True else None
    if node.op != "call_function":
        return None
    target = node.target
    assert callable(target), f"call_function target {target!r} is not callable"
    if isinstance(target, torch._ops.OpOverload):
        return _schema_argument(node, target, write=True)
    if target in _INPLACE_OPERATORS:
        return _first_node(node)
    name = getattr(target, "__name__", "")
    if (_from_torch(target) or getattr(target, "__objclass__", None) is torch._C.TensorBase) and (
        name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITING
    ):
        return _first_node(node)
    if _inplace_argument(target, node):
        return _first_node(node)
    return None


def _schema_argument(node: fx.Node, op: Any, write: bool) -> Optional[fx.Node]:
    """The argument of an ATen operator that its schema says it writes (``Tensor(a!)``) or, for
    ``write=False``, that its result may alias (``Tensor(a)``, a view)."""
    schema = op._schema
    if not write and not any(r.alias_info is not None for r in schema.returns):
        return None
    for i, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is None or (write and not info.is_write):
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        return value if isinstance(value, fx.Node) else None
    return None


def aliased_input(node: fx.Node, modules: Mapping[str, Any]) -> Optional[fx.Node]:
    """The argument whose memory ``node``'s value may share (views, in-place results, identity modules)."""
    if written_input(node, modules) is not None:
        return _first_node(node)
    if node.op == "call_method" and node.target in _VIEW_METHODS:
        return _first_node(node)
    if node.op == "call_function" and node.target in _VIEW_FUNCTIONS:
        return _first_node(node)
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return _schema_argument(node, node.target, write=False)
    if node.op == "call_module":
        module = modules[str(node.target)]
        if isinstance(module, _ALIASING_MODULES):
            return _first_node(node)
    return None
