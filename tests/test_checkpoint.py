"""is_checkpointing() / is_recomputing() patterns, and which micro-batches each mode checkpoints."""
from typing import List, Tuple

import pytest
import torch
from torch import Tensor, nn

import torchpipe
from torchpipe import GPipe
from torchpipe.checkpoint import checkpoint_stop


class Observe(nn.Module):
    def __init__(self, log: List[Tuple[int, bool, bool, bool]], partition: int) -> None:
        super().__init__()
        self.log = log
        self.partition = partition

    def forward(self, x: Tensor) -> Tensor:
        mb = torchpipe.current_microbatch()
        assert mb is not None
        self.log.append((mb.index, torchpipe.is_checkpointing(), torchpipe.is_recomputing(), torch.is_grad_enabled()))
        return x


@pytest.mark.parametrize(
    "mode, expected_stop", [("always", 4), ("except_last", 3), ("never", 0)]
)
def test_patterns(mode: str, expected_stop: int) -> None:
    log: List[Tuple[int, bool, bool, bool]] = []
    model = nn.Sequential(nn.Linear(2, 2), Observe(log, 0), nn.Linear(2, 2), Observe(log, 1))
    piped = GPipe(model, [2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint=mode)
    piped(torch.randn(8, 2)).sum().backward()
    first = [e for e in log if not e[2]]
    again = [e for e in log if e[2]]
    assert len(first) == 8
    for index, checkpointing, _, grad in first:
        assert checkpointing == (index < expected_stop)
        assert grad == (not checkpointing)
    assert sorted(e[0] for e in again) == sorted(list(range(expected_stop)) * 2)
    assert all(not e[1] and e[3] for e in again)
    assert not torchpipe.is_checkpointing() and not torchpipe.is_recomputing()


def test_flags_are_false_outside_gpipe() -> None:
    log: List[Tuple[bool, bool]] = []

    class Look(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            log.append((torchpipe.is_checkpointing(), torchpipe.is_recomputing()))
            return x

    nn.Sequential(Look())(torch.zeros(1))
    assert log == [(False, False)]
    assert torchpipe.current_microbatch() is None


def test_one_microbatch_except_last_does_not_checkpoint() -> None:
    assert checkpoint_stop("except_last", 1, True) == 0
    assert checkpoint_stop("always", 1, True) == 1
    assert checkpoint_stop("always", 5, False) == 0


def test_counter_pattern_from_the_guide() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.counter = 0

        def forward(self, x: Tensor) -> Tensor:
            if not torchpipe.is_recomputing():
                self.counter += 1
            return x

    counter = Counter()
    piped = GPipe(nn.Sequential(nn.Linear(2, 2), counter), [1, 1], devices=["cpu", "cpu"], chunks=4,
                  checkpoint="always")
    piped(torch.randn(8, 2)).sum().backward()
    assert counter.counter == 4


def test_recomputation_is_scheduled_before_the_gradient_arrives() -> None:
    # Partition 0 recomputes micro-batch i right after its backward of micro-batch i+1: the order
    # of actions of one partition is the schedule's, observed through the flags.
    events: List[Tuple[str, int]] = []

    class Probe(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            mb = torchpipe.current_microbatch()
            assert mb is not None
            events.append(("R" if torchpipe.is_recomputing() else "F", mb.index))
            return _BackwardProbe.apply(x, mb.index, events)

    piped = GPipe(nn.Sequential(Probe(), nn.Linear(2, 2)), [1, 1], devices=["cpu", "cpu"], chunks=3,
                  checkpoint="always")
    piped(torch.randn(6, 2, requires_grad=True)).sum().backward()
    assert events == [("F", 0), ("F", 1), ("F", 2), ("R", 2), ("B", 2), ("R", 1), ("B", 1), ("R", 0), ("B", 0)]


class _BackwardProbe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, index: int, events: list) -> Tensor:  # type: ignore[no-untyped-def,override]
        ctx.index, ctx.events = index, events
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[no-untyped-def,override]
        ctx.events.append(("B", ctx.index))
        return grad, None, None
