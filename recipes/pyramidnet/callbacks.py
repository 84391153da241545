"""Callbacks of the PyramidNet recipe."""

from __future__ import annotations

import time

import lightning.pytorch as L
from typing_extensions import override

__all__ = ["FinalReport"]


class FinalReport(L.Callback):
    """Print one summary line when fitting ends (global rank 0 only): the last line of the run's output.

    ``PyramidNet quickstart: val_acc=0.912 val_loss=0.301 (chance 0.100) after 6 epochs, 192 steps, fit 41.0 s``

    The line is what a README quotes, so it comes last: Lightning's progress bar draws its final state when it is torn
    down, after ``on_fit_end``, so this callback finishes the bar (its public ``teardown`` hook, which Lightning's bars
    accept being called twice) before printing. The metrics are read on every rank: reading ``callback_metrics`` can
    compute (and, under DDP, synchronise) epoch values, and a collective that only rank 0 enters would hang the others.
    """

    def __init__(self, label: str = "PyramidNet", num_classes: int = 10) -> None:
        self.label = label
        self.num_classes = num_classes
        self._start = 0.0

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()

    def summary(self, trainer: L.Trainer) -> str:
        """The summary line from ``trainer.callback_metrics``."""
        metrics = trainer.callback_metrics
        parts = [
            f"{name}={float(metrics[name]):.3f}"
            for name in ("val_acc", "val_loss", "train_loss_epoch")
            if name in metrics
        ]
        elapsed = time.perf_counter() - self._start
        return (
            f"{self.label}: {' '.join(parts)} (chance {1 / self.num_classes:.3f}) after "
            f"{trainer.current_epoch} epochs, {trainer.global_step} steps, fit {elapsed:.1f} s"
        )

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        line = self.summary(trainer)  # on every rank (see the class docstring)
        if not trainer.is_global_zero:
            return
        bar = trainer.progress_bar_callback
        if bar is not None:
            bar.teardown(trainer, pl_module, "fit")  # its final render now, not after the summary
        print(line, flush=True)
