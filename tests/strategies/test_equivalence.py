"""Training under parallel_criterion / dp with N virtual CPU devices equals single-device training."""

from __future__ import annotations

import pytest
import torch
from strategy_models import NAMESPACES, Classifier, clone, flat_params, loader, metrics, models, seeded, trainer

import lightning_mgpu

STEPS = 5


def _fit(module, strategy, devices, batch_size, namespace="lightning.pytorch", **trainer_kwargs):
    t = trainer(
        strategy,
        devices,
        namespace,
        max_steps=STEPS,
        limit_val_batches=2,
        val_check_interval=STEPS,
        check_val_every_n_epoch=None,
        **trainer_kwargs,
    )
    t.fit(module, loader(batch_size), loader(batch_size, seed=1))
    return t


@pytest.fixture(scope="module")
def reference():
    """Single-device runs for each batch size: (parameters, logged metrics)."""
    base = seeded(Classifier)
    results = {}
    for batch_size in (10, 3):
        module = clone(base)
        t = _fit(module, "auto", 1, batch_size)
        results[batch_size] = (flat_params(module), metrics(t), dict(t.progress_bar_metrics))
    return base, results


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
@pytest.mark.parametrize("devices", [2, 3, 4])
@pytest.mark.parametrize("batch_size", [10, 3])
def test_parameters_and_logged_metrics_equal_single_device(reference, strategy, devices, batch_size, namespace):
    """Under both Lightning namespaces (``import lightning.pytorch as L`` and ``import pytorch_lightning as pl``)."""
    _, results = reference
    expected_params, expected_metrics, expected_bar = results[batch_size]
    module = seeded(models(namespace).Classifier)  # the same initial weights as the reference's
    t = _fit(module, strategy, devices, batch_size, namespace)
    assert t.global_step == STEPS
    torch.testing.assert_close(flat_params(module), expected_params, rtol=0, atol=1e-10)
    got = metrics(t)
    assert got.keys() == expected_metrics.keys()
    for name, value in expected_metrics.items():
        assert got[name] == pytest.approx(value, abs=1e-10), name
    assert t.progress_bar_metrics == pytest.approx(expected_bar, abs=1e-10)


def test_equal_weighting_would_differ(reference):
    """The 'mean' option (Lightning 1.x dp) is not single-device training when shards are unequal: 10 over 4."""
    base, results = reference
    module = clone(base)
    _fit(module, lightning_mgpu.ParallelCriterionStrategy(loss_reduction="replica_mean"), 4, 10)
    assert (flat_params(module) - results[10][0]).abs().max() > 1e-6


@pytest.mark.parametrize("strategy_cls", ["ParallelCriterionStrategy", "DataParallelStrategy"])
def test_threads_mode_is_bitwise_reproducible_and_equals_one_device(reference, strategy_cls):
    """Running the replicas in threads must not make results depend on which thread finishes first: gradients are
    summed in replica order, so two runs agree bitwise, and both equal one device (and the sequential mode)."""
    base, results = reference
    runs = []
    for mode in ("threads", "threads", "sequential"):
        module = clone(base)
        t = _fit(module, getattr(lightning_mgpu, strategy_cls)(execution_mode=mode), 3, 10)
        runs.append((flat_params(module), metrics(t)))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    torch.testing.assert_close(runs[0][0], results[10][0], rtol=0, atol=1e-10)
    torch.testing.assert_close(runs[2][0], results[10][0], rtol=0, atol=1e-10)


def test_float32_within_1e5():
    base = seeded(Classifier, dtype=torch.float32)
    single, multi = clone(base), clone(base)
    _fit_32 = dict(max_steps=STEPS, limit_val_batches=0)
    trainer("auto", 1, **_fit_32).fit(single, loader(10, dtype=torch.float32))
    trainer("parallel_criterion", 4, **_fit_32).fit(multi, loader(10, dtype=torch.float32))
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_predictions_come_back_in_batch_order(strategy):
    base = seeded(Classifier)
    expected = torch.cat(trainer("auto", 1).predict(clone(base), loader(7)))
    got = torch.cat(trainer(strategy, 3).predict(clone(base), loader(7)))
    assert got.shape == (40, 3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_validate_and_test_equal_single_device(strategy):
    base = seeded(Classifier)
    ref_val = trainer("auto", 1).validate(clone(base), loader(9), verbose=False)
    ref_test = trainer("auto", 1).test(clone(base), loader(9), verbose=False)
    got_val = trainer(strategy, 4).validate(clone(base), loader(9), verbose=False)
    got_test = trainer(strategy, 4).test(clone(base), loader(9), verbose=False)
    for got, ref in ((got_val, ref_val), (got_test, ref_test)):
        assert got[0].keys() == ref[0].keys()
        for key in ref[0]:
            assert got[0][key] == pytest.approx(ref[0][key], abs=1e-10), key
