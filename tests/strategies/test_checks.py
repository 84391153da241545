"""Checks said once, without running anything twice (:mod:`lightning_mgpu.strategies.checks`).

1. Code that gathers through ``torch.distributed`` (lightly's ``NTXentLoss(gather_distributed=True)``, bolts'
   ``SyncFunction``, MoCo's ``concat_all_gather``), read at set-up: in one process it gathers nothing, so each replica
   computes the loss on its own shard. The fixes the message names (``self.all_gather(z, sync_grads=True)`` under
   ``parallel_criterion``, or ``dp`` with the loss as written) equal one device (float64, 2 and 3 devices).
2. Plain Python objects held by the module that a replicated step changed (a DQN's environment and replay buffer, a
   list of outputs), from the first steps; the fix (play the environment in ``on_train_batch_start``) equals one
   device.

The stand-ins below copy what those libraries do (no lightly, bolts or gym here). Two tests need the strategy's wiring
(``distributed_gathers`` at set-up, ``HeldObjects`` around the first replicated steps):
``test_set_up_says_torch_distributed_gathering_once_under_parallel_criterion`` and
``test_a_dqn_stepping_its_environment_in_the_step_is_said_once_naming_env_and_buffer``.
"""

from __future__ import annotations

import argparse
import collections
import time
import warnings
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.functional.classification import multiclass_f1_score

import lightning_mgpu
from lightning_mgpu.strategies import checks
from lightning_mgpu.strategies.checks import (
    HeldObjects,
    distributed_gather_message,
    distributed_gathers,
    held_objects_message,
)


# --- stand-ins for libraries that gather through torch.distributed ---------------------------------------------------
def _world_size() -> int:
    """lightly.utils.dist.world_size."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _GatherLayer(torch.autograd.Function):
    """lightly.utils.dist.GatherLayer: all_gather with gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        output = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(output, x)
        return tuple(output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


def _gather(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """lightly.utils.dist.gather."""
    return _GatherLayer.apply(x)


class NTXentLoss(nn.Module):
    """lightly.loss.NTXentLoss (no memory bank): a loss over both views' embeddings, each row's positive the same
    sample's other view; with ``gather_distributed`` it gathers the other ranks' embeddings as negatives."""

    def __init__(self, temperature: float = 0.5, gather_distributed: bool = False) -> None:
        super().__init__()
        self.temperature = temperature
        self.gather_distributed = gather_distributed
        self.cross_entropy = nn.CrossEntropyLoss(reduction="mean")

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        out0, out1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
        batch_size = out0.shape[0]
        if self.gather_distributed and _world_size() > 1:
            out0_large, out1_large = torch.cat(_gather(out0), 0), torch.cat(_gather(out1), 0)
            diag_mask = torch.eye(batch_size, len(out0_large), dtype=torch.bool).roll(dist.get_rank() * batch_size, 1)
        else:
            out0_large, out1_large = out0, out1
            diag_mask = torch.eye(batch_size, device=out0.device, dtype=torch.bool)
        logits_00 = torch.einsum("nc,mc->nm", out0, out0_large) / self.temperature
        logits_01 = torch.einsum("nc,mc->nm", out0, out1_large) / self.temperature
        logits_10 = torch.einsum("nc,mc->nm", out1, out0_large) / self.temperature
        logits_11 = torch.einsum("nc,mc->nm", out1, out1_large) / self.temperature
        logits_00 = logits_00[~diag_mask].view(batch_size, -1)
        logits_11 = logits_11[~diag_mask].view(batch_size, -1)
        logits = torch.cat([torch.cat([logits_01, logits_00], 1), torch.cat([logits_10, logits_11], 1)], 0)
        labels = torch.arange(batch_size, device=out0.device, dtype=torch.long)
        if self.gather_distributed:
            labels = labels + dist.get_rank() * batch_size if _world_size() > 1 else labels
        return self.cross_entropy(logits, labels.repeat(2))


class SyncFunction(torch.autograd.Function):
    """pl_bolts.models.self_supervised.simclr.simclr_module.SyncFunction."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.batch_size = tensor.shape[0]
        gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor)
        return torch.cat(gathered, 0)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        grad_input = grad_output.clone()
        dist.all_reduce(grad_input, op=dist.ReduceOp.SUM, async_op=False)
        start = dist.get_rank() * ctx.batch_size
        return grad_input[start : start + ctx.batch_size]


@torch.no_grad()
def concat_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """MoCo's (moco/builder.py): no gradient, every rank's keys."""
    tensors_gather = [torch.ones_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(tensors_gather, tensor, async_op=False)
    return torch.cat(tensors_gather, dim=0)


# --- modules ---------------------------------------------------------------------------------------------------------
def views(n: int = 21, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return TensorDataset(x, x + 0.3 * torch.randn(n, 6, generator=g, dtype=torch.float64))


class SimCLR(L.LightningModule):
    """``how="lightly"``: NTXentLoss(gather_distributed=True), as lightly's examples write it for DDP;
    ``"all_gather"``: the fix the message names, the strategy's collective then the loss without its own gathering;
    ``"plain"``: the loss without gathering (for subclasses whose step gathers otherwise)."""

    def __init__(self, how: str = "lightly") -> None:
        super().__init__()
        self.how = how
        self.backbone = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
        self.criterion = NTXentLoss(gather_distributed=how == "lightly")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x0, x1 = batch
        z0, z1 = self(x0), self(x1)
        if self.how == "all_gather":
            z0, z1 = self.all_gather(z0, sync_grads=True), self.all_gather(z1, sync_grads=True)
            if self.trainer.world_size > 1:  # DDP's (world_size, B, ...)
                z0, z1 = z0.flatten(0, 1), z1.flatten(0, 1)
        loss = self.criterion(z0, z1)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)


class SimCLRBolts(SimCLR):
    """bolts' SimCLR: the step gathers through SyncFunction where a process group exists."""

    def __init__(self) -> None:
        super().__init__("plain")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        z0, z1 = self(batch[0]), self(batch[1])
        if dist.is_available() and dist.is_initialized():
            z0, z1 = SyncFunction.apply(z0), SyncFunction.apply(z1)
        return NTXentLoss()(z0, z1)


class MoCoLike(SimCLR):
    """MoCo: the step gathers the keys through a helper of its own file."""

    def __init__(self) -> None:
        super().__init__("plain")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        q, k = self(batch[0]), self(batch[1])
        if dist.is_available() and dist.is_initialized():
            k = concat_all_gather(k)
        return F.cross_entropy(q @ k.T, torch.arange(len(q)))


class GathersInASharedStep(SimCLR):
    """The step calls a method of its own, which gathers."""

    def __init__(self) -> None:
        super().__init__("plain")

    def shared_step(self, z: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized():
            z = SyncFunction.apply(z)
        return z.pow(2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.shared_step(self(batch[0]))


class SupConLoss(nn.Module):
    """A loss of the user's own, no flag: its forward gathers through lightly-style helpers."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if _world_size() > 1:
            z = torch.cat(_gather(z))
        return (z @ z.T).logsumexp(1).mean()


class SupConChild(SupConLoss):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(z)


class TorchNnGather(nn.Module):
    """open_clip style: torch.distributed.nn.all_gather (gradients flow)."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        import torch.distributed.nn

        if dist.is_initialized():
            z = torch.cat(torch.distributed.nn.all_gather(z))
        return z.pow(2).mean()


class OnlyAsksTheRank(nn.Module):
    """Reads the rank and gathers along a dim with torch.gather: no collective, nothing to say."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.get_rank() == 0:
            print("rank 0")
        return torch.gather(z, 1, torch.zeros_like(z, dtype=torch.long)).mean()


class Ordinary(L.LightningModule):
    """Lightning's own collective, torch's loss modules and a torchmetrics metric: nothing to say."""

    def __init__(self) -> None:
        super().__init__()
        torchmetrics = pytest.importorskip("torchmetrics")
        self.net = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
        self.loss = nn.CrossEntropyLoss()
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.rank_only = OnlyAsksTheRank()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.all_gather(self.net(x), sync_grads=True)
        self.accuracy(logits, y)
        return self.loss(logits, y)


def _module_with(**children: nn.Module) -> nn.Module:
    module = nn.Module()
    for name, child in children.items():
        module.add_module(name, child)
    return module


# --- 1. what gathers through torch.distributed ----------------------------------------------------------------------
def test_a_loss_built_with_gather_distributed_is_found_by_its_flag():
    assert distributed_gathers(SimCLR("lightly")) == ["`self.criterion` (NTXentLoss) has gather_distributed=True"]


def test_a_loss_whose_gathering_is_off_is_not_read_for_the_calls_behind_the_flag():
    assert distributed_gathers(SimCLR("all_gather")) == []


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (
            SimCLRBolts(),
            "`self` (SimCLRBolts) calls torch.distributed.all_gather through SimCLRBolts.training_step -> SyncFunction",
        ),
        (
            MoCoLike(),
            "`self` (MoCoLike) calls torch.distributed.all_gather through MoCoLike.training_step -> concat_all_gather",
        ),
        (
            _module_with(loss=SupConLoss()),
            "`self.loss` (SupConLoss) calls torch.distributed.all_gather through SupConLoss.forward -> _gather -> "
            "_GatherLayer",
        ),
        (
            GathersInASharedStep(),
            "`self` (GathersInASharedStep) calls torch.distributed.all_gather through "
            "GathersInASharedStep.training_step -> GathersInASharedStep.shared_step -> SyncFunction",
        ),
        (
            _module_with(loss=SupConChild()),
            "`self.loss` (SupConChild) calls torch.distributed.all_gather through SupConLoss.forward -> _gather -> "
            "_GatherLayer",
        ),
        (
            _module_with(head=nn.Sequential(nn.Linear(2, 2), TorchNnGather())),
            "`self.head.1` (TorchNnGather) calls torch.distributed.nn.all_gather through TorchNnGather.forward",
        ),
    ],
    ids=["bolts", "moco", "helpers", "own_method", "super_forward", "torch_distributed_nn"],
)
def test_code_that_calls_a_torch_distributed_collective_is_found_with_its_route(module, expected):
    found = distributed_gathers(module)
    assert found == [expected], found


def test_ordinary_modules_have_nothing_to_say():
    assert distributed_gathers(Ordinary()) == []
    assert distributed_gathers(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.LSTM(2, 2))) == []
    assert distributed_gathers(_module_with(a=OnlyAsksTheRank(), b=nn.CrossEntropyLoss())) == []


def test_repeated_layers_are_named_once_and_each_class_is_read_once():
    checks._code_finding.cache_clear()
    module = _module_with(**{f"loss{i}": SupConLoss() for i in range(30)}, net=nn.Linear(3, 3))
    found = distributed_gathers(module)
    assert len(found) == 1 and found[0].startswith("`self.loss0`, `self.loss1` and 28 more (SupConLoss) calls")
    # The root (nn.Module: library), SupConLoss and nn.Linear: one read each, whatever the count of layers.
    assert checks._code_finding.cache_info().misses == 3


def test_reading_a_transformers_model_is_fast_and_finds_nothing():
    pytest.importorskip("transformers")
    from hf_models import make_hf_module

    module = make_hf_module(L, "masked_lm")
    checks._code_finding.cache_clear()
    start = time.perf_counter()
    assert distributed_gathers(module) == []
    first = time.perf_counter() - start
    start = time.perf_counter()
    distributed_gathers(module)
    again = time.perf_counter() - start
    assert first < 0.5 and again < 0.05, (first, again)


def test_the_message_names_each_finding_and_both_fixes():
    message = distributed_gather_message("parallel_criterion", distributed_gathers(SimCLR("lightly")))
    assert message.startswith("parallel_criterion: `self.criterion` (NTXentLoss) has gather_distributed=True. ")
    assert "self.all_gather(z, sync_grads=True)" in message and "gather_distributed=False" in message
    assert "strategy='dp'" in message and "world size 1" in message


# The fixes the message names, checked: each equals one device.
def _fit(module: Any, strategy: Any, devices: int, steps: int = -1, callbacks: Any = None) -> torch.Tensor:
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, DataLoader(views(), batch_size=7))  # uneven shards: 4+3, 3+2+2
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def _seeded(how: str) -> SimCLR:
    torch.manual_seed(0)
    return SimCLR(how).double()


@pytest.mark.parametrize("devices", [2, 3])
def test_the_fixes_equal_one_device_and_the_loss_as_written_does_not(devices):
    expected = _fit(_seeded("lightly"), "auto", 1)
    assert torch.equal(_fit(_seeded("all_gather"), "auto", 1), expected)  # on one device the fix changes nothing
    fixed = _fit(_seeded("all_gather"), "parallel_criterion", devices)  # self.all_gather(z, sync_grads=True)
    torch.testing.assert_close(fixed, expected, rtol=0, atol=1e-9)
    as_written_dp = _fit(_seeded("lightly"), "dp", devices)  # the step runs once, on the whole batch
    torch.testing.assert_close(as_written_dp, expected, rtol=0, atol=1e-9)
    as_written = _fit(_seeded("lightly"), "parallel_criterion", devices)  # what the warning is about
    assert (as_written - expected).abs().max() > 1e-4


class _SaysAtSetUp(lightning_mgpu.ParallelCriterionStrategy):
    """A stand-in for the strategy's wiring: what set-up says of distributed_gathers' findings."""

    def _say_setup(self) -> None:
        super()._say_setup()
        found = distributed_gathers(self.lightning_module)
        if found:
            self._warn_once("torch.distributed", distributed_gather_message(self.strategy_name, found))


class _CountsWarnings(L.Callback):
    """How many warnings had been said when each training batch started."""

    def __init__(self, seen: list[Any]) -> None:
        self.seen, self.at_steps = seen, []

    def on_train_batch_start(self, *args: Any) -> None:
        self.at_steps.append(len(self.seen))


def _said_about_torch_distributed(strategy: Any, devices: int, module: Any) -> tuple[list[str], list[int]]:
    """The warnings that name torch.distributed gathering, and how many warnings had been said at each step."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        counts = _CountsWarnings(seen)
        _fit(module, strategy, devices, steps=3, callbacks=[counts])
    said = [i for i, w in enumerate(seen) if "gathers nothing here" in str(w.message)]
    return [str(seen[i].message) for i in said], [n - (said[0] if said else 0) for n in counts.at_steps]


def test_the_finding_is_said_once_at_set_up_through_a_stub_of_the_wiring():
    said, steps = _said_about_torch_distributed(_SaysAtSetUp(), 2, _seeded("lightly"))
    assert len(said) == 1 and "`self.criterion` (NTXentLoss) has gather_distributed=True" in said[0]
    assert said[0].startswith("parallel_criterion: ")
    assert steps[0] >= 1  # said before the first step started


@pytest.mark.parametrize("module", [SimCLRBolts, MoCoLike, lambda: SimCLR("lightly")], ids=["bolts", "moco", "lightly"])
def test_set_up_says_torch_distributed_gathering_once_under_parallel_criterion(module):
    """Needs the wiring: ParallelCriterionStrategy's set-up says distributed_gathers' findings once; dp and one device
    say nothing (the step runs once on the whole batch there)."""
    torch.manual_seed(0)
    said, steps = _said_about_torch_distributed("parallel_criterion", 2, module().double())
    assert len(said) == 1, said
    assert said[0].startswith("parallel_criterion: ") and "self.all_gather(z, sync_grads=True)" in said[0]
    assert steps[0] >= 1  # at set-up, before the first step started
    for strategy, devices in (("dp", 2), ("auto", 1)):
        torch.manual_seed(0)
        assert _said_about_torch_distributed(strategy, devices, module().double())[0] == []


# --- 2. plain Python objects a replicated step changed ---------------------------------------------------------------
class GridEnv:
    """A gym-like environment: a walker on a ring of ``size`` cells, rewarded at cell 0."""

    def __init__(self, size: int = 5) -> None:
        self.size = size
        self.steps = 0
        self.state = 1
        self.done = False

    def step(self, action: int) -> tuple[int, float, bool]:
        self.steps += 1
        self.state = (self.state + (1 if action else -1)) % self.size
        self.done = False  # rebound to an equal value: not a change
        return self.state, float(self.state == 0), self.done


class ReplayBuffer:
    """Lightning's DQN example's buffer: a bounded deque of experiences."""

    def __init__(self, capacity: int) -> None:
        self.memory: collections.deque[Any] = collections.deque(maxlen=capacity)

    def append(self, experience: Any) -> None:
        self.memory.append(experience)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.history: list[int] = []


class Holder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.env = GridEnv()
        self.buffer: collections.deque[Any] = collections.deque()
        self.replay = ReplayBuffer(capacity=2)
        self.outputs: dict[str, list[Any]] = collections.defaultdict(list)
        self.seen: set[int] = set()
        self.features: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.tally = {"steps": 0, "episodes": 0}
        self.flags: dict[str, bool] = {}
        self.head = Head()
        self.lstm = nn.LSTM(2, 2)
        self.table = torch.zeros(3)
        self.config = argparse.Namespace(lr=0.1)
        self.policy = lambda state: 1


def test_a_snapshot_says_what_changed_and_where():
    module = Holder()
    module.replay.append(0)
    held = HeldObjects(module)
    assert held.changes() == []
    module.env.step(1)
    module.buffer.extend([1, 2, 3])
    module.replay.append(1)
    module.outputs["loss"].append(1.0)
    module.seen.add(4)
    module.features["x"] = torch.ones(1)  # tensors in a dict: the shared-entries check says those
    module.counts["a"] = 1
    module.tally["steps"] += 1
    module.tally["episodes"] += 0  # rebound to an equal value: not a change
    module.flags["warned"] = True  # a library's warned-once dict
    module.head.history.append(1)
    module.config.lr = 0.2  # stdlib (argparse): not watched
    module.table += 1  # a tensor: not this check's
    got = [(c.path, c.kind, c.detail, c.collection) for c in held.changes()]
    assert got == [
        ("env", "GridEnv", "its attributes steps, state changed", False),
        ("buffer", "deque", "3 entries more", True),
        ("replay", "ReplayBuffer", "its memory: 1 entry more", False),
        ("outputs['loss']", "list", "1 entry more", True),
        ("seen", "set", "1 entry more", True),
        ("counts", "dict", "1 entry more", True),
        ("tally", "dict", "its entry 'steps' changed", False),
        ("head.history", "list", "1 entry more", True),
    ]
    assert [c.key for c in held.changes()][:4] == ["held:env", "held:buffer", "held:replay", "held:outputs"]


def test_a_full_deque_appended_to_and_a_list_that_shrank_are_changes():
    module = Holder()
    module.replay.append(0)
    module.replay.append(1)  # full: capacity 2
    module.head.history.extend([1, 2])
    held = HeldObjects(module)
    module.replay.append(2)
    module.head.history.pop()
    module.tally = [0]
    counter = HeldObjects(module)
    module.tally[0] += 1  # a counter in a list (a forward hook's count)
    assert [(c.path, c.detail, c.collection) for c in held.changes() + counter.changes()] == [
        ("replay", "its memory: its last entry replaced", False),
        ("head.history", "1 entry fewer", False),
        ("tally", "its last entry replaced", False),
    ]


def test_only_the_users_objects_are_watched():
    paths = [path for path, _ in checks._held(Holder())]
    assert paths == [
        "env", "buffer", "replay", "outputs", "seen", "features", "counts", "tally", "flags", "head.history"
    ]  # fmt: skip
    assert [path for path, _ in checks._held(Ordinary())] == []  # Lightning's, torch's, torchmetrics' own: none


def test_the_message_for_lists_keeps_the_collect_on_the_root_fix():
    change = checks.HeldChange("_losses", "list", "4 entries more", True)
    message = held_objects_message("KeepsOutputs", [change], 2, "validation_step")
    assert message.startswith("`KeepsOutputs._losses` grew during a step that ran on 2 replicas (`_losses` (list): ")
    assert "it holds one entry per device per step (each of its shard)" in message
    assert "Collect step outputs in `on_validation_batch_end(outputs, ...)`" in message
    assert "torchmetrics" in message


def test_the_message_for_an_environment_says_to_play_it_once_per_step_on_the_root():
    module = Holder()
    held = HeldObjects(module)
    module.env.step(0)
    module.buffer.append(1)
    message = held_objects_message("DQN", held.changes(), 2, "training_step")
    assert message.startswith(
        "`DQN.env` changed and `DQN.buffer` grew during a step that ran on 2 replicas (`env` (GridEnv): its attributes "
        "steps, state changed; `buffer` (deque): 1 entry more): each replica changed them with its own shard"
    )
    assert "they changed 2 times in a step where one device changes them once" in message
    assert "move that call to `on_train_batch_start`" in message and "IterableDataset" in message
    validation = held_objects_message("DQN", held.changes(), 2, "validation_step")
    assert "`on_validation_batch_start`" in validation and "DQN example" not in validation
    under_dp = held_objects_message("Net", held.changes()[:1], 2, "forward")
    assert "`forward` ran once per device" in under_dp and "Do that in the step" in under_dp


def test_a_dicts_lists_are_named_once_by_the_first():
    module = Holder()
    held = HeldObjects(module)
    module.outputs["loss"].append(1.0)
    module.outputs["size"].append(2)
    message = held_objects_message("KeepsOutputs", held.changes(), 2, "validation_step")
    assert message.startswith(
        "`KeepsOutputs.outputs['loss']` grew during a step that ran on 2 replicas (`outputs['loss']` (list): 1 entry "
        "more; `outputs['size']` (list): 1 entry more): they hold one entry per device per step"
    )


# End to end: a DQN-like module whose step plays the environment and fills the buffer.
class DQNLike(L.LightningModule):
    """``play="step"``: plays one environment step in ``training_step`` (as Lightning's DQN example does): once per
    replica; ``"batch_start"``: the fix, in ``on_train_batch_start``, once per step on the root."""

    def __init__(self, play: str = "step") -> None:
        super().__init__()
        self.play = play
        self.net = nn.Linear(5, 2)
        self.env = GridEnv()
        self.buffer: collections.deque[tuple[int, float]] = collections.deque(maxlen=100)

    def play_step(self) -> None:
        with torch.no_grad():
            state = F.one_hot(torch.tensor(self.env.state), 5).to(self.net.weight)
            action = int(self.net(state).argmax())
        _, reward, _ = self.env.step(action)
        self.buffer.append((action, reward))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.play == "batch_start":
            self.play_step()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.play == "step":
            self.play_step()
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_dqn(play: str, strategy: str, devices: int) -> tuple[DQNLike, list[str]]:
    torch.manual_seed(0)
    module = DQNLike(play).double()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(28, 5, generator=g, dtype=torch.float64), torch.randn(28, 2, generator=g).double())
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(data, batch_size=7))
    return module, [str(w.message) for w in seen if "during a step that ran on" in str(w.message)]


@pytest.mark.parametrize("devices", [2, 3])
def test_playing_the_environment_in_the_step_plays_it_once_per_replica(devices):
    """What the warning is about (true before and after the wiring): 4 steps play 4 times on one device, 4 x devices
    times under parallel_criterion."""
    module, _ = _fit_dqn("step", "parallel_criterion", devices)
    assert module.env.steps == 4 * devices and len(module.buffer) == 4 * devices


@pytest.mark.parametrize("devices", [2, 3])
def test_the_fix_plays_once_per_step_on_the_root_and_equals_one_device(devices):
    expected, _ = _fit_dqn("batch_start", "auto", 1)
    fixed, said = _fit_dqn("batch_start", "parallel_criterion", devices)
    assert said == []
    assert (fixed.env.steps, fixed.env.state, list(fixed.buffer)) == (4, expected.env.state, list(expected.buffer))
    torch.testing.assert_close(
        torch.cat([p.flatten() for p in fixed.parameters()]),
        torch.cat([p.flatten() for p in expected.parameters()]),
        rtol=0,
        atol=1e-9,
    )


def test_a_dqn_stepping_its_environment_in_the_step_is_said_once_naming_env_and_buffer():
    """Needs the wiring: HeldObjects around the first replicated steps replaces the list-length check."""
    _, said = _fit_dqn("step", "parallel_criterion", 2)
    assert len(said) == 1, said
    assert said[0].startswith("`DQNLike.env` changed and `DQNLike.buffer` grew during a step that ran on 2 replicas")
    assert "`on_train_batch_start`" in said[0]


# --- torchmetrics.functional in a step ------------------------------------------------------------------------------
class FunctionalF1(L.LightningModule):
    """Macro F1 from ``torchmetrics.functional`` logged in the step (each device's value is its shard's), beside the
    metric object's value (the fix the notice names)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Linear(8, 3)
        self.f1 = torchmetrics.classification.MulticlassF1Score(3, average="macro")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        logits = self.net(batch[0])
        self.log("f1_functional", multiclass_f1_score(logits, batch[1], 3, average="macro"))
        self.log("f1_object", self.f1(logits, batch[1]))


@pytest.mark.parametrize("devices", [2, 3])
def test_a_functional_metric_in_the_step_is_said_at_set_up_and_its_object_equals_one_device(devices):
    x = torch.randn(46, 8, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()), batch_size=10)
    logged, said = {}, {}
    for strategy, n in (("auto", 1), ("parallel_criterion", devices), ("dp", devices)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer = L.Trainer(accelerator="cpu", devices=n, strategy=strategy, precision="64-true", logger=False)
            logged[strategy] = trainer.validate(FunctionalF1(), data, verbose=False)[0]
        said[strategy] = [str(w.message) for w in seen if "torchmetrics.functional" in str(w.message)]
    assert len(said["parallel_criterion"]) == 1 and said["auto"] == said["dp"] == []
    message = said["parallel_criterion"][0]
    assert "multiclass_f1_score through FunctionalF1.validation_step" in message
    assert "torchmetrics.classification.MulticlassF1Score(...)" in message  # the function's own class
    assert logged["parallel_criterion"]["f1_object"] == pytest.approx(logged["auto"]["f1_object"], abs=1e-12)
    assert logged["dp"]["f1_functional"] == pytest.approx(logged["auto"]["f1_functional"], abs=1e-12)
    assert abs(logged["parallel_criterion"]["f1_functional"] - logged["auto"]["f1_functional"]) > 1e-3  # the hazard


@pytest.mark.parametrize("strategy", ["parallel_criterion"])
def test_a_batch_smaller_than_the_device_count_is_said_once(strategy, caplog):
    """Lightning's BoringModel loads batches of 1 sample: on 3 devices one replica runs; said once, as information."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = L.Trainer(accelerator="cpu", devices=3, strategy=strategy, max_steps=3, logger=False)
    with caplog.at_level("INFO"):
        trainer.fit(BoringModel(), DataLoader(torch.randn(8, 32), batch_size=1), [])
    said = [r.getMessage() for r in caplog.records if "ran on 1 of the 3 devices" in r.getMessage()]
    assert said == [
        f"{strategy}: a batch of 1 sample(s) ran on 1 of the 3 devices (at least one sample per device); "
        "the others had nothing to do."
    ]


class _Centered(nn.Module):
    """A layer that keeps a running center of its outputs, updated in ``forward`` (DINO's center), and a counter of
    its calls (alike on every replica)."""

    def __init__(self, from_batch: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.from_batch = from_batch
        self.register_buffer("center", torch.zeros(3))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.norm(self.lin(x))
        if self.training:
            with torch.no_grad():
                self.calls += 1
                if self.from_batch:
                    self.center.mul_(0.9).add_(0.1 * out.mean(0))
        return out - self.center


class _CenteredModule(L.LightningModule):
    def __init__(self, from_batch: bool) -> None:
        super().__init__()
        self.net = _Centered(from_batch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
@pytest.mark.parametrize("from_batch", [True, False])
def test_a_buffer_updated_from_each_shard_in_forward_is_said_once(strategy: str, from_batch: bool, tmp_path: Any):
    """An average of the outputs updated in ``forward`` differs per replica (the root keeps replica 0's): said once,
    naming the buffer; a counter, alike on every replica, and BatchNorm's statistics (synchronised) are not."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(14, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (14,), generator=g)
    module = _CenteredModule(from_batch).double()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2, default_root_dir=tmp_path)
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=7))
    said = [str(w.message) for w in seen if "buffer(s)" in str(w.message)]
    if from_batch:
        (message,) = said
        assert "`net.center`" in message and "calls" not in message and "norm" not in message
        assert ("all_gather" in message) == (strategy == "parallel_criterion")
    else:
        assert said == []
