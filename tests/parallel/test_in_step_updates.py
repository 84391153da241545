"""Tensors a step changes on its replicas: parameters updated in place (an EMA of a key, target or teacher network)
and buffers rebound (DINO's ``self.center = ...``).

Every replica holds its own copy of the parameters (the first, those of the original), in both execution modes and
on one device too, as a DDP rank does: an in-place update runs once on each copy and the original keeps replica 0's,
as one device. ``Embedding(max_norm=...)``'s in-place renormalisation of the rows each shard looks up reaches the
original's storage from every replica on its device (idempotent, as one device on the whole batch). A rebound buffer
takes replica 0's value, as ``nn.DataParallel`` updates
buffers from replica 0.
"""

from __future__ import annotations

import copy
import gc
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import lightning_mgpu.parallel.replicas as replicas_module
from lightning_mgpu.parallel import DataParallelModel, ReplicaSet
from lightning_mgpu.parallel.run_replicas import run_replicas

CPU = torch.device("cpu")
OTHER = torch.device("cpu", 0)  # compares unequal to CPU: the "other device" path (same memory)
CPU3 = ["cpu"] * 3
MODES = ["sequential", "threads"]
M = 0.9


def ema(key: nn.Module, query: nn.Module, how: str) -> None:
    """The ways users write an EMA of ``query`` into ``key`` inside a step."""
    with torch.no_grad():
        pairs = list(zip(key.parameters(), query.parameters(), strict=True))
        for pk, pq in pairs:
            if how == "in place":
                pk.mul_(M).add_(pq, alpha=1 - M)
            elif how == ".data in place":
                pk.data.mul_(M).add_(pq.data, alpha=1 - M)
            elif how == "copy_":
                pk.copy_(pk * M + pq * (1 - M))
        if how == "foreach":
            torch._foreach_lerp_([pk for pk, _ in pairs], [pq for _, pq in pairs], 1 - M)


class KeyEncoder(nn.Module):
    """A query network trained by the loss and a key network that follows it by EMA, updated in ``forward``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.query = nn.Linear(4, 3).double()
        self.key = copy.deepcopy(self.query).requires_grad_(False)
        with torch.no_grad():
            self.key.weight.mul_(0.5)  # the key starts away from the query: every update changes it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ema(self.key, self.query, self.how)
        return self.query(x) * self.key(x)


class Centered(nn.Module):
    """DINO's center: a buffer rebound in every step to an average of itself and a new value."""

    def __init__(self, source: str = "parameter") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.source = source
        self.net = nn.Linear(4, 3).double()
        self.register_buffer("center", torch.zeros(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        out = out + out * self.center  # autograd keeps this step's center: the rebinding must leave it unchanged
        # The same new value on every replica (from a parameter), or each replica's own shard (its outputs' mean).
        new = self.net.bias.detach() if self.source == "parameter" else out.detach().mean(0)
        self.center = self.center * M + new * (1 - M)
        return out


def batch(n: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def train(model: nn.Module, net: Callable[[torch.Tensor], Any], steps: int = 3) -> nn.Module:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(steps):
        out = net(batch(seed=step))
        (torch.cat(out) if isinstance(out, list) else out).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12, msg=name)


@pytest.fixture
def collected() -> None:
    """Replica sets of earlier tests collected: runs of theirs that raised no longer keep the hooks installed."""
    gc.collect()


def nothing_installed() -> bool:
    return not torch.nn.modules.module._global_buffer_registration_hooks


# --- parameters changed in place ------------------------------------------------------------------------------------
HOWS = ["in place", "copy_", "foreach"]


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", [*HOWS, ".data in place"])
def test_an_in_step_update_runs_on_each_replicas_own_copy_and_equals_one_device(how, mode, devices, collected):
    """Every replica holds its own copy of the key network, even on one device, and updates it once per step, as a
    DDP rank does; the original is replica 0's."""
    reference = KeyEncoder(how)
    train(reference, reference)
    model = KeyEncoder(how)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, DataParallelModel(model, ["cpu"] * devices, execution_mode=mode))
    assert_same(model, reference)
    assert nothing_installed()


def run_on(replica_set: ReplicaSet, devices: list[Any], mode: str) -> Callable[[torch.Tensor], list[Any]]:
    """A step through ``replica_set`` as the strategies run one: prepare, run the shards, watch."""

    def net(x: torch.Tensor) -> list[Any]:
        replicas = replica_set.prepare(len(devices))
        calls = [lambda r=r, c=c: r(c) for r, c in zip(replicas, x.tensor_split(len(devices)), strict=True)]
        outputs = run_replicas(calls, devices, mode)
        replica_set.watch(outputs)
        return outputs

    return net


def after(call: Callable[[torch.Tensor], Any], model: KeyEncoder) -> Callable[[torch.Tensor], Any]:
    """``call``, then the EMA update once."""

    def step(x: torch.Tensor) -> Any:
        out = call(x)
        ema(model.key, model.query, "in place")
        return out

    return step


@pytest.mark.parametrize("mode", MODES)
def test_the_fix_the_error_suggests_equals_one_device(mode):
    """The update after the DataParallelModel call, once per step."""
    reference = KeyEncoder("none")
    train(reference, after(reference, reference))
    model = KeyEncoder("none")
    train(model, after(DataParallelModel(model, CPU3, execution_mode=mode), model))
    assert_same(model, reference)


def distinct_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a ReplicaSet keep ``cpu:0`` apart from ``cpu``: replica 1 then holds copies, as on another GPU."""
    monkeypatch.setattr(replicas_module, "to_device", lambda d: d if isinstance(d, torch.device) else torch.device(d))


@pytest.mark.parametrize("how", [*HOWS, ".data in place"])
@pytest.mark.parametrize("mode", MODES)
def test_replicas_with_their_own_copies_update_as_one_device(how, mode, monkeypatch):
    distinct_devices(monkeypatch)
    reference = KeyEncoder(how)
    train(reference, reference)
    model = KeyEncoder(how)
    replica_set = ReplicaSet(model, [CPU, OTHER])
    assert replica_set.devices == [CPU, OTHER]
    train(model, run_on(replica_set, [CPU, OTHER], mode))
    assert_same(model, reference)
    flat = replica_set._flat
    assert flat is not None
    for leaf, original in zip(flat.leaves[0], model.parameters(), strict=True):
        assert leaf.data_ptr() == original.data_ptr()  # replica 0 still works on the originals


@pytest.mark.parametrize("mode", MODES)
def test_two_replicas_on_another_device_hold_a_copy_each(mode, monkeypatch):
    """Replicas 1 and 2 on the other device hold one copy each: the update runs once on each, as one device's."""
    distinct_devices(monkeypatch)
    reference = KeyEncoder("in place")
    train(reference, reference)
    model = KeyEncoder("in place")
    train(model, run_on(ReplicaSet(model, [CPU, OTHER, OTHER]), [CPU, OTHER, OTHER], mode))
    assert_same(model, reference)


class Renormed(nn.Module):
    """An embedding that renormalises the rows it looks up in place, in every forward (untied: only lookups read it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 4, max_norm=1.0).double()
        self.out = nn.Linear(4, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.embedding(x.abs().mul(3).long() % 10)).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_an_embedding_renormalising_rows_in_place_is_no_error_and_equals_one_device(mode):
    """Each replica renormalises the rows it looks up, on the storage the replicas share: idempotent, as one device."""
    reference = Renormed()
    train(reference, reference)
    model = Renormed()
    with pytest.warns(UserWarning, match=r"max_norm=1\.0"):  # the wrapper names the layer once
        net = DataParallelModel(model, ["cpu"] * 2, execution_mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, net)
    assert_same(model, reference)


# --- buffers rebound -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_rebound_to_one_value_on_every_replica_equals_one_device(mode):
    reference = Centered()
    train(reference, reference, steps=4)
    model = Centered()
    net = DataParallelModel(model, CPU3, execution_mode=mode)
    train(model, net, steps=4)
    assert_same(model, reference)
    assert net._replicas.values()[0].builds == 1  # a new value of the same shape: no rebuild


@pytest.mark.parametrize("mode", MODES)
def test_a_rebound_buffer_takes_replica_0s_value_and_every_replica_gets_it_back(mode, collected):
    model = Centered(source="shard")
    replica_set = ReplicaSet(model, CPU3)
    x = batch()
    run_on(replica_set, CPU3, mode)(x)
    first = Centered(source="shard")
    first(x[:2])  # replica 0's shard on one device
    torch.testing.assert_close(model.center, first.center, rtol=0, atol=0)
    assert nothing_installed()
    replicas = replica_set.prepare(3)
    assert replicas[0].center is model.center  # replica 0 shares the original again
    for replica in replicas[1:]:
        assert replica.center is not model.center
        torch.testing.assert_close(replica.center, model.center, rtol=0, atol=0)
    replica_set.watch([])


class Growing(nn.Module):
    """A cache buffer replaced by a longer one when a longer input comes (rotary-embedding caches do this)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache.numel() < x.shape[1]:
            self.cache = torch.arange(float(x.shape[1]))
        return x[:, : self.cache.numel()] + self.cache[: x.shape[1]]


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_rebound_with_another_shape_reaches_the_original_and_rebuilds_the_replicas(mode):
    model = Growing()
    net = DataParallelModel(model, CPU3, execution_mode=mode)
    x = torch.ones(6, 4)
    torch.testing.assert_close(torch.cat(net(x)), Growing()(x))
    assert model.cache.shape == (4,)
    torch.testing.assert_close(torch.cat(net(x)), Growing()(x))
    replica_set = net._replicas.values()[0]
    assert replica_set.builds == 2
    assert all(r.cache.shape == (4,) for r in replica_set.replicas)


def test_a_failed_step_keeps_what_replica_0_rebound_and_leaves_nothing_installed(collected):
    class Fails(Centered):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            if x.shape[0] == 1:
                raise ValueError("a replica fails")
            return out

    model = Fails()
    net = DataParallelModel(model, CPU3, execution_mode="sequential")
    with pytest.raises(ValueError, match="a replica fails"):
        net(batch(4))  # shards of 2, 1, 1: replica 0 rebinds its center, replica 1 fails
    net(batch(6))
    assert nothing_installed()
    reference = Centered()
    for _ in range(2):  # as on one device: the failed step's update, then this one's
        reference(batch(6))
    torch.testing.assert_close(model.center, reference.center, rtol=0, atol=0)


def test_a_replica_set_dropped_between_prepare_and_watch_leaves_no_hook_installed(collected):
    # The buffer registration hook is global: a run the collector frees unstopped must take it along, or every
    # later buffer registration in the process would pay for it.
    for mode in ("sequential", "threads"):
        replica_set = ReplicaSet(Centered(), CPU3)
        replica_set.prepare()
        assert not nothing_installed()
        del replica_set
        gc.collect()
        assert nothing_installed(), mode
