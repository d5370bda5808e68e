"""Small layers and model builders shared by the tests."""
import time
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import Tensor, nn

import torchpipe
from torchpipe import GPipe
from torchpipe.skip import Namespace, pop, skippable, stash

#: The device of every partition in the transparency tests: the CPU, and the first GPU where there is one. The
#: GPU's cases are marked ``cuda``, so ``pytest -m cuda`` runs them (as benchmarks/gpu_check.py does).
DEVICES = ["cpu"] + ([pytest.param("cuda:0", marks=pytest.mark.cuda)] if torch.cuda.is_available() else [])


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


def cpu_gpipe(module: nn.Sequential, balance: List[int], **kwargs: Any) -> GPipe:
    """A GPipe with every partition on the CPU."""
    return GPipe(module, balance, devices=["cpu"] * len(balance), **kwargs)


def grads_of(module: nn.Module) -> List[Tensor]:
    """A copy of each parameter's gradient, zeros where it has none."""
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


@skippable(stash=["skip"])
class Stash(nn.Module):
    """Stashes ``linear(x)`` as ``'skip'`` (unless ``stashes`` is off: then popping it is an error)."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.stashes = True

    def forward(self, x: Tensor) -> Any:
        y = self.linear(x)
        if self.stashes:
            yield stash("skip", y)
        return torch.tanh(y)


@skippable(pop=["skip"])
class Pop(nn.Module):
    """Pops ``'skip'``: ``linear(x) * skip``."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Any:
        skip = yield pop("skip")
        return self.linear(x) * skip


def remember_and_recall() -> Tuple[nn.Module, nn.Module]:
    """The user guide's skip by hand: the first layer remembers its input under ``torchpipe.current_microbatch()``,
    the second pops it and adds it to its own input."""
    skips: Dict[object, Tensor] = {}

    class Remember(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            skips[torchpipe.current_microbatch()] = x
            return x

    class Recall(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            skip = skips.pop(torchpipe.current_microbatch())
            return x + skip.to(x.device)

    return Remember(), Recall()


class WithMask(nn.Module):
    """x -> (x, an integer mask that needs no grad, of ``dtype``) riding along to the next stage."""

    def __init__(self, dtype: torch.dtype = torch.int64) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return x, (x > 0).to(self.dtype)


class UseMask(nn.Module):
    """(x, mask) -> linear(x) * mask + x."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tensor:
        x, mask = pair
        return self.linear(x) * mask.to(x.dtype) + x


def skippable_unet(depth: int = 3, width: int = 4, *, stash_output: bool = False) -> nn.Sequential:
    """A U-Net of Linear layers: each encoder stashes, its decoder pops and concatenates, in reverse order
    (nested long skips). ``stash_output``: encoders stash their output, a tensor with grad history, instead of
    their input."""

    @skippable(stash=["skip"])
    class Down(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x: Tensor) -> Any:
            if not stash_output:
                yield stash("skip", x)
                return torch.relu(self.linear(x))
            y = torch.relu(self.linear(x))
            yield stash("skip", y)
            return y * 2

    @skippable(pop=["skip"])
    class Up(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2 * width, width)

        def forward(self, x: Tensor) -> Any:
            skip = yield pop("skip")
            return torch.relu(self.linear(torch.cat([x, skip], dim=1)))

    namespaces = [Namespace() for _ in range(depth)]
    layers: List[nn.Module] = [Down().isolate(ns) for ns in namespaces]
    layers.append(nn.Linear(width, width))
    layers += [Up().isolate(ns) for ns in reversed(namespaces)]
    return nn.Sequential(*layers)


class RaisesInBackward(torch.autograd.Function):
    """The identity, whose backward raises ``ArithmeticError('backward failed')``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise ArithmeticError("backward failed")


class Sleep(nn.Module):
    """A deliberately slow layer: sleeping costs wall time, not CPU, so a busy machine cannot hide it."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.seconds)
        return x * 1
