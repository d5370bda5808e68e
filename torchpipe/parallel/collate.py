"""Helpers for per-replica data: collate functions, recursive moves, and tuple-wise sugar for TupleParallel."""
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

import torch
import torch.utils.data
from torch import Tensor

from torchpipe.transfer import map_structure, move
from torchpipe.types import Device

__all__ = [
    "recursive_to",
    "recursive_cuda",
    "cuda_attrs",
    "Batch",
    "tp_collate",
    "default_collate",
    "tuple_fn",
    "Tuplewise",
    "cat",
    "per_argument",
    "per_output",
]

T = TypeVar("T")
B = TypeVar("B", bound="Batch")


def recursive_to(val: T, device: Device, **kwargs: Any) -> T:
    """``val.to(device, **kwargs)``, recursing into lists, tuples, dicts (and dataclasses).

    A value without a ``.to`` method is returned as it is. With no keyword
    other than ``non_blocking`` this is :func:`torchpipe.transfer.move`.
    """
    if set(kwargs) <= {"non_blocking"}:
        return move(val, device, non_blocking=bool(kwargs.get("non_blocking", False)))

    def to(leaf: Any) -> Any:
        method = getattr(leaf, "to", None)
        if isinstance(leaf, type) or not callable(method):
            return leaf
        return method(device, **kwargs)

    return map_structure(to, val)


def recursive_cuda(val: T, device: Optional[Device] = None, **kwargs: Any) -> T:
    """``val.cuda(device, **kwargs)``, recursing into lists, tuples, dicts (and dataclasses).

    A value without ``.cuda`` is moved with ``.to`` instead, and one without
    either is returned as it is. ``device`` defaults to the current CUDA device.
    """

    def cuda(leaf: Any) -> Any:
        if isinstance(leaf, type):
            return leaf
        method = getattr(leaf, "cuda", None)
        if callable(method):
            return method(device, **kwargs)
        method = getattr(leaf, "to", None)
        if callable(method):
            target = torch.device("cuda", torch.cuda.current_device()) if device is None else device
            return method(target, **kwargs)
        return leaf

    return map_structure(cuda, val)


def cuda_attrs(obj: T, *args: Any, **kwargs: Any) -> T:
    """Moves every attribute of ``obj`` with :func:`recursive_cuda`, in place; returns ``obj``.

    A generic ``.cuda()`` for your own classes::

        def cuda(self, device=None):
            return cuda_attrs(self, device)
    """
    for name, value in list(vars(obj).items()):
        setattr(obj, name, recursive_cuda(value, *args, **kwargs))
    return obj


def _to_attrs(obj: T, device: Device, **kwargs: Any) -> T:
    for name, value in list(vars(obj).items()):
        setattr(obj, name, recursive_to(value, device, **kwargs))
    return obj


class Batch:
    """A base class for batch types whose ``.cuda()`` / ``.to()`` move every attribute in place.

    Example::

        class Pair(Batch):
            def __init__(self, x, y):
                self.x, self.y = x, y

        pair = Pair(torch.ones(2), [torch.zeros(2)]).to('cpu')  # returns pair itself
    """

    def cuda(self: B, device: Optional[Device] = None, **kwargs: Any) -> B:
        return cuda_attrs(self, device, **kwargs)

    def to(self: B, device: Device, **kwargs: Any) -> B:
        return _to_attrs(self, device, **kwargs)


def _contiguous_parts(items: Sequence[T], parts: int) -> List[Sequence[T]]:
    """``items`` cut into ``parts`` contiguous, in-order, non-empty pieces whose sizes differ by at most 1."""
    size, extra = divmod(len(items), parts)
    pieces: List[Sequence[T]] = []
    start = 0
    for index in range(parts):
        end = start + size + (1 if index < extra else 0)
        pieces.append(items[start:end])
        start = end
    return pieces


def per_argument(results: Sequence[Any]) -> Any:
    """Per-part collate results regrouped per argument (see :func:`tp_collate`)."""
    first = results[0]
    if isinstance(first, (list, tuple)) and len({len(r) for r in results}) > 1:
        raise ValueError(
            f"collate_fn returned sequences of different lengths for the parts: {[len(r) for r in results]}"
        )
    if isinstance(first, dict):
        return {k: [r[k] for r in results] for k in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(tuple(column) for column in zip(*results)))
    if isinstance(first, (list, tuple)):
        return [tuple(column) for column in zip(*results)]
    return tuple(results)


class _TupleCollate:
    """The collate function :func:`tp_collate` returns (a class, so DataLoader workers can pickle it)."""

    def __init__(self, ndevices: int, collate_fn: Callable[[List[Any]], Any]) -> None:
        self.ndevices = ndevices
        self.collate_fn = collate_fn

    def __call__(self, items: List[Any]) -> Any:
        if len(items) < self.ndevices:
            raise ValueError(
                f"cannot split a batch of {len(items)} items into {self.ndevices} non-empty parts; "
                f"use a batch size of at least {self.ndevices} and DataLoader(drop_last=True)"
            )
        return per_argument([self.collate_fn(list(part)) for part in _contiguous_parts(items, self.ndevices)])

    def __repr__(self) -> str:
        return f"tp_collate({self.ndevices})({getattr(self.collate_fn, '__name__', self.collate_fn)})"


def tp_collate(ndevices: int) -> Callable[[Callable[[List[Any]], Any]], Callable[[List[Any]], Any]]:
    """Makes a collate function for a module work for ``TupleParallel(module)`` (a decorator).

    The list of dataset items is cut into ``ndevices`` contiguous, non-empty,
    in-order parts; ``collate_fn`` collates each; the results come back per
    argument, so ``for x, y in loader: model(x, y)`` feeds a ``TupleParallel``:
    items ``(x, y)`` give ``[(x_0, ..., x_n-1), (y_0, ..., y_n-1)]``, dict
    items give ``{k: [v_0, ..., v_n-1]}``, and any other result (a tensor, for
    example) gives the ``n`` per-part results as a tuple.

    Raises:
        ValueError: ``ndevices`` is not positive; or (when called) the batch
            has fewer than ``ndevices`` items.
    """
    if ndevices < 1:
        raise ValueError(f"ndevices must be a positive int, got {ndevices}")

    def decorate(collate_fn: Callable[[List[Any]], Any]) -> Callable[[List[Any]], Any]:
        return _TupleCollate(ndevices, collate_fn)

    return decorate


def default_collate(ndevices: int) -> Callable[[List[Any]], Any]:
    """``tp_collate(ndevices)(torch.utils.data.default_collate)``: pass it as ``DataLoader(collate_fn=...)``."""
    return tp_collate(ndevices)(torch.utils.data.default_collate)


def per_output(results: Sequence[Any]) -> Union[Tuple[Any, ...], List[Tuple[Any, ...]]]:
    """Per-part results as a tuple; if each result is a tuple, a list of per-output tuples instead."""
    if results and all(isinstance(r, tuple) for r in results):
        lengths = [len(r) for r in results]
        if len(set(lengths)) > 1:
            raise ValueError(f"the parts returned tuples of different lengths ({lengths}); they cannot be regrouped")
        return [tuple(column) for column in zip(*results)]
    return tuple(results)


def tuple_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Makes ``fn`` take and return arguments in tuple form, one element per part (a decorator).

    Where ``a, b = fn(x, y)``, ``(a0, a1), (b0, b1) = tuple_fn(fn)((x0, x1), (y0, y1))``.
    The parts run one after another, on the calling thread.

    Raises:
        TypeError: an argument is not a list or tuple.
        ValueError: the arguments have different lengths.
    """

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        named = [(f"positional argument {i}", v) for i, v in enumerate(args)]
        named += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
        for name, value in named:
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"{name} is a {type(value).__name__}, not a list or tuple of parts")
        lengths = {len(v) for _, v in named}
        if len(lengths) > 1:
            raise ValueError(
                "every argument must have the same number of parts; got lengths "
                + ", ".join(f"{len(v)} ({name})" for name, v in named)
            )
        count = lengths.pop() if lengths else 0
        results = [fn(*(a[i] for a in args), **{k: v[i] for k, v in kwargs.items()}) for i in range(count)]
        return per_output(results)

    wrapped.__name__ = getattr(fn, "__name__", "tuple_fn")
    wrapped.__doc__ = getattr(fn, "__doc__", None)
    return wrapped


class Tuplewise:
    """Applies item and attribute access to every element of a sequence.

    Example::

        Tuplewise([(0, 1), (2, 3), (4, 5)])[0] == [0, 2, 4]
        Tuplewise([torch.ones(2), torch.ones(3)]).shape == [torch.Size([2]), torch.Size([3])]
    """

    def __init__(self, seq: Sequence[Any]) -> None:
        object.__setattr__(self, "_items", list(seq))

    def __getitem__(self, key: Any) -> List[Any]:
        return [item[key] for item in self._items]

    def __getattr__(self, name: str) -> List[Any]:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return [getattr(item, name) for item in self._items]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __repr__(self) -> str:
        return f"Tuplewise({self._items!r})"


def cat(returns: Any, dim: int = 0) -> Any:
    """``torch.cat`` of per-replica outputs: ``TupleParallel(..., transfer_output=True, reduction=cat)``.

    A tuple of tensors becomes one tensor; a list or tuple of per-output tuples
    (what a module returning several values gives) becomes a list with each
    tuple of tensors concatenated (other values are left as they are).
    0-dimensional tensors (per-replica losses, say) are stacked into a vector.
    """
    if _all_tensors(returns):
        return _cat(returns, dim)
    if isinstance(returns, (list, tuple)):
        return [_cat(r, dim) if _all_tensors(r) else r for r in returns]
    return returns


def _cat(tensors: Sequence[Tensor], dim: int) -> Tensor:
    if all(t.dim() == 0 for t in tensors):
        return torch.stack(list(tensors))
    return torch.cat(list(tensors), dim)


def _all_tensors(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, Tensor) for v in value)

