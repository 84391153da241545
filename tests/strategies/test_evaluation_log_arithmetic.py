"""Values logged in ``validation_step`` built from torch's loss calls by arithmetic (``ce * len(x)``, a sum, a mixed
sum) equal one device's at the epoch level, with a last batch of one sample per device and a plain ``ce`` logged
beside them; a value made from a loss by another operation (``ce.sqrt()``) is said once per logged name, with a fix
that gives one device's number, and a plain ``ce`` says nothing. Float64, 10 samples in batches of 4 (4, 4, 2)."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from strategy_models import NAMESPACES, metrics, trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WEIGHT = torch.tensor([0.2, 1.0, 3.0, 0.5], dtype=torch.float64)  # a class-weighted mean is no per-sample mean


def loader(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x, y, t = torch.randn(10, 6, generator=g), torch.randint(0, 4, (10,), generator=g), torch.randn(10, generator=g)
    return DataLoader(TensorDataset(x.double(), y, t.double()), batch_size=4)


def validated(kind: str) -> Any:
    """What the step logs as ``val_loss`` (beside the plain ``val_ce``)."""
    if kind == "times_len":
        return lambda out, y, t: F.cross_entropy(out, y) * len(y)
    if kind == "sum":
        return lambda out, y, t: F.cross_entropy(out, y, reduction="sum")
    if kind == "mixed":  # a weighted mean over targets, a per-element mean and a sum over a constant
        return lambda out, y, t: (
            0.5 * F.cross_entropy(out, y, weight=WEIGHT)
            + F.mse_loss(out[:, 0], t)
            - F.l1_loss(out[:, 1], t, reduction="sum").detach() / 7
        )
    return lambda out, y, t: F.cross_entropy(out, y, weight=WEIGHT).sqrt()  # "unfollowed"


def make_module(namespace: str, kind: str, metric: bool = False) -> Any:
    L = importlib.import_module(namespace)

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4))
            self.val_ce = torchmetrics.MeanMetric()  # the fix the message names, where ``metric``

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, _ = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y, t = batch
            out = self.net(x)
            if metric:
                self.val_ce.update(F.cross_entropy(out, y, weight=WEIGHT))
                return
            self.log("val_loss", validated(kind)(out, y, t))
            self.log("val_ce", F.cross_entropy(out, y))

        def on_validation_epoch_end(self) -> None:
            if metric:
                self.log("val_rmse", self.val_ce.compute().sqrt())
                self.val_ce.reset()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Model().double()


def run(kind: str, strategy: str, devices: int, namespace: str = NAMESPACES[0], metric: bool = False) -> Any:
    """The epoch-level logged values after two epochs (validation twice), and the package's warnings."""
    module = make_module(namespace, kind, metric)
    t = trainer(strategy, devices, namespace, max_epochs=2, enable_progress_bar=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(module, loader(0), loader(1))
    return metrics(t), [str(w.message) for w in caught if "made from a loss call" in str(w.message)]


@pytest.mark.parametrize("kind", ["times_len", "sum", "mixed"])
@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
@pytest.mark.parametrize("devices", [2, 3])
def test_logged_evaluation_arithmetic_of_loss_calls_equals_one_device(kind, strategy, devices):
    expected, _ = run(kind, "auto", 1)
    got, said = run(kind, strategy, devices)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=1e-12, rel=1e-12), name
    assert not said


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_value_made_from_a_loss_otherwise_is_said_once_and_the_fix_gives_one_devices_value(namespace):
    pytest.importorskip(namespace)
    _, said = run("unfollowed", "parallel_criterion", 3, namespace)
    assert len(said) == 1  # 2 epochs of 3 steps: once
    assert "'val_loss', logged in `validation_step`, was made from a loss call through `sqrt`" in said[0]
    assert "MeanMetric" in said[0] and "on_validation_epoch_end" in said[0]
    expected, _ = run("unfollowed", "auto", 1, namespace, metric=True)
    got, said = run("unfollowed", "parallel_criterion", 3, namespace, metric=True)
    assert got["val_rmse"] == pytest.approx(expected["val_rmse"], abs=1e-12, rel=1e-12)
    assert not said
