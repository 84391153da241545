"""Issue 10 §1: under ``parallel_criterion`` the step's loss normalisation is found out on the first step (or said
with ``loss_reduction`` / ``loss_weight``), so training equals one device for the losses people write; where it cannot
be established the first step warns; the experiment leaves nothing behind.

Every equivalence check: float64, ``STEPS`` SGD steps, uneven shards (7 over 2 = 4+3, 10 over 3 = 4+3+3), Lightning's
default callbacks; final parameters, the loss each step optimized and every logged value equal one device's to 1e-10.
The ``transformers`` models are in ``test_transformers_models.py``.
"""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from hf_models import (
    FORWARD_CALLS,
    N_IN,
    N_OUT,
    STEPS,
    Run,
    assert_equal_runs,
    fit,
    make_mlp,
    mlp_loader,
)
from strategy_models import Classifier, loader, seeded
from torch import nn

import lightning_mgpu

SPLITS = [pytest.param(2, 7, id="2dev-batch7"), pytest.param(3, 10, id="3dev-batch10")]

# Findings of this file (see the report); each xfail is strict: it fails the suite once the library is fixed.
NOISY_STEP_FALSE_ALARM = (
    "A known limit of the experiment: a step that draws random numbers (input noise) gives the sub-batch and its "
    "shards different draws (torch's CPU randn does not compose by size); the shards' losses then miss the sub-batch "
    "loss by far more than the loss moves with the seed, so the rule is not established and the strategy warns "
    "(with the fix) instead of deciding"
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tmp_path_factory.mktemp("runs")


_references: dict[Any, Run] = {}


def one_device(key: Any, make: Any, data: Any, root: Any) -> Run:
    """The single-device run for ``key`` (cached for the module: the reference of several device counts)."""
    if key not in _references:
        _references[key] = fit(make(), "auto", 1, data(), root)
    return _references[key]


def assert_decided(run: Run, spec: str) -> None:
    """The decision was printed once (INFO on the namespace's logger), named ``spec``, and nothing warned."""
    assert run.normalisation_warnings() == []
    decisions = run.decisions()
    assert len(decisions) == 1, decisions
    assert f"loss_reduction={spec!r}" in decisions[0], decisions[0]
    assert run.trainer.strategy.normalization.spec() == spec


# --- 1. sums ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["handwritten_sum", "mse_sum", "ce_sum"])
@pytest.mark.parametrize(("devices", "batch"), SPLITS)
def test_sum_losses_equal_one_device(root, loss, devices, batch):
    """``((net(x) - y) ** 2).sum()``, ``MSELoss(reduction="sum")``, ``cross_entropy(reduction="sum")``: found to be
    sums, summed over devices; the optimized loss, ``self.log("loss", loss)`` (step and epoch) and the parameters
    equal one device's."""
    expected = one_device(("mlp", loss, batch), lambda: make_mlp(L, loss), lambda: mlp_loader(loss, batch), root)
    got = fit(make_mlp(L, loss), "parallel_criterion", devices, mlp_loader(loss, batch), root)
    assert_decided(got, "sum")
    assert_equal_runs(got, expected)
    assert {"loss_step", "loss_epoch"} <= got.final.keys()


class DetachedLog(L.LightningModule):
    """Logs ``loss.detach()`` (a copy of the sum loss) instead of the loss tensor itself."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(N_IN, N_OUT)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = ((self.net(x) - y) ** 2).sum()
        self.log("loss", loss.detach(), on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_logged_detached_sum_loss_equals_one_device(root):
    """The parameters are right; the logged number must be too (``loss.detach()`` is what many users log)."""
    make = lambda: seeded(DetachedLog)  # noqa: E731
    expected = one_device("detached", make, lambda: mlp_loader("mse_sum", 10), root)
    got = fit(make(), "parallel_criterion", 3, mlp_loader("mse_sum", 10), root)
    torch.testing.assert_close(got.params, expected.params, rtol=0, atol=1e-10)
    assert got.final["loss_epoch"] == pytest.approx(expected.final["loss_epoch"], abs=1e-10)


class LoggedWithBatchSize(L.LightningModule):
    """A mean over non-ignored labels, logged with ``batch_size=`` the sample count (common for dict batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(N_IN, N_OUT)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, batch_size=len(y), on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_logged_loss_with_batch_size_is_the_optimized_loss(root):
    """``batch_size=`` weights the step in Lightning's epoch mean; the logged value is still the optimized loss
    (weighted by non-ignored labels here), not a sample-weighted mean of the shards' losses."""
    data = lambda: mlp_loader("ce_mean", 10, ignored=slice(1, None, 3))  # noqa: E731
    make = lambda: seeded(LoggedWithBatchSize)  # noqa: E731
    expected = one_device("logged-batch-size", make, data, root)
    got = fit(make(), "parallel_criterion", 3, data(), root)
    assert_decided(got, "tokens:1")
    assert_equal_runs(got, expected)
    assert got.final["loss_epoch"] == pytest.approx(expected.final["loss_epoch"], abs=1e-10)


# --- 3. no false alarms on per-sample means --------------------------------------------------------------------------
def _false_alarm_marks(case: str, devices: int) -> list[Any]:
    # Measured: the 8-sample sub-batch of the 10-sample batches trips the separation check; the 7-sample one does not.
    return []


@pytest.mark.parametrize(
    ("case", "devices", "batch"),
    [
        pytest.param(case, d, b, id=f"{case}-{d}dev-batch{b}", marks=_false_alarm_marks(case, d))
        for case in ("ce_mean", "ce_ignore_index", "Classifier")
        for d, b in ((2, 7), (3, 10))
    ],
)
def test_per_sample_means_are_samples_without_warning(root, case, devices, batch):
    """An MLP with ``cross_entropy``, one with ``ignore_index`` on 1-D labels holding no -100, and the suite's
    ``Classifier`` (metrics, max/min/sum logs): no warning, equal to one device. ``cross_entropy`` ignores -100
    labels, which the experiment finds out by masking one: ``tokens:1``, the same weights as ``samples`` while no
    label is ignored, and the right ones when one is."""
    if case == "Classifier":
        make, data = lambda: seeded(Classifier, lr=0.1), lambda: loader(batch, n=batch * STEPS)
    else:
        make, data = lambda: make_mlp(L, case), lambda: mlp_loader(case, batch)
    expected = one_device((case, batch), make, data, root)
    got = fit(make(), "parallel_criterion", devices, data(), root)
    assert_decided(got, "tokens:1")
    assert_equal_runs(got, expected)


def test_mean_over_non_ignored_1d_labels_is_a_token_mean(root):
    """``cross_entropy`` over 1-D labels where some samples are -100 averages over the others: found as
    ``tokens:1`` (the labels' position in the ``(x, y)`` batch), equal to one device."""
    ignored = slice(1, None, 3)
    data = lambda: mlp_loader("ce_mean", 10, ignored=ignored)  # noqa: E731
    expected = one_device("ignored-1d", lambda: make_mlp(L, "ce_mean"), data, root)
    got = fit(make_mlp(L, "ce_mean"), "parallel_criterion", 3, data(), root)
    assert_decided(got, "tokens:1")
    assert_equal_runs(got, expected)


def test_ignored_labels_after_the_first_batch_never_diverge_silently(root):
    """The first batch holds no -100, later ones do: the batch alone cannot tell ``samples`` from ``tokens:1``, the
    experiment's masked label does. Either training equals one device or the strategy warned."""
    data = lambda: mlp_loader("ce_mean", 10, ignored=slice(20, None, 3))  # noqa: E731
    expected = one_device("ignored-later", lambda: make_mlp(L, "ce_mean"), data, root)
    got = fit(make_mlp(L, "ce_mean"), "parallel_criterion", 3, data(), root)
    diverged = (got.params - expected.params).abs().max().item() > 1e-10
    assert not diverged or got.normalisation_warnings(), "trained differently from one device without a warning"


# --- 4. undeterminable losses: the first step warns; explicit settings silence it -------------------------------------
def test_undeterminable_loss_warns_once_with_the_difference_and_the_fix(root):
    """A median of per-sample losses is no weighting of shard losses: one warning (5 steps), naming the measured
    difference of each rule and the one-line fixes; no decision line."""
    got = fit(make_mlp(L, "median"), "parallel_criterion", 3, mlp_loader("median", 10), root)
    warned = got.normalisation_warnings()
    assert len(warned) == 1, warned
    message = warned[0]
    assert "could not establish" in message
    assert "difference" in message and "'samples'" in message and "'sum'" in message
    assert "loss_weight" in message and "loss_terms" in message and "loss_reduction=" in message
    assert got.decisions() == []
    assert got.trainer.strategy.normalization.spec() == "samples"


@pytest.mark.parametrize(
    "setting",
    [
        pytest.param({"loss_reduction": "samples"}, id="loss_reduction=samples"),
        pytest.param({"loss_reduction": "sum"}, id="loss_reduction=sum"),
        pytest.param({"output": "loss_weight"}, id="loss_weight"),
    ],
)
def test_explicit_setting_silences_the_warning(root, setting):
    output = setting.get("output", "loss")
    strategy = lightning_mgpu.ParallelCriterionStrategy(loss_reduction=setting.get("loss_reduction", "auto"))
    got = fit(make_mlp(L, "median", output=output), strategy, 3, mlp_loader("median", 10), root)
    assert got.normalisation_warnings() == []
    assert got.decisions() == []


def test_loss_reduction_turns_the_experiment_off(root):
    """With ``loss_reduction`` set the model runs exactly once per replica per step (3 devices x 5 steps); with
    ``auto`` the first step runs it more (the experiment), and only the first."""
    counts = {}
    for reduction in ("samples", "auto"):
        FORWARD_CALLS["n"] = 0
        strategy = lightning_mgpu.ParallelCriterionStrategy(loss_reduction=reduction)
        fit(make_mlp(L, "ce_mean"), strategy, 3, mlp_loader("ce_mean", 10), root)
        counts[reduction] = FORWARD_CALLS["n"]
    assert counts["samples"] == 3 * STEPS
    assert 3 * STEPS < counts["auto"] <= 3 * STEPS + 2 * 3  # a bounded, one-time cost (a sub-batch run + its shards)


# --- 5. no side effects ----------------------------------------------------------------------------------------------
class Busy(L.LightningModule):
    """A step with state everywhere: BatchNorm, a torchmetrics metric, logs, a list it appends to, a counter it
    increments, and random input noise (any RNG the experiment consumed would change the training)."""

    def __init__(self, python_rng: bool = False, buffer_counter: bool = False) -> None:
        super().__init__()
        self.python_rng, self.buffer_counter = python_rng, buffer_counter
        self.net = nn.Sequential(nn.Linear(N_IN, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, N_OUT))
        self.acc = torchmetrics.classification.MulticlassAccuracy(N_OUT, average="micro")
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.history: list[float] = []
        self.calls = 0
        self.draws: list[tuple[bool, int, float, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x + 0.01 * torch.randn_like(x)
        out = self.net(x)
        loss = F.cross_entropy(out, y)
        self.acc(out, y)
        self.log("acc", self.acc, on_step=True, on_epoch=True)
        self.log("loss", loss, on_step=True, on_epoch=True)
        self.log("bn_mean", self.net[1].running_mean.sum(), on_step=True)
        self.history.append(float(loss))
        self.calls += 1
        if self.buffer_counter:
            self.seen += len(x)
        if self.python_rng:
            self.draws.append((torch.is_grad_enabled(), self.calls, random.random(), float(np.random.rand())))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _auto_and_explicit(root: Any, **busy: Any) -> tuple[tuple[Run, Any], tuple[Run, Any]]:
    """The same seeded run with ``auto`` and with ``loss_reduction`` set to what ``auto`` ended up using."""
    runs = []
    for reduction in ("auto", None):
        if reduction is None:
            reduction = runs[0][0].trainer.strategy.normalization.spec()
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        module = Busy(**busy).to(torch.float64)
        strategy = lightning_mgpu.ParallelCriterionStrategy(loss_reduction=reduction)
        run = fit(module, strategy, 3, mlp_loader("ce_mean", 10), root)
        runs.append((run, (torch.get_rng_state(), random.getstate(), np.random.get_state())))
    return runs[0], runs[1]


def test_experiment_leaves_no_side_effects(root):
    """Parameters, BatchNorm running statistics, metric state, every logged value, the list and counter the step
    updates, and torch's RNG stream end exactly as with the experiment turned off."""
    (auto, auto_rng), (explicit, explicit_rng) = _auto_and_explicit(root)
    assert torch.equal(auto.params, explicit.params)
    for (name, a), (_, b) in zip(auto.module.named_buffers(), explicit.module.named_buffers(), strict=True):
        assert torch.equal(a, b), name  # BatchNorm running statistics and batch count
    assert auto.losses == explicit.losses
    # the metric's state shows in its logged values: per step (acc_step) and accumulated (acc_epoch)
    assert auto.logged == explicit.logged and auto.final == explicit.final
    assert {"acc_step", "acc_epoch", "loss_epoch", "bn_mean"} <= auto.final.keys()
    assert auto.module.history == explicit.module.history and len(auto.module.history) == 3 * STEPS
    assert auto.module.calls == explicit.module.calls
    assert torch.equal(auto_rng[0], explicit_rng[0])


def test_experiment_leaves_buffers_alone(root):
    (auto, _), (explicit, _) = _auto_and_explicit(root, buffer_counter=True)
    assert int(auto.module.seen) == int(explicit.module.seen)


def test_experiment_restores_python_and_numpy_rng(root):
    (auto, auto_rng), (explicit, explicit_rng) = _auto_and_explicit(root, python_rng=True)
    training_draws = [d for d in auto.module.draws if d[0]]  # the experiment runs without grad
    assert training_draws == explicit.module.draws
    assert auto_rng[1] == explicit_rng[1]


@pytest.mark.xfail(strict=True, reason=NOISY_STEP_FALSE_ALARM)
def test_noisy_per_sample_mean_is_samples_without_warning(root):
    (auto, _), _ = _auto_and_explicit(root)
    assert auto.normalisation_warnings() == []
    assert_decided(auto, "samples")


# --- 6. the pytorch_lightning namespace ------------------------------------------------------------------------------
def test_sum_loss_under_pytorch_lightning(root):
    """``import pytorch_lightning as pl``: ``pl.Trainer(strategy="parallel_criterion")`` finds the sum, prints the
    decision on the ``pytorch_lightning`` logger, and equals ``pl``'s one device."""
    pl = pytest.importorskip("pytorch_lightning")
    expected = fit(make_mlp(pl, "handwritten_sum"), "auto", 1, mlp_loader("handwritten_sum", 10), root, ns=pl)
    got = fit(make_mlp(pl, "handwritten_sum"), "parallel_criterion", 3, mlp_loader("handwritten_sum", 10), root, ns=pl)
    assert type(got.trainer.strategy).__module__ == "lightning_mgpu.strategies.pytorch_lightning"
    assert_decided(got, "sum")
    assert_equal_runs(got, expected)
