"""Benchmark models as ``nn.Sequential``: ResNet-101-, U-Net- and AmoebaNet-D-style, each with size presets.

Every builder takes a preset name, ``'small'`` (a whole speed benchmark in
minutes on a 2-core CPU), ``'paper'`` (the GPU sizes of the GPipe and
torchgpipe papers) or ``'tiny'`` (the same depth at the least width and
batch: what checks that a benchmark runs), and returns a :class:`Workload`: the module and the shape
of one mini-batch. Layers are flat so that a balancer has many places to cut:

* ResNet-101: stem layers, then one element per bottleneck block (the
  residual skip lives inside the block module), then the head.
* U-Net: three variants with the same layers in the same order (so the same
  seed gives the same weights): ``'plain'`` (an ordinary ``nn.Module`` whose
  ``forward`` keeps the long skips in a list; it is *not* an
  ``nn.Sequential`` and is the baseline), ``'tuple'`` (an ``nn.Sequential``
  where every layer takes and returns ``(x, skip_0, skip_1, ...)``, so the
  skips are carried through every layer and every partition boundary) and
  ``'skip'`` (an ``nn.Sequential`` of ``torchpipe.skip`` skippable layers:
  ``yield stash(...)`` / ``yield pop(...)``, one ``Namespace`` per level).
* AmoebaNet-D: stem, then one element per cell; a cell takes the two previous
  cells' outputs as a tuple ``(prev, cur)``, sums pairs of parallel ops
  (separable convolutions, pooling, 1x7/7x1 convolutions), concatenates the
  sums and returns ``(cur, new)``.

Two builders take sizes instead of a preset: :func:`mlp` (Linear+ReLU pairs)
and :func:`transformer` (encoder blocks on token ids), for the overhead,
schedule and GPU-check benchmarks. :class:`Logits` calls a Hugging Face
language model as its Sequential is called (ids in, logits out), and
:func:`even_balance` cuts a Sequential into even partitions.
"""
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

__all__ = [
    "PRESETS",
    "MODELS",
    "UNET_VARIANTS",
    "Workload",
    "build",
    "resnet101",
    "resnet50",
    "ResNet",
    "resnet_by_hand",
    "torchvision_module",
    "unet",
    "amoebanet",
    "mlp",
    "transformer",
    "skip_api",
    "copy_weights",
    "even_balance",
    "Logits",
]

PRESETS = ("small", "paper", "tiny")
UNET_VARIANTS = ("plain", "tuple", "skip")

Carried = Union[Tensor, Tuple[Tensor, ...]]


@dataclass
class Workload:
    """A model and the shape of one mini-batch for it."""

    name: str
    module: nn.Module
    input_shape: Tuple[int, ...]

    @property
    def batch(self) -> int:
        return self.input_shape[0]

    def sample(self, batch: Optional[int] = None, device: Union[str, torch.device] = "cpu") -> Tensor:
        """A random mini-batch (of ``batch`` samples, default the preset's)."""
        shape = (batch if batch is not None else self.input_shape[0],) + self.input_shape[1:]
        return torch.randn(shape, device=device)


def _check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")


def even_balance(layers: int, partitions: int) -> List[int]:
    """``layers`` split into ``partitions`` contiguous parts differing by at most one layer (the first ones
    longer)."""
    return [layers // partitions + (1 if j < layers % partitions else 0) for j in range(partitions)]


def mlp(layers: int = 32, width: int = 512) -> nn.Sequential:
    """``layers`` Linear+ReLU pairs of ``width`` features (seed 0): the overhead and schedule benchmarks' MLP."""
    torch.manual_seed(0)
    modules: List[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*modules)


def transformer(layers: int = 4, width: int = 256, heads: int = 4, vocab: int = 1024) -> nn.Sequential:
    """A small transformer on token ids (seed 0): an embedding, ``layers`` pre-norm encoder blocks (self-attention
    and a feed-forward of ``4 * width``, no dropout), a LayerNorm and the output projection to ``vocab`` logits.

    No positional encoding and no causal mask: it stands for a transformer's work (attention, matrix products,
    norms), not for a language model; ``(batch, length)`` ids in, ``(batch, length, vocab)`` logits out.
    """
    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
              for _ in range(layers)]
    return nn.Sequential(nn.Embedding(vocab, width), *blocks, nn.LayerNorm(width), nn.Linear(width, vocab))


class Logits(nn.Module):
    """A Hugging Face causal language model called as its Sequential is (``as_sequential(..., output="logits")``):
    token ids in, logits out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, use_cache=False).logits  # type: ignore[no-any-return]


def conv_bn_relu(cin: int, cout: int, kernel: int = 3, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=False),
    )


# --- ResNet-101 --------------------------------------------------------------------------------------


class Bottleneck(nn.Module):
    """ResNet's bottleneck block (1x1, 3x3, 1x1 convolutions) with its residual skip inside."""

    def __init__(self, cin: int, width: int, stride: int = 1, expansion: int = 4) -> None:
        super().__init__()
        cout = width * expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.downsample: Optional[nn.Module] = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)  # type: ignore[no-any-return]


class ResNet(nn.Module):
    """A ResNet as torchvision writes it: an ordinary module (not a Sequential) with torchvision's layout.

    The same architecture as ``torchvision.models.resnet50`` (bottleneck blocks
    with the stride on the 3x3 convolution, a strided 1x1 convolution and BN
    as downsample, ``blocks=(3, 4, 6, 3)``) and the same attribute names, so
    its ``state_dict`` keys are torchvision's; ``width`` is the stem's
    channels (64 in torchvision).
    """

    def __init__(self, blocks: Sequence[int] = (3, 4, 6, 3), width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        cin = width
        stages: List[nn.Sequential] = []
        for stage, count in enumerate(blocks):
            planes = width * 2**stage
            layers: List[nn.Module] = []
            for index in range(count):
                layers.append(Bottleneck(cin, planes, 2 if index == 0 and stage > 0 else 1))
                cin = planes * 4
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))  # type: ignore[no-any-return]


def resnet_by_hand(model: nn.Module) -> nn.Sequential:
    """A ResNet (this module's or torchvision's) written by hand as the flat Sequential GPipe takes.

    Stem layers, one element per block (the residual skip inside it), then
    the head; the layers are ``model``'s own modules.
    """
    stem = [model.conv1, model.bn1, model.relu, model.maxpool]
    blocks = [block for stage in (model.layer1, model.layer2, model.layer3, model.layer4) for block in stage]
    return nn.Sequential(*stem, *blocks, model.avgpool, nn.Flatten(), model.fc)


def _resnet_sizes(preset: str) -> Tuple[int, int, int, int]:
    """(width, image size, classes, batch): ``paper`` is torchvision's ImageNet model, ``small`` fits a CPU."""
    _check_preset(preset)
    return {"paper": (64, 224, 1000, 128), "small": (4, 32, 10, 32), "tiny": (2, 32, 10, 8)}[preset]


def resnet101(preset: str = "small") -> Workload:
    """ResNet-101 (blocks [3, 4, 23, 3]) flattened: 4 stem layers, 33 blocks, 3 head layers.

    ``paper``: base width 64, 224x224 images, 1000 classes, batch 128.
    ``small``: base width 4, 32x32 images, 10 classes, batch 32 (same depth).
    """
    width, size, classes, batch = _resnet_sizes(preset)
    model = ResNet((3, 4, 23, 3), width, classes)
    return Workload("resnet101", resnet_by_hand(model), (batch, 3, size, size))


def torchvision_module() -> Optional[ModuleType]:
    """``torchvision``, or None where it does not import or does not work beside this torch.

    A CUDA build of torchvision beside a CPU build of torch imports, then
    fails loading its compiled operators (a RuntimeError, not an ImportError).
    """
    try:
        import torchvision  # type: ignore[import-untyped]
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    return torchvision


def resnet50(preset: str = "small", *, width: Optional[int] = None, size: Optional[int] = None) -> Workload:
    """ResNet-50 as an ordinary module: torchvision's when it imports, else :class:`ResNet` (the same architecture).

    ``paper``: torchvision's sizes (width 64, 224x224, 1000 classes, batch 128).
    ``small``: width 4, 32x32, 10 classes, batch 32. ``width`` and ``size``
    (the images') override the preset's; torchvision's model is used only at
    its own width, 64.
    """
    preset_width, preset_size, classes, batch = _resnet_sizes(preset)
    width = preset_width if width is None else width
    size = preset_size if size is None else size
    torchvision = torchvision_module() if width == 64 else None
    if torchvision is not None:
        module = torchvision.models.resnet50(num_classes=classes)
        return Workload("resnet50-torchvision", module, (batch, 3, size, size))
    return Workload("resnet50", ResNet((3, 4, 6, 3), width, classes), (batch, 3, size, size))


# --- U-Net -------------------------------------------------------------------------------------------


def skip_api(name: str = "torchpipe") -> ModuleType:
    """The skip-connection API module: ``torchpipe.skip`` (default) or ``torchgpipe.skip``.

    Both offer ``skippable``, ``stash``, ``pop`` and ``Namespace`` with the same contract.

    Raises:
        ImportError: the module is not importable (``torchpipe.skip`` may not exist yet).
    """
    if name not in ("torchpipe", "torchgpipe"):
        raise ValueError(f"skip API must be 'torchpipe' or 'torchgpipe', got {name!r}")
    return importlib.import_module(f"{name}.skip")


def _unet_layers(preset: str) -> Tuple[List[Tuple[str, Optional[nn.Module], int]], Tuple[int, ...]]:
    """The U-Net as a flat list of ``(kind, layer, level)``; kind is 'layer', 'stash' or 'popcat'.

    Encoder level i: two conv-BN-ReLU, stash, max-pool. Bottom: two conv-BN-ReLU.
    Decoder level i (deepest first): transposed conv (x2 up), pop + concat, two conv-BN-ReLU.
    Head: 1x1 conv.
    """
    _check_preset(preset)
    # paper: torchgpipe's U-Net benchmark sizes (5 levels, 64 base channels, 192x192);
    # small: 3 levels, 16 base channels, 48x48.
    levels, base, size, batch = {"paper": (5, 64, 192, 32), "small": (3, 16, 48, 32), "tiny": (2, 4, 16, 8)}[preset]
    spec: List[Tuple[str, Optional[nn.Module], int]] = []
    cin = 3
    for level in range(levels):
        cout = base * 2**level
        spec += [("layer", conv_bn_relu(cin, cout), level), ("layer", conv_bn_relu(cout, cout), level)]
        spec += [("stash", None, level), ("layer", nn.MaxPool2d(2), level)]
        cin = cout
    bottom = base * 2**levels
    spec += [("layer", conv_bn_relu(cin, bottom), levels), ("layer", conv_bn_relu(bottom, bottom), levels)]
    cin = bottom
    for level in reversed(range(levels)):
        cout = base * 2**level
        spec += [("layer", nn.ConvTranspose2d(cin, cout, 2, stride=2), level), ("popcat", None, level)]
        spec += [("layer", conv_bn_relu(2 * cout, cout), level), ("layer", conv_bn_relu(cout, cout), level)]
        cin = cout
    spec.append(("layer", nn.Conv2d(cin, 1, 1), 0))
    return spec, (batch, 3, size, size)


class PlainUNet(nn.Module):
    """The baseline U-Net: the same layers, long skips kept in a list by ``forward``."""

    def __init__(self, spec: Sequence[Tuple[str, Optional[nn.Module], int]]) -> None:
        super().__init__()
        self.kinds = [kind for kind, _, _ in spec]
        self.layers = nn.ModuleList([layer if layer is not None else nn.Identity() for _, layer, _ in spec])

    def forward(self, x: Tensor) -> Tensor:
        skips: List[Tensor] = []
        for kind, layer in zip(self.kinds, self.layers):
            if kind == "stash":
                skips.append(x)
            elif kind == "popcat":
                x = torch.cat([x, skips.pop()], dim=1)
            else:
                x = layer(x)
        return x


class Carry(nn.Module):
    """Applies a layer to the first element of ``(x, skip_0, ...)`` and passes the skips through."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, input: Carried) -> Carried:
        if isinstance(input, Tensor):
            return self.layer(input)  # type: ignore[no-any-return]
        return (self.layer(input[0]),) + tuple(input[1:])


class StashTuple(nn.Module):
    """``(x, skips...) -> (x, skips..., x)``: the skip joins the tuple carried by every later layer."""

    def forward(self, input: Carried) -> Tuple[Tensor, ...]:
        items = (input,) if isinstance(input, Tensor) else tuple(input)
        return items + (items[0],)


class PopCatTuple(nn.Module):
    """``(x, skips..., s) -> (cat(x, s), skips...)``; a lone tensor when no skip is left."""

    def forward(self, input: Tuple[Tensor, ...]) -> Carried:
        x = torch.cat([input[0], input[-1]], dim=1)
        rest = tuple(input[1:-1])
        return (x,) + rest if rest else x


def _skippable_unet_layers(api: ModuleType) -> Tuple[type, type]:
    """The stash and pop+concat layers written against the ``skip`` API (torchpipe's or torchgpipe's)."""

    @api.skippable(stash=["skip"])
    class Stash(nn.Module):
        """Stashes its input as ``'skip'`` and returns it unchanged."""

        def forward(self, x: Tensor) -> Generator[Any, None, Tensor]:
            yield api.stash("skip", x)
            return x

    @api.skippable(pop=["skip"])
    class PopCat(nn.Module):
        """Pops ``'skip'`` and concatenates it to its input along channels."""

        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            skip = yield api.pop("skip")
            return torch.cat([x, skip], dim=1)

    return Stash, PopCat


def unet(preset: str = "small", variant: str = "skip", *, api: str = "torchpipe") -> Workload:
    """A U-Net with long skip connections; ``variant`` is 'plain', 'tuple' or 'skip' (see the module doc).

    ``paper``: 5 levels, 64 base channels, 192x192 images, batch 32.
    ``small``: 3 levels, 16 base channels, 48x48 images, batch 32.
    ``api`` picks the skip module for the ``'skip'`` variant: ``'torchpipe'`` or ``'torchgpipe'``.
    The variants create the same layers in the same order, so after the same
    ``torch.manual_seed`` they hold the same weights.

    Raises:
        ImportError: ``variant='skip'`` and the chosen skip API is not importable.
    """
    if variant not in UNET_VARIANTS:
        raise ValueError(f"unknown U-Net variant {variant!r}; choose one of {', '.join(UNET_VARIANTS)}")
    spec, shape = _unet_layers(preset)
    name = f"unet-{variant}" if api == "torchpipe" or variant != "skip" else f"unet-skip-{api}"
    if variant == "plain":
        return Workload(name, PlainUNet(spec), shape)
    layers: List[nn.Module] = []
    if variant == "tuple":
        for kind, layer, _ in spec:
            if kind == "stash":
                layers.append(StashTuple())
            elif kind == "popcat":
                layers.append(PopCatTuple())
            else:
                assert layer is not None
                layers.append(Carry(layer))
        return Workload(name, nn.Sequential(*layers), shape)
    module = skip_api(api)
    stash_cls, popcat_cls = _skippable_unet_layers(module)
    namespaces: Dict[int, Any] = {}
    for kind, layer, level in spec:
        if kind == "layer":
            assert layer is not None
            layers.append(layer)
            continue
        ns = namespaces.setdefault(level, module.Namespace())
        layers.append((stash_cls() if kind == "stash" else popcat_cls()).isolate(ns))
    return Workload(name, nn.Sequential(*layers), shape)


# --- AmoebaNet-D -------------------------------------------------------------------------------------


class SepConv(nn.Module):
    """ReLU, depthwise k x k (stride s), pointwise 1x1, BN: a separable convolution."""

    def __init__(self, channels: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.ops = nn.Sequential(
            nn.ReLU(),
            nn.Conv2d(channels, channels, kernel, stride, padding=kernel // 2, groups=channels, bias=False),
            nn.Conv2d(channels, channels, 1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.ops(x)  # type: ignore[no-any-return]


class Conv17(nn.Module):
    """ReLU, 1x7 then 7x1 convolution (stride s), BN."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.ops = nn.Sequential(
            nn.ReLU(),
            nn.Conv2d(channels, channels, (1, 7), (1, stride), padding=(0, 3), bias=False),
            nn.Conv2d(channels, channels, (7, 1), (stride, 1), padding=(3, 0), bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.ops(x)  # type: ignore[no-any-return]


def _relu_conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.ReLU(), nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class AmoebaCell(nn.Module):
    """``(prev, cur) -> (cur, new)``: three sums of two parallel ops each, concatenated and mixed by 1x1.

    A reduction cell halves the resolution (stride-2 ops). ``prev_reduced``:
    the cell before this one reduced, so ``prev`` has twice ``cur``'s
    resolution and is brought to it by a strided 1x1 convolution.
    """

    def __init__(self, c_prev: int, c_cur: int, channels: int, reduction: bool, prev_reduced: bool) -> None:
        super().__init__()
        stride = 2 if reduction else 1
        self.pre_prev = _relu_conv_bn(c_prev, channels, 2 if prev_reduced else 1)
        self.pre_cur = _relu_conv_bn(c_cur, channels)
        self.sep3 = SepConv(channels, 3, stride)
        self.max3 = nn.MaxPool2d(3, stride, padding=1)
        self.sep5 = SepConv(channels, 5, stride)
        self.conv17 = Conv17(channels, stride)
        self.avg3 = nn.AvgPool2d(3, stride, padding=1, count_include_pad=False)
        self.sep3b = SepConv(channels, 3, stride)
        self.mix = _relu_conv_bn(3 * channels, channels)

    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        prev, cur = pair
        p = self.pre_prev(prev)
        c = self.pre_cur(cur)
        a = self.sep3(c) + self.max3(p)
        b = self.sep5(p) + self.conv17(c)
        d = self.avg3(c) + self.sep3b(p)
        return cur, self.mix(torch.cat([a, b, d], dim=1))


class Twin(nn.Module):
    """``x -> (x, x)``: the first cell's two inputs."""

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return x, x


class TakeLast(nn.Module):
    """``(prev, cur) -> cur``."""

    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tensor:
        return pair[1]


def amoebanet(preset: str = "small") -> Workload:
    """AmoebaNet-D-style (L, D): 3 stages of L/3 normal cells, a reduction cell between stages.

    ``paper``: AmoebaNet-D (18, 256) as in torchgpipe's speed benchmark, 224x224, 1000 classes, batch 128
    ``small``: (6, 8), 16x16, 10 classes, batch 32.
    """
    _check_preset(preset)
    cells, filters, size, classes, batch = {"paper": (18, 256, 224, 1000, 128), "small": (6, 8, 16, 10, 32),
                                            "tiny": (3, 4, 8, 10, 8)}[preset]
    stem = filters // 4 if preset == "paper" else filters
    layers: List[nn.Module] = [nn.Conv2d(3, stem, 3, 2 if preset == "paper" else 1, padding=1, bias=False),
                               nn.BatchNorm2d(stem), Twin()]
    c_prev = c_cur = stem
    channels = filters
    prev_reduced = False
    per_stage = max(1, cells // 3)
    for stage in range(3):
        if stage > 0:
            channels *= 2
            layers.append(AmoebaCell(c_prev, c_cur, channels, reduction=True, prev_reduced=prev_reduced))
            c_prev, c_cur, prev_reduced = c_cur, channels, True
        for _ in range(per_stage):
            layers.append(AmoebaCell(c_prev, c_cur, channels, reduction=False, prev_reduced=prev_reduced))
            c_prev, c_cur, prev_reduced = c_cur, channels, False
    layers += [TakeLast(), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_cur, classes)]
    return Workload("amoebanet", nn.Sequential(*layers), (batch, 3, size, size))


MODELS: Dict[str, Callable[[str], Workload]] = {
    "resnet101": resnet101,
    "unet": unet,
    "amoebanet": amoebanet,
}


def build(name: str, preset: str = "small", seed: int = 0) -> Workload:
    """Builds model ``name`` (a key of :data:`MODELS`) after ``torch.manual_seed(seed)``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    torch.manual_seed(seed)
    return MODELS[name](preset)


def copy_weights(source: nn.Module, target: nn.Module) -> None:
    """Copies parameters and buffers from ``source`` to ``target`` in order (same layers, other wrapping)."""
    pairs = list(zip(source.parameters(), target.parameters())) + list(zip(source.buffers(), target.buffers()))
    counts = (len(list(source.parameters())), len(list(target.parameters())))
    if counts[0] != counts[1]:
        raise ValueError(f"models differ: {counts[0]} versus {counts[1]} parameters")
    with torch.no_grad():
        for a, b in pairs:
            b.copy_(a)
