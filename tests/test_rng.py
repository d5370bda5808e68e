"""Which layers may draw random numbers (torchpipe.rng.may_draw), which decides whether a stage's tasks run on
random streams of their own."""
from typing import Any

import torch
from torch import nn

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
