"""Detection-style batches (images plus a PerSample list of target dicts) train under both strategies as on one device
(batches of 5, 5 and 1 over 3 devices)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from strategy_models import clone, flat_params, metrics, trainer
from torch import nn
from torch.utils.data import DataLoader

import lightning_mgpu


class BoxRegression(L.LightningModule):
    """One predicted box per image; loss: mean over images of the mean L1 distance to that image's boxes."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(4, 4)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, targets = batch
        boxes = self(images)
        per_image = torch.stack([(b - t["boxes"]).abs().mean() for b, t in zip(boxes, targets, strict=True)])
        loss = per_image.mean()
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def detection_loader(n: int = 11, batch_size: int = 5) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    samples = [
        (
            torch.randn(3, 8, 8, generator=g, dtype=torch.float64),
            {"boxes": torch.rand(i % 4 + 1, 4, generator=g, dtype=torch.float64)},
        )
        for i in range(n)
    ]
    return DataLoader(
        samples,
        batch_size=batch_size,
        collate_fn=lambda s: (torch.stack([x for x, _ in s]), lightning_mgpu.PerSample(t for _, t in s)),
    )


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_detection_batches_train_like_one_device(strategy: str):
    torch.manual_seed(0)
    base = BoxRegression().double()
    single, multi = clone(base), clone(base)
    reference = trainer("auto", 1, max_epochs=1)
    reference.fit(single, detection_loader())
    parallel = trainer(strategy, 3, max_epochs=1)  # dp replicates forward(images); its loss runs on the root
    parallel.fit(multi, detection_loader())
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)
    assert float(parallel.callback_metrics["train_loss"]) == pytest.approx(
        float(reference.callback_metrics["train_loss"]), abs=1e-12
    )


class ListOfImages(BoxRegression):
    """Images of different sizes as a PerSample list: Lightning reads the batch size off a channel dim (and warns that
    the batch is ambiguous) unless ``batch_size=`` says it."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, targets = batch
        boxes = torch.cat([self(image[None]) for image in images])
        per_image = torch.stack([(b - t["boxes"]).abs().mean() for b, t in zip(boxes, targets, strict=True)])
        self.log("val_loss", per_image.mean())
        self.log("val_loss_sized", per_image.mean(), batch_size=len(images))
        self.per_image.append(per_image.detach())

    def on_validation_epoch_start(self) -> None:
        self.per_image: list[torch.Tensor] = []


def test_epoch_means_weight_steps_as_one_device_and_batch_size_gives_each_its_images():
    g = torch.Generator().manual_seed(1)
    samples = [
        (
            torch.randn(3, 8 + i % 3, 8, generator=g, dtype=torch.float64),
            {"boxes": torch.rand(i % 4 + 1, 4, generator=g, dtype=torch.float64)},
        )
        for i in range(11)
    ]
    loader = DataLoader(
        samples,
        batch_size=5,
        collate_fn=lambda s: (lightning_mgpu.PerSample(x for x, _ in s), lightning_mgpu.PerSample(t for _, t in s)),
    )
    torch.manual_seed(0)
    module = ListOfImages().double()
    reference = trainer("auto", 1)
    with pytest.warns(UserWarning, match="ambiguous collection"):  # Lightning's own, on one device as on several
        reference.validate(clone(module), loader, verbose=False)
    with pytest.warns(UserWarning, match="grew during a step"):  # per_image: recorded per replica, on purpose
        parallel = trainer("parallel_criterion", 2)
        parallel.validate(module, loader, verbose=False)
    true_mean = torch.cat(module.per_image).mean()  # batches of 5, 5 and 1 images
    got, ref = metrics(parallel), metrics(reference)
    assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=0, abs=1e-12)
    assert got["val_loss_sized"] == pytest.approx(float(true_mean), rel=0, abs=1e-12)
    assert ref["val_loss_sized"] == pytest.approx(float(true_mean), rel=0, abs=1e-12)
