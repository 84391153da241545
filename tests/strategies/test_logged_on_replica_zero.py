"""``self.log`` behind ``self.trainer.is_global_zero`` in a step (DDP-style code): replica 0 alone logs, from its
shard. A value it also returned (the training loss) is one device's, merged from every replica's return; another is
said once, naming it, and logging on every replica (the fix the warning names) equals one device. Under ``dp`` the
step runs once, on the root: every value is one device's already. Also: ``dp``'s notice for a step that never called
the replicated forward fires for a manual-optimization step too (it returns ``None``)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from strategy_models import NAMESPACES, clone, loader, metrics, models, trainer
from torch import nn

ALONE = "on replica 0 alone"
USERS = dict(enable_checkpointing=True, enable_progress_bar=True, enable_model_summary=True, num_sanity_val_steps=2)


@functools.cache
def zero_logging(namespace: str) -> type:
    class LoggedOnReplicaZero(models(namespace).Classifier):
        """Logs its losses behind ``is_global_zero``; ``val_loss_fixed`` is the fix: logged on every replica."""

        def __init__(self, returns: bool = False) -> None:
            super().__init__()
            self.save_hyperparameters()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            if self.trainer.is_global_zero:
                self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            if self.trainer.is_global_zero:
                self.log("val_loss", loss, prog_bar=True)
            self.log("val_loss_fixed", loss, rank_zero_only=True)
            return loss if self.hparams.returns else None

    return LoggedOnReplicaZero


def _fit(module: Any, strategy: str, devices: int, namespace: str, tmp_path: Any) -> tuple[Any, list[str]]:
    checkpoint = models(namespace).L.callbacks.ModelCheckpoint(dirpath=tmp_path / strategy, monitor="val_loss_fixed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = trainer(  # as users run it: default callbacks, progress bar, the sanity check
            strategy, devices, namespace, max_epochs=2, callbacks=[checkpoint], **USERS
        )  # batches of 10 (5 + 5) to train, 7, 7 and 5 (4 + 3, 3 + 2) to validate
        fit.fit(module, loader(10, n=20), loader(7, n=19, seed=1))
    return fit, [str(w.message) for w in caught if ALONE in str(w.message)]


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("returns", [False, True])
@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_values_logged_behind_is_global_zero_are_one_devices_or_said_once(strategy, returns, namespace, tmp_path):
    torch.manual_seed(0)
    base = zero_logging(namespace)(returns).double()
    one, _ = _fit(clone(base), "auto", 1, namespace, tmp_path)
    got, said = _fit(clone(base), strategy, 2, namespace, tmp_path)
    ref, logged = metrics(one), metrics(got)
    for name in ("train_loss_step", "train_loss_epoch", "val_loss_fixed"):  # the training loss: it is returned
        assert logged[name] == pytest.approx(ref[name], rel=0, abs=1e-10), name
    assert float(got.checkpoint_callback.best_model_score) == pytest.approx(ref["val_loss_fixed"], rel=0, abs=1e-10)
    if strategy == "dp" or returns:  # the step ran once, or replica 0 logged what every replica returned
        assert said == []
        assert logged["val_loss"] == pytest.approx(ref["val_loss"], rel=0, abs=1e-10)
    else:  # replica 0's shards' values: said once, for 3 validation steps per epoch over 2 epochs
        assert logged["val_loss"] != pytest.approx(ref["val_loss"], rel=0, abs=1e-3)
        assert len(said) == 1
        assert "`validation_step` logged 'val_loss' on replica 0 alone" in said[0]
        assert "from its shard (4 of 7 samples)" in said[0]
        assert "Call self.log on every replica" in said[0]


@functools.cache
def manual_dp(namespace: str) -> type:
    class ManualSubmodule(models(namespace).Classifier):
        """Manual optimization, returning ``None``; ``self.net(x)`` calls the submodule directly (not replicated),
        ``self(x)`` the replicated forward. Batch 1 is skipped before any work (no notice is due for it)."""

        def __init__(self, direct: bool) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:
                return
            x, y = batch
            optimizer = self.optimizers()
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(self.net(x) if self.hparams.direct else self(x), y)
            self.manual_backward(loss)
            optimizer.step()
            self.log("train_loss", loss)

    return ManualSubmodule


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("direct", [True, False])
def test_dp_says_once_when_a_manual_optimization_step_never_calls_the_replicated_forward(direct, namespace, tmp_path):
    torch.manual_seed(0)
    base = manual_dp(namespace)(direct).double()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = trainer("dp", 2, namespace, max_epochs=1, default_root_dir=tmp_path, **USERS)
        got.fit(multi := clone(base), loader(10))
    said = [str(w.message) for w in caught if "ran on one device" in str(w.message)]
    if direct:
        assert len(said) == 1  # 3 steps did the work
        assert "dp: `training_step` ran on one device" in said[0]
        assert "parallel_modules=[...]" in said[0]
        assert "'net'" in said[0]
    else:
        assert said == []
    one = trainer("auto", 1, namespace, max_epochs=1, default_root_dir=tmp_path / "one")
    one.fit(single := clone(base), loader(10))
    torch.testing.assert_close(list(multi.parameters()), list(single.parameters()), rtol=0, atol=1e-10)
    assert metrics(got)["train_loss"] == pytest.approx(metrics(one)["train_loss"], rel=0, abs=1e-10)
