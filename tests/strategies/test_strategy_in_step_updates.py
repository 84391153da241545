"""A step that changes the module's own tensors, under ``parallel_criterion`` and ``dp`` against one device.

Every replica owns its parameters, as a DDP rank does (on one device too): an EMA key encoder updated in the step or
in ``forward`` (MoCo, BYOL, mean teacher; in place or through ``.data``) and a DQN's target network copied in the step
run once per replica on its own copy, and the root keeps replica 0's: equal to one device. DINO's center buffer rebound
in the step (``self.center = ...``) equals one device.
"""

from __future__ import annotations

import copy
import functools
import importlib
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from strategy_models import N_CLASSES, N_FEATURES, NAMESPACES, loader, metrics, trainer
from torch import nn

M = 0.9
MODES = ["sequential", "threads"]


@functools.cache
def models(namespace: str = "lightning.pytorch") -> SimpleNamespace:
    L = importlib.import_module(namespace)

    class KeyEncoder(L.LightningModule):
        """A query network trained by the loss, a key network that follows it by EMA (``how``: where and how)."""

        def __init__(self, how: str = "in place", where: str = "training_step") -> None:
            super().__init__()
            torch.manual_seed(0)
            self.how, self.where = how, where
            # Two layers: backward needs the second layer's weight, saved by the graph (a copy into the key network
            # must not look like a change of it).
            self.query = nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Tanh(), nn.Linear(8, N_CLASSES))
            self.key = copy.deepcopy(self.query).requires_grad_(False)
            self.updates = 0

        def update_key(self) -> None:
            self.updates += 1
            if self.how == "target copy":  # a DQN's target network, copied every other step
                if self.updates % 2 == 0:
                    self.key.load_state_dict(self.query.state_dict())
                return
            with torch.no_grad():
                for pk, pq in zip(self.key.parameters(), self.query.parameters(), strict=True):
                    if self.how == ".data":  # MoCo's momentum update
                        pk.data = pk.data * M + pq.data * (1 - M)
                    else:
                        pk.mul_(M).add_(pq, alpha=1 - M)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.where == "forward":  # bolts' MoCo updates its key encoder in forward
                self.update_key()
            return self.query(x) - self.key(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if self.where == "training_step":
                self.update_key()
            difference = self(x)
            loss = nn.functional.cross_entropy(self.query(x), y) + difference.pow(2).mean()
            if self.where == "after_loss":  # Lightning's DQN example copies its target network after the loss
                self.update_key()
            self.log("loss", loss)
            self.log("updates", float(self.updates))
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.where == "on_train_batch_end":
                self.update_key()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.query.parameters(), lr=0.3)

    class Dino(L.LightningModule):
        """DINO's center: a buffer rebound in every step to an average of itself and the batch's mean output, from
        the whole batch (``all_gather``) or from a parameter (the same on every replica, no collective)."""

        def __init__(self, source: str = "all_gather") -> None:
            super().__init__()
            torch.manual_seed(0)
            self.source = source
            self.net = nn.Linear(N_FEATURES, N_CLASSES)
            self.register_buffer("center", torch.zeros(N_CLASSES))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.net(x)
            loss = nn.functional.cross_entropy(logits - self.center, y)
            if self.source == "all_gather":
                new = self.all_gather(logits.detach()).reshape(-1, N_CLASSES).mean(0)
            else:
                new = self.net.bias.detach()
            self.center = self.center * M + new * (1 - M)
            self.log("loss", loss)
            self.log("center", self.center.sum())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.3)

    class StepsItsScheduler(L.LightningModule):
        """A warm-up stepped by hand: ``self.lr_schedulers().step()`` in the step, or in ``on_train_batch_end``."""

        def __init__(self, where: str = "training_step") -> None:
            super().__init__()
            torch.manual_seed(0)
            self.where = where
            self.net = nn.Linear(N_FEATURES, N_CLASSES)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if self.where == "training_step":
                self.lr_schedulers().step()
            elif self.where == "held":  # a scheduler of its own, which Lightning does not know
                self.warmup.step()
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("lr", self.optimizers().param_groups[0]["lr"])
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.where == "on_train_batch_end":  # the fix the error suggests
                self.lr_schedulers().step()

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
            if self.where == "held":
                self.warmup = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
                return optimizer
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    return SimpleNamespace(KeyEncoder=KeyEncoder, Dino=Dino, StepsItsScheduler=StepsItsScheduler)


def strategy(mode: str, namespace: str = "lightning.pytorch", name: str = "parallel_criterion") -> Any:
    module = importlib.import_module(f"lightning_mgpu.strategies.{namespace.replace('.', '_')}")
    cls = module.ParallelCriterionStrategy if name == "parallel_criterion" else module.DataParallelStrategy
    return cls(execution_mode=mode)


def fit(module: Any, how: Any, devices: int, namespace: str = "lightning.pytorch") -> Any:
    t = trainer(how, devices, namespace=namespace, max_epochs=2, enable_progress_bar=True)
    t.fit(module, loader(8, n=32))
    return t


def assert_equal_to_one_device(
    base: Any, mode: str, devices: int = 2, namespace: str = "lightning.pytorch", name: str = "parallel_criterion"
) -> Any:
    single, multi = copy.deepcopy(base), copy.deepcopy(base)
    reference = fit(single, "auto", 1, namespace)
    got = fit(multi, strategy(mode, namespace, name), devices, namespace)
    for (key, a), b in zip(multi.state_dict().items(), single.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=key)
    assert metrics(got) == pytest.approx(metrics(reference), rel=0, abs=1e-12)
    return multi


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["in place", ".data", "target copy"])
@pytest.mark.parametrize(("name", "where"), [("parallel_criterion", "training_step"), ("dp", "forward")])
def test_an_in_step_update_of_a_network_equals_one_device(name, where, how, mode, devices):
    """Each replica updates its own copy once per step (dp: in its replicated ``forward``); the root keeps replica 0's,
    and its plain attributes (the update count) too."""
    module = models().KeyEncoder(how, where).double()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(rebound|in place).*")
        trained = assert_equal_to_one_device(module, mode, devices, name=name)
    assert trained.updates == 8  # 2 epochs of 4 steps: once per step, as on one device


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["parallel_criterion", "dp"])
def test_a_target_network_copied_after_the_loss_equals_one_device(name, mode, devices):
    """The copy writes into the target's parameters after the graph saved the online network's: a replica's
    parameters are separate tensors (each its own version counter), as on one device, so backward still runs."""
    assert_equal_to_one_device(models().KeyEncoder("target copy", "after_loss").double(), mode, devices, name=name)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_the_update_in_on_train_batch_end_equals_one_device(namespace):
    assert_equal_to_one_device(
        models(namespace).KeyEncoder(where="on_train_batch_end").double(), "threads", 3, namespace
    )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_center_buffer_rebound_from_the_whole_batch_equals_one_device(namespace):
    dino = assert_equal_to_one_device(models(namespace).Dino().double(), "threads", 3, namespace)
    assert dino.center.abs().sum() > 0


@pytest.mark.parametrize("mode", MODES)
def test_a_center_buffer_rebound_to_the_same_value_on_every_replica_equals_one_device(mode):
    assert_equal_to_one_device(models().Dino("parameter").double(), mode)


@pytest.mark.parametrize(("namespace", "where"), [(NAMESPACES[0], "held"), *((n, "training_step") for n in NAMESPACES)])
@pytest.mark.parametrize("mode", MODES)
def test_a_scheduler_stepped_in_the_step_is_refused_with_the_fix(mode, namespace, where):
    """Each replica would step it: the learning rate decayed 2x / 3x per step, silently."""
    module = models(namespace).StepsItsScheduler(where).double()
    with pytest.raises(RuntimeError, match=r"scheduler StepLR on each of the 2 replicas.*`on_train_batch_end`"):
        fit(module, strategy(mode, namespace), 2, namespace)


@pytest.mark.parametrize("mode", MODES)
def test_the_scheduler_stepped_in_on_train_batch_end_equals_one_device(mode):
    assert_equal_to_one_device(models().StepsItsScheduler("on_train_batch_end").double(), mode, devices=3)
