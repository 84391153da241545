"""A tiny classifier on random data: the benchmark's smoke-test recipe (``configs/bench/tiny.yaml``).

Seconds per strategy on a CPU, so the benchmark's tests and a first try of ``python -m benchmarks.compare`` finish
quickly. It is written like a recipe module: the loss is computed outside ``forward`` (so ``dp`` replicates only the
network) and steps change no state but logs.
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyClassifier(L.LightningModule):
    """An MLP with BatchNorm, cross-entropy, SGD."""

    def __init__(self, in_features: int = 32, hidden: int = 64, num_classes: int = 10, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class RandomClassificationData(L.LightningDataModule):
    """Gaussian features with labels from a fixed random linear map (learnable), generated in memory."""

    def __init__(
        self, batch_size: int = 32, num_samples: int = 512, in_features: int = 32, num_classes: int = 10, seed: int = 0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.dataset: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        h = self.hparams
        generator = torch.Generator().manual_seed(h.seed)
        x = torch.randn(h.num_samples, h.in_features, generator=generator)
        y = (x @ torch.randn(h.in_features, h.num_classes, generator=generator)).argmax(dim=1)
        self.dataset = TensorDataset(x, y)

    def train_dataloader(self) -> DataLoader:
        assert self.dataset is not None, "call setup() first"
        return DataLoader(self.dataset, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)
