"""PyramidNet architecture: parameter counts of every named config, shapes, memory formats, autocast, init."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from recipes.pyramidnet.model import (
    PyramidNet,
    build_pyramidnet,
    count_parameters,
    pyramidnet_names,
)
from recipes.pyramidnet.model import _shortcut as shortcut

# name → (parameters reported by the source, relative tolerance, final width). The paper's table rounds to 0.1M; the
# seed article's count is exact. Final widths are the paper's "output dim" (16 + alpha, times 4 for bottlenecks).
REPORTED = {
    "seed": (24_253_410, 0.0, 271),
    "pyramidnet110_a48": (1_700_000, 0.05, 64),
    "pyramidnet110_a84": (3_800_000, 0.05, 100),
    "pyramidnet110_a270": (28_300_000, 0.05, 286),
    "pyramidnet164_bottleneck_a270": (27_000_000, 0.05, 1144),
    "pyramidnet200_bottleneck_a240": (26_600_000, 0.05, 1024),
    "pyramidnet236_bottleneck_a220": (26_800_000, 0.05, 944),
    "pyramidnet272_bottleneck_a200": (26_000_000, 0.05, 864),
}
# (depth, alpha, bottleneck, units per stage) as the paper and the article describe each model, written out here
# rather than read from the recipe's table.
ARCHITECTURES = {
    "seed": (110, 270, False, 17),
    "pyramidnet110_a48": (110, 48, False, 18),
    "pyramidnet110_a84": (110, 84, False, 18),
    "pyramidnet110_a270": (110, 270, False, 18),
    "pyramidnet164_bottleneck_a270": (164, 270, True, 18),
    "pyramidnet200_bottleneck_a240": (200, 240, True, 22),
    "pyramidnet236_bottleneck_a220": (236, 220, True, 26),
    "pyramidnet272_bottleneck_a200": (272, 200, True, 30),
}


def paper_parameter_count(depth: int, alpha: int, bottleneck: bool, units: int, num_classes: int = 10) -> int:
    """Parameters of an additive PyramidNet, counted from the paper's description alone.

    Unit k (1-based over all 3 stages) is ``round(16 + k * alpha / (3 n))`` wide, n = (depth - 2) / 6 basic or
    / 9 bottleneck units per stage (exact fractions: the tables' configs have no rounding ties). A basic unit is
    BN(in) 3x3(in→w) BN(w) 3x3(w→w) BN(w); a bottleneck BN(in) 1x1(in→w) BN(w) 3x3(w→w) BN(w) 1x1(w→4w) BN(4w);
    shortcuts are parameter-free (zero-padded identities). Plus the 3x3 stem to 16 channels and its BN, the final
    BN and the linear classifier. Convolutions have no bias; a BN has a weight and a bias per channel.
    """
    n = Fraction(depth - 2, 9 if bottleneck else 6)
    assert n.denominator == 1
    total = 3 * 3 * 3 * 16 + 2 * 16  # stem conv + BN
    in_channels = 16
    for k in range(1, 3 * units + 1):
        w = round(16 + k * Fraction(alpha) / (3 * n))
        if bottleneck:
            total += 2 * in_channels + in_channels * w + 2 * w + 9 * w * w + 2 * w + w * 4 * w + 2 * 4 * w
            in_channels = 4 * w
        else:
            total += 2 * in_channels + 9 * in_channels * w + 2 * w + 9 * w * w + 2 * w
            in_channels = w
    return total + 2 * in_channels + in_channels * num_classes + num_classes  # final BN + linear head


def test_the_closed_form_count_gives_the_articles_exact_number() -> None:
    # The article's model has integer widths 21, 26, ..., 271 (rate 5): the count above must give its 24,253,410.
    assert paper_parameter_count(*ARCHITECTURES["seed"]) == 24_253_410


@pytest.mark.parametrize("name", sorted(REPORTED))
def test_parameter_counts_match_the_papers_architecture(name: str) -> None:
    with torch.device("meta"):
        model = build_pyramidnet(name)
    reported, tolerance, width = REPORTED[name]
    n = count_parameters(model)
    assert n == paper_parameter_count(*ARCHITECTURES[name]), f"{name}: {n:,} parameters"
    assert abs(n - reported) <= tolerance * reported, f"{name}: {n:,} vs the paper's {reported:,}"
    assert model.final_channels == width


def test_every_named_config_is_covered_and_builds() -> None:
    small = {"tiny", "small"}
    assert set(pyramidnet_names()) == set(REPORTED) | small
    for name in small:
        with torch.device("meta"):
            assert count_parameters(build_pyramidnet(name)) < 500_000


def test_seed_structure_is_17_units_per_stage_with_rate_5() -> None:
    with torch.device("meta"):
        model = build_pyramidnet("seed")
    stages = [model.stage1, model.stage2, model.stage3]
    assert [len(s) for s in stages] == [17, 17, 17]
    widths = [unit.out_channels for s in stages for unit in s]
    assert widths == [16 + 5 * (i + 1) for i in range(51)]
    strides = [unit.stride for s in stages for unit in s]
    assert strides[0] == 1 and strides[17] == 2 and strides[34] == 2 and strides.count(2) == 2
    # No projection shortcuts anywhere: every conv belongs to a residual branch or the stem.
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 1 + 2 * 51


def test_channel_multiple_rounds_every_width_up_and_keeps_the_paper_model_by_default() -> None:
    with torch.device("meta"):
        paper = build_pyramidnet("seed")
        aligned = build_pyramidnet("seed", channel_multiple=8)
    paper_widths = [unit.out_channels for s in (paper.stage1, paper.stage2, paper.stage3) for unit in s]
    aligned_widths = [unit.out_channels for s in (aligned.stage1, aligned.stage2, aligned.stage3) for unit in s]
    assert aligned_widths == [8 * math.ceil(w / 8) for w in paper_widths]  # 21 -> 24, 26 -> 32, ..., 271 -> 272
    assert paper.channel_multiple == 1 and count_parameters(paper) == 24_253_410
    convs = [m for m in aligned.modules() if isinstance(m, torch.nn.Conv2d)][1:]  # all but the RGB stem
    assert all(c.in_channels % 8 == 0 and c.out_channels % 8 == 0 for c in convs)
    assert 1.0 < count_parameters(aligned) / count_parameters(paper) < 1.15
    with pytest.raises(ValueError, match="channel_multiple must be >= 1"):
        PyramidNet(8, 24, channel_multiple=0)
    torch.manual_seed(0)
    tiny = build_pyramidnet("tiny", channel_multiple=16)
    assert tiny(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_units_per_stage_override_keeps_the_widening_rate() -> None:
    with torch.device("meta"):
        full = PyramidNet(110, 270)
        short = PyramidNet(110, 270, units_per_stage=17)
    assert full.final_channels == 16 + 270 and len(full.stage1) == 18
    assert short.final_channels == 16 + 5 * 51 and len(short.stage1) == 17


def test_bottleneck_units_expand_four_times() -> None:
    with torch.device("meta"):
        model = PyramidNet(20, 24, bottleneck=True)  # n = 2 units per stage, rate 4
    widths = [unit.out_channels for s in (model.stage1, model.stage2, model.stage3) for unit in s]
    assert widths == [4 * (16 + 4 * (i + 1)) for i in range(6)]


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown PyramidNet 'resnet50'") as err:
        build_pyramidnet("resnet50")
    for name in pyramidnet_names():
        assert name in str(err.value)


@pytest.mark.parametrize(("depth", "bottleneck"), [(109, False), (111, True), (2, False)])
def test_invalid_depth_is_refused(depth: int, bottleneck: bool) -> None:
    with pytest.raises(ValueError, match="depth"):
        PyramidNet(depth, 48, bottleneck=bottleneck)


def test_tiny_forward_shapes_and_channels_last_agree() -> None:
    torch.manual_seed(0)
    model = build_pyramidnet("tiny", num_classes=7).eval()
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        model_cl = model.to(memory_format=torch.channels_last)
        out_cl = model_cl(x.contiguous(memory_format=torch.channels_last))
    assert out.shape == out_cl.shape == (5, 7)
    torch.testing.assert_close(out, out_cl, rtol=1e-4, atol=1e-4)


def test_bottleneck_forward_and_backward_reach_every_parameter() -> None:
    torch.manual_seed(0)
    model = PyramidNet(11, 12, bottleneck=True)
    loss = F.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_autocast_bfloat16_on_cpu() -> None:
    torch.manual_seed(0)
    model = build_pyramidnet("tiny").to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    out.float().sum().backward()
    assert model.conv1.weight.grad is not None


def test_units_add_the_pooled_zero_padded_identity_to_their_residual() -> None:
    # With the last BN of every unit zeroed, every residual branch outputs 0, so the network must reduce to its
    # shortcuts: stem, then per downsampling unit a 2x2 average pool, zero channels appended up to the unit's width.
    torch.manual_seed(0)
    model = PyramidNet(14, 48).eval()  # 2 units per stage, widths 24..64; stages 2 and 3 downsample
    units = [unit for stage in (model.stage1, model.stage2, model.stage3) for unit in stage]
    for unit in units:
        torch.nn.init.zeros_(unit.bn3.weight)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        h = model.bn1(model.conv1(x))
        for unit in units:
            if unit.stride == 2:
                h = F.avg_pool2d(h, kernel_size=2, stride=2)
            h = torch.cat([h, h.new_zeros(h.shape[0], unit.out_channels - h.shape[1], *h.shape[2:])], dim=1)
        expected = model.fc(F.relu(model.bn_final(h)).mean(dim=(2, 3)))
        assert h.shape == (3, 64, 8, 8)
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)
        # ... and with the residual branches on, the output is something else (they are added, not ignored).
        for unit in units:
            torch.nn.init.ones_(unit.bn3.weight)
        assert not torch.allclose(model(x), expected, rtol=1e-3, atol=1e-4)


def test_shortcut_pools_and_zero_pads_in_the_input_dtype() -> None:
    x = torch.arange(2 * 3 * 5 * 5, dtype=torch.float64).view(2, 3, 5, 5)
    y = shortcut(x, out_channels=5, stride=2)
    assert y.shape == (2, 5, 3, 3) and y.dtype == torch.float64  # ceil_mode: 5 → 3
    torch.testing.assert_close(y[:, :3], F.avg_pool2d(x, 2, 2, ceil_mode=True))
    assert y[0, 0, 0, 0] == (0 + 1 + 5 + 6) / 4
    assert (y[:, 3:] == 0).all()
    same = shortcut(x, out_channels=3, stride=1)
    assert same is x


def test_paper_initialisation() -> None:
    torch.manual_seed(0)
    model = build_pyramidnet("pyramidnet110_a48")
    conv = model.stage3[-1].conv2  # 64 → 64, 3×3: 36,864 weights
    expected_std = math.sqrt(2.0 / (3 * 3 * conv.out_channels))
    assert abs(conv.weight.std().item() / expected_std - 1) < 0.03
    assert abs(conv.weight.mean().item()) < 0.05 * expected_std
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert all((bn.weight == 1).all() and (bn.bias == 0).all() for bn in bns)
