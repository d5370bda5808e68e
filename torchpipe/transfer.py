"""The device-transfer core: move, split and join nested tensor structures between devices.

Everything in torchpipe that moves tensors goes through this module: GPipe's
micro-batch split and join, the copies between partitions (stream-aware on
CUDA), skip connections, and the scatter / gather / copy of
:mod:`torchpipe.parallel`.

A *structure* is a tensor, or a list, tuple (named tuples too), dict or
dataclass instance of structures, or any other object (a *leaf* that is not a
tensor). :func:`move` sends every tensor (and every leaf with a ``.to``
method) to a device, :func:`split` cuts every tensor along ``dim`` into parts
(other leaves are shared by every part), and :func:`join` concatenates parts
back. All three are differentiable, so gradients flow through them as through
the equivalent ``torch`` calls.

[Note: one transfer core] If you find yourself writing another recursive
"move this structure to that device" function, call the one here instead.
"""
import dataclasses
import threading
from contextlib import contextmanager
from typing import (
    Any,
    Callable,
    Collection,
    Generator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    cast,
)

import torch
from torch import Tensor, nn

from torchpipe.stream import (
    CPU_EVENT,
    AbstractEvent,
    AbstractStream,
    record_event,
    record_stream,
    use_stream,
    wait_event,
    wait_stream,
)
from torchpipe.types import Device

__all__ = [
    "map_structure",
    "tensors_of",
    "move",
    "split",
    "scatter",
    "join",
    "gather",
    "send",
    "receive",
    "TransferRecord",
    "record_transfers",
    "log_transfer",
]

T = TypeVar("T")


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def map_structure(fn: Callable[[Any], Any], obj: T) -> T:
    """Applies ``fn`` to every leaf of ``obj`` and rebuilds the same structure around the results."""
    return cast(T, _map(fn, obj))


def _map(fn: Callable[[Any], Any], obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [_map(fn, x) for x in obj]
    if _is_namedtuple(obj):
        return type(obj)(*(_map(fn, x) for x in obj))
    if isinstance(obj, tuple):
        return tuple(_map(fn, x) for x in obj)
    if isinstance(obj, dict):
        rebuilt = {k: _map(fn, v) for k, v in obj.items()}
        return rebuilt if type(obj) is dict else type(obj)(rebuilt)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _map(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return fn(obj)


def tensors_of(obj: Any) -> List[Tensor]:
    """Every tensor in ``obj``, in the order :func:`map_structure` visits them."""
    found: List[Tensor] = []

    def visit(leaf: Any) -> Any:
        if isinstance(leaf, Tensor):
            found.append(leaf)
        return leaf

    map_structure(visit, obj)
    return found


def move(obj: T, device: Device, *, non_blocking: bool = False) -> T:
    """Moves every tensor in ``obj`` to ``device`` (differentiably, as ``Tensor.to``).

    A leaf that is not a tensor but has a ``.to`` method (a custom batch type,
    for example) is moved with ``leaf.to(device)``; modules are left alone,
    and so is everything else.
    """
    device = torch.device(device) if not isinstance(device, torch.device) else device

    def to(leaf: Any) -> Any:
        if isinstance(leaf, Tensor):
            return leaf.to(device, non_blocking=non_blocking)
        if isinstance(leaf, nn.Module) or isinstance(leaf, type):
            return leaf
        method = getattr(leaf, "to", None)
        if callable(method):
            return method(device)
        return leaf

    return map_structure(to, obj)


def split(obj: T, parts: int, dim: int = 0) -> List[T]:
    """Cuts every tensor in ``obj`` into at most ``parts`` pieces along ``dim``, like ``torch.chunk``.

    Returns one structure per piece. A batch that does not divide by ``parts``
    makes a smaller last piece; a batch smaller than ``parts`` makes fewer
    pieces (an empty batch, one empty piece). Leaves that are not tensors, and
    0-dimensional tensors, are shared by every piece.

    Raises:
        ValueError: ``parts`` is not positive, or two tensors of ``obj`` have
            different sizes along ``dim`` (so they cannot be cut alike).
    """
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts; parts must be a positive int")
    tensors = [t for t in tensors_of(obj) if t.dim() > 0]
    sizes = {t.size(dim) for t in tensors}
    if len(sizes) > 1:
        raise ValueError(
            f"cannot split tensors of different sizes along dim {dim} alike (sizes: {sorted(sizes)}); "
            "every tensor must share the batch dimension"
        )
    if not sizes:
        return [obj for _ in range(parts)]
    if sizes == {0}:
        return [obj]
    if type(obj) is tuple and all(isinstance(t, Tensor) and t.dim() > 0 for t in obj):  # type: ignore[attr-defined]
        # A tuple of tensors (a Batch's values, every step): no structure to rebuild.
        columns = [t.chunk(parts, dim) for t in tensors]
        return [cast(T, tuple(column[index] for column in columns)) for index in range(len(columns[0]))]
    # Each tensor cut once, not once per piece (by identity: the structure holds them while it is rebuilt).
    cut = {id(t): t.chunk(parts, dim) for t in tensors}
    count = len(cut[id(tensors[0])])

    pieces: List[Any] = []
    for index in range(count):

        def take(leaf: Any, index: int = index) -> Any:
            if isinstance(leaf, Tensor) and leaf.dim() > 0:
                return cut[id(leaf)][index]
            return leaf

        pieces.append(map_structure(take, obj))
    return pieces


def scatter(obj: T, devices: Sequence[Device], dim: int = 0, *, non_blocking: bool = False) -> List[T]:
    """Splits ``obj`` into ``len(devices)`` pieces along ``dim`` and moves piece i to ``devices[i]``.

    Fewer pieces come back when the batch is smaller than ``len(devices)``.
    """
    pieces = split(obj, len(devices), dim)
    return [move(piece, device, non_blocking=non_blocking) for piece, device in zip(pieces, devices)]


def join(parts: Sequence[T], dim: int = 0, *, keep_keys: Collection[Any] = ()) -> T:
    """Concatenates structures of the same shape along ``dim`` (the inverse of :func:`split`).

    Tensors are concatenated (0-dimensional ones are stacked into a vector);
    other leaves are taken from the first part. The values of dict keys in
    ``keep_keys``, at any depth, are not joined but returned as a tuple with
    one element per part.

    Raises:
        ValueError: ``parts`` is empty or its structures differ.
    """
    if not parts:
        raise ValueError("cannot join zero parts")
    return cast(T, _join(list(parts), dim, frozenset(keep_keys)))


def _join(parts: List[Any], dim: int, keep_keys: Collection[Any]) -> Any:
    first = parts[0]
    if isinstance(first, Tensor):
        if not all(isinstance(p, Tensor) for p in parts):
            raise ValueError("cannot join a tensor with a non-tensor")
        if len(parts) == 1:
            return first
        if first.dim() == 0:
            return torch.stack(parts)
        return torch.cat(parts, dim)
    if isinstance(first, (list, tuple)):
        if any(type(p) is not type(first) or len(p) != len(first) for p in parts):
            raise ValueError(f"cannot join parts of different structure: {[type(p).__name__ for p in parts]}")
        items = [_join([p[k] for p in parts], dim, keep_keys) for k in range(len(first))]
        if isinstance(first, list):
            return items
        if _is_namedtuple(first):
            return type(first)(*items)
        return tuple(items)
    if isinstance(first, dict):
        if any(not isinstance(p, dict) or p.keys() != first.keys() for p in parts):
            raise ValueError("cannot join dicts with different keys")
        joined = {
            k: tuple(p[k] for p in parts) if k in keep_keys else _join([p[k] for p in parts], dim, keep_keys)
            for k in first
        }
        return joined if type(first) is dict else type(first)(joined)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        changes = {
            f.name: _join([getattr(p, f.name) for p in parts], dim, keep_keys)
            for f in dataclasses.fields(first)
            if f.init
        }
        return dataclasses.replace(first, **changes)
    return first


def gather(
    parts: Sequence[T], device: Device, dim: int = 0, *, keep_keys: Collection[Any] = ()
) -> T:
    """Moves every part to ``device`` and joins them along ``dim`` (see :func:`join`).

    The values of dict keys in ``keep_keys`` stay on their own devices, one per part.
    """
    if not keep_keys:
        return join([move(p, device) for p in parts], dim)
    moved = [_move_except(p, device, frozenset(keep_keys)) for p in parts]
    return cast(T, join(moved, dim, keep_keys=keep_keys))


def _move_except(obj: Any, device: Device, keep_keys: Collection[Any]) -> Any:
    if isinstance(obj, dict):
        moved = {k: v if k in keep_keys else _move_except(v, device, keep_keys) for k, v in obj.items()}
        return moved if type(obj) is dict else type(obj)(moved)
    if isinstance(obj, (list, tuple)) and not _is_namedtuple(obj):
        items = [_move_except(x, device, keep_keys) for x in obj]
        return items if isinstance(obj, list) else tuple(items)
    return move(obj, device)


# --- stream-aware copies between pipeline partitions -------------------------------------------


def send(
    tensors: Sequence[Optional[Tensor]],
    device: torch.device,
    *,
    source_stream: AbstractStream,
    source_copy_stream: AbstractStream,
    target_copy_stream: AbstractStream,
) -> Tuple[List[Optional[Tensor]], AbstractEvent]:
    """Starts copying ``tensors`` to ``device``; the consumer passes the result to :func:`receive`.

    Tensors already on ``device`` are handed over as they are. On CUDA the copy
    runs on the copy streams of the source and target devices, after the work
    already queued on ``source_stream`` (which produced the tensors), so it
    overlaps with later compute; the returned event marks its end. A copy to
    the CPU is synchronous, so the CPU consumer never reads before it lands.
    """
    if all(t is None or t.device == device for t in tensors):
        if any(t is not None and t.is_cuda for t in tensors):
            return list(tensors), record_event(source_stream)
        return list(tensors), CPU_EVENT
    wait_stream(source_copy_stream, source_stream)
    wait_stream(target_copy_stream, source_copy_stream)
    non_blocking = device.type == "cuda"
    copied: List[Optional[Tensor]] = []
    with use_stream(source_copy_stream), use_stream(target_copy_stream):
        for tensor in tensors:
            if tensor is None:
                copied.append(None)
                continue
            copy = tensor.to(device, non_blocking=non_blocking)
            # The source is read on the copy streams: keep its memory until the copy ends.
            record_stream(tensor, source_copy_stream)
            record_stream(copy, target_copy_stream)
            copied.append(copy)
    return copied, record_event(target_copy_stream)


def receive(
    tensors: Sequence[Optional[Tensor]], event: AbstractEvent, target_stream: AbstractStream
) -> List[Optional[Tensor]]:
    """Makes ``target_stream`` wait for the copy that :func:`send` started, then returns the tensors."""
    wait_event(target_stream, event)
    for tensor in tensors:
        if tensor is not None:
            # Allocated on the copy stream, used on the target stream from now on.
            record_stream(tensor, target_stream)
    return list(tensors)


# --- an opt-in log of what crossed between partitions ------------------------------------------


class TransferRecord(NamedTuple):
    """One hand-over of tensors between two pipeline partitions (see :func:`record_transfers`)."""

    #: ``'activation'``, ``'gradient'``, ``'skip'`` or ``'skip-gradient'``.
    kind: str
    #: Index of the partition the tensors come from.
    source: int
    #: Index of the partition the tensors go to.
    target: int
    #: Index of the micro-batch.
    microbatch: int
    #: Device the tensors come from and go to.
    source_device: torch.device
    target_device: torch.device
    #: Total bytes handed over.
    nbytes: int
    #: The skip's name (``None`` for the main path).
    name: Optional[str]


_recorders: List[List[TransferRecord]] = []
_recorders_lock = threading.Lock()


@contextmanager
def record_transfers() -> Generator[List[TransferRecord], None, None]:
    """Records every hand-over between partitions made inside the block.

    Example::

        with torchpipe.transfer.record_transfers() as log:
            model(x).sum().backward()
        skips = [r for r in log if r.kind == 'skip']
    """
    log: List[TransferRecord] = []
    with _recorders_lock:
        _recorders.append(log)
    try:
        yield log
    finally:
        with _recorders_lock:
            _recorders.remove(log)


def log_transfer(
    kind: str,
    source: int,
    target: int,
    microbatch: int,
    tensors: Sequence[Optional[Tensor]],
    source_device: torch.device,
    target_device: torch.device,
    name: Optional[str] = None,
) -> None:
    """Adds a hand-over to every active :func:`record_transfers` log (free when none is active).

    The devices are given by the caller, who knows where the tensors came from
    (after a copy, every tensor is on the target device).
    """
    if not _recorders:
        return
    present = [t for t in tensors if t is not None]
    record = TransferRecord(
        kind,
        source,
        target,
        microbatch,
        source_device,
        target_device,
        sum(t.numel() * t.element_size() for t in present),
        name,
    )
    with _recorders_lock:
        for log in _recorders:
            log.append(record)
