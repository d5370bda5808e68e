"""The wire format of a message between ranks: a fixed-size header that says what follows, then the tensors.

Every message names everything its receiver needs to allocate and rebuild it:
the number of tensors, and for each whether it is present, its dtype, whether
the receiving leaf needs grad, and its shape (a DTensor's local shape, then
its placements and global shape: see ``distributed/dtensors.py``); whether
the stage output was a single tensor; and the message's kind (data, a skip that was not stashed, or
an abort). The receiver may guess the layout from the message's last
crossing to post its receives early, but the header always says what the
message is, so a shorter sequence or an uneven last micro-batch can never be
received into a stale buffer (see [Note: expected layouts] in
``distributed/packing.py``).
"""
import ctypes
import enum
import functools
import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from torchpipe.distributed.dtensors import Sharding

__all__ = ["HEADER_LENGTH", "Kind", "Header", "encode", "decode", "DTYPES", "Layout", "pack", "unpack", "packed_bytes"]

#: int64 entries in a header.
HEADER_LENGTH = 256
_HEADER_BYTES = HEADER_LENGTH * 8

#: The dtypes a message may carry, by code (the position in this tuple).
DTYPES: Tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)
_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
_SIZES = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in DTYPES}
_MAGIC = 0x70697065  # "pipe"


#: A message's layout: the dtype and shape of each tensor it carries (absent ones left out).
Layout = Tuple[Tuple[torch.dtype, Tuple[int, ...]], ...]


class Kind(enum.IntEnum):
    """What a message is."""

    #: Tensors follow the header.
    DATA = 1
    #: A declared skip that the layer did not stash this time (nothing follows).
    NOT_STASHED = 2
    #: The sender's step failed (or it learnt that another rank's did): nothing follows, nothing more comes.
    ABORT = 3


class Header:
    """A decoded header: the kind, whether the value is a single tensor, and per tensor its metadata (shared by
    every message with the same header: read it, never change it)."""

    __slots__ = ("kind", "atomic", "tensors", "layout", "requires_grad", "shardings")

    def __init__(
        self, kind: Kind, atomic: bool, tensors: Tuple[Optional[Tuple[torch.dtype, bool, Tuple[int, ...]]], ...],
        shardings: Tuple[Optional[Sharding], ...] = (),
    ) -> None:
        self.kind = kind
        self.atomic = atomic
        #: Per tensor: None (absent), or (dtype, requires_grad, shape).
        self.tensors = tensors
        #: The dtype and shape of each tensor present: what the message carries.
        self.layout: Layout = tuple((dtype, shape) for dtype, _, shape in filter(None, tensors))
        #: Per tensor: whether the receiving leaf requires grad (False where absent).
        self.requires_grad = tuple(meta is not None and meta[1] for meta in tensors)
        #: Per tensor: how the DTensor it was lies on the tp mesh (None: a plain tensor, or absent); empty where
        #: none was a DTensor.
        self.shardings = shardings if any(shardings) else ()


def encode(kind: Kind, tensors: Sequence[Optional[Tensor]] = (), requires_grad: Sequence[bool] = (),
           atomic: bool = False, shardings: Sequence[Optional[Sharding]] = ()) -> Tensor:
    """The header of a message as an int64 tensor of :data:`HEADER_LENGTH` entries (shared by every message of
    the same header: read it, never write it). ``shardings``: per tensor, where it is a DTensor's local shard,
    how the DTensor lies (see :func:`~torchpipe.distributed.dtensors.split`).

    Raises:
        ValueError: a dtype that cannot cross (see :data:`DTYPES`), or more
            tensors and dimensions than a header holds.
    """
    values = [_MAGIC, int(kind), int(atomic), len(tensors)]
    for k, tensor in enumerate(tensors):
        if tensor is None:
            values.append(0)
            continue
        code = _CODES.get(tensor.dtype)
        if code is None:
            raise ValueError(f"a tensor of dtype {tensor.dtype} cannot be sent between stages; "
                             f"supported: {', '.join(map(str, DTYPES))}")
        flag = bool(requires_grad[k]) if k < len(requires_grad) else False
        sharding = shardings[k] if k < len(shardings) else None
        values += [1 if sharding is None else 2, code, int(flag), tensor.dim(), *tensor.shape]
        if sharding is not None:
            assert len(sharding.shape) == tensor.dim(), "a DTensor's shard has its global shape's dimensions"
            values += [len(sharding.placements), *(v for placement in sharding.placements for v in placement),
                       *sharding.shape]
    if len(values) > HEADER_LENGTH:
        raise ValueError(
            f"a message of {len(tensors)} tensors needs {len(values)} header entries, more than the "
            f"{HEADER_LENGTH} a header holds; pass fewer tensors between stages"
        )
    return _header(tuple(values))


@functools.lru_cache(maxsize=1024)
def _header(values: Tuple[int, ...]) -> Tensor:
    """The header tensor of ``values`` (a message's header seldom changes between micro-batches and steps: made
    once per header, on the sending end)."""
    header = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
    header[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return header


def decode(message: Tensor) -> Header:
    """The :class:`Header` at the start of ``message``: a header as :func:`encode` made it, or a packed message
    (a CPU tensor either way, received whole).

    Raises:
        ValueError: it is not a torchpipe header (the ranks are out of step).
    """
    assert message.device.type == "cpu" and message.is_contiguous(), "a header is read from CPU memory"
    assert message.numel() * message.element_size() >= _HEADER_BYTES, "a message starts with a whole header"
    # The header's bytes name it: a message's header seldom changes between micro-batches and steps, so each
    # is decoded once (a copy of 2 KiB and a look-up, in place of 256 integers made Python objects).
    return _decoded(ctypes.string_at(message.data_ptr(), _HEADER_BYTES))


@functools.lru_cache(maxsize=1024)
def _decoded(raw: bytes) -> Header:
    values = memoryview(raw).cast("q").tolist()  # int64 in this machine's byte order, as the sender wrote them
    if values[0] != _MAGIC:
        raise ValueError("received a message that is not a torchpipe header: the ranks' schedules disagree")
    kind, atomic, count = Kind(values[1]), bool(values[2]), values[3]
    position = 4
    tensors: List[Optional[Tuple[torch.dtype, bool, Tuple[int, ...]]]] = []
    shardings: List[Optional[Sharding]] = []
    for _ in range(count):
        present = values[position]
        if present == 0:
            tensors.append(None)
            shardings.append(None)
            position += 1
            continue
        code, flag, ndim = values[position + 1], values[position + 2], values[position + 3]
        shape = tuple(int(v) for v in values[position + 4 : position + 4 + ndim])
        tensors.append((DTYPES[code], bool(flag), shape))
        position += 4 + ndim
        if present == 2:  # a DTensor's shard: its placements, then its global shape
            places = values[position]
            pairs = values[position + 1 : position + 1 + 2 * places]
            placements = tuple((int(pairs[2 * j]), int(pairs[2 * j + 1])) for j in range(places))
            position += 1 + 2 * places
            shardings.append(Sharding(placements, tuple(int(v) for v in values[position : position + ndim])))
            position += ndim
        else:
            shardings.append(None)
    return Header(kind, atomic, tuple(tensors), tuple(shardings))


#: Where a packed message's tensors start: on this boundary (a multiple of every dtype's size).
_ALIGN = 64


@functools.lru_cache(maxsize=1024)
def _extents(layout: Layout) -> Tuple[Tuple[Tuple[int, int], ...], int]:
    """Each tensor's (start, bytes) in a packed message of ``layout``, and the message's total bytes (a
    message's layout seldom changes between steps: computed once per layout, on both ends)."""
    extents = []
    position = HEADER_LENGTH * 8
    for dtype, shape in layout:
        position = -(-position // _ALIGN) * _ALIGN
        size = math.prod(shape) * _SIZES[dtype]
        extents.append((position, size))
        position += size
    return tuple(extents), position


def packed_bytes(layout: Layout) -> int:
    """The size of a packed message of ``layout``, header included."""
    return _extents(layout)[1]


def pack(header: Tensor, tensors: Optional[Sequence[Tensor]], layout: Layout) -> Tensor:
    """One byte buffer that carries ``header`` and then ``tensors`` (of ``layout``) on CPU, for one send in
    place of one per tensor (see [Note: packed messages] in ``distributed/packing.py``). With ``tensors``
    None the tensors' bytes are left as they are: a filler of that layout's size."""
    extents, total = _extents(layout)
    if tensors is None:
        buffer = torch.empty(total, dtype=torch.uint8)
        buffer[: HEADER_LENGTH * 8].view(torch.int64).copy_(header)
        return buffer
    # One concatenation: a third of the time of filling an empty buffer piece by piece (a message's cost
    # on the sending stage's thread).
    pieces = [header.view(torch.uint8)]
    position = HEADER_LENGTH * 8
    for tensor, (start, size) in zip(tensors, extents):
        if start > position:
            pieces.append(_padding(start - position))
        pieces.append(tensor.reshape(-1).view(torch.uint8))
        position = start + size
    return torch.cat(pieces)


@functools.lru_cache(maxsize=_ALIGN)
def _padding(size: int) -> Tensor:
    """``size`` bytes between a packed message's tensors (never written)."""
    return torch.zeros(size, dtype=torch.uint8)


def unpack(buffer: Tensor, layout: Layout) -> List[Tensor]:
    """The tensors (of ``layout``) of a packed message: tensors on ``buffer``'s memory, no copies (its header
    :func:`decode` reads from the buffer itself)."""
    base = buffer.storage_offset()  # bytes: the buffer is uint8
    assert base % _ALIGN == 0, "a packed buffer starts on an aligned boundary, as its tensors do"
    storage = buffer.untyped_storage()
    # One tensor set on the buffer's memory per tensor, in place of three views (a slice, a dtype, a shape): half
    # the time, on the receiving thread as it posts each receive.
    return [torch.empty(0, dtype=dtype).set_(storage, base // _SIZES[dtype] + offset, shape, strides)
            for dtype, offset, shape, strides in _places(layout)]


@functools.lru_cache(maxsize=1024)
def _places(layout: Layout) -> Tuple[Tuple[torch.dtype, int, Tuple[int, ...], Tuple[int, ...]], ...]:
    """Each tensor's dtype, offset in the buffer in its own elements, shape and (contiguous) strides, in a packed
    message of ``layout``."""
    extents, _ = _extents(layout)
    places = []
    for (dtype, shape), (start, _) in zip(layout, extents):
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * max(shape[d + 1], 1)
        places.append((dtype, start // _SIZES[dtype], shape, tuple(strides)))
    return tuple(places)
