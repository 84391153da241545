"""A module with lazy parameters not made yet (``nn.LazyLinear`` never run): replicas cannot copy them. The error names
the module and says to run one forward pass first; that fix trains as one device does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mgpu.parallel import DataParallelModel


def lazy_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Sequential(nn.LazyLinear(3)))


def train(model: nn.Module, net: nn.Module) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        out = net(x)
        (torch.cat(out) if isinstance(out, list) else out).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("mode", ["sequential", "threads"])
def test_uninitialized_lazy_parameters_name_the_module_and_one_forward_first_equals_one_device(mode):
    net = DataParallelModel(lazy_model(), ["cpu"] * 2, execution_mode=mode)
    with pytest.raises(RuntimeError, match=r"`2\.0` \(LazyLinear\) has uninitialized lazy parameters.*model\(sample\)"):
        net(torch.randn(6, 4))
    reference = lazy_model()
    reference(torch.zeros(2, 4))  # the fix the error suggests, on both sides
    train(reference, reference)
    model = lazy_model()
    model(torch.zeros(2, 4))
    train(model, DataParallelModel(model, ["cpu"] * 2, execution_mode=mode))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
