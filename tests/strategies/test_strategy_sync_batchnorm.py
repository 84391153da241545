"""``sync_batchnorm=True`` under ``parallel_criterion`` and ``dp``: BatchNorm statistics over the whole batch, so a
BatchNorm model trains exactly as on one device (shards 4/3/3), running statistics included."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from strategy_models import NAMESPACES, clone, loader, metrics, models, seeded, trainer
from torch import nn

import lightning_mgpu


def normalized_classifier(namespace: str = "lightning.pytorch") -> type:
    Classifier = models(namespace).Classifier

    class Normalized(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))

    return Normalized


def _state(module: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().double().flatten() for t in (*module.parameters(), *module.buffers())])


def _fit(module: Any, strategy: Any, devices: int, namespace: str = "lightning.pytorch", **kwargs: Any) -> Any:
    t = trainer(strategy, devices, namespace, max_steps=5, limit_val_batches=2, **kwargs)
    t.fit(module, loader(10), loader(10, seed=1))
    return t


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_sync_batchnorm_trains_exactly_as_one_device(strategy, namespace, caplog, recwarn):
    """By default (no option anywhere): equal to one device, running statistics included; the set-up line says the
    replicas run in threads and why, and how to opt out, once (no override warning repeats it at the first step)."""
    base = seeded(normalized_classifier(namespace))
    single, multi = clone(base), clone(base)
    reference = _fit(single, "auto", 1, namespace)
    with caplog.at_level(logging.INFO, logger=namespace):
        synced = _fit(multi, strategy, 3, namespace)  # batches of 10: shards 4, 3, 3
    said = [r.getMessage() for r in caplog.records if "SyncBatchNorm" in r.getMessage()]
    assert said == [
        f"{synced.strategy.strategy_name}: 3 replicas on cpu, cpu, cpu; virtual devices: 1 physical device(s); "
        "replicas run in threads, one per device (SyncBatchNorm layers make the replicas meet inside every BatchNorm "
        "layer); BatchNorm synchronised across the replicas, as one device on the whole batch (opt out: "
        f"{type(synced.strategy).__name__}(sync_batchnorm=False))."
    ]
    assert not [w for w in recwarn if "SyncBatchNorm" in str(w.message)]
    torch.testing.assert_close(_state(multi), _state(single), rtol=0, atol=1e-10)  # running statistics included
    got, expected = metrics(synced), metrics(reference)
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=1e-10), name
    assert type(multi.net[1]) is nn.BatchNorm1d  # the user's module leaves with the classes it came with
    assert set(multi.state_dict()) == set(single.state_dict())  # plain BatchNorm keys in checkpoints


def test_opting_out_of_sync_batchnorm_normalises_each_shard_alone_and_says_so(caplog):
    """The reason for the default: per-shard statistics drift from one device from the first step."""
    base = seeded(normalized_classifier())
    single, multi = clone(base), clone(base)
    _fit(single, "auto", 1)
    with caplog.at_level(logging.INFO):
        _fit(multi, lightning_mgpu.ParallelCriterionStrategy(sync_batchnorm=False), 3)
    assert any("BatchNorm normalises each shard with its own statistics" in r.getMessage() for r in caplog.records)
    assert (_state(multi) - _state(single)).abs().max() > 1e-4


def test_sync_batchnorm_overriding_an_explicit_sequential_mode_warns():
    strategy = lightning_mgpu.ParallelCriterionStrategy(execution_mode="sequential")
    overridden = "execution_mode='sequential' overridden: SyncBatchNorm layers make the replicas meet.*in threads"
    with pytest.warns(UserWarning, match=overridden):
        _fit(seeded(normalized_classifier()), strategy, 2, sync_batchnorm=True)


def test_sync_batchnorm_with_an_explicit_threads_mode_says_nothing(recwarn):
    base = seeded(normalized_classifier())
    single, multi = clone(base), clone(base)
    _fit(single, "auto", 1)
    strategy = lightning_mgpu.ParallelCriterionStrategy(execution_mode="threads")
    _fit(multi, strategy, 2, sync_batchnorm=True)
    torch.testing.assert_close(_state(multi), _state(single), rtol=0, atol=1e-10)
    assert not [w for w in recwarn if "SyncBatchNorm" in str(w.message)]


def two_view_classifier() -> type:
    """Two forward passes of one batch in a step (SimCLR's two views), through BatchNorm."""
    Normalized = normalized_classifier()

    class TwoViews(Normalized):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            first, second = self(x + 0.1), self(x - 0.1)
            loss = nn.functional.cross_entropy(first, y) + nn.functional.mse_loss(first, second)
            self.log("train_loss", loss)
            return loss

    return TwoViews


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_two_views_through_batchnorm_in_one_step_equal_one_device(strategy, devices):
    """Several replicated forwards in one step through synchronised BatchNorm (dp's crashed with autograd's in-place
    error before): parameters, running statistics and the logged loss as on one device."""
    base = seeded(two_view_classifier())
    single, multi = clone(base), clone(base)
    reference = _fit(single, "auto", 1)
    got = _fit(multi, strategy, devices)
    torch.testing.assert_close(_state(multi), _state(single), rtol=0, atol=1e-10)
    assert metrics(got)["train_loss"] == pytest.approx(metrics(reference)["train_loss"], abs=1e-10)
