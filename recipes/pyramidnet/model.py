"""PyramidNet for CIFAR (Han, Kim, Kim: "Deep Pyramidal Residual Networks", CVPR 2017) as a plain ``nn.Module``.

Additive widening: the residual units' width grows by ``alpha / (3 n)`` channels per unit (``n`` units per stage)
from 16 to ``16 + alpha``, each unit's width being ``int(round(running_width))``. Units are the paper's
BN-conv-BN-ReLU-conv-BN (basic) or BN-1×1-BN-ReLU-3×3-BN-ReLU-1×1-BN with 4× expansion (bottleneck). Shortcuts are
identities, zero-padded on the channel axis and 2×2 average-pooled (ceil mode) when a unit downsamples: there are no
projection convolutions anywhere. No Lightning in here: the LightningModule in ``module.py`` wraps this.

``build_pyramidnet(name)`` returns the named configurations: the seed article's variant (``seed``, exactly
24,253,410 parameters), the paper's CIFAR table, and small ones for tests and the quickstart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PYRAMIDNET_CONFIGS",
    "BasicUnit",
    "BottleneckUnit",
    "PyramidNet",
    "PyramidNetConfig",
    "build_pyramidnet",
    "count_parameters",
    "pyramidnet_names",
]


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_ch: int, out_ch: int) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=1, bias=False)


def _shortcut(x: torch.Tensor, out_channels: int, stride: int) -> torch.Tensor:
    """Identity shortcut: 2×2 average pooling when downsampling, then zero channels appended up to ``out_channels``.

    The zeros are made with ``F.pad``, so they follow the input's dtype, device and memory format (the official code
    concatenates a ``torch.cuda.FloatTensor``, which breaks on CPU and under autocast).
    """
    if stride != 1:
        x = F.avg_pool2d(x, kernel_size=2, stride=2, ceil_mode=True)
    extra = out_channels - x.shape[1]
    if extra > 0:
        x = F.pad(x, (0, 0, 0, 0, 0, extra))
    return x


class _Unit(nn.Module):
    """What both units share: the first BN, ``out_channels`` and the padded identity added to ``residual``."""

    expansion = 1

    def __init__(self, in_channels: int, planes: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.out_channels = planes * self.expansion
        self.bn1 = nn.BatchNorm2d(in_channels)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.residual(x) + _shortcut(x, self.out_channels, self.stride)


class BasicUnit(_Unit):
    """Basic pyramidal unit: BN → 3×3 conv (stride) → BN → ReLU → 3×3 conv → BN, plus the padded identity."""

    expansion = 1

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__(in_channels, planes, stride)
        self.conv1 = _conv3x3(in_channels, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn3 = nn.BatchNorm2d(planes)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(self.bn1(x))
        out = self.conv2(F.relu(self.bn2(out)))
        return self.bn3(out)


class BottleneckUnit(_Unit):
    """Bottleneck unit: BN → 1×1 → BN → ReLU → 3×3 (stride) → BN → ReLU → 1×1 (4× planes) → BN, plus the identity."""

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__(in_channels, planes, stride)
        self.conv1 = _conv1x1(in_channels, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn3 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, self.out_channels)
        self.bn4 = nn.BatchNorm2d(self.out_channels)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(self.bn1(x))
        out = self.conv2(F.relu(self.bn2(out)))
        out = self.conv3(F.relu(self.bn3(out)))
        return self.bn4(out)


class PyramidNet(nn.Module):
    """Additive PyramidNet for 32×32 inputs (CIFAR).

    Args:
        depth: the paper's depth; gives ``n = (depth - 2) / 6`` basic or ``(depth - 2) / 9`` bottleneck units per
            stage, and with it the widening rate ``alpha / (3 n)``.
        alpha: total widening: the last unit is ``16 + alpha`` channels wide (times 4 for bottlenecks).
        bottleneck: bottleneck units (4× expansion) instead of basic ones.
        num_classes: size of the linear head.
        units_per_stage: build this many units per stage instead of ``n`` while keeping the widening rate of
            ``depth``. The seed article's model is ``depth=110`` (rate 270/54 = 5) with 17 units per stage.
        stem_channels: width of the 3×3 stem convolution (16 in the paper).
        channel_multiple: round every unit's width up to a multiple of this (1: the paper's widths). GPU tensor
            cores run convolutions whose channel counts are multiples of 8 fastest; the paper's additive widening
            gives widths such as 21, 26, 31, so ``8`` trades a few percent more parameters for aligned kernels.
            This is a different model from the paper's (its parameter count changes); leave it at 1 to reproduce.
    """

    def __init__(
        self,
        depth: int,
        alpha: float,
        bottleneck: bool = False,
        num_classes: int = 10,
        units_per_stage: int | None = None,
        stem_channels: int = 16,
        channel_multiple: int = 1,
    ) -> None:
        super().__init__()
        per_unit = 9 if bottleneck else 6
        if depth < 2 + per_unit or (depth - 2) % per_unit:
            kind = "bottleneck" if bottleneck else "basic"
            raise ValueError(
                f"PyramidNet depth {depth} is invalid for {kind} units: need depth = {per_unit}·n + 2 with n ≥ 1 "
                f"(e.g. {per_unit + 2}, {2 * per_unit + 2}, {18 * per_unit + 2})"
            )
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        n = (depth - 2) // per_unit
        units = n if units_per_stage is None else units_per_stage
        if units < 1:
            raise ValueError(f"units_per_stage must be >= 1, got {units}")
        if channel_multiple < 1:
            raise ValueError(f"channel_multiple must be >= 1 (1 keeps the paper's widths), got {channel_multiple}")
        self.depth = depth
        self.alpha = alpha
        self.bottleneck = bottleneck
        self.units_per_stage = units
        self.channel_multiple = channel_multiple
        unit_cls: type[_Unit] = BottleneckUnit if bottleneck else BasicUnit
        add_rate = alpha / (3 * n)

        self.conv1 = _conv3x3(3, stem_channels)
        self.bn1 = nn.BatchNorm2d(stem_channels)
        width = float(stem_channels)
        in_channels = stem_channels
        stages = []
        for stage in range(3):
            blocks = []
            for i in range(units):
                width += add_rate
                stride = 2 if stage > 0 and i == 0 else 1
                planes = round(width)  # Python rounding, as the official code
                planes = -(-planes // channel_multiple) * channel_multiple
                unit = unit_cls(in_channels, planes, stride)
                blocks.append(unit)
                in_channels = unit.out_channels
            stages.append(nn.Sequential(*blocks))
        self.stage1, self.stage2, self.stage3 = stages
        self.final_channels = in_channels
        self.bn_final = nn.BatchNorm2d(in_channels)
        self.fc = nn.Linear(in_channels, num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The paper's initialisation: conv ~ N(0, 2 / (k·k·out_channels)), BN weight 1 / bias 0, default Linear."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                k_h, k_w = m.kernel_size
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / (k_h * k_w * m.out_channels)))
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                m.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(N, num_classes)`` for images ``(N, 3, H, W)`` (normalised floats; H = W = 32 for CIFAR)."""
        x = self.bn1(self.conv1(x))
        x = self.stage3(self.stage2(self.stage1(x)))
        x = F.relu(self.bn_final(x))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


@dataclass(frozen=True)
class PyramidNetConfig:
    """A named PyramidNet: constructor arguments plus the parameter count the source reports (for 10 classes)."""

    depth: int
    alpha: float
    bottleneck: bool = False
    units_per_stage: int | None = None
    reported_params: int | None = None
    note: str = ""

    def kwargs(self) -> dict[str, object]:
        return {
            "depth": self.depth,
            "alpha": self.alpha,
            "bottleneck": self.bottleneck,
            "units_per_stage": self.units_per_stage,
        }


PYRAMIDNET_CONFIGS: dict[str, PyramidNetConfig] = {
    "seed": PyramidNetConfig(
        110,
        270,
        units_per_stage=17,
        reported_params=24_253_410,
        note="the seed article's model: basic units, alpha 270, 17 units per stage with the widening rate of 18 "
        "(off by one against the paper's PyramidNet-110); exactly 24,253,410 parameters",
    ),
    "pyramidnet110_a48": PyramidNetConfig(110, 48, reported_params=1_700_000, note="paper: 1.7M, C10 error 4.62%"),
    "pyramidnet110_a84": PyramidNetConfig(110, 84, reported_params=3_800_000, note="paper: 3.8M, C10 error 4.27%"),
    "pyramidnet110_a270": PyramidNetConfig(110, 270, reported_params=28_300_000, note="paper: 28.3M, C10 error 3.73%"),
    "pyramidnet164_bottleneck_a270": PyramidNetConfig(
        164, 270, bottleneck=True, reported_params=27_000_000, note="paper: 27.0M, C10 error 3.48%"
    ),
    "pyramidnet200_bottleneck_a240": PyramidNetConfig(
        200, 240, bottleneck=True, reported_params=26_600_000, note="paper: 26.6M, C10 error 3.44%"
    ),
    "pyramidnet236_bottleneck_a220": PyramidNetConfig(
        236, 220, bottleneck=True, reported_params=26_800_000, note="paper: 26.8M, C10 error 3.40%"
    ),
    "pyramidnet272_bottleneck_a200": PyramidNetConfig(
        272, 200, bottleneck=True, reported_params=26_000_000, note="paper: 26.0M, C10 error 3.31%"
    ),
    "tiny": PyramidNetConfig(8, 24, note="tests and the quickstart: 3 basic units (one per stage), widths 24/32/40"),
    "small": PyramidNetConfig(14, 48, note="CPU experiments: 6 basic units, widths 24..64, about 4× the cost of tiny"),
}


def pyramidnet_names() -> list[str]:
    """Names accepted by :func:`build_pyramidnet`, in definition order."""
    return list(PYRAMIDNET_CONFIGS)


def build_pyramidnet(name: str, num_classes: int = 10, channel_multiple: int = 1) -> PyramidNet:
    """Build a named PyramidNet (see :data:`PYRAMIDNET_CONFIGS`); unknown names raise ``ValueError`` listing valid ones.

    ``channel_multiple`` > 1 builds the hardware-aligned variant described in :class:`PyramidNet` (not the named
    model's exact widths). Build under ``with torch.device("meta"):`` to count parameters without allocating them.
    """
    try:
        cfg = PYRAMIDNET_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown PyramidNet {name!r}; valid names: {', '.join(pyramidnet_names())}") from None
    model = PyramidNet(num_classes=num_classes, channel_multiple=channel_multiple, **cfg.kwargs())  # type: ignore[arg-type]
    if name == "seed" and num_classes == 10 and channel_multiple == 1:
        # The seed article's number; a mismatch means the architecture drifted from the article's model.
        n_params = count_parameters(model)
        assert n_params == 24_253_410, f"seed PyramidNet has {n_params:,} parameters, expected 24,253,410"
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (trainable or not; buffers excluded). Works on ``meta`` tensors."""
    return sum(p.numel() for p in model.parameters())
