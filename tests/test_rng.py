"""Random numbers in pipelined and data-parallel steps: which layers may draw (torchpipe.rng.may_draw), which decides
whether a stage's tasks run on random streams of their own, and that replays and reruns draw the same numbers
whatever the threads' timing."""
import threading
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch import Tensor, nn

import torchpipe
from tests.models import cpu_gpipe, grads_of
from torchpipe import DataParallel, GPipe
from torchpipe.rng import may_draw


class KeepsLinearForward(nn.Linear):
    """A subclass that keeps nn.Linear's forward: judged as nn.Linear."""


class Noisy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_a_subclass_that_keeps_its_bases_forward_is_judged_as_the_base() -> None:
    assert not may_draw(nn.Sequential(KeepsLinearForward(2, 2), nn.ReLU()))
    assert may_draw(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
    assert not may_draw(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)).eval())


def test_a_class_whose_forward_is_replaced_is_judged_anew() -> None:
    # The class whose forward runs is looked up once per class (every step asks for every module of every stage),
    # keyed by the forward itself: replacing it, here with a forward that draws, is seen at the next look.
    model = nn.Sequential(KeepsLinearForward(2, 2))
    assert not may_draw(model)

    def noisy_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn_like(x)

    KeepsLinearForward.forward = noisy_forward  # type: ignore[method-assign, assignment]
    try:
        assert may_draw(model)
    finally:
        del KeepsLinearForward.forward
    assert not may_draw(model)


def test_a_module_of_unknown_code_may_draw() -> None:
    assert may_draw(nn.Sequential(Noisy()))


# --- replays and reruns --------------------------------------------------------------------------------


def _masks_spy(store: Dict[Tuple[Any, ...], Tensor]) -> nn.Module:
    class Spy(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            store[(id(self), torchpipe.current_microbatch(), torchpipe.is_recomputing())] = (x == 0).clone()
            return x

    return Spy()


def _assert_recomputation_drew_the_same(store: Dict[Tuple[Any, ...], Tensor]) -> None:
    pairs = [(k, v) for k, v in store.items() if not k[2]]
    assert pairs
    for (layer, microbatch, _), mask in pairs:
        replay = store.get((layer, microbatch, True))
        if replay is not None:
            assert torch.equal(mask, replay), "a recomputation drew other numbers than its forward"


def test_a_partition_that_starts_drawing_later_is_replayed() -> None:
    # The replay remembered from the first step that a partition draws nothing, and stopped saving and
    # restoring its state: once dropout's p was raised from 0, recomputations drew other masks.
    store: Dict[Tuple[Any, ...], Tensor] = {}
    dropout = nn.Dropout(0.0)
    model = cpu_gpipe(nn.Sequential(nn.Linear(8, 8), dropout, _masks_spy(store), nn.Linear(8, 8)), [3, 1],
                      chunks=4, checkpoint="always")
    model(torch.randn(8, 8) + 1).sum().backward()
    dropout.p = 0.5
    store.clear()
    model(torch.randn(8, 8) + 1).sum().backward()
    _assert_recomputation_drew_the_same(store)
    assert any(mask.any() for mask in store.values()), "dropout drew nothing: the test shows nothing"


@pytest.mark.timeout(120)
def test_two_gpipes_in_two_threads_keep_their_own_random_streams() -> None:
    # Each GPipe had its own lock around the CPU generator they share: from two threads, with dropout and
    # checkpointing, they corrupted each other's replay in about 40% of the steps.
    stores: List[Dict[Tuple[Any, ...], Tensor]] = [{}, {}]
    models = [
        cpu_gpipe(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), _masks_spy(store), nn.Linear(16, 16),
                                nn.Dropout(0.5), _masks_spy(store)), [3, 3], chunks=4, checkpoint="always")
        for store in stores
    ]
    errors: List[BaseException] = []

    def train(model: GPipe) -> None:
        try:
            for _ in range(10):
                model(torch.randn(8, 16) + 1).sum().backward()
        except BaseException as exc:  # noqa: B036 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for store in stores:
        _assert_recomputation_drew_the_same(store)


def _dropout_run(make: Callable[[], nn.Module], seed: int) -> Tuple[Tensor, List[Tensor]]:
    torch.manual_seed(0)
    model = make()
    x = torch.randn(16, 8)
    torch.manual_seed(seed)
    out = model(x)
    out.sum().backward()
    return out.detach(), grads_of(model)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_the_same_seed_gives_the_same_results_whatever_the_timing(checkpoint: str) -> None:
    # CPU partitions drew from one generator in an order set by thread timing: 8 of 8 reruns differed.
    def make() -> nn.Module:
        layers = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 32), nn.Dropout(0.5),
                               nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 1))
        return cpu_gpipe(layers, [2, 2, 3], chunks=4, checkpoint=checkpoint)

    out, grads = _dropout_run(make, 5)
    for _ in range(4):
        again, again_grads = _dropout_run(make, 5)
        assert torch.equal(out, again)
        assert all(torch.equal(a, b) for a, b in zip(grads, again_grads))
    assert not torch.equal(_dropout_run(make, 6)[0], out)


def test_data_parallel_replicas_with_dropout_are_reproducible() -> None:
    # The same for data-parallel replicas, which draw on worker threads too: the same seed, the same results.
    def make() -> nn.Module:
        return DataParallel(nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 1)), ["cpu"] * 3)

    out, grads = _dropout_run(make, 5)
    for _ in range(4):
        again, again_grads = _dropout_run(make, 5)
        assert torch.equal(out, again)
        assert all(torch.equal(a, b) for a, b in zip(grads, again_grads))
