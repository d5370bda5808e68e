"""The device-transfer core: move, split, join, scatter, gather, send/receive, the transfer log."""
import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import torchpipe
from tests.models import mlp
from torchpipe import GPipe, transfer
from torchpipe.microbatch import Batch, check_input, gather, scatter
from torchpipe.stream import CPU_EVENT, CPU_STREAM

Point = namedtuple("Point", "x y")


@dataclasses.dataclass
class Item:
    tensor: torch.Tensor
    label: str


def test_move_recurses_and_keeps_structure() -> None:
    obj = {"a": [torch.zeros(2), (torch.ones(1), "s")], "p": Point(torch.zeros(1), 3), "d": Item(torch.ones(2), "x")}
    moved = transfer.move(obj, "cpu")
    assert isinstance(moved["p"], Point) and moved["p"].y == 3
    assert isinstance(moved["d"], Item) and moved["d"].label == "x"
    assert moved["a"][1][1] == "s"


def test_move_is_differentiable() -> None:
    x = torch.randn(3, requires_grad=True)
    transfer.move({"x": x}, torch.device("cpu"))["x"].sum().backward()
    assert torch.equal(x.grad, torch.ones(3))


@given(batch=st.integers(1, 20), parts=st.integers(1, 8))
def test_split_follows_torch_chunk_and_join_inverts_it(batch: int, parts: int) -> None:
    x = torch.arange(batch * 2.0).view(batch, 2)
    obj = {"x": x, "pair": (x + 1, "label"), "scalar": torch.tensor(5.0)}
    pieces = transfer.split(obj, parts)
    assert [p["x"].size(0) for p in pieces] == [c.size(0) for c in x.chunk(parts)]
    assert all(p["pair"][1] == "label" and p["scalar"] is obj["scalar"] for p in pieces)
    joined = transfer.join(pieces)
    assert torch.equal(joined["x"], x) and torch.equal(joined["pair"][0], x + 1)


@given(batch=st.integers(0, 20), parts=st.integers(1, 8), nested=st.booleans())
@example(batch=0, parts=2, nested=False)  # torch.chunk cuts an empty batch into 2 empty pieces; split into one
def test_a_tuple_of_tensors_splits_as_any_structure_does(batch: int, parts: int, nested: bool) -> None:
    # A tuple of tensors (a micro-batch's values, cut every step) takes a shorter way than other structures: the
    # pieces must be the same, also for a tuple that holds a tuple (the general way).
    x = torch.arange(batch * 2.0).view(batch, 2)
    y = x * 2
    obj = (x, (y,)) if nested else (x, y)
    pieces = transfer.split(obj, parts)
    # The pieces are views of x and y, no arithmetic: compared exactly.
    expected = [(c, (d,) if nested else d) for c, d in zip(x.chunk(parts), y.chunk(parts))] if batch else [obj]
    assert len(pieces) == len(expected) and all(type(p) is tuple for p in pieces)
    for piece, (first, second) in zip(pieces, expected):
        assert torch.equal(piece[0], first)
        assert torch.equal(piece[1][0], second[0]) if nested else torch.equal(piece[1], second)


def test_split_errors() -> None:
    with pytest.raises(ValueError, match="different sizes"):
        transfer.split((torch.zeros(2), torch.zeros(3)), 2)
    with pytest.raises(ValueError, match="positive"):
        transfer.split(torch.zeros(2), 0)
    # An empty batch is one empty piece (so that the plain module's behaviour, an empty output, follows).
    (piece,) = transfer.split(torch.zeros(0, 2), 2)
    assert piece.shape == (0, 2)


def test_join_keep_keys_and_scalars() -> None:
    parts = [{"loss": torch.tensor(1.0), "feat": {"f": torch.zeros(1, 2)}, "y": torch.ones(2, 1)} for _ in range(3)]
    joined = transfer.join(parts, keep_keys=["feat"])
    assert isinstance(joined["feat"], tuple) and len(joined["feat"]) == 3
    assert joined["loss"].shape == (3,)
    assert joined["y"].shape == (6, 1)


def test_scatter_gather_round_trip_on_cpu_devices() -> None:
    x = torch.randn(7, 3)
    pieces = transfer.scatter(x, ["cpu", "cpu", "cpu"])
    assert [p.size(0) for p in pieces] == [3, 3, 1]
    assert torch.equal(transfer.gather(pieces, "cpu"), x)


def test_send_and_receive_on_cpu_hand_over_as_is() -> None:
    x = torch.randn(2)
    tensors, event = transfer.send([x, None], torch.device("cpu"), source_stream=CPU_STREAM,
                                   source_copy_stream=CPU_STREAM, target_copy_stream=CPU_STREAM)
    assert tensors[0] is x and tensors[1] is None and event is CPU_EVENT
    assert transfer.receive(tensors, event, CPU_STREAM)[0] is x


def test_transfer_log_is_off_unless_recording() -> None:
    cpu = torch.device("cpu")
    transfer.log_transfer("activation", 0, 1, 0, [torch.zeros(1)], cpu, cpu)
    with transfer.record_transfers() as log:
        transfer.log_transfer("skip", 0, 2, 1, [torch.zeros(4)], cpu, cpu, "s")
    transfer.log_transfer("activation", 0, 1, 0, [torch.zeros(1)], cpu, cpu)
    assert [(r.kind, r.source, r.target, r.microbatch, r.nbytes, r.name) for r in log] == [("skip", 0, 2, 1, 16, "s")]


def test_the_transfer_log_records_where_tensors_came_from() -> None:
    # Each record's source device was read off the tensor after the copy: it was always the target.
    with torchpipe.transfer.record_transfers() as log:
        torchpipe.transfer.log_transfer("activation", 0, 1, 0, [torch.zeros(2)], torch.device("meta"),
                                        torch.device("cpu"))
    assert log[0].source_device == torch.device("meta") and log[0].target_device == torch.device("cpu")


@pytest.mark.cuda
def test_the_transfer_log_of_a_gpu_to_cpu_pipeline() -> None:
    # The same through a pipeline from a GPU to the CPU: each activation's record says it left the GPU.
    model = GPipe(mlp(1, 4), [1, 1], devices=["cuda:0", "cpu"], chunks=2)
    with torchpipe.transfer.record_transfers() as log:
        model(torch.randn(4, 4)).sum().backward()
    forward = [r for r in log if r.kind == "activation"]
    assert forward and all(r.source_device.type == "cuda" and r.target_device.type == "cpu" for r in forward)


def test_microbatch_scatter_gather() -> None:
    x, y = torch.randn(5, 2), torch.randn(5, 1)
    batches = scatter((x, y), 2)
    assert [len(b) for b in batches] == [2, 2] and not batches[0].atomic
    assert all(isinstance(v, torch.Tensor) for v in gather(batches))
    single = scatter(x, 3)
    assert single[0].atomic and torch.equal(gather(single), x)  # type: ignore[arg-type]
    assert repr(Batch(x)).startswith("Batch(")
    with pytest.raises(ValueError, match="0-dimensional"):
        scatter(torch.tensor(1.0), 2)


@pytest.mark.parametrize("bad", [[torch.zeros(1)], (), (torch.zeros(1), None), 1])
def test_check_input(bad: Any) -> None:
    with pytest.raises(TypeError):
        check_input(bad)
