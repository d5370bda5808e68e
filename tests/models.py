"""Small layers and model builders shared by the tests."""
from typing import List, Tuple

from torch import Tensor, nn


class Fork(nn.Module):
    """Tensor -> (tensor, 2 * tensor)."""

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return x, x * 2


class Both(nn.Module):
    """(a, b) -> (linear(a), tanh(b))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, ab: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        a, b = ab
        return self.linear(a), b.tanh()


class Join(nn.Module):
    """(a, b) -> a + b."""

    def forward(self, ab: Tuple[Tensor, Tensor]) -> Tensor:
        a, b = ab
        return a + b


class WithIndex(nn.Module):
    """Tensor -> (tensor, count of positive entries per row): a long tensor crossing partitions."""

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return x, (x > 0).long().sum(1)


class UseIndex(nn.Module):
    """(x, index) -> x + index as float."""

    def forward(self, xi: Tuple[Tensor, Tensor]) -> Tensor:
        x, index = xi
        return x + index.to(x.dtype).unsqueeze(1)


def build(kinds: List[str], width: int) -> nn.Sequential:
    """A Sequential from layer names: 'linear', 'relu', 'relu_', 'tanh', 'norm', 'fork', 'both', 'join',
    'index', 'use_index'."""
    layers: List[nn.Module] = []
    for kind in kinds:
        layers.append(
            {
                "linear": lambda: nn.Linear(width, width),
                "relu": nn.ReLU,
                "relu_": lambda: nn.ReLU(inplace=True),
                "tanh": nn.Tanh,
                "norm": lambda: nn.LayerNorm(width),
                "fork": Fork,
                "both": lambda: Both(width),
                "join": Join,
                "index": WithIndex,
                "use_index": UseIndex,
            }[kind]()
        )
    return nn.Sequential(*layers)


def mlp(layers: int = 4, width: int = 8) -> nn.Sequential:
    modules: List[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*modules)
