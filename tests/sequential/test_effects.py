"""torchpipe.sequential.effects: which graph nodes draw random numbers, write a tensor in place, or alias one."""
from typing import Any, Callable, List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

import torchpipe
from torchpipe.sequential.effects import aliased_input, draws_random, written_input


def calls(function: Callable[..., Any]) -> List[fx.Node]:
    """The call nodes of ``function`` traced with fx."""
    graph = fx.symbolic_trace(function).graph
    return [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]


@fx.wrap
def custom(x: Tensor) -> Tensor:
    """A function fx records as one call; its code is unknown to torchpipe."""
    return x + 1


RANDOM = {
    "rand_like": lambda x: torch.rand_like(x),
    "randn": lambda x: x + torch.randn(x.shape),
    "randint": lambda x: x + torch.randint(0, 3, x.shape),
    "randperm": lambda x: x[torch.randperm(x.size(0))],
    "bernoulli": lambda x: torch.bernoulli(x),
    "multinomial": lambda x: torch.multinomial(x, 1),
    "normal": lambda x: torch.normal(x, 1.0),
    "poisson": lambda x: torch.poisson(x),
    "dropout default": lambda x: F.dropout(x, 0.5),
    "dropout training": lambda x: F.dropout(x, 0.5, True),
    "dropout2d": lambda x: F.dropout2d(x, training=True),
    "alpha_dropout training": lambda x: F.alpha_dropout(x, 0.5, True),
    "torch.dropout": lambda x: torch.dropout(x, 0.5, True),
    "rrelu training": lambda x: F.rrelu(x, training=True),
    "gumbel_softmax": lambda x: F.gumbel_softmax(x),
    "sdpa dropout": lambda x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.1),
    "bernoulli_": lambda x: x.bernoulli_(0.5),
    "uniform_": lambda x: x.uniform_(),
    "normal_": lambda x: x.normal_(),
    "random_": lambda x: x.random_(),
    "exponential_": lambda x: x.exponential_(),
    "geometric_": lambda x: x.geometric_(0.5),
    "log_normal_": lambda x: x.log_normal_(),
    "cauchy_": lambda x: x.cauchy_(),
    "unknown function": lambda x: custom(x),
}

DETERMINISTIC = {
    "add": lambda x: x + 1,
    "relu": lambda x: F.relu(x),
    "matmul": lambda x: torch.matmul(x, x.t()),
    "size": lambda x: x.view(x.size(0), -1),
    "dropout not training": lambda x: F.dropout(x, 0.5, False),
    "dropout training=False": lambda x: F.dropout(x, p=0.5, training=False),
    "alpha_dropout default": lambda x: F.alpha_dropout(x, 0.5),
    "rrelu default": lambda x: F.rrelu(x),
    "sdpa no dropout": lambda x: F.scaled_dot_product_attention(x, x, x),
    "sdpa dropout 0": lambda x: F.scaled_dot_product_attention(x, x, x, None, 0.0),
    "dropout p 0": lambda x: F.dropout(x, 0.0, True),
    "dropout p=0": lambda x: F.dropout(x, p=0.0, training=True),
    "torch.dropout p 0": lambda x: torch.dropout(x, 0.0, True),
    "dropout2d p 0": lambda x: F.dropout2d(x, 0.0, True),
    "add_": lambda x: x.add_(1),
    "getitem": lambda x: x[0],
}


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_random_calls_draw(name: str) -> None:
    assert any(draws_random(n) for n in calls(RANDOM[name]))


@pytest.mark.parametrize("name", sorted(DETERMINISTIC))
def test_other_calls_do_not_draw(name: str) -> None:
    assert not any(draws_random(n) for n in calls(DETERMINISTIC[name]))


def test_dropout_with_a_traced_training_flag_draws() -> None:
    def forward(x: Tensor, training: Tensor) -> Tensor:
        return F.dropout(x, 0.5, training)

    assert any(draws_random(n) for n in calls(forward))


class Draws(nn.Module):
    """Layers whose own code draws (F.dropout in training), and whose submodule draws (nn.Dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.d = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.drop(self.a(x))             # layer a: the Dropout module is checked by its class, not here
        x = F.dropout(self.b(x), 0.5, True)  # layer b: draws in its own code
        x = F.dropout(self.c(x), 0.5, False)  # layer c: statically not training
        return custom(self.d(x))             # layer d: unknown code may draw


class Noise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) + torch.randn(3)  # no traced argument: fx alone would make it a constant


def test_random_calls_without_traced_arguments_still_draw_every_time() -> None:
    seq = torchpipe.as_sequential(Noise(), torch.zeros(2, 3))
    x = torch.zeros(2, 3)
    assert not torch.equal(seq(x), seq(x))
    assert seq[0].torchpipe_draws_random
    torch.manual_seed(5)
    first = seq(x)
    torch.manual_seed(5)
    assert torch.equal(seq(x), first)


def test_every_generated_layer_says_whether_its_own_code_draws() -> None:
    seq = torchpipe.as_sequential(Draws(), torch.randn(2, 4))
    assert [layer.name for layer in seq] == ["a", "b", "c", "d"]
    assert [layer.torchpipe_draws_random for layer in seq] == [False, True, False, True]
    assert all(isinstance(layer.torchpipe_draws_random, bool) for layer in seq)


def test_the_modules_a_layer_makes_to_hold_submodules_never_draw() -> None:
    module = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Dropout()), nn.Linear(2, 2))
    seq = torchpipe.as_sequential(module, torch.randn(3, 2))
    own = {id(m) for m in module.modules()}
    made = [m for layer in seq for m in layer.modules() if id(m) not in own]
    assert len(made) > len(seq)  # the layers and the paths to the submodules ('0' in '0.0')
    assert all(m.torchpipe_draws_random is False for m in made)


# --- writes and aliases ---


def test_in_place_writes_are_found() -> None:
    def forward(x: Tensor) -> Tensor:
        a = x.add_(1)
        b = F.relu(a, inplace=True)
        c = torch.relu_(b)
        return c

    nodes = calls(forward)
    assert [written_input(n, {}) is not None for n in nodes] == [True, True, True]
    assert [written_input(n, {}).name for n in nodes] == ["x", "add_", "relu"]  # type: ignore[union-attr]
    assert written_input(calls(lambda x: x.add(1))[0], {}) is None


def test_module_with_inplace_writes_its_input() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.ReLU(inplace=True)
            self.keep = nn.ReLU()

        def forward(self, x: Tensor) -> Tensor:
            return self.keep(self.act(x))

    traced = fx.symbolic_trace(M())
    modules = dict(traced.named_modules())
    act, keep = [n for n in traced.graph.nodes if n.op == "call_module"]
    assert written_input(act, modules) is act.args[0]
    assert written_input(keep, modules) is None


def test_views_alias_their_input() -> None:
    def forward(x: Tensor) -> Tensor:
        return x.view(-1)[0].t().flatten() + x.sum()

    nodes = calls(forward)
    aliased = [aliased_input(n, {}) is not None for n in nodes]
    assert aliased == [True, True, True, True, False, False]
