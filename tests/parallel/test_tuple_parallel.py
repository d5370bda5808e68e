import copy
import threading
from typing import Any, List, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from torchpipe.parallel import DataParallel, TupleParallel, cat, default_collate

CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture(autouse=True)
def manual_seed() -> None:
    torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.tag = "net"
        self.threads: List[str] = []

    def forward(self, x: Tensor) -> Tensor:
        self.threads.append(threading.current_thread().name)
        return self.linear(x)

    def describe(self) -> str:
        return f"{self.tag}: {self.linear}"


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        return self.linear(x), (self.linear(x) - y).pow(2).sum()


def test_returns_per_replica_outputs_in_order() -> None:
    model = Net()
    tp = TupleParallel(model, ["cpu", "cpu"])
    xs = (torch.randn(2, 4), torch.randn(3, 4))
    out = tp(xs)
    assert isinstance(out, tuple) and len(out) == 2
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, model.linear(x))
    assert len(set(model.threads)) == 2


def test_tuple_outputs_become_a_list_of_per_output_tuples() -> None:
    tp = TupleParallel(TwoOutputs(), ["cpu"] * 3)
    xs = [torch.randn(2, 4) for _ in range(3)]
    ys = [torch.randn(2, 3) for _ in range(3)]
    out = tp(xs, y=ys)
    assert isinstance(out, list) and len(out) == 2
    assert all(isinstance(o, tuple) and len(o) == 3 for o in out)
    assert out[1][0].dim() == 0


def test_transfer_output_and_cat_reduction_equal_the_whole_batch() -> None:
    model = Net()
    tp = TupleParallel(model, ["cpu"] * 3, transfer_output=True, reduction=cat)
    x = torch.randn(7, 4)
    torch.testing.assert_close(tp(list(x.tensor_split(3))), model.linear(x))
    two = TupleParallel(TwoOutputs(), ["cpu"] * 2, transfer_output=True, reduction=cat)
    logits, losses = two([x[:3], x[3:]], [torch.zeros(3, 3), torch.zeros(4, 3)])
    assert logits.shape == (7, 3) and losses.shape == (2,)


def test_transfer_input_false_uses_elements_as_they_are() -> None:
    seen: List[int] = []

    class Ptr(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(x.data_ptr())
            return x

    xs = (torch.randn(2, 4), torch.randn(2, 4))
    TupleParallel(Ptr(), ["cpu", "cpu"], transfer_input=False)(xs)
    assert sorted(seen) == sorted(x.data_ptr() for x in xs)


def test_wrong_length_names_both_lengths() -> None:
    tp = TupleParallel(Net(), ["cpu", "cpu"])
    with pytest.raises(ValueError, match="has 3 elements but there are 2 replicas"):
        tp([torch.randn(1, 4)] * 3)


def test_non_sequence_argument_is_a_clear_error() -> None:
    tp = TupleParallel(Net(), ["cpu", "cpu"])
    with pytest.raises(TypeError, match="positional argument 0 is a Tensor, not a list or tuple"):
        tp(torch.randn(2, 4))


def test_attribute_access_falls_through() -> None:
    model = Net()
    tp = TupleParallel(model, ["cpu"])
    assert tp.tag == "net" and tp.describe() == model.describe()
    assert tp.linear is model.linear and tp.module is model
    assert isinstance(tp, DataParallel)
    with pytest.raises(AttributeError):
        _ = tp.no_such_attribute


def test_one_replica() -> None:
    model = Net()
    out = TupleParallel(model, ["cpu"])([torch.randn(2, 4)])
    assert isinstance(out, tuple) and len(out) == 1
    assert model.threads == [threading.current_thread().name]


def test_exception_in_a_replica_reaches_the_caller() -> None:
    class Fails(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            if x.shape[0] == 3:
                raise IndexError("three rows are too many")
            return x

    tp = TupleParallel(Fails(), ["cpu", "cpu"])
    with pytest.raises(IndexError, match="three rows"):
        tp([torch.ones(1), torch.ones(3)])
    assert len(tp([torch.ones(1), torch.ones(2)])) == 2


class Pairs(Dataset[Tuple[Tensor, Tensor]]):
    def __init__(self, size: int) -> None:
        self.x = torch.randn(size, 4)
        self.y = torch.randn(size, 3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> Tuple[Tensor, Tensor]:
        return self.x[index], self.y[index]


def test_dataloader_with_default_collate_end_to_end() -> None:
    data = Pairs(10)
    model = Net()
    tp = TupleParallel(model, ["cpu", "cpu"])
    loader = DataLoader(data, batch_size=5, collate_fn=default_collate(2))
    rows = []
    for x, y in loader:
        assert isinstance(x, tuple) and [len(t) for t in x] == [3, 2]
        out = tp(x)
        assert [o.shape for o in out] == [torch.Size([3, 3]), torch.Size([2, 3])]
        rows.append(torch.cat(x))
        assert torch.cat(y).shape == (5, 3)
    torch.testing.assert_close(torch.cat(rows), data.x)


def test_training_loop_matches_the_plain_module() -> None:
    data = Pairs(24)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model = copy.deepcopy(plain)
    tp = TupleParallel(model, ["cpu"] * 3, transfer_output=True, reduction=cat)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(data, batch_size=8, collate_fn=default_collate(3))
    plain_loader = DataLoader(data, batch_size=8)
    for _ in range(2):
        for (xs, ys), (x, y) in zip(loader, plain_loader):
            opt.zero_grad()
            loss = nn.functional.mse_loss(tp([t.double() for t in xs]), torch.cat(ys).double())
            loss.backward()
            opt.step()
            plain_opt.zero_grad()
            nn.functional.mse_loss(plain(x.double()), y.double()).backward()
            plain_opt.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q)


def test_dict_items_feed_keyword_arguments() -> None:
    class Dicts(Dataset[Any]):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> Any:
            return {"x": torch.full((4,), float(i)), "y": torch.zeros(3)}

    tp = TupleParallel(TwoOutputs(), ["cpu", "cpu"])
    (batch,) = DataLoader(Dicts(), batch_size=6, collate_fn=default_collate(2))
    assert isinstance(batch["x"], list) and len(batch["x"]) == 2
    logits, losses = tp(**batch)
    assert [t.shape[0] for t in logits] == [3, 3] and len(losses) == 2


@pytest.mark.cuda
@cuda
def test_cuda_transfer_input_and_output() -> None:
    model = Net().cuda()
    tp = TupleParallel(model, [0, "cpu"], transfer_output=True)
    out = tp([torch.randn(2, 4), torch.randn(3, 4)])
    assert all(o.device == torch.device("cuda", 0) for o in out)
    torch.cat(out).sum().backward()
    assert model.linear.weight.grad is not None
    plain = TupleParallel(Net().cuda(), [0, "cpu"])
    devices = [o.device.type for o in plain([torch.randn(2, 4), torch.randn(3, 4)])]
    assert devices == ["cuda", "cpu"]
