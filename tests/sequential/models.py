"""Models that are not Sequentials, for the as_sequential tests: each an ordinary ``nn.Module`` with its own forward."""
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Norm = Callable[[int], nn.Module]


def group_norm(channels: int) -> nn.Module:
    """A norm without batch statistics, so that micro-batches give the mini-batch's numbers."""
    return nn.GroupNorm(2, channels)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock, written as torchvision writes it (in-place ReLU, ``out += identity``)."""

    def __init__(self, cin: int, cout: int, stride: int = 1, norm: Norm = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = norm(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = norm(cout)
        self.downsample: Optional[nn.Module] = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResidualNet(nn.Module):
    """A small ResNet: stem, two stages of basic blocks (the second downsamples), pooling, a linear head."""

    def __init__(self, width: int = 8, classes: int = 5, norm: Norm = group_norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = norm(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(width, width, norm=norm), BasicBlock(width, width, norm=norm))
        self.layer2 = nn.Sequential(
            BasicBlock(width, 2 * width, 2, norm=norm), BasicBlock(2 * width, 2 * width, norm=norm)
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class UNet(nn.Module):
    """A U-Net whose skips are concatenated with ``torch.cat``, kept in a list by forward."""

    def __init__(self, levels: int = 2, base: int = 4) -> None:
        super().__init__()
        self.down = nn.ModuleList()
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        cin = 3
        for level in range(levels):
            cout = base * 2**level
            self.down.append(nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.Tanh()))
            cin = cout
        self.bottom = nn.Conv2d(cin, 2 * cin, 3, padding=1)
        cin = 2 * cin
        for level in reversed(range(levels)):
            cout = base * 2**level
            self.up.append(nn.ConvTranspose2d(cin, cout, 2, stride=2))
            self.merge.append(nn.Conv2d(2 * cout, cout, 3, padding=1))
            cin = cout
        self.head = nn.Conv2d(cin, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips: List[Tensor] = []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = torch.tanh(self.bottom(x))
        for up, merge in zip(self.up, self.merge):
            x = up(x)
            x = torch.tanh(merge(torch.cat([x, skips.pop()], dim=1)))
        return self.head(x)


class Encoder(nn.Module):
    """Token embedding, an ``nn.TransformerEncoder`` stack with a padding mask input, and a classification head."""

    def __init__(self, vocabulary: int = 20, width: int = 16, heads: int = 2, depth: int = 3, classes: int = 3,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: Tensor, padding: Tensor) -> Tensor:
        x = self.encoder(self.embedding(tokens), src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1).clamp(min=1.0))


class TwoInTwoOut(nn.Module):
    """Two inputs, two outputs, and values that cross between the branches."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)
        self.d = nn.Linear(width, 2)

    def forward(self, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        a = torch.relu(self.a(x))
        b = torch.tanh(self.b(y)) + a
        c = self.c(a * b)
        return self.d(c + x), c - y
