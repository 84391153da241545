"""The README's advice for step code that touches shared objects works as it says: a weighted ``MeanMetric`` of the
loss and a ``BasePredictionWriter`` give what one device gives."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torchmetrics
from torch import nn

from tests.strategies.strategy_models import N_CLASSES, N_FEATURES, NAMESPACES, loader


def _module_and_writer(namespace: str) -> tuple[Any, Any]:
    L = importlib.import_module(namespace)
    writer_base = importlib.import_module(f"{namespace}.callbacks").BasePredictionWriter

    class MeanLoss(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(N_FEATURES, N_CLASSES, dtype=torch.float64)
            self.mean_loss = torchmetrics.MeanMetric()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.mean_loss.update(loss, weight=len(y))
            self.log("mean_loss", self.mean_loss, on_step=False, on_epoch=True)
            return loss

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).argmax(1)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Writer(writer_base):
        def __init__(self) -> None:
            super().__init__("batch")
            self.written: list[tuple[int, list[int], list[int]]] = []

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            self.written.append((batch_idx, prediction.tolist(), list(batch_indices)))

    return L, (MeanLoss, Writer)


def _run(namespace: str, **trainer_options: Any) -> tuple[float, list[Any]]:
    L, (MeanLoss, Writer) = _module_and_writer(namespace)
    module, writer = MeanLoss(), Writer()
    trainer = L.Trainer(
        max_epochs=2, logger=False, enable_checkpointing=False, callbacks=[writer], accelerator="cpu", **trainer_options
    )
    trainer.fit(module, loader(10, n=37))  # batches of 10 and a last one of 7: shards of 4, 3, 3 and 3, 2, 2
    mean_loss = trainer.callback_metrics["mean_loss"].item()
    trainer.predict(module, loader(10, n=37))
    return mean_loss, writer.written


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_weighted_mean_metric_of_the_loss_and_a_prediction_writer_equal_one_device(namespace: str) -> None:
    one_mean, one_written = _run(namespace, devices=1)
    mean, written = _run(namespace, devices=3, strategy="parallel_criterion")
    assert mean == pytest.approx(one_mean, rel=1e-12)
    assert written == one_written and [index for _, _, indices in written for index in indices] == list(range(37))
