"""Counts a step returns (``correct``, ``total``, ``len(x)``) reach the batch hooks as one device's counts over the
whole batch: the devices' counts add up (they were averaged by sample count, 4 correct read 2.09)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.strategies.strategy_models import NAMESPACES, loader, models


def _counting_module(namespace: str) -> Any:
    L = models(namespace).L

    class Counting(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(6, 3).double()
            self.seen: list[tuple[int, int, int]] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            logits = self.net(x)
            correct = (logits.argmax(1) == y).sum()
            return {
                "loss": nn.functional.cross_entropy(logits, y),
                "correct": correct.item(),
                "total": len(x),
                "correct_tensor": correct,
            }

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.seen.append((outputs["correct"], outputs["total"], int(outputs["correct_tensor"])))

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            correct = (self.net(x).argmax(1) == y).sum()
            return {"correct": correct.item(), "total": len(x), "correct_tensor": correct}

        def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.seen.append((outputs["correct"], outputs["total"], int(outputs["correct_tensor"])))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Counting()


def _fit(tmp_path: Any, namespace: str, strategy: str, devices: int) -> list[tuple[int, int, int]]:
    module = _counting_module(namespace)
    trainer = models(namespace).L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, default_root_dir=tmp_path, logger=False
    )  # default callbacks and progress bar
    trainer.fit(
        module, loader(batch_size=11, n=40), loader(batch_size=11, n=29, seed=1)
    )  # shards of 11: 6/5 and 4/4/3; the last batch of 7: 4/3, 3/2/2
    return module.seen


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
@pytest.mark.parametrize("devices", [2, 3])
def test_counts_returned_from_the_step_equal_one_devices(tmp_path: Any, namespace: str, strategy: str, devices: int):
    expected = _fit(tmp_path / "one", namespace, "auto", 1)
    got = _fit(tmp_path / "many", namespace, strategy, devices)
    assert got == expected
    assert {total for _, total, _ in got} == {11, 7}


def _logging_module(namespace: str) -> Any:
    L = models(namespace).L

    class Logging(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(6, 3).double()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            logits = self.net(x)
            loss = nn.functional.cross_entropy(logits, y)
            self.log("train_loss_c", loss, batch_size=4, on_step=False, on_epoch=True)
            self.log(
                "train_correct", (logits.argmax(1) == y).sum().item(), on_step=False, on_epoch=True, reduce_fx="sum"
            )
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            logits = self.net(x)
            self.log("val_loss", nn.functional.cross_entropy(logits, y), batch_size=4)  # a constant, as hparams give
            self.log("val_correct", (logits.argmax(1) == y).sum(), reduce_fx="sum")
            self.log("val_total", len(x), reduce_fx="sum")

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Logging()


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_logged_counts_and_a_constant_batch_size_equal_one_devices(tmp_path: Any, namespace: str, strategy: str):
    """Batches of 4 and a last batch of 2 on 3 devices (1/1/... samples each): a constant batch_size= weighs each step
    as one device's call does, and counts logged with reduce_fx="sum" are the batch's (equal on every shard too)."""

    def fit(strategy: str, devices: int) -> dict[str, float]:
        trainer = models(namespace).L.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, default_root_dir=tmp_path / strategy
        )
        trainer.fit(_logging_module(namespace), loader(batch_size=4, n=10), loader(batch_size=4, n=10, seed=1))
        return {k: float(v) for k, v in trainer.callback_metrics.items()}

    expected, got = fit("auto", 1), fit(strategy, 3)
    assert expected["val_total"] == 10
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=1e-12, rel=1e-12), name
