"""The PyramidNet recipe (a BatchNorm network) under parallel_criterion with sync_batchnorm follows the one-device
loss curve; without it, the per-shard statistics drift from the first step."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as L
import pytest
import torch

import lightning_mgpu
from recipes.pyramidnet.data import CIFAR10DataModule
from recipes.pyramidnet.module import PyramidNetModule

STEPS = 6


class LossCurve(L.Callback):
    """The loss each training step optimized (the strategy's combined loss under parallel_criterion)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def _train(strategy: str, devices: int, **trainer: Any) -> tuple[list[float], torch.Tensor]:
    L.seed_everything(0, verbose=False)
    module = PyramidNetModule(arch="tiny", lr=0.05, schedule="cosine")
    data = CIFAR10DataModule(source="synthetic", batch_size=10, synthetic_train_size=60, synthetic_test_size=20)
    curve = LossCurve()
    L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="64-true",
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        callbacks=[curve],
        **trainer,
    ).fit(module, data)
    state = torch.cat(
        [t.detach().flatten() for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    )
    return curve.losses, state


@pytest.fixture(scope="module")
def one_device() -> tuple[list[float], torch.Tensor]:
    return _train("auto", 1)


def test_sync_batchnorm_follows_the_one_device_loss_curve(one_device, caplog):
    losses, state = one_device
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        synced_losses, synced_state = _train("parallel_criterion", 3, sync_batchnorm=True)  # batches of 10: 4/3/3
    assert any("replicas run in threads, one per device (SyncBatchNorm" in r.getMessage() for r in caplog.records)
    assert len(synced_losses) == STEPS
    torch.testing.assert_close(torch.tensor(synced_losses), torch.tensor(losses), rtol=0, atol=1e-9)
    torch.testing.assert_close(synced_state, state, rtol=0, atol=1e-9)  # running statistics included


def test_without_sync_batchnorm_the_loss_curve_drifts_from_the_first_step(one_device):
    losses, _ = one_device
    drifting, _ = _train(lightning_mgpu.ParallelCriterionStrategy(sync_batchnorm=False), 3)
    assert abs(drifting[0] - losses[0]) > 1e-6
