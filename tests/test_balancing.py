"""Tests of torchpipe_balancing: the exact solver, both profilers, and that profiling leaves no trace."""
import copy
import itertools
import time
from fractions import Fraction
from typing import List, Sequence, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from tests import models
from tests.models import Sleep
from torchpipe import GPipe
from torchpipe.skip import pop, skippable, stash
from torchpipe_balancing import balance_by_size, balance_by_time, balance_cost
from torchpipe_balancing.blockpartition import solve
from torchpipe_balancing.profile import profile_sizes
from torchpipe_balancing.sandbox import sandbox

# Profiling budget for tests: enough timed passes for a stable median, still quick.
TIMEOUT = 0.3


@pytest.fixture(autouse=True)
def seed() -> None:
    torch.manual_seed(0)


# --- balance_cost -----------------------------------------------------------------------------


def partition_costs(costs: Sequence[float], balance: Sequence[int]) -> List[Fraction]:
    """Exact partition totals (Fractions, so float rounding cannot blur ties)."""
    totals, start = [], 0
    for size in balance:
        totals.append(sum((Fraction(c) for c in costs[start : start + size]), Fraction(0)))
        start += size
    return totals


def brute_force(costs: Sequence[float], partitions: int) -> Fraction:
    """The optimal bottleneck, by trying every placement of the partition boundaries."""
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), partitions - 1):
        bounds = (0, *cuts, n)
        balance = [b - a for a, b in zip(bounds, bounds[1:])]
        worst = max(partition_costs(costs, balance))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


def assert_valid(balance: Sequence[int], layers: int, partitions: int) -> None:
    assert isinstance(balance, list)
    assert all(type(b) is int for b in balance), balance
    assert len(balance) == partitions, balance
    assert all(b >= 1 for b in balance), balance
    assert sum(balance) == layers, balance


def costs_and_partitions(elements: st.SearchStrategy[float]) -> st.SearchStrategy[Tuple[List[float], int]]:
    return st.lists(elements, min_size=1, max_size=9).flatmap(
        lambda costs: st.tuples(st.just(costs), st.integers(1, len(costs)))
    )


# Small ranges make ties and zeros frequent.
INTS = st.integers(0, 6)
FLOATS = st.one_of(
    st.sampled_from([0.0, 0.1, 0.2, 0.3, 0.5, 1.0]),
    st.floats(0, 100, allow_nan=False, allow_infinity=False),
)


@settings(max_examples=300, deadline=None)
@given(costs_and_partitions(INTS))
def test_balance_cost_ints_is_optimal(case: Tuple[List[int], int]) -> None:
    costs, partitions = case
    balance = balance_cost(costs, partitions)
    assert_valid(balance, len(costs), partitions)
    assert max(partition_costs(costs, balance)) == brute_force(costs, partitions)


@settings(max_examples=300, deadline=None)
@given(costs_and_partitions(FLOATS))
def test_balance_cost_floats_is_optimal(case: Tuple[List[float], int]) -> None:
    costs, partitions = case
    balance = balance_cost(costs, partitions)
    assert_valid(balance, len(costs), partitions)
    assert max(partition_costs(costs, balance)) == brute_force(costs, partitions)


@settings(max_examples=100, deadline=None)
@given(costs_and_partitions(st.one_of(INTS, FLOATS)))
def test_balance_cost_is_deterministic(case: Tuple[List[float], int]) -> None:
    costs, partitions = case
    assert balance_cost(costs, partitions) == balance_cost(list(costs), partitions)


def test_balance_cost_examples() -> None:
    assert balance_cost([1, 1, 1, 1, 8, 1, 1], 3) == [4, 1, 2]
    assert balance_cost([5], 1) == [1]
    assert balance_cost([1, 2, 3], 3) == [1, 1, 1]
    assert balance_cost([1, 2, 3], 1) == [3]
    # Equal costs and all zeros give even partitions.
    assert balance_cost([1] * 8, 4) == [2, 2, 2, 2]
    assert balance_cost([0] * 6, 3) == [2, 2, 2]
    assert balance_cost([0.0] * 6, 3) == [2, 2, 2]


def test_balance_cost_float_ties_are_exact() -> None:
    # 0.1 + 0.2 != 0.3 in floats, but exact arithmetic sees the real sums: [0.1, 0.2] and [0.3] tie.
    costs = [0.1, 0.2, 0.3]
    assert max(partition_costs(costs, balance_cost(costs, 2))) == brute_force(costs, 2)


def test_balance_cost_large_is_valid() -> None:
    costs = [float(c) for c in torch.rand(10_000).tolist()]
    balance = balance_cost(costs, 64)
    assert_valid(balance, 10_000, 64)
    # The optimum is at least the average and at most average + largest cost.
    worst = max(partition_costs(costs, balance))
    assert sum(costs) / 64 <= worst <= sum(costs) / 64 + max(costs)
    # And no smaller bottleneck is feasible: one ulp-free check with the exact solver itself.
    assert solve(costs, 64) == balance


def test_balance_cost_accepts_other_reals() -> None:
    assert balance_cost([Fraction(1, 3), Fraction(2, 3), Fraction(1, 3)], 2) == [1, 2]
    assert balance_cost((1, 2.5, True), 2) == [1, 2]


@pytest.mark.parametrize("partitions", [0, -1, 4])
def test_balance_cost_partitions_out_of_range(partitions: int) -> None:
    with pytest.raises(ValueError, match="partitions"):
        balance_cost([1, 2, 3], partitions)


def test_balance_cost_messages() -> None:
    with pytest.raises(ValueError, match="cannot split 3 layers .* into 4 non-empty partitions"):
        balance_cost([1, 2, 3], 4)
    with pytest.raises(ValueError, match="at least 1, got 0"):
        balance_cost([1, 2, 3], 0)
    with pytest.raises(ValueError, match="into 1 non-empty"):
        balance_cost([], 1)
    with pytest.raises(ValueError, match=r"costs\[1\] = -1 is negative"):
        balance_cost([1, -1, 2], 2)
    with pytest.raises(ValueError, match="not a finite"):
        balance_cost([1.0, float("nan")], 1)
    with pytest.raises(ValueError, match="not a finite"):
        balance_cost([1.0, float("inf")], 1)
    with pytest.raises(TypeError, match="partitions must be an int"):
        balance_cost([1, 2], 1.0)  # type: ignore[arg-type]


# --- models for the profilers -----------------------------------------------------------------


class Split(nn.Module):
    """Returns a tuple, as pipeline layers may."""

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return x, x * 2


class Join(nn.Module):
    def forward(self, xs: Tuple[Tensor, Tensor]) -> Tensor:
        a, b = xs
        return a + b


def small_models() -> List[nn.Sequential]:
    return [
        nn.Sequential(nn.Linear(8, 8)),
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 8)),
        nn.Sequential(
            nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True), nn.Dropout(0.5), Split(), Join()
        ),
    ]


# --- balance_by_time --------------------------------------------------------------------------


@pytest.mark.parametrize("position", [0, 2, 4])
def test_balance_by_time_isolates_a_slow_layer(position: int) -> None:
    layers: List[nn.Module] = [nn.Linear(8, 8) for _ in range(5)]
    layers[position] = Sleep(0.03)
    model = nn.Sequential(*layers)
    balance = balance_by_time(3, model, torch.randn(4, 8), timeout=TIMEOUT, device="cpu")
    assert_valid(balance, 5, 3)
    starts = list(itertools.accumulate([0, *balance]))
    # The partition holding the slow layer holds nothing else.
    assert [position, position + 1] in [[a, b] for a, b in zip(starts, starts[1:])], balance


def test_balance_by_time_two_slow_layers() -> None:
    model = nn.Sequential(Sleep(0.02), nn.Linear(8, 8), nn.Linear(8, 8), Sleep(0.02), nn.Linear(8, 8))
    balance = balance_by_time(2, model, torch.randn(4, 8), timeout=TIMEOUT, device="cpu")
    # Each partition must get exactly one of the two sleeps.
    assert balance[0] in (1, 2, 3), balance


@pytest.mark.parametrize("model_index", range(3))
@pytest.mark.parametrize("partitions", [1, 2, 3])
def test_balance_by_time_is_valid(model_index: int, partitions: int) -> None:
    model = small_models()[model_index]
    partitions = min(partitions, len(model))
    balance = balance_by_time(partitions, model, torch.randn(4, 8), timeout=0.05)
    assert_valid(balance, len(model), partitions)


def test_balance_by_time_timeout_bounds_profiling() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    started = time.perf_counter()
    balance_by_time(2, model, torch.randn(4, 8), timeout=0.2)
    # Generous: the bound is 0.2 s plus one pass; only catch runaway loops.
    assert time.perf_counter() - started < 10


def test_balance_by_time_tuple_sample() -> None:
    class Add(nn.Module):
        def forward(self, xs: Tuple[Tensor, Tensor]) -> Tensor:
            return xs[0] + xs[1]

    model = nn.Sequential(Add(), nn.Linear(8, 8), nn.ReLU())
    sample = (torch.randn(4, 8), torch.randn(4, 8))
    assert_valid(balance_by_time(2, model, sample, timeout=0.05), 3, 2)


def test_balance_by_time_integer_input() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    assert_valid(balance_by_time(2, model, torch.tensor([[1, 2], [3, 4]]), timeout=0.05), 2, 2)


def test_balance_by_time_does_not_modify_the_sample() -> None:
    sample = torch.randn(4, 8)
    original = sample.clone()
    balance_by_time(1, nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8)), sample, timeout=0.05)
    assert torch.equal(sample, original)
    assert not sample.requires_grad


# --- balance_by_size --------------------------------------------------------------------------


class Big(nn.Module):
    """Saves a large activation for backward: (batch, 8) -> (batch, 8) through a (batch, 4096) tensor."""

    def forward(self, x: Tensor) -> Tensor:
        wide = x.repeat(1, 512)  # (batch, 4096)
        return (wide * wide).reshape(x.size(0), 512, 8).sum(1)


@pytest.mark.parametrize("position", [0, 2, 4])
def test_balance_by_size_isolates_a_big_layer(position: int) -> None:
    layers: List[nn.Module] = [nn.Linear(8, 8) for _ in range(5)]
    layers[position] = Big()
    model = nn.Sequential(*layers)
    balance = balance_by_size(3, model, torch.randn(64, 8), device="cpu")
    assert_valid(balance, 5, 3)
    starts = list(itertools.accumulate([0, *balance]))
    assert [position, position + 1] in [[a, b] for a, b in zip(starts, starts[1:])], balance


def test_balance_by_size_counts_parameters() -> None:
    # With activations negligible, the one big Linear dominates through param_scale.
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2000), nn.Linear(2000, 2))
    sizes = profile_sizes(model, torch.randn(1, 2), chunks=1, device=torch.device("cpu"))
    assert [s.parameter_bytes for s in sizes] == [24, 24, 24000, 16008]
    balance = balance_by_size(2, model, torch.randn(1, 2), param_scale=10.0)
    assert balance == [3, 1]


def test_balance_by_size_measures_saved_activations() -> None:
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8), Big())
    sizes = profile_sizes(model, torch.randn(32, 8), chunks=4, device=torch.device("cpu"))
    micro = 8  # 32 / 4
    # Linear saves its input (the weight is a parameter, not counted).
    assert sizes[0].activation_bytes == micro * 8 * 4
    # ReLU saves its output.
    assert sizes[1].activation_bytes == micro * 16 * 4
    # Big saves `wide` (once, although `wide * wide` saves it twice).
    assert sizes[3].activation_bytes >= micro * 4096 * 4
    assert sizes[0].parameter_bytes == 8 * 16 * 4


def test_balance_by_size_chunks_scale_activations() -> None:
    model = nn.Sequential(Big(), Big())
    one = profile_sizes(model, torch.randn(64, 8), chunks=1, device=torch.device("cpu"))
    four = profile_sizes(model, torch.randn(64, 8), chunks=4, device=torch.device("cpu"))
    assert one[0].activation_bytes == 4 * four[0].activation_bytes


@pytest.mark.parametrize("model_index", range(3))
@pytest.mark.parametrize("partitions", [1, 2, 3])
def test_balance_by_size_is_valid(model_index: int, partitions: int) -> None:
    model = small_models()[model_index]
    partitions = min(partitions, len(model))
    balance = balance_by_size(partitions, model, torch.randn(4, 8), chunks=2)
    assert_valid(balance, len(model), partitions)


def test_balance_by_size_tuple_input() -> None:
    model = nn.Sequential(Join(), Split(), Join(), nn.Linear(8, 8))
    assert_valid(balance_by_size(2, model, (torch.randn(4, 8), torch.randn(4, 8)), chunks=2), 4, 2)


# --- skip connections --------------------------------------------------------------------------


@skippable(stash=["skip"])
class StashWide(nn.Module):
    """Stashes a wide activation that a later layer pops."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 512)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        wide = self.linear(x)
        yield stash("skip", wide)
        return wide[:, :16]


@skippable(pop=["skip"])
class PopWide(nn.Module):
    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        wide = yield pop("skip")
        return x + wide[:, 16:32] * wide[:, 32:48]


def skip_model() -> nn.Sequential:
    return nn.Sequential(StashWide(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), PopWide(), nn.Linear(16, 4))


@pytest.mark.parametrize("balance", [balance_by_time, balance_by_size])
def test_the_profilers_run_skippable_layers(balance) -> None:  # type: ignore[no-untyped-def]
    # Each layer is profiled alone: a popped tensor is a fresh input there, and a stashed one a root of the
    # stashing layer's backward (see [Note: skips while profiling]).
    model = skip_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    kwargs = {"timeout": 0.1} if balance is balance_by_time else {}
    result = balance(3, model, torch.randn(8, 16), **kwargs)
    assert len(result) == 3 and sum(result) == 6
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(p.grad is None for p in model.parameters())


def test_a_skip_counts_where_it_is_held() -> None:
    sizes = profile_sizes(skip_model(), torch.randn(8, 16), 1, torch.device("cpu"))
    # In a pipeline the stashing partition holds the stashed tensor until its backward, and the popping one its
    # copy, which PopWide saves (two slices of it) for the product's backward: both count it.
    assert sizes[0].activation_bytes >= 8 * 512 * 4
    assert sizes[4].activation_bytes >= 8 * 512 * 4
    assert all(size.activation_bytes < 8 * 512 * 4 for size in sizes[1:4])


def skippable_unet(depth: int = 3) -> nn.Sequential:
    """Each encoder stashes its output, a tensor with grad history; its decoder pops it."""
    return models.skippable_unet(depth, width=8, stash_output=True)


def test_balance_by_time_on_a_skippable_unet() -> None:
    """balance_by_time ran each layer's backward right after its forward; an encoder's backward freed the
    graph of the tensor it stashed, and its decoder's backward then failed with "Trying to backward
    through the graph a second time". The profiler now treats stashed tensors as the pipeline does:
    they end the stashing layer's backward, and the popping layer gets a leaf."""
    model = skippable_unet()
    before = copy.deepcopy(model.state_dict())
    balance = balance_by_time(3, model, torch.randn(16, 8), timeout=0.1, device="cpu")
    assert len(balance) == 3 and sum(balance) == len(model) and min(balance) >= 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    piped = GPipe(model, balance, devices=["cpu"] * 3, chunks=2)
    piped(torch.randn(4, 8)).sum().backward()


def test_balance_by_size_on_a_skippable_unet_counts_the_stash() -> None:
    """balance_by_size measured each layer in a function of its own, with no one serving stash and pop in
    between; the stash a layer holds until its pop is part of its memory, and is counted."""
    from torchpipe_balancing.profile import profile_sizes

    model = skippable_unet(depth=1)
    x = torch.randn(16, 8)
    sizes = profile_sizes(model, x, chunks=1, device=torch.device("cpu"))
    # The encoder keeps its output for relu's backward; the stash is that same storage, counted once.
    assert sizes[0].activation_bytes == 16 * 8 * 4 + 16 * 8 * 4  # the input of linear, relu's output
    balance = balance_by_size(2, skippable_unet(), x, chunks=2, device="cpu")
    assert sum(balance) == 7

    @skippable(stash=["skip"])
    class StashOnly(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            yield stash("skip", x * 3)  # saved by nothing: held only by the skip
            return x

    @skippable(pop=["skip"])
    class PopOnly(nn.Module):
        def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
            skip = yield pop("skip")
            return x + skip

    sizes = profile_sizes(nn.Sequential(StashOnly(), PopOnly()), x, chunks=1, device=torch.device("cpu"))
    assert sizes[0].activation_bytes == 16 * 8 * 4


# --- the module is left as it was -------------------------------------------------------------


def snapshot(model: nn.Module) -> dict:  # type: ignore[type-arg]
    return {
        "training": [m.training for m in model.modules()],
        "params": [(p, p.data.data_ptr(), p.device, p.requires_grad, p.grad) for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "values": [p.detach().clone() for p in model.parameters()],
        "buffers": [(name, b, b.clone()) for name, b in model.named_buffers()],
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:  # type: ignore[type-arg]
    after = snapshot(model)
    assert after["training"] == before["training"]
    for (p, ptr, device, rg, grad), (q, ptr2, device2, rg2, grad2) in zip(before["params"], after["params"]):
        assert p is q and ptr == ptr2 and device == device2 and rg == rg2 and grad is grad2
    for g, g2 in zip(before["grads"], after["grads"]):
        assert (g is None and g2 is None) or torch.equal(g, g2)
    for v, v2 in zip(before["values"], after["values"]):
        assert torch.equal(v, v2)
    for (name, b, value), (name2, b2, value2) in zip(before["buffers"], after["buffers"]):
        assert name == name2 and b is b2 and torch.equal(value, value2), name


def stateful_model() -> nn.Sequential:
    model = nn.Sequential(
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 8), nn.BatchNorm1d(8)
    )
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)  # an existing gradient
    model[4].weight.requires_grad_(False)  # a frozen parameter
    model[1].eval()  # a mixed-mode module
    model.train(True)
    model[5].eval()
    return model


@pytest.mark.parametrize("balance", ["time", "size"])
def test_profiling_leaves_the_module_as_found(balance: str) -> None:
    model = stateful_model()
    before = snapshot(model)
    sample = torch.randn(4, 8)
    rng = torch.get_rng_state()
    if balance == "time":
        balance_by_time(2, model, sample, timeout=0.05, device="cpu")
    else:
        balance_by_size(2, model, sample, device="cpu")
    assert_unchanged(model, before)
    assert model[1].num_batches_tracked.item() == 0
    assert torch.equal(torch.get_rng_state(), rng)


def test_profiling_leaves_an_eval_module_in_eval_mode() -> None:
    model = stateful_model().eval()
    before = snapshot(model)
    balance_by_time(2, model, torch.randn(4, 8), timeout=0.05)
    assert_unchanged(model, before)
    assert not any(m.training for m in model.modules())


def test_profiling_restores_the_module_when_a_layer_raises() -> None:
    class Boom(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise RuntimeError("boom")

    model = stateful_model()
    model.append(Boom())
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        balance_by_time(2, model, torch.randn(4, 8), timeout=0.05)
    assert_unchanged(model, before)
    with pytest.raises(RuntimeError, match="boom"):
        balance_by_size(2, model, torch.randn(4, 8))
    assert_unchanged(model, before)


def test_sandbox_restores_shared_parameters() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    before = snapshot(model)
    with sandbox(model, torch.device("cpu")):
        model(torch.randn(2, 4)).sum().backward()
        assert shared.weight.grad is not None
    assert_unchanged(model, before)
    assert shared.weight.grad is None


def test_profiling_works_under_no_grad() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Sleep(0.01), nn.Linear(8, 8))
    with torch.no_grad():
        assert_valid(balance_by_time(3, model, torch.randn(4, 8), timeout=0.05), 3, 3)
        assert_valid(balance_by_size(3, model, torch.randn(4, 8)), 3, 3)


# --- call forms and errors --------------------------------------------------------------------


def test_torchgpipe_0_0_4_call_form() -> None:
    """torchgpipe 0.0.3 and 0.0.4's torchgpipe_balancing took (module, sample, partitions=n)."""
    model = nn.Sequential(nn.Linear(8, 8), Sleep(0.02), nn.Linear(8, 8))
    sample = torch.randn(4, 8)
    assert balance_by_time(model, sample, partitions=3, timeout=0.05) == [1, 1, 1]
    assert_valid(balance_by_time(model, sample, partitions=2), 3, 2)
    assert_valid(balance_by_time(model, sample, 2, timeout=0.05), 3, 2)
    assert balance_by_size(model, sample, partitions=3, chunks=2) == [1, 1, 1]
    assert_valid(balance_by_size(model, sample, 2), 3, 2)
    # Everything by keyword.
    assert_valid(balance_by_time(partitions=2, module=model, sample=sample, timeout=0.05), 3, 2)
    assert_valid(balance_by_size(partitions=2, module=model, input=sample), 3, 2)


def test_default_device_is_cpu_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the default device is CUDA")
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert_valid(balance_by_size(2, model, torch.randn(4, 8)), 2, 2)
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("balance", [balance_by_time, balance_by_size])
def test_errors(balance) -> None:  # type: ignore[no-untyped-def]
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    sample = torch.randn(4, 8)
    with pytest.raises(ValueError, match="at least 1, got 0"):
        balance(0, model, sample)
    with pytest.raises(ValueError, match="cannot split 2 layers .* into 3 non-empty partitions"):
        balance(3, model, sample)
    with pytest.raises(ValueError, match="cannot split 2 layers"):
        balance(model, sample, partitions=3)
    with pytest.raises(TypeError, match="needs an nn.Sequential module, got Linear"):
        balance(1, nn.Linear(8, 8), sample)
    with pytest.raises(TypeError, match="needs an nn.Sequential module, got ModuleList"):
        balance(1, nn.ModuleList([nn.Linear(8, 8)]), sample)
    with pytest.raises(ValueError, match="empty"):
        balance(1, model, torch.empty(0, 8))
    with pytest.raises(ValueError, match="empty"):
        balance(1, model, ())
    with pytest.raises(ValueError, match="empty nn.Sequential"):
        balance(1, nn.Sequential(), sample)
    with pytest.raises(TypeError, match="Tensor or a tuple of Tensors, got list"):
        balance(1, model, [sample])
    with pytest.raises(TypeError, match="partitions must be an int"):
        balance(1.5, model, sample)
    with pytest.raises(TypeError, match="multiple values for argument 'partitions'"):
        balance(1, model, sample, partitions=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        balance(1, model, sample, nope=1)
    with pytest.raises(TypeError, match="missing required argument"):
        balance(model, sample)


def test_option_errors() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    sample = torch.randn(4, 8)
    with pytest.raises(ValueError, match="timeout must be a positive"):
        balance_by_time(1, model, sample, timeout=0)
    with pytest.raises(ValueError, match="chunks must be at least 1"):
        balance_by_size(1, model, sample, chunks=0)
    with pytest.raises(ValueError, match="param_scale must be a non-negative"):
        balance_by_size(1, model, sample, param_scale=-1.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profiling_keeps_the_module_on_cpu() -> None:
    model = stateful_model()
    before = snapshot(model)
    balance_by_time(2, model, torch.randn(4, 8), timeout=0.05, device="cuda")
    balance_by_size(2, model, torch.randn(4, 8), device="cuda")
    assert_unchanged(model, before)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_and_cpu_sizes_agree() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Big(), nn.Linear(8, 8))
    x = torch.randn(32, 8)
    cpu = profile_sizes(model, x, 1, torch.device("cpu"))
    with sandbox(model, torch.device("cuda", 0)):
        cuda = profile_sizes(model, x.cuda(), 1, torch.device("cuda", 0))
    assert [s.activation_bytes for s in cpu] == [s.activation_bytes for s in cuda]
    assert all(s.cuda_peak_bytes is not None for s in cuda)
