"""The summary line a recipe prints last: what a README quotes and what ``| tail -1`` shows."""

from __future__ import annotations

import time
from collections.abc import Sequence

import lightning.pytorch as L
from typing_extensions import override

__all__ = ["FinalReport"]


class FinalReport(L.Callback):
    """Print one summary line when fitting ends (global rank 0 only): the last line of the run's output.

    ``PyramidNet quickstart: val_acc=0.912 val_loss=0.301 (chance 0.100) after 6 epochs, 192 steps, fit 41.0 s``,
    followed by where the logs and the checkpoints went when the run has a logger or checkpoints.

    Lightning's progress bar draws its final state when it is torn down, after ``on_fit_end``, so this callback
    finishes the bar first (its public ``teardown`` hook, which Lightning's bars accept being called twice). The
    metrics are read on every rank: reading ``callback_metrics`` can compute (and, under DDP, synchronise) epoch
    values, and a collective that only rank 0 enters would hang the others.
    """

    def __init__(
        self,
        label: str = "PyramidNet",
        metrics: Sequence[str] = ("val_acc", "val_loss", "train_loss_epoch"),
        chance: float | None = 0.1,
    ) -> None:
        self.label = label
        self.metrics = list(metrics)
        self.chance = chance
        self._start = 0.0

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()

    def summary(self, trainer: L.Trainer) -> str:
        """The summary line from ``trainer.callback_metrics`` and where the run wrote its files."""
        values = trainer.callback_metrics
        parts = [f"{name}={float(values[name]):.3f}" for name in self.metrics if name in values]
        chance = f" (chance {self.chance:.3f})" if self.chance is not None else ""
        elapsed = time.perf_counter() - self._start
        line = (
            f"{self.label}: {' '.join(parts)}{chance} after {_count(trainer.current_epoch, 'epoch')}, "
            f"{_count(trainer.global_step, 'step')}, fit {elapsed:.1f} s"
        )
        return line + "".join(f"; {what} in {where}" for what, where in _outputs(trainer))

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        line = self.summary(trainer)  # on every rank (see the class docstring)
        if not trainer.is_global_zero:
            return
        bar = trainer.progress_bar_callback
        if bar is not None:
            bar.teardown(trainer, pl_module, "fit")  # its final render now, not after the summary
            if getattr(bar, "progress", None) is not None:
                # Rich's bar: Lightning's own teardown would stop it a second time, and each stop prints an empty
                # line when the output is not a terminal, which would come after the summary.
                bar.progress = None
        print(line, flush=True)


def _outputs(trainer: L.Trainer) -> list[tuple[str, str]]:
    """``(what, folder)`` for the run's logs and checkpoints, where it has them."""
    found = []
    if trainer.logger is not None and trainer.logger.log_dir:
        found.append(("logs", str(trainer.logger.log_dir)))
    checkpoint = trainer.checkpoint_callback
    if checkpoint is not None and getattr(checkpoint, "dirpath", None):
        found.append(("checkpoints", str(checkpoint.dirpath)))
    return found


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
