import collections
import dataclasses
import pickle
from typing import Any, List, Optional

import pytest
import torch
import torch.utils.data
from hypothesis import given, settings
from hypothesis import strategies as st

from torchpipe.parallel import (
    Batch,
    Tuplewise,
    cat,
    cuda_attrs,
    default_collate,
    recursive_cuda,
    recursive_to,
    tp_collate,
    tuple_fn,
)
from torchpipe.parallel.collate import per_output

CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture(autouse=True)
def manual_seed() -> None:
    torch.manual_seed(0)


# --- tp_collate / default_collate ------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(parts=st.integers(1, 5), extra=st.integers(0, 12))
def test_parts_are_contiguous_non_empty_and_in_order(parts: int, extra: int) -> None:
    items = list(range(parts + extra))
    pieces: List[List[int]]
    collate = tp_collate(parts)(lambda part: ("part", part))
    kinds, pieces = collate(items)
    assert kinds == ("part",) * parts
    assert all(pieces) and [i for p in pieces for i in p] == items
    assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


def test_tuple_items_give_per_argument_tuples() -> None:
    items = [(torch.full((2,), float(i)), torch.tensor(i)) for i in range(5)]
    xs, ys = default_collate(2)(items)
    assert isinstance(xs, tuple) and len(xs) == 2
    assert xs[0].shape == (3, 2) and xs[1].shape == (2, 2)
    assert ys[0].tolist() == [0, 1, 2] and ys[1].tolist() == [3, 4]


def test_dict_items_give_per_key_lists() -> None:
    items = [{"x": torch.tensor(float(i)), "name": f"n{i}"} for i in range(4)]
    batch = default_collate(2)(items)
    assert set(batch) == {"x", "name"}
    assert [t.tolist() for t in batch["x"]] == [[0.0, 1.0], [2.0, 3.0]]
    assert batch["name"] == [["n0", "n1"], ["n2", "n3"]]


def test_tensor_items_give_the_per_part_tensors() -> None:
    parts = default_collate(3)([torch.tensor([float(i)]) for i in range(7)])
    assert isinstance(parts, tuple) and [p.shape[0] for p in parts] == [3, 2, 2]


def test_other_results_give_the_n_results() -> None:
    assert tp_collate(2)(len)(list(range(5))) == (3, 2)


def test_named_tuples_keep_their_type() -> None:
    Point = collections.namedtuple("Point", ["x", "y"])
    points = [Point(torch.tensor(i), torch.tensor(-i)) for i in range(4)]
    result = default_collate(2)(points)
    assert isinstance(result, Point) and len(result.x) == 2


def test_results_of_different_lengths_are_an_error_not_truncated() -> None:
    with pytest.raises(ValueError, match="different lengths"):
        tp_collate(2)(list)([1, 2, 3])


def test_per_output_tuples_of_different_lengths_on_python_3_9() -> None:
    """``zip(..., strict=True)`` in parallel/collate.py is Python 3.10; on 3.9, the declared minimum, every
    TupleParallel whose module returns a tuple raised TypeError. The length check is now explicit."""
    assert per_output([(1, "a"), (2, "b")]) == [(1, 2), ("a", "b")]
    with pytest.raises(ValueError, match="different lengths"):
        per_output([(1, 2), (3,)])
    items: List[int] = [1, 2]
    assert per_output(items) == (1, 2)


def test_too_few_items_is_an_error() -> None:
    with pytest.raises(ValueError, match="batch of 1 items into 2 non-empty parts"):
        default_collate(2)([torch.ones(1)])
    with pytest.raises(ValueError, match="positive"):
        tp_collate(0)


def test_collate_function_pickles() -> None:
    collate = pickle.loads(pickle.dumps(default_collate(2)))
    assert len(collate([torch.ones(1)] * 4)) == 2


# --- tuple_fn, Tuplewise, cat ----------------------------------------------------------------------


def test_tuple_fn_transposes_results() -> None:
    def divmod_(x: int, y: int) -> Any:
        return divmod(x, y)

    (q0, q1), (r0, r1) = tuple_fn(divmod_)((7, 9), (2, 4))
    assert (q0, q1, r0, r1) == (3, 2, 1, 1)
    assert tuple_fn(lambda x, k=1: x * k)((1, 2), k=(3, 4)) == (3, 8)


def test_tuple_fn_errors() -> None:
    with pytest.raises(ValueError, match="same number of parts"):
        tuple_fn(max)((1, 2), (3,))
    with pytest.raises(TypeError, match="not a list or tuple"):
        tuple_fn(abs)(3)


def test_tuplewise() -> None:
    assert Tuplewise([(0, 1), (2, 3), (4, 5)])[0] == [0, 2, 4]
    tensors = Tuplewise([torch.ones(2), torch.ones(3)])
    assert tensors.shape == [torch.Size([2]), torch.Size([3])]
    assert [m() for m in tensors.sum] == [torch.tensor(2.0), torch.tensor(3.0)]
    assert len(tensors) == 2 and list(tensors)[0].shape == (2,)


def test_cat() -> None:
    a, b = torch.ones(2, 3), torch.zeros(1, 3)
    assert cat((a, b)).shape == (3, 3)
    logits, losses, names = cat([(a, b), (torch.tensor(1.0), torch.tensor(2.0)), ("x", "y")])
    assert logits.shape == (3, 3) and losses.tolist() == [1.0, 2.0] and names == ("x", "y")
    assert cat((a, b), dim=0).shape == (3, 3)


# --- recursive_to, recursive_cuda, cuda_attrs, Batch ----------------------------------------------


class Fake:
    """A non-tensor with .cuda and .to that records how it was called."""

    def __init__(self) -> None:
        self.calls: List[Any] = []

    def cuda(self, device: Optional[Any] = None, **kwargs: Any) -> "Fake":
        self.calls.append(("cuda", device, kwargs))
        return self

    def to(self, device: Any, **kwargs: Any) -> "Fake":
        self.calls.append(("to", device, kwargs))
        return self


class ToOnly:
    def __init__(self) -> None:
        self.calls: List[Any] = []

    def to(self, device: Any, **kwargs: Any) -> "ToOnly":
        self.calls.append((device, kwargs))
        return self


@dataclasses.dataclass
class Record:
    tensor: torch.Tensor
    label: str


def test_recursive_to_recurses_and_passes_keywords() -> None:
    fake = Fake()
    value = {"a": [torch.ones(2), (torch.zeros(1), "text")], "b": fake, "c": 3, "d": Record(torch.ones(1), "r")}
    moved = recursive_to(value, "cpu", dtype=torch.float64)
    assert moved["a"][0].dtype == torch.float64 and moved["a"][1][0].dtype == torch.float64
    assert moved["a"][1][1] == "text" and moved["c"] == 3
    assert moved["d"].tensor.dtype == torch.float64 and moved["d"].label == "r"
    assert fake.calls == [("to", "cpu", {"dtype": torch.float64})]
    same = torch.ones(2)
    assert recursive_to([same], "cpu")[0] is same


def test_recursive_cuda_prefers_cuda_then_to() -> None:
    fake, to_only = Fake(), ToOnly()
    result = recursive_cuda([fake, (to_only, "x")], 1, non_blocking=True)
    assert result[0] is fake and result[1][1] == "x"
    assert fake.calls == [("cuda", 1, {"non_blocking": True})]
    assert to_only.calls == [(1, {"non_blocking": True})]
    assert recursive_cuda(5) == 5


class Example(Batch):
    def __init__(self) -> None:
        self.x = torch.ones(2)
        self.items = [torch.zeros(1), "keep"]
        self.fake = Fake()


def test_batch_to_moves_attributes_in_place_and_returns_itself() -> None:
    batch = Example()
    assert batch.to("cpu", dtype=torch.float64) is batch
    assert batch.x.dtype == torch.float64 and batch.items[0].dtype == torch.float64
    assert batch.items[1] == "keep"


def test_cuda_attrs_and_batch_cuda_move_in_place() -> None:
    class Fakes(Batch):
        def __init__(self) -> None:
            self.fake = Fake()
            self.nested = {"k": [Fake()]}
            self.n = 1

    batch = Fakes()
    fake, inner = batch.fake, batch.nested["k"][0]
    assert batch.cuda(0) is batch and batch.fake is fake and batch.n == 1
    assert fake.calls == [("cuda", 0, {})] and inner.calls == [("cuda", 0, {})]
    holder = type("Holder", (), {})()
    holder.fake = Fake()
    assert cuda_attrs(holder, 2, non_blocking=True) is holder
    assert holder.fake.calls == [("cuda", 2, {"non_blocking": True})]


def test_batch_through_data_parallel_scatter() -> None:
    from torch import nn

    from torchpipe.parallel import DataParallel

    class Uses(nn.Module):
        def forward(self, x: torch.Tensor, batch: Example) -> torch.Tensor:
            return x * batch.x.sum()

    out = DataParallel(Uses(), ["cpu", "cpu"])(torch.ones(4, 1), Example())
    assert out.tolist() == [[2.0]] * 4


@pytest.mark.cuda
@cuda
def test_cuda_recursive_moves() -> None:
    value = {"a": [torch.ones(2)], "b": (torch.zeros(1), "s")}
    moved = recursive_cuda(value)
    assert moved["a"][0].is_cuda and moved["b"][0].is_cuda and moved["b"][1] == "s"
    back = recursive_to(moved, "cpu")
    assert not back["a"][0].is_cuda
    batch = Example().cuda()
    assert batch.x.is_cuda and batch.items[0].is_cuda
