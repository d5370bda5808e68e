"""The wire format of a message between ranks, in one process: headers and packed buffers round-trip exactly."""
from typing import List, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from torchpipe.distributed import wire

_DTYPES = st.sampled_from(wire.DTYPES)
_SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


def _tensor(dtype: torch.dtype, shape: Tuple[int, ...], seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=generator, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=generator).to(dtype)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_DTYPES, _SHAPES), min_size=0, max_size=5), st.integers(0, 2**16))
def test_a_packed_message_carries_its_header_and_tensors_bit_for_bit(
    metas: List[Tuple[torch.dtype, Tuple[int, ...]]], seed: int
) -> None:
    tensors = [_tensor(dtype, shape, seed + k) for k, (dtype, shape) in enumerate(metas)]
    flags = [k % 2 == 0 for k in range(len(tensors))]
    header = wire.encode(wire.Kind.DATA, tensors, flags, atomic=len(tensors) == 1)
    layout = tuple((t.dtype, tuple(t.shape)) for t in tensors)
    buffer = wire.pack(header, tensors, layout)
    assert buffer.dtype == torch.uint8 and buffer.numel() == wire.packed_bytes(layout)
    # The header tensor is shared by every message of that header (wire._header): the buffer is a copy,
    # also of a message without tensors (a concatenation of one piece must not hand back the piece).
    assert buffer.untyped_storage().data_ptr() != header.untyped_storage().data_ptr()
    # What the receiver gets: a buffer of its own (as if from the wire), read as views.
    arrived = buffer.clone()
    received = wire.unpack(arrived, layout)
    decoded = wire.decode(arrived)
    assert decoded.kind is wire.Kind.DATA and decoded.atomic == (len(tensors) == 1)
    assert [meta[1] for meta in decoded.tensors if meta is not None] == flags
    # Decoded headers are cached by their bytes: a header (from encode, or at the start of a packed message)
    # always decodes to its own layout, never to an earlier message's.
    assert decoded.layout == layout and wire.decode(header).layout == layout
    # Exact, byte for byte: packing and unpacking copy bytes and do no arithmetic, on any CPU's kernels.
    for sent, got in zip(tensors, received):
        assert got.dtype == sent.dtype and got.shape == sent.shape and got.stride() == sent.stride()
        # On the buffer's memory, not a copy of it.
        assert got.untyped_storage().data_ptr() == arrived.untyped_storage().data_ptr()
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(_DTYPES, _SHAPES), min_size=1, max_size=4), st.integers(1, 4), st.integers(0, 2**16))
def test_a_packed_message_inside_a_larger_buffer_unpacks_alike(
    metas: List[Tuple[torch.dtype, Tuple[int, ...]]], blocks: int, seed: int
) -> None:
    # unpack sets each tensor on the buffer's memory at its offset counted in its own elements from the memory's
    # start: a buffer that starts further in (on an aligned boundary, as its tensors do) must count its own offset.
    start = blocks * 64
    tensors = [_tensor(dtype, shape, seed + k) for k, (dtype, shape) in enumerate(metas)]
    layout = tuple((t.dtype, tuple(t.shape)) for t in tensors)
    packed = wire.pack(wire.encode(wire.Kind.DATA, tensors), tensors, layout)
    larger = torch.zeros(start + packed.numel(), dtype=torch.uint8)
    larger[start:].copy_(packed)
    for got, sent in zip(wire.unpack(larger[start:], layout), tensors):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))


def test_a_packed_tensor_is_a_usable_leaf() -> None:
    # The receiver hands views of the buffer to the stage, which makes them leaves that require grad.
    x = torch.randn(4, 3)
    layout = ((x.dtype, (4, 3)),)
    (got,) = wire.unpack(wire.pack(wire.encode(wire.Kind.DATA, [x], [True]), [x], layout).clone(), layout)
    leaf = got.detach().requires_grad_(True)
    (leaf * 2).sum().backward()
    # Exact: each gradient entry is 1.0 times 2, which rounds to nothing on any kernel.
    assert leaf.grad is not None and torch.equal(leaf.grad, torch.full((4, 3), 2.0))


def test_a_filler_has_the_size_of_the_layout_the_receiver_expects() -> None:
    # A message whose layout changed is packed with only its header, at the size the peer posted.
    expected = ((torch.float32, (8, 6)), (torch.int64, (8,)))
    filler = wire.pack(wire.encode(wire.Kind.ABORT), None, expected)
    assert filler.numel() == wire.packed_bytes(expected) >= wire.HEADER_LENGTH * 8 + 8 * 6 * 4 + 8 * 8
    assert wire.decode(filler).kind is wire.Kind.ABORT


def test_a_dtype_that_cannot_cross_is_refused_with_the_ones_that_can() -> None:
    uint16 = getattr(torch, "uint16", None)  # PyTorch 2.3 and later
    if uint16 is None:
        pytest.skip("this PyTorch has no uint16")
    with pytest.raises(ValueError, match="cannot be sent between stages; supported: torch.float32"):
        wire.encode(wire.Kind.DATA, [torch.zeros(2, dtype=uint16)], [False])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.none(), st.tuples(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)),
                                                            min_size=1, max_size=3).map(tuple),
                                                   st.tuples(st.integers(0, 9), st.integers(0, 9)))),
                min_size=1, max_size=4))
def test_a_dtensors_placements_and_global_shape_cross_in_the_header(
    shardings: List[object],
) -> None:
    # A tensor-parallel stage's DTensor crosses as its local shard; the receiver rebuilds it from the header's
    # placements and global shape (torchpipe/distributed/dtensors.py): they must come back as they went.
    from torchpipe.distributed.dtensors import Sharding

    tensors = [torch.zeros(2, 3) for _ in shardings]  # local shapes: of the global one's dimensions
    made = [None if s is None else Sharding(*s) for s in shardings]  # type: ignore[misc]
    header = wire.encode(wire.Kind.DATA, tensors, [True] * len(tensors), shardings=made)
    decoded = wire.decode(wire.pack(header, tensors, tuple((t.dtype, tuple(t.shape)) for t in tensors)))
    assert decoded.shardings == (tuple(made) if any(made) else ())
    assert decoded.layout == tuple((torch.float32, (2, 3)) for _ in tensors)
    assert decoded.requires_grad == (True,) * len(tensors)
