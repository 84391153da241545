"""Values logged in ``training_step`` beside a loss that is not a per-sample mean (a mean over the labels kept):
``loss.item()`` merges as the loss; a function of it that no record explains (``torch.exp(loss)``) is said once;
ordinary values (a norm of the weights, a max) stay silent."""

from __future__ import annotations

import functools
import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from strategy_models import N_CLASSES, N_FEATURES, NAMESPACES, models
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, N_FEATURES, generator=g, dtype=torch.float64)
    y = torch.randint(0, N_CLASSES, (12,), generator=g)
    y[[0, 1, 2, 6, 7]] = -100  # the kept labels differ between the shards: 1 vs 3, 4 vs 2
    return DataLoader(TensorDataset(x, y), batch_size=6, shuffle=False)


def _module(namespace: str, logs: str) -> Any:
    L = models(namespace).L

    class Tokens(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Tanh(), nn.Linear(8, N_CLASSES))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.net(x)
            loss = F.cross_entropy(logits, y)  # a mean over the kept labels
            self.log("train_loss", loss)
            if logs == "item":
                self.log("train_loss_item", loss.item())
            else:
                self.log("train_ppl", torch.exp(loss))
                self.log("weight_norm", self.net[0].weight.norm())
                self.log("max_logit", logits.max(), reduce_fx="max")
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tokens


@functools.cache
def _fit(namespace: str, logs: str, strategy: str, devices: int) -> tuple[dict[str, float], tuple[str, ...]]:
    torch.manual_seed(0)
    module = _module(namespace, logs)().double()
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = models(namespace).L.Trainer(
            strategy=strategy, accelerator="cpu", devices=devices, max_epochs=2, default_root_dir=root
        )
        trainer.fit(module, _data())
    said = tuple(str(w.message) for w in caught if str(w.message).startswith(strategy))
    return {k: float(v) for k, v in trainer.callback_metrics.items()}, said


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_loss_logged_as_a_python_number_merges_as_the_loss(namespace: str):
    expected, _ = _fit(namespace, "item", "auto", 1)
    got, said = _fit(namespace, "item", "parallel_criterion", 2)
    assert got == pytest.approx(expected, abs=1e-12) and said == ()


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_function_of_the_loss_no_record_explains_is_said_once(namespace: str):
    expected, _ = _fit(namespace, "functions", "auto", 1)
    got, said = _fit(namespace, "functions", "parallel_criterion", 2)
    assert got["train_ppl"] != pytest.approx(expected["train_ppl"], abs=1e-6)  # what the message is about
    for name in ("train_loss", "weight_norm", "max_logit"):
        assert got[name] == pytest.approx(expected[name], abs=1e-12), name
    (message,) = said
    assert "'train_ppl'" in message and "ExpBackward0" in message and "strategy='dp'" in message
