"""Manual optimization under ``parallel_criterion`` and ``dp`` against one device.

A GAN as Lightning's example writes it (two optimizers, ``toggle_optimizer``, ``manual_backward``, ``opt.step()``,
``zero_grad``, ``untoggle_optimizer``; BatchNorm in the generator), its noise drawn by the data loader so that one
device and the replicas see the same numbers. Under ``parallel_criterion`` every replica runs the step on its shard and
the replicas meet at each ``manual_backward`` (one backward pass of the combined loss) and ``opt.step()`` (one step, on
the root): the run equals one device. Progress bar and default callbacks on.
"""

from __future__ import annotations

import copy
import functools
import importlib
import time
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from strategy_models import NAMESPACES
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

LATENT, FEATURES = 4, 6


@functools.cache
def models(namespace: str = "lightning.pytorch") -> SimpleNamespace:
    L = importlib.import_module(namespace)

    class GAN(L.LightningModule):
        """Lightning's ``generative_adversarial_net`` example, made tiny: a generator with BatchNorm, a discriminator,
        binary cross-entropy, the generator and the discriminator stepped in turn."""

        def __init__(self, clip: bool = False, norm: bool = True, schedule: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.clip, self.schedule = clip, schedule
            self.generator = nn.Sequential(
                nn.Linear(LATENT, 8),
                nn.BatchNorm1d(8) if norm else nn.Identity(),
                nn.LeakyReLU(0.2),
                nn.Linear(8, FEATURES),
                nn.Tanh(),
            )
            self.discriminator = nn.Sequential(nn.Linear(FEATURES, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return self.generator(z)

        def adversarial_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.binary_cross_entropy_with_logits(logits, target)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            real, z = batch
            opt_g, opt_d = self.optimizers()
            valid = torch.ones(real.size(0), 1).type_as(real)
            fake = torch.zeros(real.size(0), 1).type_as(real)

            self.toggle_optimizer(opt_g)
            g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
            self.log("g_loss", g_loss, prog_bar=True)
            self.manual_backward(g_loss)
            if self.clip:
                self.clip_gradients(opt_g, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)

            self.toggle_optimizer(opt_d)
            real_loss = self.adversarial_loss(self.discriminator(real), valid)
            fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
            d_loss = (real_loss + fake_loss) / 2
            self.log("d_loss", d_loss, prog_bar=True)
            self.manual_backward(d_loss)
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)
            if self.schedule:  # manual optimization steps its schedulers itself, as Lightning documents
                for scheduler in self.lr_schedulers():
                    scheduler.step()
                self.log("lr_g", opt_g.param_groups[0]["lr"])

        def configure_optimizers(self) -> Any:
            opt_g = torch.optim.Adam(self.generator.parameters(), lr=0.01, betas=(0.5, 0.999))
            opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=0.01, betas=(0.5, 0.999))
            if not self.schedule:
                return [opt_g, opt_d], []
            decay = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.8) for o in (opt_g, opt_d)]
            return [opt_g, opt_d], decay

    return SimpleNamespace(L=L, GAN=GAN)


def data(n: int = 30, batch_size: int = 7) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    real = torch.randn(n, FEATURES, generator=generator, dtype=torch.float64).tanh()
    z = torch.randn(n, LATENT, generator=generator, dtype=torch.float64)
    return DataLoader(TensorDataset(real, z), batch_size=batch_size)


def fit(module: Any, strategy: Any, devices: int, namespace: str, batch_size: int = 7) -> Any:
    trainer = models(namespace).L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data(batch_size=batch_size))
    return trainer


def assert_equal_to_one_device(strategy: Any, devices: int, namespace: str = "lightning.pytorch", **kwargs: Any) -> Any:
    base = models(namespace).GAN(**kwargs).double()
    single, multi = copy.deepcopy(base), copy.deepcopy(base)
    reference = fit(single, "auto", 1, namespace)
    trainer = fit(multi, strategy, devices, namespace)
    for (name, a), b in zip(multi.state_dict().items(), single.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9, msg=name)
    for name in ("g_loss", "d_loss"):
        got, expected = float(trainer.callback_metrics[name]), float(reference.callback_metrics[name])
        assert got == pytest.approx(expected, rel=0, abs=1e-9), name
    assert trainer.global_step == reference.global_step == 2 * 2 * 5  # two optimizer steps per batch, counted once
    return trainer


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_a_two_optimizer_gan_equals_one_device(strategy, devices):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(rebound|grew|differ|overridden).*")  # auto chooses threads
        assert_equal_to_one_device(strategy, devices)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_gradient_clipping_between_backward_and_step_equals_one_device(namespace):
    assert_equal_to_one_device("parallel_criterion", 3, namespace, clip=True)


@pytest.mark.parametrize("devices", [2, 3])
def test_schedulers_stepped_in_the_step_step_once_as_on_one_device(devices):
    """Manual optimization steps its schedulers in the step: once per step, not once per replica."""
    trainer = assert_equal_to_one_device("parallel_criterion", devices, schedule=True)
    # A Python float logged is a tensor of the default dtype (float32), as one device's self.log makes it.
    expected = torch.tensor(0.01 * 0.8**10, dtype=torch.get_default_dtype()).item()
    assert float(trainer.callback_metrics["lr_g"]) == expected


def test_sequential_execution_is_overridden_so_that_the_replicas_meet():
    module = importlib.import_module("lightning_mgpu.strategies.lightning_pytorch")
    with pytest.warns(UserWarning, match=r"overridden: manual optimization: the replicas meet"):
        assert_equal_to_one_device(module.ParallelCriterionStrategy(execution_mode="sequential"), 2, norm=False)


def test_a_replica_that_skips_a_manual_backward_fails_clearly():
    """A branch on the shard's size: one replica steps, the other does not: an error that names the meeting."""

    class Skips(models().GAN):  # type: ignore[misc, valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> None:
            if batch[0].shape[0] > 3:
                super().training_step(batch, batch_idx)

    with pytest.raises(Exception, match=r"manual_backward \(call 1 of this step\)[\s\S]*same number of times"):
        fit(Skips(norm=False).double(), "parallel_criterion", 2, "lightning.pytorch")


def scheduled_module(gate: str = "every") -> Any:
    """Manual optimization with a scheduler stepped in the step and the rate logged: stepped by every replica
    (``"every"``), behind ``self.trainer.is_global_zero`` (``"zero"``) or its negation (``"others"``), or held as an
    attribute (``"held"``). Replica 0
    arrives late at the scheduler on purpose (its shard of 7 rows is the largest on 2 or 3 devices)."""
    L = models().L

    class Scheduled(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.layer = nn.Linear(FEATURES, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            real, _ = batch
            opt = self.optimizers()
            self.manual_backward(self.layer(real).square().mean())
            opt.step()
            opt.zero_grad()
            if real.shape[0] == 4:
                time.sleep(0.05)
            if gate == "held":
                self.held.step()
            elif gate == "every" or self.trainer.is_global_zero == (gate == "zero"):
                self.lr_schedulers().step()
            if gate != "zero":  # replicas that skip the step do not wait for it: their read would race
                self.log("lr", opt.param_groups[0]["lr"])

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            self.held = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return [opt], [] if gate == "held" else [self.held]

    return Scheduled().double()


def fit_scheduled(module: Any, strategy: str, devices: int, **options: Any) -> tuple[Any, list[float]]:
    L, rates = models().L, []

    class Rates(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            rates.append(float(trainer.callback_metrics.get("lr", float("nan"))))

    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[Rates()], **options,
    )  # fmt: skip
    trainer.fit(module, data(n=28, batch_size=7))
    return trainer, rates


@pytest.mark.parametrize(("devices", "precision"), [(2, "32-true"), (3, "32-true"), (3, "64-true")])
def test_a_rate_read_after_the_scheduler_step_is_the_stepped_one_on_every_replica(devices, precision):
    """Replica 0 steps the schedulers for all; the others must not read the rate before it has. The rate, alike on
    every replica, is logged exactly as one device logs it (a Python float: a tensor of the step's default dtype)."""
    _, rates = fit_scheduled(scheduled_module(), "parallel_criterion", devices, precision=precision)
    dtype = torch.float64 if precision == "64-true" else torch.get_default_dtype()
    assert rates == [torch.tensor(0.1 * 0.5**k, dtype=dtype).item() for k in range(1, 5)]


@pytest.mark.parametrize("devices", [2, 3])
def test_a_scheduler_stepped_by_replica_0_alone_equals_one_device(devices):
    """``if self.trainer.is_global_zero: scheduler.step()``: replica 0 steps it, the others go on without waiting."""
    single, multi = scheduled_module("zero"), scheduled_module("zero")
    fit_scheduled(single, "auto", 1)
    trainer, _ = fit_scheduled(multi, "parallel_criterion", devices)
    for a, b in zip(multi.parameters(), single.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.1 * 0.5**4


def test_a_held_scheduler_under_manual_optimization_gets_the_fix_that_works_there():
    """Lightning steps no scheduler under manual optimization: the fix is ``self.lr_schedulers().step()``, which
    the test above shows equal to one device."""
    with pytest.raises(RuntimeError, match=r"on each of the 2 replicas[\s\S]*self\.lr_schedulers\(\)\.step\(\)"):
        fit_scheduled(scheduled_module("held"), "parallel_criterion", 2)


def test_replicas_that_step_a_scheduler_replica_0_never_steps_fail_clearly():
    with pytest.raises(
        Exception, match=r"lr_scheduler\.step\(\) \(call 1 of this step\)[\s\S]*replica 0, which finished"
    ):
        fit_scheduled(scheduled_module("others"), "parallel_criterion", 2)
