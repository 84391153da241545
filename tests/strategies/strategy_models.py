"""Small deterministic LightningModules and data shared by the strategy tests."""

from __future__ import annotations

import copy
import functools
import importlib
from types import SimpleNamespace
from typing import Any

import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu  # noqa: F401  (registers the strategies, as a user's project does)

N_FEATURES = 6
N_CLASSES = 3


def make_data(n: int = 40, seed: int = 0, dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, generator=g, dtype=dtype)
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    return TensorDataset(x, y)


def loader(batch_size: int, n: int = 40, seed: int = 0, dtype: torch.dtype = torch.float64) -> DataLoader:
    return DataLoader(make_data(n, seed, dtype), batch_size=batch_size, shuffle=False)


NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


@functools.cache
def models(namespace: str = "lightning.pytorch") -> SimpleNamespace:
    """The test models, built on ``namespace``'s LightningModule (``lightning.pytorch`` or ``pytorch_lightning``)."""
    L = importlib.import_module(namespace)

    class Classifier(L.LightningModule):
        """An MLP classifier (no dropout, no BatchNorm) that logs in every way the tests check."""

        def __init__(self, lr: float = 0.3, output: str = "tensor", hidden: int = 16) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(N_FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, N_CLASSES))
            self.train_acc = torchmetrics.classification.MulticlassAccuracy(N_CLASSES, average="micro")
            self.val_acc = torchmetrics.classification.MulticlassAccuracy(N_CLASSES, average="macro")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            logits = self(x)
            loss = nn.functional.cross_entropy(logits, y)
            self.train_acc(logits, y)
            self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
            self.log_dict({"max_logit": logits.max(), "max_target": y.max().double()}, reduce_fx="max", on_step=True)
            self.log("min_logit", logits.min(), reduce_fx="min", on_step=True)
            self.log("n_seen", float(len(y)), reduce_fx="sum", on_step=True, on_epoch=False)
            if self.hparams.output == "dict":
                return {"loss": loss, "preds": logits.argmax(-1), "mean_logit": logits.mean()}
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            logits = self(x)
            self.val_acc.update(logits, y)
            self.log("val_loss", nn.functional.cross_entropy(logits, y))
            self.log("val_acc", self.val_acc)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("test_loss", nn.functional.cross_entropy(self(x), y))

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0]).softmax(-1)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    return SimpleNamespace(L=L, Classifier=Classifier)


Classifier = models().Classifier


def seeded(module_cls: type = Classifier, seed: int = 0, dtype: torch.dtype = torch.float64, **kwargs: Any) -> Any:
    torch.manual_seed(seed)
    return module_cls(**kwargs).to(dtype)


def clone(module: Any) -> Any:
    return copy.deepcopy(module)


def trainer(strategy: Any = "auto", devices: int = 1, namespace: str = "lightning.pytorch", **kwargs: Any) -> Any:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return models(namespace).L.Trainer(strategy=strategy, devices=devices, **defaults)


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def metrics(t: Any) -> dict[str, float]:
    return {k: float(v) for k, v in t.callback_metrics.items()}
