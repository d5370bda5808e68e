"""The gradient reducer's collectives, counted in one process with a group that records what is issued.

A collective issued once too often on one rank pairs with its peer's collective of the next step: the
peer's next step then waits forever. So every committed step issues each reduction exactly once per rank,
whether the step ends well or fails, and whenever the failure arrives.
"""
from types import SimpleNamespace
from typing import Any, List

import torch
from torch import Tensor, nn

from torchpipe.distributed.reduce import GradientReducer, TiedGroup


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


# The exact comparisons below are right: the reducer packs gradients by copying them into a flat buffer (no
# arithmetic, no batching), and the recording group hands them back untouched.


class _Recording:
    """A process group of one rank that records its all-reduces (and leaves the tensors as they are)."""

    def __init__(self) -> None:
        self.issued: List[Tensor] = []

    def allreduce(self, tensors: List[Tensor]) -> Any:
        self.issued.append(tensors[0].clone())
        return _Done()


def _reducer(group: _Recording) -> "tuple[GradientReducer, nn.Parameter]":
    shared = nn.Parameter(torch.ones(3))
    stage = nn.Module()
    stage.weight = shared
    reducer = GradientReducer(SimpleNamespace(rank=0), {0: stage}, [0], None, [TiedGroup(shared, group)])
    return reducer, shared


def test_a_failure_after_the_tied_sum_issues_no_second_one() -> None:
    # Seen on a 2 x 2 mesh under load: a tied weight's holders on ranks 0 and 1; a rank of the other replica
    # failed. Rank 1 finished its step and summed the tied gradient with rank 0 (rank 0 had already learnt of
    # the failure, and issued its share from abort), then learnt of the failure itself and aborted: abort
    # issued the sum again. Rank 0 owed nothing more, so rank 1's extra sum paired with rank 0's sum of the
    # next step, and rank 1's own sum of that step waited forever.
    group = _Recording()
    reducer, shared = _reducer(group)
    step = SimpleNamespace(sequence=1)
    reducer.before_step(step)
    shared.grad = torch.full((3,), 2.0)
    reducer.after_step(step)
    assert len(group.issued) == 1
    reducer.abort(step)  # the failure arrives after the sum
    assert len(group.issued) == 1, "abort issued the tied sum a second time"

    nxt = SimpleNamespace(sequence=2)
    reducer.before_step(nxt)
    shared.grad = torch.full((3,), 5.0)
    reducer.after_step(nxt)
    assert len(group.issued) == 2
    assert torch.equal(group.issued[1][:3], torch.full((3,), 5.0))


def test_a_failure_before_the_tied_sum_issues_it_once_with_zeros() -> None:
    group = _Recording()
    reducer, shared = _reducer(group)
    step = SimpleNamespace(sequence=1)
    shared.grad = torch.full((3,), 7.0)  # accumulated before the step
    reducer.before_step(step)
    reducer.abort(step)
    reducer.abort(step)  # the step's error path may reach abort twice: still once
    assert len(group.issued) == 1
    assert torch.equal(group.issued[0][:3], torch.zeros(3))
    assert torch.equal(shared.grad, torch.full((3,), 7.0)), "a failed step keeps the gradient held before it"
