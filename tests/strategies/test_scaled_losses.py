"""A loss multiplied by its shard's sample count (``ce * len(x)``, a sum over the shard) stays a sum on every step,
also where the last batch leaves one sample per device (the product is then 1): the reading of earlier steps holds,
and a plain loss logged beside it keeps its own."""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from strategy_models import N_CLASSES, N_FEATURES, NAMESPACES, flat_params, loader, models
from torch import nn


def _scaled_classifier(namespace: str) -> Any:
    L = models(namespace).L

    class Scaled(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Tanh(), nn.Linear(8, N_CLASSES))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            ce = F.cross_entropy(self.net(x), y)
            self.log("train_ce", ce)  # a plain mean beside the scaled loss: read on its own
            loss = ce * len(x)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Scaled


@functools.cache  # the one-device reference once per namespace
def _fit(namespace: str, strategy: str, devices: int) -> tuple[torch.Tensor, dict[str, float]]:
    module_cls = _scaled_classifier(namespace)
    torch.manual_seed(0)
    module = module_cls().double()
    with tempfile.TemporaryDirectory() as root:  # default callbacks, progress bar and logger on
        trainer = models(namespace).L.Trainer(
            strategy=strategy, accelerator="cpu", devices=devices, max_epochs=2, default_root_dir=root
        )
        trainer.fit(module, loader(4, n=10))  # batches of 4, 4, 2: the last one sample per device on 2 devices
    return flat_params(module), {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize(("strategy", "devices"), [("parallel_criterion", 2), ("parallel_criterion", 3), ("dp", 2)])
def test_a_loss_times_its_sample_count_equals_one_device(namespace: str, strategy: str, devices: int):
    expected_params, expected_logged = _fit(namespace, "auto", 1)
    params, logged = _fit(namespace, strategy, devices)
    torch.testing.assert_close(params, expected_params, rtol=0, atol=1e-10)
    assert logged == pytest.approx(expected_logged, abs=1e-10)
