"""A LightningModule with lazy parameters not made yet (``nn.LazyLinear``) under ``parallel_criterion``: an error that
names the module and says to run one forward pass in ``setup()``; that fix equals one device."""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from strategy_models import N_CLASSES, N_FEATURES, NAMESPACES, loader, metrics, trainer
from torch import nn


@functools.cache
def models(namespace: str) -> SimpleNamespace:
    L = importlib.import_module(namespace)

    class Lazy(L.LightningModule):
        """An MLP whose last layer takes its input size from the first batch; ``initialize``: the fix, in setup()."""

        def __init__(self, initialize: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.initialize = initialize
            self.net = nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Tanh(), nn.LazyLinear(N_CLASSES))
            self.example_input_array = torch.zeros(2, N_FEATURES)

        def setup(self, stage: str) -> None:
            if self.initialize:
                torch.manual_seed(1)  # the lazy layer's initial values, the same in both runs
                self(self.example_input_array)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.3)

    return SimpleNamespace(Lazy=Lazy)


def fit(module: Any, strategy: str, devices: int, namespace: str) -> Any:
    t = trainer(strategy, devices, namespace=namespace, max_epochs=2, enable_progress_bar=True)
    t.fit(module, loader(8, n=32, dtype=torch.float32))
    return t


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_uninitialized_lazy_parameters_name_the_module_and_the_fix_in_setup_equals_one_device(namespace):
    with pytest.raises(RuntimeError, match=r"`net\.2` \(LazyLinear\).*`setup\(\)` hook.*example_input_array"):
        fit(models(namespace).Lazy(initialize=False), "parallel_criterion", 2, namespace)
    single, multi = models(namespace).Lazy(initialize=True), models(namespace).Lazy(initialize=True)
    reference = fit(single, "auto", 1, namespace)
    got = fit(multi, "parallel_criterion", 2, namespace)
    for p, q in zip(multi.parameters(), single.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert metrics(got) == pytest.approx(metrics(reference), rel=1e-6)
