import copy
import dataclasses
import sys
import threading
from typing import Any, Dict, List

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tests.models import RaisesInBackward
from torchpipe.parallel import DataParallel

CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture(autouse=True)
def manual_seed() -> None:
    torch.manual_seed(0)


def cpus(n: int) -> List[str]:
    return ["cpu"] * n


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def grads(module: nn.Module) -> List[Tensor]:
    return [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]


# --- transparency: outputs and gradients equal the module on the whole batch ----------------------


@settings(max_examples=25, deadline=None)
@given(replicas=st.integers(1, 3), batch=st.integers(1, 10))
def test_outputs_and_gradients_equal_plain(replicas: int, batch: int) -> None:
    plain = mlp()
    model = copy.deepcopy(plain)
    dp = DataParallel(model, cpus(replicas))
    x = torch.randn(batch, 5, dtype=torch.double, requires_grad=True)
    x_plain = x.detach().clone().requires_grad_()

    out = dp(x)
    expected = plain(x_plain)
    torch.testing.assert_close(out, expected)
    (out * torch.arange(3.0, dtype=torch.double)).sum().backward()
    (expected * torch.arange(3.0, dtype=torch.double)).sum().backward()
    torch.testing.assert_close(grads(model), grads(plain))
    torch.testing.assert_close(x.grad, x_plain.grad)


def test_gradients_accumulate_over_steps() -> None:
    plain = mlp()
    model = copy.deepcopy(plain)
    dp = DataParallel(model, cpus(2))
    for _ in range(3):
        x = torch.randn(5, 5, dtype=torch.double)
        dp(x).sum().backward()
        plain(x).sum().backward()
    torch.testing.assert_close(grads(model), grads(plain))


def test_autograd_grad_reaches_parameters() -> None:
    plain = mlp()
    model = copy.deepcopy(plain)
    dp = DataParallel(model, cpus(3))
    x = torch.randn(7, 5, dtype=torch.double)
    got = torch.autograd.grad(dp(x).pow(2).sum(), list(model.parameters()))
    expected = torch.autograd.grad(plain(x).pow(2).sum(), list(plain.parameters()))
    torch.testing.assert_close(got, expected)
    assert all(p.grad is None for p in model.parameters())


def test_retain_graph_allows_second_backward() -> None:
    dp = DataParallel(mlp(), cpus(2))
    loss = dp(torch.randn(4, 5, dtype=torch.double)).sum()
    loss.backward(retain_graph=True)
    first = grads(dp.module)
    loss.backward()
    torch.testing.assert_close(grads(dp.module), [2 * g for g in first])


def test_second_backward_without_retain_graph_is_an_error() -> None:
    dp = DataParallel(mlp(), cpus(2))
    loss = dp(torch.randn(4, 5, dtype=torch.double)).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_no_grad_output_does_not_require_grad() -> None:
    dp = DataParallel(mlp(), cpus(2))
    with torch.no_grad():
        out = dp(torch.randn(4, 5, dtype=torch.double))
    assert not out.requires_grad


def test_non_differentiable_outputs() -> None:
    class ArgMax(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 4)

        def forward(self, x: Tensor) -> Any:
            y = self.linear(x)
            return y, y.argmax(1)

    dp = DataParallel(ArgMax(), cpus(2))
    y, index = dp(torch.randn(5, 3))
    assert y.requires_grad and not index.requires_grad
    assert index.dtype == torch.long and index.shape == (5,)
    y.sum().backward()


# --- nested inputs and outputs ---------------------------------------------------------------------


@dataclasses.dataclass
class Pair:
    left: Tensor
    right: Tensor


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2).double()

    def forward(self, items: List[Tensor], table: Dict[str, Any], pair: Pair, scale: float = 1.0) -> Any:
        a = self.linear(items[0] + items[1]) * scale
        b = self.linear(table["x"]) * table["factor"]
        c = self.linear(pair.left - pair.right)
        return {"a": a, "more": [b, (c, "tag")], "pair": Pair(a, c)}


def test_nested_inputs_and_outputs() -> None:
    plain = Nested()
    model = copy.deepcopy(plain)
    dp = DataParallel(model, cpus(3))
    t = [torch.randn(7, 4, dtype=torch.double) for _ in range(5)]

    def call(m: nn.Module) -> Any:
        return m([t[0], t[1]], {"x": t[2], "factor": 2.0}, Pair(t[3], t[4]), scale=3.0)

    got, expected = call(dp), call(plain)
    torch.testing.assert_close(got["a"], expected["a"])
    torch.testing.assert_close(got["more"][0], expected["more"][0])
    torch.testing.assert_close(got["more"][1][0], expected["more"][1][0])
    assert got["more"][1][1] == ("tag", "tag", "tag")  # one per replica
    assert isinstance(got["pair"], Pair)
    torch.testing.assert_close(got["pair"].right, expected["pair"].right)
    (got["a"].sum() + got["more"][0].sum() + got["pair"].right.sum()).backward()
    (expected["a"].sum() + expected["more"][0].sum() + expected["pair"].right.sum()).backward()
    torch.testing.assert_close(grads(model), grads(plain))


def test_scalar_outputs_are_stacked() -> None:
    class Loss(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.sum()

    out = DataParallel(Loss(), cpus(2))(torch.ones(4, 2))
    assert out.tolist() == [4.0, 4.0]


class Counting(nn.Module):
    """Returns its rows' logits and how many rows it saw, in several shapes of output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        logits = self.linear(x)
        rows = x.shape[0]
        return {
            "pair": (logits, rows),
            "nested": {"rows": rows, "names": [f"row{rows}"], "none": None, "kept": logits * 2},
        }


def test_data_parallel_keeps_every_replicas_non_tensor_outputs() -> None:
    """DataParallel's gather took non-tensor leaves from replica 0 alone: a module returning
    ``(logits, count)`` gave replica 0's count for the whole batch and dropped the others. Each such
    leaf is now a tuple with one value per replica (also inside dicts; None everywhere stays None)."""
    model = Counting()
    x = torch.randn(5, 3)  # 3 rows and 2 rows on two replicas
    out = DataParallel(model, ["cpu", "cpu"])(x)
    logits, rows = out["pair"]
    torch.testing.assert_close(logits, model.linear(x))
    assert rows == (3, 2)
    assert out["nested"]["rows"] == (3, 2)
    assert out["nested"]["names"] == [("row3", "row2")]
    assert out["nested"]["none"] is None
    torch.testing.assert_close(out["nested"]["kept"], model.linear(x) * 2)

    # One replica: the same rule, so code does not change with the number of devices.
    assert DataParallel(model, ["cpu"])(x)["pair"][1] == (5,)

    # except_keywords: the kept values are per-replica tuples as before; the rest follows the rule.
    kept = DataParallel(model, ["cpu", "cpu"], except_keywords=["kept"])(x)
    assert isinstance(kept["nested"]["kept"], tuple) and [t.shape[0] for t in kept["nested"]["kept"]] == [3, 2]
    assert kept["pair"][1] == (3, 2) and kept["nested"]["rows"] == (3, 2)

    # gather_to_one_device=False gives each replica's output whole; sort_and_gather gathers by the rule.
    apart = DataParallel(model, ["cpu", "cpu"], gather_to_one_device=False)(x)
    assert [o["pair"][1] for o in apart] == [3, 2] and [o["nested"]["names"] for o in apart] == [["row3"], ["row2"]]
    sorted_out = DataParallel(model, ["cpu", "cpu"], gather_to_one_device=False, sort_and_gather=True)(x)
    assert sorted_out["pair"][1] == (3, 2)
    listed = DataParallel(model, ["cpu", "cpu"], batch_outputs=False)(x)
    assert [o["pair"][1] for o in listed] == [3, 2]


# --- threads, devices, errors ----------------------------------------------------------------------


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.calls: List[Dict[str, Any]] = []
        self.lock = threading.Lock()

    def forward(self, x: Tensor, **kwargs: Any) -> Tensor:
        with self.lock:
            self.calls.append(
                {
                    "thread": threading.current_thread().name,
                    "grad": torch.is_grad_enabled(),
                    "threads": torch.get_num_threads(),
                    "rows": x.shape[0],
                    "ptr": x.data_ptr(),
                    **kwargs,
                }
            )
        return self.linear(x)


def test_replicas_run_on_worker_threads_with_a_share_of_intra_op_threads() -> None:
    model = Recorder()
    dp = DataParallel(model, cpus(2))
    dp(torch.randn(4, 2))
    names = {c["thread"] for c in model.calls}
    assert len(names) == 2 and threading.current_thread().name not in names
    expected = max(1, torch.get_num_threads() // 2)
    assert [c["threads"] for c in model.calls] == [expected, expected]


def test_grad_mode_reaches_workers() -> None:
    model = Recorder()
    dp = DataParallel(model, cpus(2))
    with torch.no_grad():
        dp(torch.randn(4, 2))
    dp(torch.randn(4, 2))
    assert [c["grad"] for c in model.calls] == [False, False, True, True]


def test_autocast_reaches_workers() -> None:
    dp = DataParallel(nn.Linear(4, 4), cpus(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dp(torch.randn(4, 4))
    assert out.dtype == torch.bfloat16


def test_one_replica_uses_no_threads() -> None:
    model = Recorder()
    dp = DataParallel(model, ["cpu"])
    dp(torch.randn(3, 2))
    assert model.calls[0]["thread"] == threading.current_thread().name
    assert dp._workers is None


def test_small_batch_uses_fewer_replicas() -> None:
    model = Recorder()
    out = DataParallel(model, cpus(3))(torch.randn(2, 2))
    assert out.shape == (2, 2) and len(model.calls) == 2


def test_default_device_ids() -> None:
    dp = DataParallel(nn.Linear(1, 1).to("cuda" if CUDA else "cpu"))
    if CUDA:
        assert dp.device_ids == [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    else:
        assert dp.device_ids == [torch.device("cpu")]
    assert dp.output_device == dp.device_ids[0]


def test_module_on_another_device_is_an_error_naming_both() -> None:
    dp = DataParallel(nn.Linear(2, 2, device="meta"), ["cpu", "cpu"])
    with pytest.raises(RuntimeError, match=r"device cpu \(device_ids\[0\]\).*on device meta"):
        dp(torch.randn(2, 2))


def test_exception_in_a_replica_reaches_the_caller_and_the_wrapper_recovers() -> None:
    class Fails(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            if (x < 0).any():
                raise KeyError(f"negative input of {x.shape[0]} rows")
            return x * 2

    dp = DataParallel(Fails(), cpus(2))
    x = torch.ones(4, 1)
    x[3] = -1  # only replica 1 sees it
    with pytest.raises(KeyError, match="negative input of 2 rows") as info:
        dp(x)
    if sys.version_info >= (3, 11):
        assert any("replica 1" in note for note in getattr(info.value, "__notes__", []))
    torch.testing.assert_close(dp(torch.ones(4, 1)), torch.full((4, 1), 2.0))


def test_exception_in_a_replica_backward_reaches_the_caller() -> None:
    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            return RaisesInBackward.apply(self.linear(x))  # type: ignore[no-any-return, no-untyped-call]

    dp = DataParallel(Module(), cpus(2))
    with pytest.raises(ArithmeticError, match="backward failed"):
        dp(torch.randn(4, 2)).sum().backward()
    dp.module = nn.Linear(2, 2)
    dp(torch.randn(4, 2)).sum().backward()


def test_batchnorm_statistics_follow_replica_zero_like_torch() -> None:
    plain = nn.BatchNorm1d(3)
    model = copy.deepcopy(plain)
    x = torch.randn(8, 3)
    DataParallel(model, cpus(2))(x)
    plain(x[:4])
    torch.testing.assert_close(model.running_mean, plain.running_mean)
    torch.testing.assert_close(model.running_var, plain.running_var)
    assert int(model.num_batches_tracked) == 1


def test_state_dict_and_deepcopy() -> None:
    dp = DataParallel(nn.Linear(2, 2), cpus(2))
    dp(torch.randn(2, 2))
    assert set(dp.state_dict()) == {"module.weight", "module.bias"}
    clone = copy.deepcopy(dp)
    torch.testing.assert_close(clone(torch.ones(2, 2)), dp(torch.ones(2, 2)))


# --- flags ----------------------------------------------------------------------------------------


class FeatureNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


class HeadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(2, 1)
        self.seen: List[int] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(x.data_ptr())
        return self.model(x)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_tutorial_case_one_feature_net_feeds_head_without_moving_tensors(replicas: int) -> None:
    feature, head = FeatureNet(), HeadNet()
    plain_feature, plain_head = copy.deepcopy(feature), copy.deepcopy(head)
    net_a = DataParallel(feature, cpus(replicas), gather_to_one_device=False)
    net_b = DataParallel(head, cpus(replicas), inputs_are_scattered=True)
    x = torch.ones(16, 5) + torch.arange(16.0)[:, None]

    a_out = net_a(x)
    assert isinstance(a_out, tuple) and len(a_out) == replicas
    assert [o.shape[0] for o in a_out] == [t.shape[0] for t in x.chunk(replicas)]
    b_out = net_b(a_out)
    # Each replica of the head computed on the very tensor the feature replica returned.
    assert sorted(head.seen) == sorted(o.data_ptr() for o in a_out)
    assert all(o.device == torch.device("cpu") for o in a_out)

    expected = plain_head(plain_feature(x))
    torch.testing.assert_close(b_out, expected)
    b_out.mean().backward()
    expected.mean().backward()
    torch.testing.assert_close(grads(feature) + grads(head), grads(plain_feature) + grads(plain_head))


def test_chaining_moves_nothing_that_gather_and_rescatter_moves() -> None:
    feature, head = FeatureNet(), HeadNet()
    scattered = DataParallel(feature, cpus(2), gather_to_one_device=False)
    gathered = DataParallel(feature, cpus(2))
    x = torch.randn(6, 5)
    parts = scattered(x)
    DataParallel(head, cpus(2), inputs_are_scattered=True)(parts)
    assert sorted(head.seen) == sorted(p.data_ptr() for p in parts)
    head.seen.clear()
    whole = gathered(x)
    DataParallel(head, cpus(2))(whole)
    assert set(head.seen).isdisjoint({p.data_ptr() for p in parts})


class ComplexA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Dict[str, Any]:
        output = self.model(x)
        return {"outputs": {"out1": output, "out2": output}, "second_output": output}


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_tutorial_case_two_except_keywords_on_nested_dict_outputs(replicas: int) -> None:
    net_a_module, net_b_module = ComplexA(), FeatureNet()
    net_b_module.model = nn.Linear(2, 1)
    plain_a, plain_b = copy.deepcopy(net_a_module), copy.deepcopy(net_b_module)
    net_a = DataParallel(net_a_module, cpus(replicas), except_keywords=["out1", "out2"])
    net_b = DataParallel(net_b_module, cpus(replicas), inputs_are_scattered=True)
    x = torch.randn(16, 5)

    a_out = net_a(x)
    out1, out2 = a_out["outputs"]["out1"], a_out["outputs"]["out2"]
    assert isinstance(out1, tuple) and isinstance(out2, tuple) and len(out1) == replicas
    assert [o.shape for o in out1] == [c.shape[:1] + (2,) for c in x.chunk(replicas)]
    second = a_out["second_output"]
    assert isinstance(second, Tensor) and second.shape == (16, 2)

    b_out = net_b(tuple(o1 + o2 for o1, o2 in zip(out1, out2)))
    plain_out = plain_a(x)
    expected = plain_b(plain_out["outputs"]["out1"] + plain_out["outputs"]["out2"])
    torch.testing.assert_close(b_out, expected)
    torch.testing.assert_close(second, plain_out["second_output"])
    (b_out.sum() + second.sum()).backward()
    (expected.sum() + plain_out["second_output"].sum()).backward()
    torch.testing.assert_close(grads(net_a_module), grads(plain_a))


def test_inputs_are_scattered_wrong_length_names_both_lengths() -> None:
    dp = DataParallel(nn.Linear(2, 2), cpus(2), inputs_are_scattered=True)
    with pytest.raises(ValueError, match="3 elements but there are 2 replicas"):
        dp([torch.ones(1, 2)] * 3)
    with pytest.raises(ValueError, match="keyword argument 'x' has 1 elements"):
        DataParallel(Recorder(), cpus(2), inputs_are_scattered=True)([torch.ones(1, 2)] * 2, x=[1])


def test_inputs_are_scattered_needs_sequences() -> None:
    dp = DataParallel(nn.Linear(2, 2), cpus(2), inputs_are_scattered=True)
    with pytest.raises(TypeError, match="positional argument 0 is a Tensor"):
        dp(torch.ones(2, 2))


def test_inputs_are_scattered_keyword_and_non_tensor_elements() -> None:
    model = Recorder()
    dp = DataParallel(model, cpus(2), inputs_are_scattered=True)
    out = dp([torch.ones(1, 2), torch.ones(3, 2)], tag=["a", "b"])
    assert out.shape == (4, 2)
    assert sorted((c["rows"], c["tag"]) for c in model.calls) == [(1, "a"), (3, "b")]


def test_sort_and_gather_lines_rows_up_with_the_batch() -> None:
    plain = mlp()
    dp = DataParallel(copy.deepcopy(plain), cpus(3), gather_to_one_device=False, sort_and_gather=True)
    x = torch.randn(8, 5, dtype=torch.double)
    torch.testing.assert_close(dp(x), plain(x))


def test_cpu_keywords_are_split_and_stay() -> None:
    model = Recorder()
    lengths = torch.arange(5)
    dp = DataParallel(model, cpus(2), cpu_keywords=["lengths"])
    dp(torch.randn(5, 2), lengths=lengths)
    seen = sorted((c["rows"], c["lengths"].tolist()) for c in model.calls)
    assert seen == [(2, [3, 4]), (3, [0, 1, 2])]
    assert all(c["lengths"].device.type == "cpu" for c in model.calls)


def test_batch_outputs_false_returns_a_list_per_replica() -> None:
    plain = mlp()
    dp = DataParallel(copy.deepcopy(plain), cpus(2), batch_outputs=False)
    x = torch.randn(5, 5, dtype=torch.double)
    out = dp(x)
    assert isinstance(out, list) and [o.shape[0] for o in out] == [3, 2]
    torch.testing.assert_close(torch.cat(out), plain(x))


def test_dim_one() -> None:
    class Columns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0))

        def forward(self, x: Tensor) -> Tensor:
            return x * self.scale

    dp = DataParallel(Columns(), cpus(2), dim=1)
    x = torch.randn(3, 5)
    out = dp(x)
    torch.testing.assert_close(out, x * 2)
    out.sum().backward()
    torch.testing.assert_close(dp.module.scale.grad, x.sum())


def test_one_replica_honours_every_flag() -> None:
    x = torch.randn(4, 5)
    out = DataParallel(FeatureNet(), ["cpu"], gather_to_one_device=False)(x)
    assert isinstance(out, tuple) and len(out) == 1 and out[0].shape == (4, 2)
    nested = DataParallel(ComplexA(), ["cpu"], except_keywords=["out1"])(x)
    assert isinstance(nested["outputs"]["out1"], tuple) and len(nested["outputs"]["out1"]) == 1
    assert isinstance(nested["outputs"]["out2"], Tensor)
    listed = DataParallel(FeatureNet(), ["cpu"], batch_outputs=False)(x)
    assert isinstance(listed, list) and len(listed) == 1
    head = HeadNet()
    DataParallel(head, ["cpu"], inputs_are_scattered=True)(out)
    assert head.seen == [out[0].data_ptr()]
    with pytest.raises(ValueError, match="2 elements but there are 1 replicas"):
        DataParallel(head, ["cpu"], inputs_are_scattered=True)([x, x])


# --- CUDA -----------------------------------------------------------------------------------------


@pytest.mark.cuda
@cuda
def test_cuda_module_on_cpu_is_an_error_naming_both_devices() -> None:
    dp = DataParallel(nn.Linear(2, 2), [0])
    with pytest.raises(RuntimeError, match=r"device cuda:0 .*on device cpu"):
        dp(torch.randn(2, 2))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("device_ids", [[0], [0, 0], [0, "cpu"], ["cpu", 0]])
def test_cuda_outputs_and_gradients_equal_plain(device_ids: List[Any]) -> None:
    first = torch.device("cuda", 0) if device_ids[0] == 0 else torch.device("cpu")
    plain = mlp().to(first)
    model = copy.deepcopy(plain)
    dp = DataParallel(model, device_ids)
    x = torch.randn(7, 5, dtype=torch.double, device=first)
    out = dp(x)
    expected = plain(x)
    assert out.device == first
    torch.testing.assert_close(out, expected)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(grads(model), grads(plain))


@pytest.mark.cuda
@cuda
def test_cuda_output_device_and_cpu_keywords() -> None:
    model = Recorder().cuda()
    dp = DataParallel(model, [0, "cpu"], output_device="cpu", cpu_keywords=["lengths"])
    out = dp(torch.randn(4, 2), lengths=torch.arange(4))
    assert out.device.type == "cpu"
    assert all(c["lengths"].device.type == "cpu" for c in model.calls)


@pytest.mark.cuda
@cuda
def test_cuda_chaining_keeps_outputs_on_their_devices() -> None:
    feature, head = FeatureNet().cuda(), HeadNet().cuda()
    parts = DataParallel(feature, [0, "cpu"], gather_to_one_device=False)(torch.randn(6, 5))
    assert [p.device.type for p in parts] == ["cuda", "cpu"]
    out = DataParallel(head, [0, "cpu"], inputs_are_scattered=True)(parts)
    assert sorted(head.seen) == sorted(p.data_ptr() for p in parts)
    out.sum().backward()
    assert feature.model.weight.grad is not None and feature.model.weight.grad.is_cuda
