"""Whole-batch losses in one process: ``all_gather``, ``reduce``, ``broadcast``, ``barrier`` and
``reduce_boolean_decision`` act across the replicas of a ``parallel_criterion`` step.

The CLIP-style module is written for DDP (``self.all_gather(z, sync_grads=True)``, flattened when
``world_size > 1``) and runs unchanged under ``parallel_criterion`` (equal to one device to 1e-10 in float64), ``dp``
(the step runs once, on the root: collectives are identities) and DDP (2 processes, under a timeout that kills the
process group). Faults (a replica that skips, reorders or raises a collective) fail fast with errors naming it.
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu
from benchmarks.compare.process_group import run_in_process_group
from lightning_mgpu.parallel.collectives import CollectiveShapeError
from lightning_mgpu.parallel.replica_group import RendezvousError

REPO = Path(__file__).resolve().parents[2]
EPOCHS, BATCH, N = 3, 7, 21  # 3 epochs of 3 batches of 7: uneven shards (4+3, 3+2+2)


def clip_data(n: int = N, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(n, 5, generator=g, dtype=torch.float64)
    )


def make_clip(ns: Any = L, variant: str = "matrix") -> Any:
    """``variant="matrix"``: every device computes the whole-batch loss from the gathered embeddings; ``"rows"``: each
    device its own rows (``lightning_mgpu.local_rows``), averaged over rows; ``"std"``: a loss normalised by the
    gathered batch's standard deviation; ``"own_rows_nosync"``: each device's own image rows against every text,
    gathered without ``sync_grads`` (on one device ``all_gather`` is an identity: gradients flow through it)."""

    class CLIP(ns.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.image = nn.Linear(6, 4)
            self.text = nn.Linear(5, 4)
            self.scale = nn.Parameter(torch.tensor(2.0))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, t = batch
            zi, zt = F.normalize(self.image(x), dim=-1), F.normalize(self.text(t), dim=-1)
            if variant == "own_rows_nosync":
                all_t = self.all_gather(zt)
                all_t = all_t.flatten(0, 1) if self.trainer.world_size > 1 else all_t
                labels = torch.arange(len(all_t), device=zi.device)[lightning_mgpu.local_rows(len(zi))]
                loss = F.cross_entropy(self.scale * zi @ all_t.T, labels)
                self.log("loss", loss, on_step=True, on_epoch=True)
                return loss
            all_i = self.all_gather(zi, sync_grads=True)
            all_t = self.all_gather(zt, sync_grads=True)
            if self.trainer.world_size > 1:  # DDP stacks a leading world dimension
                all_i, all_t = all_i.flatten(0, 1), all_t.flatten(0, 1)
            if variant == "std":
                scores = (all_i * all_t).sum(-1)
                loss = ((scores - scores.mean()) / scores.std()).pow(2).mean() + scores.mean()
            else:
                logits = self.scale * all_i @ all_t.T
                labels = torch.arange(len(all_i), device=logits.device)
                rows = lightning_mgpu.local_rows(len(zi)) if variant == "rows" else slice(None)
                loss = (F.cross_entropy(logits[rows], labels[rows]) + F.cross_entropy(logits.T[rows], labels[rows])) / 2
            self.log("loss", loss, on_step=True, on_epoch=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.3)

    torch.manual_seed(0)
    return CLIP().to(torch.float64)


def fit(module: Any, strategy: Any, devices: int, ns: Any = L, root: Path | None = None) -> tuple[Any, Any]:
    trainer = ns.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=EPOCHS, logger=False,
        default_root_dir=str(root) if root else None,
    )  # fmt: skip
    trainer.fit(module, DataLoader(clip_data(), batch_size=BATCH))
    return trainer, torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.parametrize("variant", ["matrix", "rows", "std", "own_rows_nosync"])
@pytest.mark.parametrize("devices", [2, 3])
def test_whole_batch_losses_equal_one_device(variant, devices, tmp_path, caplog, recwarn):
    """Equal to one device; the set-up line says the replicas run in threads because the code calls all_gather (no
    override warning repeats it)."""
    expected_trainer, expected = fit(make_clip(variant=variant), "auto", 1, root=tmp_path)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer, got = fit(make_clip(variant=variant), "parallel_criterion", devices, root=tmp_path)
    said = [r.getMessage() for r in caplog.records if "calls all_gather" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        "replicas run in threads, one per device (CLIP calls all_gather in the module's code)."
    )
    assert not [w for w in recwarn if "calls all_gather" in str(w.message)]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    for name in ("loss_step", "loss_epoch"):
        assert float(trainer.callback_metrics[name]) == pytest.approx(
            float(expected_trainer.callback_metrics[name]), abs=1e-10
        )


def test_the_shards_alone_would_differ(tmp_path):
    """The same module with the gather switched off (collectives=False: a replica calling all_gather then fails, so
    gather nothing) would train on each shard's own matrix: the check above can fail."""
    _, expected = fit(make_clip(), "auto", 1, root=tmp_path)
    module = make_clip()
    module.all_gather = lambda data, group=None, sync_grads=False: data  # what an identity all_gather would do
    _, got = fit(module, lightning_mgpu.ParallelCriterionStrategy(collectives=True), 2, root=tmp_path)
    assert (got - expected).abs().max() > 1e-3


def test_under_pytorch_lightning(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    _, expected = fit(make_clip(pl), "auto", 1, ns=pl, root=tmp_path)
    _, got = fit(make_clip(pl), "parallel_criterion", 3, ns=pl, root=tmp_path)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_dp_runs_the_module_unchanged_with_identities(tmp_path):
    """Under dp the step runs once, on the root, with the whole batch: the collectives are identities there."""
    _, expected = fit(make_clip(), "auto", 1, root=tmp_path)
    _, got = fit(make_clip(), "dp", 2, root=tmp_path)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


DDP_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import lightning.pytorch as L
    import torch
    from test_collectives import fit, make_clip
    trainer, params = fit(make_clip(variant="rows"), "ddp", 2)  # local_rows under DDP: this rank's rows
    if trainer.is_global_zero:
        print("DDP_OK", float(trainer.callback_metrics["loss_epoch"]))
    torch.distributed.destroy_process_group()  # else gloo's threads can abort the interpreter's exit
    """
)


def test_ddp_runs_the_same_module(tmp_path):
    script = tmp_path / "ddp_clip.py"
    script.write_text(DDP_SCRIPT.format(tests=str(Path(__file__).parent)))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    run = run_in_process_group([sys.executable, str(script)], 240, cwd=tmp_path, env=env, log=tmp_path / "ddp.log")
    assert not run.timed_out and run.returncode == 0, run.describe()
    assert "DDP_OK" in run.output, run.describe()


# --- the collectives' semantics, and faults ---------------------------------------------------------------------------
class Probe(L.LightningModule):
    """Runs ``self.check(self, batch)`` in its step, then a plain per-sample loss."""

    def __init__(self, check: Any) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.check = check

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        self.check(self, x)
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run_probe(check: Any, devices: int = 3, batch: int = 7) -> None:
    data = DataLoader(TensorDataset(torch.arange(batch * 3, dtype=torch.float32).reshape(batch, 3)), batch_size=batch)
    strategy = lightning_mgpu.ParallelCriterionStrategy(collectives=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False
    )
    trainer.fit(Probe(check), data)


def test_reduce_broadcast_barrier_and_decisions_act_across_replicas():
    seen: dict[str, list[Any]] = {k: [] for k in ("sum", "mean", "max", "bcast", "all", "any", "gather", "rows")}

    def check(module: Any, x: torch.Tensor) -> None:
        strategy = module.trainer.strategy
        n = torch.tensor(float(len(x)))
        seen["sum"].append(float(strategy.reduce(n, reduce_op="sum")))
        seen["mean"].append(float(strategy.reduce(n, reduce_op="mean")))
        seen["max"].append(float(strategy.reduce(n, reduce_op="max")))
        seen["bcast"].append(strategy.broadcast({"first": x[0, 0].item()}, src=1)["first"])
        strategy.barrier()
        seen["all"].append(strategy.reduce_boolean_decision(len(x) == 3, all=True))
        seen["any"].append(strategy.reduce_boolean_decision(len(x) == 3, all=False))
        gathered = module.all_gather({"x": x, "n": n})  # nested: as Lightning's all_gather walks collections
        seen["gather"].append((gathered["x"][:, 0].tolist(), gathered["n"].tolist()))
        seen["rows"].append(lightning_mgpu.local_rows(len(x)))

    run_probe(check)
    assert seen["sum"] == [7.0] * 3 and seen["mean"] == pytest.approx([7 / 3] * 3) and seen["max"] == [3.0] * 3
    assert seen["bcast"] == [9.0] * 3  # replica 1's first sample is sample 3 (shards 3, 2, 2)
    assert seen["all"] == [False] * 3 and seen["any"] == [True] * 3
    assert seen["gather"] == [([0.0, 3.0, 6.0, 9.0, 12.0, 15.0, 18.0], [3.0, 2.0, 2.0])] * 3
    assert sorted((s.start, s.stop) for s in seen["rows"]) == [(0, 3), (3, 5), (5, 7)]


def test_outside_a_step_the_collectives_are_identities():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="parallel_criterion", logger=False)
    strategy = trainer.strategy
    t = torch.ones(2)
    assert strategy.all_gather(t) is t and strategy.reduce(t) is t and strategy.broadcast(5) == 5
    assert strategy.reduce_boolean_decision(False) is False


def _skip(module: Any, x: torch.Tensor) -> None:
    if len(x) == 3:  # replica 0 only
        module.all_gather(x)


def _reorder(module: Any, x: torch.Tensor) -> None:
    strategy = module.trainer.strategy
    if len(x) == 3:
        strategy.barrier()
    else:
        strategy.reduce(torch.ones(()))


def _raise(module: Any, x: torch.Tensor) -> None:
    if len(x) == 2 and x[0, 0] == 9:  # replica 1
        raise KeyError("replica 1 fails")
    module.all_gather(x)


@pytest.mark.parametrize(
    ("check", "error", "match"),
    [
        (_skip, RendezvousError, r"all_gather \(collective 1 of this step\).*finished without reaching it"),
        (_reorder, RendezvousError, r"different sync points.*barrier.*reduce\(mean\)"),
        (_raise, KeyError, "replica 1 fails"),
    ],
)
def test_faults_fail_fast_with_the_collective_named(check, error, match):
    with pytest.raises(error, match=match):
        run_probe(check)


def test_sequential_replicas_that_call_a_collective_say_how_to_fix_it():
    strategy = lightning_mgpu.ParallelCriterionStrategy(collectives=False)
    data = DataLoader(TensorDataset(torch.ones(4, 3)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False)
    with pytest.raises(RendezvousError, match=r"ParallelCriterionStrategy\(collectives=True\)"):
        trainer.fit(Probe(lambda module, x: module.all_gather(x)), data)


def test_compiled_replicas_that_must_meet_get_a_clear_error():
    module = Probe(lambda m, x: m.all_gather(x))
    module.net.compile()
    data = DataLoader(TensorDataset(torch.ones(4, 3)), batch_size=4)
    strategy = lightning_mgpu.ParallelCriterionStrategy(collectives=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False)
    with pytest.raises(Exception, match=r"compiled with torch\.compile.*strategy='dp'"):
        trainer.fit(module, data)
    # The alternative the message names: under dp the step runs once, on the whole batch, which all_gather returns.
    gathered = []
    module = Probe(lambda m, x: gathered.append(m.all_gather(x)))
    module.net.compile()
    L.Trainer(accelerator="cpu", devices=2, strategy="dp", max_steps=1, logger=False).fit(module, data)
    assert len(gathered) == 1 and torch.equal(gathered[0], torch.ones(4, 3))


class GatheredByTorchDistributed(L.LightningModule):
    """Written for torch.distributed (lightly, open_clip): it gathers only where a process group exists, so under a
    single-process strategy each device's loss is over its own shard."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        z = F.normalize(self.net(x), dim=-1)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered = [torch.zeros_like(z) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(gathered, z)
            z = torch.cat(gathered)
        return F.cross_entropy(z @ z.T, torch.arange(len(z)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_torch_distributed_collectives_do_not_count_as_the_strategys_and_the_warning_names_the_fix():
    """The source mentions all_gather, but torch.distributed's: each device's loss is over its own shard. One warning,
    at set-up, names the torch.distributed call and the fixes (the step's own all_gather with sync_grads=True, or
    dp); the coupling it causes is not said again, and nothing calls the result exact."""
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="parallel_criterion", max_steps=2, logger=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(GatheredByTorchDistributed().double(), DataLoader(clip_data(14), batch_size=7))
    said = [str(w.message) for w in seen if str(w.message).startswith("parallel_criterion:")]
    assert len(said) == 1, said
    assert "torch.distributed.all_gather" in said[0] and "gathers nothing here" in said[0], said[0]
    assert "self.all_gather(z, sync_grads=True)" in said[0] and "strategy='dp'" in said[0], said[0]
    assert "exact" not in said[0]
    assert trainer.strategy._collectives_reason(trainer.lightning_module) is None


class QueuesGatheredKeys(L.LightningModule):
    """MoCo-style: the step returns the whole batch's keys (``all_gather``), ``on_train_batch_end`` enqueues them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 4)
        self.queue: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, _ = batch
        keys = self.net(x)
        return {"loss": keys.pow(2).mean(), "keys": self.all_gather(keys).detach()}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.queue.append(outputs["keys"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("devices", [2, 3])
def test_a_gathered_tensor_the_step_returns_comes_back_once_as_on_one_device(devices):
    queues = []
    for strategy, n in (("auto", 1), ("parallel_criterion", devices)):
        torch.manual_seed(0)
        module = QueuesGatheredKeys().double()
        trainer = L.Trainer(accelerator="cpu", devices=n, strategy=strategy, max_steps=3, logger=False)
        trainer.fit(module, DataLoader(clip_data(), batch_size=BATCH))
        queues.append(torch.cat(module.queue))
    assert queues[1].shape == queues[0].shape == (3 * BATCH, 4)  # not devices x the batch
    torch.testing.assert_close(queues[1], queues[0], rtol=0, atol=1e-12)


# --- shapes the collectives cannot combine ----------------------------------------------------------------------------
def _gathers_a_square_per_shard(module: Any, x: torch.Tensor) -> None:
    module.all_gather(x.new_zeros(len(x), len(x)))  # a non-batch dim taken from the shard


def _gathers_a_squeezed_sum(module: Any, x: torch.Tensor) -> None:
    module.all_gather(x.sum(1).squeeze())  # 0-dim on a shard of one sample


@pytest.mark.parametrize(
    ("check", "devices", "batch", "shapes", "differs", "hint"),
    [
        (_gathers_a_square_per_shard, 2, 7, "replica 0: (4, 4), replica 1: (3, 3)", 1, "pad to a size"),
        (_gathers_a_squeezed_sum, 3, 5, "replica 0: (2,), replica 1: (2,), replica 2: ()", 2, "`.squeeze()`"),
    ],
    ids=["non_batch_dim", "0_dim_vs_1_dim"],
)
def test_a_step_that_gathers_shapes_that_differ_beyond_dim_0_names_each_shape_and_the_replica(
    check, devices, batch, shapes, differs, hint
):
    with pytest.raises(CollectiveShapeError) as raised:
        run_probe(check, devices=devices, batch=batch)
    message = str(raised.value)
    assert message.startswith("all_gather (collective 1 of this step): the replicas passed tensors whose shapes")
    assert f"({shapes}); replica {differs} differs from the others" in message and hint in message
    assert raised.value.replica_index == differs
    assert f"Caught CollectiveShapeError in replica {differs}" in "\n".join(raised.value.__notes__)


class CrossCorrelation(L.LightningModule):
    """Barlow Twins' loss: every device computes the whole batch's cross-correlation from ``all_gather`` and reduces
    it by ``.sum()`` (or ``.mean()``): the same value on every device, which one device computes once."""

    def __init__(self, reduce: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reduce = reduce
        self.net = nn.Linear(4, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        z = self.all_gather(self.net(batch[0]), sync_grads=True)
        centered = z - z.mean(0)
        c = centered.T @ centered / len(z)
        off = (c - torch.eye(3, dtype=c.dtype)).pow(2)
        loss = off.sum() if self.reduce == "sum" else off.mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_a_whole_batch_loss_every_device_computes_from_all_gather_counts_once(reduce, devices):
    """A sum over gathered rows was added once per device: the loss and its gradient N times one device's."""
    data = TensorDataset(torch.randn(22, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    runs = {}
    for strategy, n in (("auto", 1), ("parallel_criterion", devices)):
        module = CrossCorrelation(reduce).double()
        trainer = L.Trainer(accelerator="cpu", devices=n, strategy=strategy, max_epochs=2, logger=False)
        trainer.fit(module, DataLoader(data, batch_size=7))
        runs[strategy] = (module.net.weight.detach().clone(), float(trainer.callback_metrics["train_loss"]))
    torch.testing.assert_close(runs["parallel_criterion"][0], runs["auto"][0], rtol=0, atol=1e-12)
    assert runs["parallel_criterion"][1] == pytest.approx(runs["auto"][1], rel=0, abs=1e-12)
