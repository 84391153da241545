"""``PyramidNetModule``: the paper's CIFAR training recipe as a LightningModule around the plain ``PyramidNet``.

Cross-entropy (optional label smoothing), top-1 accuracy with torchmetrics, SGD with Nesterov momentum 0.9 and weight
decay 1e-4, lr 0.1 divided by 10 at 50% and 75% of training (or cosine). The same module runs unchanged on one
device and under ``parallel_criterion``, ``dp`` and ``ddp``:

* steps compute logits with ``self(x)`` (so ``dp`` can replicate ``forward``) and the loss outside ``forward``;
* steps change no state but metrics and logs (``parallel_criterion`` runs them on replicas in threads);
* epoch-level logs use ``sync_dist=True`` (a no-op in one process, a mean across processes under ``ddp``).
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from recipes.pyramidnet.model import PyramidNet, build_pyramidnet

__all__ = ["PyramidNetModule"]


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 if it is in a narrower float type (fp16/bf16 under autocast), else unchanged."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class PyramidNetModule(L.LightningModule):
    """Train a PyramidNet on CIFAR-style batches ``(images, labels)`` (images already normalised on the device).

    Args:
        arch: a name for ``build_pyramidnet`` (``seed``, ``pyramidnet110_a270``, ``tiny``, ...); ``None`` to build
            from ``depth``/``alpha``/``bottleneck``/``units_per_stage`` instead.
        depth, alpha, bottleneck, units_per_stage: explicit architecture (see ``PyramidNet``), only with
            ``arch=None``.
        num_classes: classifier width.
        lr: peak learning rate (0.1 in the paper for batch 128).
        momentum, nesterov, weight_decay: SGD settings (paper: 0.9, Nesterov, 1e-4).
        schedule: ``"multistep"`` (lr × ``gamma`` at each fraction of training in ``milestones``) or ``"cosine"``.
        milestones: fractions of the total optimizer steps at which ``multistep`` decays (paper: 50% and 75%).
        gamma: decay factor of ``multistep``.
        label_smoothing: cross-entropy label smoothing (0 in the paper).
        channels_last: keep the weights in ``channels_last`` memory format and feed the network ``channels_last``
            batches (``CIFAR10DataModule`` reads the ``channels_last`` attribute and produces them in that layout).
        channel_multiple: round unit widths up to a multiple of this (see ``PyramidNet``; 1 keeps the paper's model).
        compile_net: ``torch.compile`` the PyramidNet in place (``nn.Module.compile``: state-dict keys unchanged,
            compiled on the first step). Under every strategy; the single-process multi-device ones run compiled
            replicas one after another (Dynamo is not thread-safe), so it pays off most on one device or ``ddp``.
    """

    def __init__(
        self,
        arch: str | None = "seed",
        depth: int | None = None,
        alpha: float | None = None,
        bottleneck: bool = False,
        units_per_stage: int | None = None,
        num_classes: int = 10,
        lr: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: float = 1e-4,
        schedule: Literal["multistep", "cosine"] = "multistep",
        milestones: tuple[float, ...] = (0.5, 0.75),
        gamma: float = 0.1,
        label_smoothing: float = 0.0,
        channels_last: bool = False,
        channel_multiple: int = 1,
        compile_net: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: PyramidNet = self._build_net(
            arch, depth, alpha, bottleneck, units_per_stage, num_classes, channel_multiple
        )
        if channels_last:
            self.net = self.net.to(memory_format=torch.channels_last)
        if compile_net:
            self.net.compile()
        if any(not 0 < m <= 1 for m in milestones):
            raise ValueError(f"milestones are fractions of training in (0, 1], got {milestones}")
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        # validate_args=False: torchmetrics' input checks read values back to the host, a device sync every step.
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False)
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False)

    @staticmethod
    def _build_net(
        arch: str | None,
        depth: int | None,
        alpha: float | None,
        bottleneck: bool,
        units_per_stage: int | None,
        num_classes: int,
        channel_multiple: int,
    ) -> PyramidNet:
        explicit = depth is not None or alpha is not None or units_per_stage is not None
        if arch is not None:
            if explicit:
                raise ValueError(
                    "give either arch (a named PyramidNet) or depth/alpha/units_per_stage, not both; "
                    "set arch: null to build from explicit arguments"
                )
            return build_pyramidnet(arch, num_classes=num_classes, channel_multiple=channel_multiple)
        if depth is None or alpha is None:
            raise ValueError("arch is None: depth and alpha are required")
        return PyramidNet(
            depth,
            alpha,
            bottleneck=bottleneck,
            num_classes=num_classes,
            units_per_stage=units_per_stage,
            channel_multiple=channel_multiple,
        )

    @property
    def channels_last(self) -> bool:
        """The memory format this module wants its input in; data modules may read it (one setting for both)."""
        return bool(self.hparams.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the wrapped PyramidNet (the part ``dp`` replicates)."""
        return self.net(x)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        images, labels = batch
        if self.channels_last:  # a no-op for CIFAR10DataModule's batches, already in this layout
            images = images.contiguous(memory_format=torch.channels_last)
        logits = self(images)
        # Loss in at least float32 whatever the autocast dtype of the logits (float64 stays float64 under 64-true).
        loss = self.criterion(_at_least_float32(logits), labels)
        return loss, logits, labels

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, logits, labels = self._step(batch)
        self.train_acc.update(logits, labels)
        # Per step: this process's value, no collective. Not in the progress bar: Lightning turns step-level
        # progress-bar values into Python numbers after every batch (even with the bar disabled), a device sync per
        # step that cost 16% of the seed model's throughput on an H100. Per epoch: the mean over processes.
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        self.log("train_loss_epoch", loss, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        # Logged once per epoch rather than from every step: each self.log call costs Lightning ~0.1-1 ms of host time.
        # Lightning computes the metric (synced across processes under ddp) and resets it for the next epoch.
        self.log("train_acc", self.train_acc)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "val", self.val_acc)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "test", self.test_acc)

    def _eval_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], stage: str, accuracy: MulticlassAccuracy
    ) -> torch.Tensor:
        loss, logits, labels = self._step(batch)
        accuracy.update(logits, labels)
        self.log(f"{stage}_loss", loss, on_epoch=True, sync_dist=True)
        self.log(f"{stage}_acc", accuracy, on_epoch=True, prog_bar=stage == "val")
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images = batch[0] if isinstance(batch, tuple | list) else batch
        return F.softmax(_at_least_float32(self(images)), dim=1)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Logged here, on the root module, not in training_step (which may run on replicas); works without a logger,
        # unlike LearningRateMonitor. As a CPU tensor: a Python float would become a new GPU tensor every step, and
        # the progress bar then reads it back (a device sync); a CPU value costs neither.
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.log("lr", torch.tensor(lr, dtype=torch.float32), on_step=True, on_epoch=False, prog_bar=True)

    def configure_optimizers(self) -> dict[str, Any]:
        """SGD (Nesterov) with a per-step schedule over ``trainer.estimated_stepping_batches``.

        Per-step milestones at 50%/75% of all optimizer steps equal the paper's epochs 150/225 of 300, and also hold
        when training is bounded by ``max_steps`` or accumulates gradients.
        """
        hp = self.hparams
        optimizer = torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, nesterov=hp.nesterov, weight_decay=hp.weight_decay
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler: torch.optim.lr_scheduler.LRScheduler
        if hp.schedule == "cosine":
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        else:
            steps = sorted(max(1, round(f * total)) for f in hp.milestones)
            scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=steps, gamma=hp.gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
