"""LightningModules as public repositories write them, under ``parallel_criterion`` and ``dp`` against one device.

The modules (``public_modules_models.py``) are tiny stand-ins for Lightning's CIFAR baseline tutorial, its semantic
segmentation example (UNet, ``ignore_index=250``), bolts' SimCLR (as written, and with the docs' ``self.all_gather``
fix), Lightning's Barlow Twins tutorial (gathered), Lightning's DQN example, bolts' MoCo v2, a per-sample-pairs collate,
Lightning's basic GAN and lightning-hydra-template's MNIST module (F1, ``MeanMetric``, metrics in a dict), each with its
step as written. Every run: float64 (``precision="64-true"``, the module built under ``trainer.init_module()``), 2
epochs, batch sizes that give uneven shards at 2 and 3 devices, Lightning's default callbacks, logger and progress bar
on. Each result is either equal to one device on the same seed and batches (final ``state_dict`` and
``trainer.callback_metrics``, <= 1e-9), or one clear message whose fix, applied, equals one device.

The tolerance is 1e-9 for every tensor and logged value, except where the one-device run itself does not reproduce to
1e-9 (``floor=True`` below): Adam on a bias that feeds a training-mode BatchNorm (bolts' ``Projection``, the Barlow
tutorial's ``ProjectionHead``, the template's ``SimpleDenseNet``) amplifies rounding noise by about lr/eps (1e5-1e6),
since the loss does not depend on that bias and its gradient is pure rounding; the BatchNorm's running mean and the
validation losses computed with it follow. There the one-device run is repeated twice with each batch's rows in
another order (reversed; rotated by one: the loss and BatchNorm do not depend on the order), and a key whose
one-device runs differ by more than 1e-10 gets ``100 x`` that difference as its tolerance; every other key keeps 1e-9
(measured: a SimCLR bias 3.6e-7 apart between two one-device runs, while its other tensors agree to 1e-15).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L
import public_modules_models as M
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import lightning_mgpu
from lightning_mgpu import BatchSplitError

TOL = 1e-9
STRATEGIES = ("parallel_criterion", "dp")
DEVICES = (2, 3)
_ROOT = tempfile.mkdtemp(prefix="public_modules_")
atexit.register(shutil.rmtree, _ROOT, True)


# --- the cases --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    make: Callable[..., L.LightningModule]
    data: Callable[[], tuple[DataLoader, ...]]  # (train[, val]); () for a module with its own train_dataloader
    callbacks: Callable[[], list[Any]] = list
    floor: bool = False  # Adam on a bias before BatchNorm: measure the one-device noise floor (module docstring)


def _loaders(train: Dataset, val: Dataset | None, batch: int, val_batch: int, **kwargs: Any) -> tuple[DataLoader, ...]:
    loaders = [DataLoader(train, batch_size=batch, **kwargs)]
    if val is not None:
        loaders.append(DataLoader(val, batch_size=val_batch, **kwargs))
    return tuple(loaders)


def _views3() -> tuple[DataLoader, ...]:  # bolts' ((view1, view2, online-eval view), label), 5, 5, 3 and 4, 3
    return _loaders(M.Views(13, views=3), M.Views(7, views=3, seed=1), 5, 4)


CASES: dict[str, Case] = {
    # 5, 5, 3 samples: shards 3/2, 2/1 on 2 devices; 2/2/1, 1/1/1 on 3. Validation 4, 3.
    "resnet": Case(
        lambda: M.LitResnet(batch_size=5, train_size=13),
        lambda: _loaders(M.Images(13, classes=10), M.Images(7, classes=10, seed=1), 5, 4),
        lambda: [LearningRateMonitor(logging_interval="step")],
    ),
    # 4, 3: samples 3 and 6 are all void (250), each alone on a shard at 3 devices (2/1/1, 1/1/1) and sample 6 at 2.
    "unet": Case(
        lambda: M.SegModel(batch_size=4),
        lambda: _loaders(M.Segmentation(7, void=(3, 6)), M.Segmentation(5, void=(4,), seed=1), 4, 5),
    ),
    "simclr": Case(lambda: M.SimCLRAllGather(num_samples=13, batch_size=5), _views3, floor=True),
    "simclr_dist": Case(lambda: M.SimCLR(num_samples=13, batch_size=5), _views3, floor=True),
    "barlow": Case(
        lambda: M.BarlowTwins(num_training_samples=13, batch_size=5),
        _views3,
        lambda: [M.OnlineFineTuner(encoder_output_dim=8, num_classes=4)],
        floor=True,
    ),
    # 2 batches of 5 per epoch from the replay buffer (IterableDataset): shards 3/2 and 2/2/1.
    "dqn": Case(lambda **kw: M.DQNLightning(**kw), lambda: ()),
    # 7, 7 (bolts asserts num_negatives % batch == 0): shards 4/3, 3/2/2.
    "moco": Case(lambda **kw: M.MoCoV2(**kw), lambda: _loaders(M.Views(14), M.Views(7, seed=1), 7, 7)),
    "pairs": Case(
        M.PairsClassifier,
        lambda: _loaders(M.Views(13), M.Views(7, seed=1), 5, 4, collate_fn=M.per_sample_pairs),
    ),
    "gan": Case(M.GAN, lambda: _loaders(M.WithNoise(13, latent_dim=4), None, 5, 0)),
    "hydra": Case(
        M.MNISTLitModule,
        lambda: _loaders(M.Images(13, shape=(1, 3, 4)), M.Images(7, shape=(1, 3, 4), seed=1), 5, 4),
        lambda: [
            ModelCheckpoint(monitor="val/acc", mode="max", save_last=True),
            EarlyStopping(monitor="val/acc", patience=100, mode="max"),
        ],
        floor=True,
    ),
}


# --- running them -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    state: dict[str, torch.Tensor]
    metrics: dict[str, float]
    said: tuple[str, ...]  # every warning's message
    module: L.LightningModule


class _ReorderedRows(Dataset):
    """``dataset`` with the rows of each batch of ``batch_size`` reversed or rotated by one (for the noise floor)."""

    def __init__(self, dataset: Any, batch_size: int, order: str) -> None:
        self.dataset, self.batch_size, self.order = dataset, batch_size, order

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        start = i - i % self.batch_size
        size = min(self.batch_size, len(self.dataset) - start)
        row = size - 1 - (i - start) if self.order == "reversed" else (i - start + 1) % size
        return self.dataset[start + row]


def _strategy(strategy: str, options: tuple[tuple[str, Any], ...]) -> Any:
    if not options:
        return strategy
    cls = (
        lightning_mgpu.ParallelCriterionStrategy
        if strategy == "parallel_criterion"
        else lightning_mgpu.DataParallelStrategy
    )
    return cls(**dict(options))


def fit(
    case: str, strategy: str = "auto", devices: int = 1, *, options: tuple = (), order: str = "", **variant: Any
) -> Run:
    """One run of ``case`` (its module built with ``variant``) under ``strategy`` (with ``options``) on ``devices``."""
    spec = CASES[case]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=_strategy(strategy, options),
        precision="64-true",
        max_epochs=2,
        log_every_n_steps=1,
        default_root_dir=tempfile.mkdtemp(dir=_ROOT),
        callbacks=spec.callbacks(),
    )
    L.seed_everything(0, verbose=False)  # torch, numpy (the DQN's environment and buffer) and random
    with trainer.init_module():
        module = spec.make(**variant)
    loaders = spec.data()
    if order:
        loaders = tuple(
            DataLoader(_ReorderedRows(d.dataset, d.batch_size, order), batch_size=d.batch_size, collate_fn=d.collate_fn)
            for d in loaders
        )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module, *loaders)
    return Run(
        {k: v.detach().clone() for k, v in module.state_dict().items()},
        {k: float(v) for k, v in trainer.callback_metrics.items()},
        tuple(str(w.message) for w in seen),
        module,
    )


@functools.cache
def _reference(case: str, variant: tuple[tuple[str, Any], ...]) -> Run:
    return fit(case, **dict(variant))


def reference(case: str, **variant: Any) -> Run:
    """One device on the whole batch, shared by every parametrization."""
    return _reference(case, tuple(sorted(variant.items())))


@functools.cache
def _floor(case: str, variant: tuple[tuple[str, Any], ...]) -> dict[str, float]:
    if not CASES[case].floor:
        return {}
    expected = _reference(case, variant)
    runs = [_differences(fit(case, order=order, **dict(variant)), expected) for order in ("reversed", "rotated")]
    return {key: max(run[key] for run in runs) for key in runs[0]}


def _tolerance(floor: dict[str, float], key: str) -> float:
    measured = floor.get(key, 0.0)
    return TOL if measured <= 1e-10 else max(TOL, 100 * measured)


def _differences(got: Run, expected: Run) -> dict[str, float]:
    assert got.state.keys() == expected.state.keys(), sorted(set(got.state) ^ set(expected.state))
    assert got.metrics.keys() == expected.metrics.keys(), sorted(set(got.metrics) ^ set(expected.metrics))
    out = {}
    for key, value in expected.state.items():
        a, b = got.state[key], value
        out[key] = float((a.double() - b.double()).abs().max()) if b.numel() else 0.0
    for key, value in expected.metrics.items():
        out[f"metric:{key}"] = abs(got.metrics[key] - value)
    return out


def assert_equal_to_one_device(got: Run, case: str, **variant: Any) -> float:
    """Every state tensor and logged value within 1e-9 of one device's (the noise floor above it where measured);
    returns the largest difference."""
    expected = reference(case, **variant)
    floor = _floor(case, tuple(sorted(variant.items())))
    differences = _differences(got, expected)
    beyond = {
        key: (diff, _tolerance(floor, key))
        for key, diff in differences.items()
        if not diff <= _tolerance(floor, key)  # NaN fails too
    }
    worst = max(differences.values(), default=0.0)
    assert not beyond, "differs from one device: " + ", ".join(
        f"{key} by {diff:.3e} (tolerance {tol:.0e})"
        for key, (diff, tol) in sorted(beyond.items(), key=lambda kv: -kv[1][0])[:6]
    )
    return worst


def said(run: Run, pattern: str) -> list[str]:
    return [m for m in run.said if pattern in m]


def grid(*xfails: tuple[str, str, str]) -> list[Any]:
    """strategy x devices; ``xfails``: (strategy, reason, raises) marked strict at both device counts."""
    marks = {s: (reason, raises) for s, reason, raises in xfails}
    params = []
    for strategy in STRATEGIES:
        for devices in DEVICES:
            mark = ()
            if strategy in marks:
                reason, raises = marks[strategy]
                mark = (pytest.mark.xfail(strict=True, reason=reason, raises=raises),)
            params.append(pytest.param(strategy, devices, marks=mark, id=f"{strategy}-{devices}"))
    return params


def both() -> list[Any]:
    return grid()


# --- 1. a BatchNorm classifier and a UNet with ignore_index -----------------------------------------------------------
@pytest.mark.parametrize(("strategy", "devices"), both())
def test_cifar_resnet_with_batchnorm_equals_one_device(strategy, devices):
    """``log_softmax`` + ``nll_loss``, functional ``accuracy`` logged, ``OneCycleLR`` per step, BatchNorm everywhere
    and a one-sample shard at 3 devices."""
    run = fit("resnet", strategy, devices)
    assert assert_equal_to_one_device(run, "resnet") <= TOL
    assert {"train_loss", "val_loss", "val_acc"} <= run.metrics.keys()


@pytest.mark.parametrize(("strategy", "devices"), both())
def test_unet_with_ignore_index_equals_one_device(strategy, devices):
    """``cross_entropy(..., ignore_index=250)`` with all-void samples alone on a shard (that device counts nothing);
    train and validation losses logged."""
    run = fit("unet", strategy, devices)
    assert_equal_to_one_device(run, "unet")
    assert {"train_loss", "val_loss"} <= run.metrics.keys()


# --- 2. two-view SSL with BatchNorm -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("strategy", "devices"), both())
def test_simclr_nt_xent_over_all_gather_equals_one_device(strategy, devices):
    """bolts' SimCLR with the docs' fix: NT-Xent over ``self.all_gather(z, sync_grads=True)``, BatchNorm1d in the
    projection head; nothing is said about torch.distributed once the gather is ``self.all_gather``."""
    run = fit("simclr", strategy, devices)
    assert_equal_to_one_device(run, "simclr")
    assert said(run, "torch.distributed") == []


@pytest.mark.parametrize(("strategy", "devices"), grid())
def test_barlow_twins_over_the_gathered_batch_equals_one_device(strategy, devices):
    """The tutorial's cross-correlation of batch-standardised embeddings, computed by every device over the whole
    batch (``self.all_gather(z, sync_grads=True)``), the ``OnlineFineTuner`` callback training its probe on the root."""
    run = fit("barlow", strategy, devices)
    assert_equal_to_one_device(run, "barlow")


@pytest.mark.parametrize("devices", DEVICES)
def test_barlow_twins_under_dp_says_its_step_runs_unsplit_and_the_fix_equals_one_device(devices):
    """The tutorial's step calls ``self.encoder`` and ``self.projection_head``, never ``self(...)``: dp says the step
    ran on one device and names ``parallel_modules``; passing the modules the step calls equals one device."""
    as_written = fit("barlow", "dp", devices)
    assert len(said(as_written, "never called the replicated forward")) == 1
    assert "with parameters: 'encoder', 'projection_head'" in said(as_written, "never called the replicated")[0]
    fixed = fit("barlow", "dp", devices, options=(("parallel_modules", ["encoder", "projection_head"]),))
    assert said(fixed, "never called the replicated forward") == []
    assert_equal_to_one_device(fixed, "barlow")


# --- 3. a DQN with a target network and an environment ----------------------------------------------------------------


@pytest.mark.parametrize("devices", DEVICES)
def test_dqn_as_written_equals_one_device_under_dp(devices):
    """Lightning's DQN example as written: the environment played in ``training_step``, the target network copied
    every 2 steps after the loss. Under dp the step runs once: equal to one device. (Under parallel_criterion every
    replica plays the environment: said once, next tests.)"""
    run = fit("dqn", "dp", devices)
    assert_equal_to_one_device(run, "dqn")


@pytest.mark.parametrize("devices", DEVICES)
def test_dqn_under_dp_with_the_net_replicated_equals_one_device(devices):
    """dp's message for the example (its step calls ``self.net``, not ``self``), and its fix: ``parallel_modules=
    ['net']`` replicates the Q network, also where the agent calls it on one state."""
    as_written = fit("dqn", "dp", devices)
    assert len(said(as_written, "never called the replicated forward")) == 1
    fixed = fit("dqn", "dp", devices, options=(("parallel_modules", ["net"]),))
    assert said(fixed, "never called the replicated forward") == []
    assert_equal_to_one_device(fixed, "dqn")


@pytest.mark.parametrize("devices", DEVICES)
def test_dqn_playing_its_environment_in_the_step_is_said_once_naming_env_and_buffer(devices):
    """Every replica plays the shared environment and fills the shared buffer (N times a step): said once, naming them
    and the fix; the target network copied after the loss, as the example does."""
    run = fit("dqn", "parallel_criterion", devices)
    messages = said(run, "`DQNLightning.env` changed")
    assert len(messages) == 1, messages
    assert messages[0].startswith("`DQNLightning.env` changed, `DQNLightning.buffer` changed and `DQNLightning.agent`")
    assert "move that call to `on_train_batch_start`" in messages[0]
    assert len(run.module.buffer) == 20 + 4 * devices  # warm start + 4 steps x devices: what the message is about
    # Besides, where the replicas' episodes end differently (3 devices), `total_reward` rebound to differing values is
    # said too: a consequence of the same cause, gone with the fix (next test).
    others = [m for m in said(run, "during a step that ran on") if m not in messages]
    assert all(m.startswith("`DQNLightning.total_reward` was rebound") for m in others), others


@pytest.mark.parametrize(
    "target_copy",
    [
        "after_loss",
        "before_loss",
    ],
)
@pytest.mark.parametrize("devices", DEVICES)
def test_dqn_playing_in_on_train_batch_start_equals_one_device(devices, target_copy):
    """The fix the message names: the step's play moved to ``on_train_batch_start`` (once per step, on the root).
    Environment, buffer, both networks and the logged values equal one device; nothing is said."""
    run = fit("dqn", "parallel_criterion", devices, play="on_train_batch_start", target_copy=target_copy)
    assert_equal_to_one_device(run, "dqn", play="on_train_batch_start", target_copy=target_copy)
    expected = reference("dqn", play="on_train_batch_start", target_copy=target_copy).module
    assert said(run, "during a step that ran on") == []
    assert len(run.module.buffer) == len(expected.buffer) == 24
    for got, want in zip(run.module.buffer.buffer, expected.buffer.buffer, strict=True):
        assert (got.action, got.reward, got.done) == (want.action, want.reward, want.done)
        assert (got.state == want.state).all() and (got.new_state == want.new_state).all()
    assert (run.module.env.pos, run.module.env.t) == (expected.env.pos, expected.env.t)
    target = reference("dqn", play="on_train_batch_start", target_copy=target_copy).state["target_net.net.0.weight"]
    torch.testing.assert_close(run.state["target_net.net.0.weight"], target, rtol=0, atol=TOL)


def test_dqn_fix_on_one_device_is_the_example_on_one_device():
    for target_copy in ("after_loss", "before_loss"):
        fixed, as_written = (
            reference("dqn", play="on_train_batch_start", target_copy=target_copy),
            reference("dqn", target_copy=target_copy),
        )
        assert all(torch.equal(fixed.state[k], v) for k, v in as_written.state.items())


# --- 4. MoCo v2: momentum encoder and queue ---------------------------------------------------------------------------
@pytest.mark.parametrize("update_in", ["training_step", "forward"])
@pytest.mark.parametrize("devices", DEVICES)
def test_moco_momentum_encoder_and_queue_equal_one_device_under_parallel_criterion(devices, update_in):
    """``param_k.data = param_k.data * m + param_q.data * (1 - m)`` in the step or in ``forward``, the queue filled
    with ``self.all_gather(k)`` in ``_dequeue_and_enqueue``: queue, pointer, both encoders and BatchNorm statistics
    equal one device."""
    run = fit("moco", "parallel_criterion", devices, update_in=update_in)
    assert_equal_to_one_device(run, "moco", update_in=update_in)
    assert int(run.state["queue_ptr"]) == 28 % 21  # 4 steps of 7 keys


@pytest.mark.parametrize("update_in", ["training_step", "forward"])
@pytest.mark.parametrize("devices", DEVICES)
def test_moco_queue_passed_to_forward_is_refused_under_dp_and_the_fix_equals_one_device(devices, update_in):
    """bolts passes the queue (emb_dim x K) to the replicated ``forward``: dp refuses to split it, naming it and the fix
    (keep it out of what is split, as a buffer of the module); ``forward`` reading the buffer equals one device."""
    with pytest.raises(BatchSplitError, match=r"kwargs\['queue'\] has size 4[\s\S]*register_buffer"):
        fit("moco", "dp", devices, update_in=update_in)
    fixed = fit("moco", "dp", devices, update_in=update_in, queue_arg=False)
    assert_equal_to_one_device(fixed, "moco", update_in=update_in, queue_arg=False)
    fixed_reference, as_written = (
        reference("moco", update_in=update_in, queue_arg=False),
        reference("moco", update_in=update_in),
    )  # the fix changes nothing on one device
    assert all(torch.equal(fixed_reference.state[k], v) for k, v in as_written.state.items())


# --- 5. a per-sample-pairs collate ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("strategy", "devices"), both())
def test_per_sample_pairs_collate_equals_one_device(strategy, devices):
    run = fit("pairs", strategy, devices)
    assert_equal_to_one_device(run, "pairs")
    assert {"train_loss", "train_acc_step", "train_acc_epoch", "agree", "val_loss"} <= run.metrics.keys()


# --- 6. a two-optimizer GAN -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("strategy", "devices"), both())
def test_basic_gan_with_batchnorm_generator_equals_one_device(strategy, devices):
    """Manual optimization with two Adam optimizers, ``BatchNorm1d(out, 0.8)`` in the generator, the noise from the
    DataLoader, ``example_input_array`` summarised by ModelSummary, the fixed noise sampled at each epoch's end."""
    run = fit("gan", strategy, devices)
    assert_equal_to_one_device(run, "gan")
    expected = reference("gan").module
    torch.testing.assert_close(run.module.sample_imgs, expected.sample_imgs, rtol=0, atol=TOL)
    assert {"g_loss", "d_loss"} <= run.metrics.keys()


# --- 7. a torch.distributed-gated gather ------------------------------------------------------------------------------
@pytest.mark.parametrize("devices", DEVICES)
def test_torch_distributed_gather_is_said_at_set_up_and_the_fix_equals_one_device(devices):
    """bolts' ``nt_xent_loss`` gathers through ``SyncFunction`` only ``if torch.distributed.is_initialized()``: under
    parallel_criterion each device sees its shard. Said once, naming the route and ``self.all_gather(z,
    sync_grads=True)``; that fix (``SimCLRAllGather``) equals one device (test above, and here)."""
    as_written = fit("simclr_dist", "parallel_criterion", devices)
    messages = said(as_written, "gathers nothing here")
    assert len(messages) == 1, messages
    assert messages[0].startswith("parallel_criterion: `self` (SimCLR) calls torch.distributed.all_gather through ")
    assert "self.all_gather(z, sync_grads=True)" in messages[0]
    differences = _differences(as_written, reference("simclr_dist"))
    assert max(differences.values()) > 1e-3  # what the message is about: a real difference, not noise
    fixed = fit("simclr", "parallel_criterion", devices)
    assert said(fixed, "gathers nothing here") == []
    assert_equal_to_one_device(fixed, "simclr")
    fixed_reference, as_written_reference = reference("simclr"), reference("simclr_dist")  # on one device: the same
    assert all(torch.equal(fixed_reference.state[k], v) for k, v in as_written_reference.state.items())


@pytest.mark.parametrize("devices", DEVICES)
def test_torch_distributed_gather_under_dp_equals_one_device_and_says_nothing(devices):
    run = fit("simclr_dist", "dp", devices)
    assert said(run, "gathers nothing here") == []
    assert_equal_to_one_device(run, "simclr_dist")


# --- 8. F1 and a MeanMetric logged from the step, metrics in a plain dict ---------------------------------------------


@pytest.mark.parametrize(("strategy", "devices"), grid())
def test_hydra_template_metrics_f1_mean_metric_and_dict_equal_one_device(strategy, devices):
    """``MeanMetric`` of the loss, ``Accuracy`` objects, an F1's step value, ``Precision``/``Recall`` held in a plain
    dict and logged with ``metric_attribute``, ``MaxMetric`` of the best validation accuracy, ``ReduceLROnPlateau``
    on ``val/loss``, ``ModelCheckpoint`` and ``EarlyStopping`` on ``val/acc``."""
    run = fit("hydra", strategy, devices)
    assert {"train/loss", "train/acc", "train/f1_step", "train/f1_epoch", "train/precision", "train/recall"} <= set(
        run.metrics
    )
    assert assert_equal_to_one_device(run, "hydra") <= 1
