"""Parameters a step reaches with an exactly zero gradient, under ``parallel_criterion`` in threads against one device.

A gate that starts at 0 (ReZero, LayerScale; LoRA's B = 0) gives the branch behind it an exactly zero gradient at the
first step. One device gives those parameters a zeros ``.grad`` (so momentum, weight decay and AdamW's step count
apply); the replicas' reduction gave ``None``. A parameter no step reaches keeps ``None``, as on one device.
"""

from __future__ import annotations

import copy
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

    class Gated(L.LightningModule):
        """A classifier with a gated residual branch (gate at 0) and a layer no step uses."""

        def __init__(self, optimizer: str) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.optimizer = optimizer
            self.f = nn.Linear(N_FEATURES, N_FEATURES)
            self.gate = nn.Parameter(torch.zeros(1))
            self.head = nn.Linear(N_FEATURES, N_CLASSES)
            self.unused = nn.Linear(N_FEATURES, N_FEATURES)
            self.grads_none: list[tuple[bool, bool]] = []  # (f.weight, unused.weight) per optimizer step

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.head(x + self.gate * self.f(x)), y)
            self.log("loss", loss)
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.grads_none.append((self.f.weight.grad is None, self.unused.weight.grad is None))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if self.optimizer == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
            return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)

    return SimpleNamespace(Gated=Gated)


def fit(module: Any, how: Any, devices: int, namespace: str) -> Any:
    t = trainer(how, devices, namespace=namespace, max_epochs=2, enable_progress_bar=True)
    t.fit(module, loader(8, n=32))
    return t


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_branch_behind_a_zero_gate_steps_as_on_one_device(namespace, optimizer):
    base = models(namespace).Gated(optimizer).double()
    single, multi = copy.deepcopy(base), copy.deepcopy(base)
    reference = fit(single, "auto", 1, namespace)
    strategies = importlib.import_module(f"lightning_mgpu.strategies.{namespace.replace('.', '_')}")
    got = fit(multi, strategies.ParallelCriterionStrategy(execution_mode="threads"), 2, namespace)
    assert multi.grads_none == single.grads_none == [(False, True)] * 8
    for (name, a), b in zip(multi.state_dict().items(), single.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    assert metrics(got) == pytest.approx(metrics(reference), rel=0, abs=1e-12)
