"""GPipe's arguments, errors, container protocol, placement, modes and robustness."""
import copy
import gc
import threading
import traceback
import weakref
from collections import OrderedDict

import pytest
import torch
from torch import Tensor, nn

import torchpipe
from tests.models import cpu_gpipe, mlp
from torchpipe import BalanceError, DataParallel, GPipe

# --- arguments -------------------------------------------------------------------------------------


def test_non_sequential_module_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="nn.Sequential"):
        GPipe(nn.Linear(1, 1), [1])  # type: ignore[arg-type]


def test_duplicate_children_are_rejected() -> None:
    layer = nn.Linear(1, 1)
    with pytest.raises(ValueError, match="duplicate children"):
        GPipe(nn.Sequential(layer, layer), [1, 1], devices=["cpu", "cpu"])


def test_shared_buffers_are_rejected_shared_parameters_are_ties() -> None:
    # Layers sharing a parameter (tied weights) are accepted since issue 17 (tests/test_ties.py); a shared buffer
    # could not be kept equal between copies, and stays an error.
    a, b = nn.BatchNorm1d(2), nn.BatchNorm1d(2)
    b.running_mean = a.running_mean
    with pytest.raises(ValueError, match="buffer shared by distinct children"):
        GPipe(nn.Sequential(a, b), [1, 1], devices=["cpu", "cpu"])
    c, d = nn.Linear(2, 2), nn.Linear(2, 2)
    d.weight = c.weight
    GPipe(nn.Sequential(c, d), [1, 1], devices=["cpu", "cpu"])


def test_missing_balance_points_at_torchpipe_balancing() -> None:
    with pytest.raises(ValueError, match="torchpipe_balancing") as info:
        GPipe(mlp(1), devices=["cpu"])
    assert not isinstance(info.value, BalanceError)


@pytest.mark.parametrize("balance", [[1], [1, 1, 1], [2, 0], [3, -1], [1.0, 1]])
def test_bad_balance_is_a_balance_error(balance: list) -> None:
    with pytest.raises(BalanceError) as info:
        GPipe(mlp(1), balance, devices=["cpu"] * 3)
    assert isinstance(info.value, ValueError)
    assert str(balance[0]) in str(info.value)


def test_balance_error_message_names_the_sum_and_the_layers() -> None:
    with pytest.raises(BalanceError, match="module has 4 layers but balance sums to 3"):
        GPipe(mlp(2), [1, 2], devices=["cpu", "cpu"])


@pytest.mark.parametrize("chunks", [0, -1, 1.5, "2"])
def test_bad_chunks(chunks: object) -> None:
    with pytest.raises(ValueError, match="chunks"):
        GPipe(mlp(1), [2], devices=["cpu"], chunks=chunks)  # type: ignore[arg-type]


def test_torchgpipe_argument_forms() -> None:
    # torchgpipe's argument forms work as there: chunks as a whole float, a checkpoint mode as any object whose
    # str() names it, and an empty Sequential with an empty balance (the identity); a fractional chunks stays
    # an error.
    class Mode:
        def __str__(self) -> str:
            return "always"

    model = cpu_gpipe(mlp(1, 2), [1, 1], chunks=42.0, checkpoint=Mode())  # type: ignore[arg-type]
    assert model.chunks == 42 and type(model.chunks) is int and model.checkpoint == "always"
    with pytest.raises(ValueError, match="chunks"):
        cpu_gpipe(mlp(1, 2), [1, 1], chunks=2.5)  # type: ignore[arg-type]
    empty = GPipe(nn.Sequential(), [])
    x = torch.randn(3, 2)
    assert empty(x) is x and len(empty) == 0


def test_bad_checkpoint() -> None:
    with pytest.raises(ValueError, match="checkpoint"):
        GPipe(mlp(1), [2], devices=["cpu"], checkpoint="sometimes")


def test_too_few_devices_is_an_index_error() -> None:
    with pytest.raises(IndexError, match="devices"):
        GPipe(mlp(2), [2, 2], devices=["cpu"])


def test_extra_devices_are_ignored_and_devices_are_normalised() -> None:
    model = GPipe(mlp(2), [2, 2], devices=["cpu", torch.device("cpu"), "cpu"])
    assert model.devices == [torch.device("cpu"), torch.device("cpu")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="default devices without CUDA")
def test_default_devices_without_cuda_are_cpu() -> None:
    model = GPipe(mlp(2), [1, 3])
    assert model.devices == [torch.device("cpu")] * 2


def test_attributes() -> None:
    model = cpu_gpipe(mlp(3), [2, 4], chunks=3, checkpoint="always")
    assert model.balance == [2, 4]
    assert model.chunks == 3
    assert model.checkpoint == "always"
    assert isinstance(model.partitions, nn.ModuleList)
    assert [len(p) for p in model.partitions] == [2, 4]
    assert all(isinstance(p, nn.Sequential) for p in model.partitions)


# --- container protocol ----------------------------------------------------------------------------


def test_container_protocol_over_the_original_layers() -> None:
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh()]
    model = cpu_gpipe(nn.Sequential(*layers), [1, 3])
    assert len(model) == 4
    assert list(model) == layers
    assert [model[i] for i in range(4)] == layers
    assert model[-1] is layers[-1] and model[-4] is layers[0]
    with pytest.raises(IndexError):
        model[4]
    with pytest.raises(IndexError):
        model[-5]


def test_layer_names_are_kept() -> None:
    module = nn.Sequential(OrderedDict([("encoder", nn.Linear(2, 2)), ("act", nn.ReLU()), ("head", nn.Linear(2, 1))]))
    model = cpu_gpipe(module, [2, 1])
    assert model.partitions[0].encoder is module.encoder
    assert model.partitions[1].head is module.head


# --- moving is denied ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "move",
    [
        lambda m: m.cuda(),
        lambda m: m.cpu(),
        lambda m: m.to("cpu"),
        lambda m: m.to(torch.device("cpu")),
        lambda m: m.to(0),
        lambda m: m.to(torch.zeros(1)),
        lambda m: m.to("cpu", torch.float64),
        lambda m: m.to(device="cpu"),
    ],
)
def test_moving_is_denied(move: object) -> None:
    model = cpu_gpipe(mlp(1), [2])
    with pytest.raises(TypeError, match="denied to move"):
        move(model)  # type: ignore[operator]


def test_to_dtype_is_allowed() -> None:
    model = cpu_gpipe(mlp(1), [2])
    assert model.to(torch.float64) is model
    assert model.to(dtype=torch.float16) is model
    assert all(p.dtype == torch.float16 for p in model.parameters())


def test_to_a_tensors_device_is_denied() -> None:
    # to(tensor=...) moves to a tensor's device (and dtype): denied as every move is; a dtype alone is allowed.
    model = cpu_gpipe(mlp(1, 2), [1, 1])
    with pytest.raises(TypeError, match="denied"):
        model.to(tensor=torch.zeros(1))
    model.to(torch.float64)
    assert model[0].weight.dtype == torch.float64


def test_each_denied_move_raises_its_own_error() -> None:
    # GPipe and Pipeline raised one module-level TypeError instance: every raise chained a traceback onto the
    # last, so the error held the frames (and their tensors) of every earlier denied call.
    model = cpu_gpipe(mlp(1, 2), [1, 1])
    errors = []
    for _ in range(3):
        with pytest.raises(TypeError, match="denied to move the partitions of a GPipe") as info:
            model.cpu()
        errors.append(info.value)
    assert errors[0] is not errors[1] is not errors[2]
    depths = [len(traceback.extract_tb(error.__traceback__)) for error in errors]
    assert depths[0] == depths[1] == depths[2]


# --- inputs and outputs ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [[torch.zeros(2, 2)], (), (torch.zeros(2, 2), 1), "x", None, {"x": torch.zeros(1)}])
def test_bad_input_is_a_type_error(bad: object) -> None:
    model = cpu_gpipe(mlp(1, 2), [2])
    with pytest.raises(TypeError, match="Tensor"):
        model(bad)  # type: ignore[arg-type]


def test_bad_layer_output_is_a_type_error_naming_the_partition() -> None:
    class ReturnsDict(nn.Module):
        def forward(self, x: Tensor) -> dict:
            return {"x": x}

    model = cpu_gpipe(nn.Sequential(nn.Linear(2, 2), ReturnsDict(), nn.Identity()), [2, 1])
    with pytest.raises(TypeError, match="partition 0"):
        model(torch.zeros(2, 2))
    model.partitions[0][1].forward = lambda x: x  # type: ignore[method-assign]
    assert model(torch.zeros(2, 2)).shape == (2, 2)


def test_batch_smaller_than_chunks_and_uneven_batches() -> None:
    model = cpu_gpipe(mlp(2, 3), [2, 2], chunks=4)
    for batch in (1, 2, 3, 5, 7):
        assert model(torch.randn(batch, 3)).shape == (batch, 3)


def test_counts_of_microbatches_follow_torch_chunk() -> None:
    seen = []

    class Record(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(x.size(0))
            return x

    model = cpu_gpipe(nn.Sequential(Record(), nn.Identity()), [1, 1], chunks=4)
    with torch.no_grad():
        model(torch.zeros(6, 1))
    assert sorted(seen) == sorted(len(c) for c in torch.zeros(6).chunk(4))


def test_output_structure_and_device() -> None:
    class Pair(nn.Module):
        def forward(self, x: Tensor) -> tuple:
            return x, x + 1

    model = cpu_gpipe(nn.Sequential(nn.Linear(2, 2), Pair()), [1, 1], chunks=2)
    out = model(torch.zeros(4, 2))
    assert isinstance(out, tuple) and len(out) == 2
    assert all(o.device == model.devices[-1] for o in out)


def test_one_layer_tuple_input() -> None:
    class Add(nn.Module):
        def forward(self, xy: tuple) -> Tensor:
            return xy[0] + xy[1]

    model = cpu_gpipe(nn.Sequential(Add()), [1], chunks=2)
    x, y = torch.randn(4, 2, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    model((x, y)).sum().backward()
    assert torch.equal(x.grad, torch.ones(4, 2)) and torch.equal(y.grad, torch.ones(4, 2))


def test_an_empty_batch_gives_an_empty_output() -> None:
    # An empty batch gives an empty output and an empty input gradient, as the plain module does (and so does
    # DataParallel).
    model = mlp(2, 4)
    piped = cpu_gpipe(copy.deepcopy(model), [2, 2], chunks=4)
    x = torch.randn(0, 4, requires_grad=True)
    out = piped(x)
    assert out.shape == model(x).shape == (0, 4)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 4)
    assert DataParallel(nn.Linear(4, 2), ["cpu", "cpu"])(torch.randn(0, 4)).shape == (0, 2)


# --- grad modes ------------------------------------------------------------------------------------


def test_no_grad_runs_without_checkpointing_or_graph() -> None:
    flags = []

    class Flags(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            flags.append((torchpipe.is_checkpointing(), torchpipe.is_recomputing(), torch.is_grad_enabled()))
            return x

    model = cpu_gpipe(nn.Sequential(nn.Linear(2, 2), Flags()), [1, 1], chunks=3, checkpoint="always")
    with torch.no_grad():
        out = model(torch.randn(6, 2))
    assert not out.requires_grad
    assert flags == [(False, False, False)] * 3


def test_eval_mode_gives_the_plain_output_and_does_not_checkpoint() -> None:
    flags = []

    class Flags(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            flags.append(torchpipe.is_checkpointing())
            return x

    module = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), Flags(), nn.Linear(3, 1))
    model = cpu_gpipe(module, [2, 2], chunks=2, checkpoint="always").eval()
    x = torch.randn(4, 3)
    out = model(x)
    assert flags == [False, False]
    assert torch.allclose(out, nn.Sequential(*module).eval()(x))


def test_backward_twice_is_a_clear_error() -> None:
    model = cpu_gpipe(mlp(2, 2), [2, 2], chunks=2)
    out = model(torch.randn(4, 2)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        out.backward()


# --- exceptions and threads ------------------------------------------------------------------------


class Boom(Exception):
    pass


class Raiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.in_backward = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed and not self.in_backward:
            raise Boom("layer exploded on purpose")
        if self.armed and self.in_backward:
            return _RaiseInBackward.apply(x)
        return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:
        raise Boom("backward exploded on purpose")


@pytest.mark.parametrize("position", [0, 2, 4])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_exception_in_forward_reaches_the_caller_and_the_next_call_works(position: int, checkpoint: str) -> None:
    layers = [nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3)]
    raiser = Raiser()
    layers.insert(position, raiser)
    model = cpu_gpipe(nn.Sequential(*layers), [2, 2, 2], chunks=4, checkpoint=checkpoint)
    raiser.armed = True
    with pytest.raises(Boom, match="exploded on purpose"):
        model(torch.randn(8, 3))
    raiser.armed = False
    model(torch.randn(8, 3)).sum().backward()


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_exception_in_backward_reaches_the_caller_and_the_next_call_works(checkpoint: str) -> None:
    raiser = Raiser()
    model = cpu_gpipe(nn.Sequential(nn.Linear(3, 3), raiser, nn.Linear(3, 3), nn.ReLU()), [2, 2], chunks=3,
                      checkpoint=checkpoint)
    raiser.armed, raiser.in_backward = True, True
    out = model(torch.randn(6, 3))
    with pytest.raises(Boom, match="backward exploded"):
        out.sum().backward()
    raiser.armed = False
    model(torch.randn(6, 3)).sum().backward()


def test_repeated_steps_leak_no_threads() -> None:
    model = cpu_gpipe(mlp(3, 4), [2, 2, 2], chunks=4)
    model(torch.randn(8, 4)).sum().backward()
    before = set(threading.enumerate())
    for _ in range(20):
        model(torch.randn(8, 4)).sum().backward()
        with torch.no_grad():
            model(torch.randn(8, 4))
    # No new thread (threads of earlier tests' collected models may end meanwhile).
    assert set(threading.enumerate()) - before == set()
    assert all(w.thread in before for w in model._runner.stages.workers().workers)


def test_workers_stop_when_the_gpipe_is_collected() -> None:
    model = cpu_gpipe(mlp(2, 4), [2, 2], chunks=2)
    model(torch.randn(4, 4)).sum().backward()
    threads = [w.thread for w in model._runner.stages.workers().workers]
    assert len(threads) == 2 and all(t.is_alive() for t in threads)
    ref = weakref.ref(model)
    del model
    assert ref() is None, "a GPipe is freed by reference counting alone (no cycle through its workers)"
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_repeated_steps_release_memory() -> None:
    # Every tensor a step creates is released: the number of live tensors is stable.
    model = cpu_gpipe(mlp(3, 4), [2, 2, 2], chunks=4, checkpoint="except_last")

    def live_tensors() -> int:
        # A tensor shows in gc.get_objects() once Python has seen it: see the gradients first.
        grads = [p.grad for p in model.parameters()]
        gc.collect()
        count = sum(1 for o in gc.get_objects() if type(o) in (Tensor, nn.Parameter))
        del grads
        return count

    model(torch.randn(8, 4)).sum().backward()
    before = live_tensors()
    steps = 20
    for _ in range(steps):
        model(torch.randn(8, 4)).sum().backward()
    # A step that leaked would leave at least one tensor each time; a few may come and go with other tests'
    # threads winding down in the same process.
    assert live_tensors() - before < steps


def test_deepcopy_gives_an_independent_working_copy() -> None:
    import copy

    model = cpu_gpipe(mlp(2, 4), [2, 2], chunks=2)
    clone = copy.deepcopy(model)
    x = torch.randn(4, 4)
    assert torch.allclose(model(x), clone(x))
    assert clone.partitions[0][0].weight is not model.partitions[0][0].weight


def test_state_dict_round_trip() -> None:
    model = cpu_gpipe(mlp(2, 4), [2, 2])
    other = cpu_gpipe(mlp(2, 4), [2, 2])
    other.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    assert torch.allclose(model(x), other(x))


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_autocast_reaches_every_partition_and_the_recomputation(checkpoint: str) -> None:
    dtypes = []

    class Dtype(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            dtypes.append((torchpipe.is_recomputing(), x.dtype))
            return x

    module = nn.Sequential(nn.Linear(4, 4), Dtype(), nn.Linear(4, 4), Dtype())
    plain = nn.Sequential(*module)
    model = cpu_gpipe(module, [2, 2], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        expected = plain(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    out.float().sum().backward()
    assert {d for _, d in dtypes} == {torch.bfloat16}
    assert any(recomputing for recomputing, _ in dtypes) == (checkpoint == "always")


def test_inference_mode() -> None:
    model = cpu_gpipe(mlp(2, 4), [2, 2], chunks=2)
    with torch.inference_mode():
        out = model(torch.randn(4, 4))
    assert out.is_inference() and not out.requires_grad


def test_numpy_balance_and_chunks_are_accepted_as_plain_ints() -> None:
    import numpy as np

    model = GPipe(mlp(1), np.array([1, 1]), devices=["cpu", "cpu"], chunks=np.int64(2))
    assert model.balance == [1, 1] and all(type(b) is int for b in model.balance)
    assert model.chunks == 2 and type(model.chunks) is int
    with pytest.raises(BalanceError):
        GPipe(mlp(1), 2, devices=["cpu", "cpu"])  # type: ignore[arg-type]


def test_one_gpipe_driven_from_several_threads() -> None:
    import concurrent.futures

    model = cpu_gpipe(mlp(3, 4), [2, 2, 2], chunks=4, checkpoint="except_last")
    plain = nn.Sequential(*model)
    inputs = [torch.randn(8, 4) for _ in range(8)]

    def run(x: Tensor) -> Tensor:
        out = model(x)
        out.sum().backward()
        return out.detach()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(run, inputs, timeout=60))
    for x, out in zip(inputs, outputs):
        assert torch.allclose(out, plain(x), atol=1e-6)
