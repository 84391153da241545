"""Clear errors on configurations that cannot work; registration with Lightning."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from strategy_models import Classifier, loader, seeded, trainer
from torch.utils.data import DataLoader

import lightning_mgpu


def test_registered_names_and_idempotent_registration():
    for name, cls in [
        ("parallel_criterion", lightning_mgpu.ParallelCriterionStrategy),
        ("dp", lightning_mgpu.DataParallelStrategy),
        ("data_parallel", lightning_mgpu.DataParallelStrategy),
    ]:
        assert StrategyRegistry[name]["strategy"] is cls
    lightning_mgpu.register_strategies()
    importlib.reload(importlib.import_module("lightning_mgpu.strategies"))
    lightning_mgpu.register_strategies()
    assert "parallel_criterion" in StrategyRegistry


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_trainer_is_single_process_with_n_devices(strategy):
    t = trainer(strategy, 4)
    assert isinstance(t.strategy, lightning_mgpu.strategies.single_process.SingleProcessParallel)
    assert t.world_size == 1 and t.num_devices == 4 and t.global_rank == 0
    assert t.strategy.parallel_devices == [torch.device("cpu")] * 4
    assert t.strategy.root_device == torch.device("cpu")
    assert not t._accelerator_connector.is_distributed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised on a machine without a GPU")
def test_gpu_accelerator_without_gpu_is_refused():
    with pytest.raises(MisconfigurationException, match="No supported gpu backend found"):
        L.Trainer(strategy="parallel_criterion", accelerator="gpu", devices=2)


class RecordsShardSizes(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.shards: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.shards.append(batch[0].shape[0])
        return super().training_step(batch, batch_idx)


def test_batch_smaller_than_device_count_uses_fewer_replicas():
    module = seeded(RecordsShardSizes)
    trainer("parallel_criterion", 4, max_steps=1).fit(module, loader(3))
    assert module.shards == [1, 1, 1]
    module = seeded(RecordsShardSizes)
    trainer("parallel_criterion", 4, max_steps=1).fit(module, loader(10))
    assert module.shards == [3, 3, 2, 2]


class DictBatches(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return super().training_step((batch["x"], batch["y"]), batch_idx)


def _bad_collate(items: list) -> dict[str, torch.Tensor]:
    x = torch.stack([i[0] for i in items])
    y = torch.stack([i[1] for i in items])
    return {"x": x, "y": y, "mask": torch.ones(len(items) + 1)}


@pytest.mark.parametrize("strategy", ["parallel_criterion"])
def test_unsplittable_batch_names_the_key_path(strategy):
    data = loader(10).dataset
    with pytest.raises(ValueError, match=r"batch\['x'\] has size 10 but batch\['mask'\] has size 11"):
        trainer(strategy, 2, max_steps=1).fit(
            seeded(DictBatches), DataLoader(data, batch_size=10, collate_fn=_bad_collate)
        )


def test_dp_output_device_and_parallel_modules():
    strategy = lightning_mgpu.DataParallelStrategy(output_device="cpu", parallel_modules=["net"])
    t = trainer(strategy, 2, max_steps=2)
    t.fit(seeded(Classifier), loader(10))
    assert strategy.output_device == torch.device("cpu")
    with pytest.raises(ValueError, match="not a submodule"):
        t2 = trainer(lightning_mgpu.DataParallelStrategy(parallel_modules=["nope"]), 2, max_steps=1)
        t2.fit(seeded(Classifier), loader(10))
    for nested in (["", "net"], ["net", "net.0"], ["net", "net"]):
        with pytest.raises(ValueError, match=r"runs inside .* Name only the outermost module"):
            lightning_mgpu.DataParallelStrategy(parallel_modules=nested)
    lightning_mgpu.DataParallelStrategy(parallel_modules=["net.0", "net.2"])  # siblings are fine


class SkipsABatch(Classifier):
    """Returns None (skips) on batch 1 before calling the model: no forward is expected on that step."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if batch_idx == 1 else super().training_step(batch, batch_idx)


def test_dp_says_nothing_about_the_replicated_forward_when_a_step_skips_its_batch():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp = seeded(SkipsABatch)
        trainer("dp", 2, max_epochs=1, enable_progress_bar=True).fit(dp, loader(10))
    assert not [w for w in caught if "ran on one device" in str(w.message)]
    one = seeded(SkipsABatch)
    trainer("auto", 1, max_epochs=1).fit(one, loader(10))
    torch.testing.assert_close(list(dp.parameters()), list(one.parameters()), rtol=0, atol=1e-10)


def test_invalid_options_are_refused():
    with pytest.raises(ValueError, match="loss_reduction must be one of 'auto', 'samples'"):
        lightning_mgpu.ParallelCriterionStrategy(loss_reduction="median")
    with pytest.raises(TypeError, match=r"parallel_modules must be a list of submodule names.*\['net'\]"):
        lightning_mgpu.DataParallelStrategy(parallel_modules="net")
    with pytest.raises(ValueError, match="execution_mode must be one of"):
        lightning_mgpu.DataParallelStrategy(execution_mode="processes")


class MismatchedForwardInputs(Classifier):
    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(x) if scale is None else self.net(x) * scale.mean()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x, scale=torch.ones(len(y) + 1, dtype=x.dtype))
        return torch.nn.functional.cross_entropy(logits, y)


def test_dp_refuses_forward_inputs_with_different_batch_sizes():
    with pytest.raises(ValueError, match=r"args\[0\] has size 10 but kwargs\['scale'\] has size 11"):
        trainer("dp", 2, max_steps=1).fit(seeded(MismatchedForwardInputs), loader(10))


class CustomBatch:
    """A batch class of the user's own, holding its tensors as attributes: nothing the strategies can split."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def to(self, device: Any) -> CustomBatch:
        return CustomBatch(self.x.to(device), self.y.to(device))


class OnCustomBatches(Classifier):
    def forward(self, batch: CustomBatch) -> torch.Tensor:
        return self.net(batch.x)

    def training_step(self, batch: CustomBatch, batch_idx: int) -> Any:
        return torch.nn.functional.cross_entropy(self(batch), batch.y)


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_a_batch_with_nothing_to_split_says_once_that_nothing_runs_in_parallel(strategy):
    data = [CustomBatch(x, y) for x, y in loader(4, n=12)]
    batches = DataLoader(data, batch_size=None, collate_fn=lambda b: b)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        multi = seeded(OnCustomBatches)
        trainer(strategy, 2, max_epochs=1, limit_val_batches=0).fit(multi, batches)
    said = [str(w.message) for w in caught if "nothing runs in parallel" in str(w.message)]
    assert len(said) == 1, said
    assert ("the batch (CustomBatch)" if strategy == "parallel_criterion" else "OnCustomBatches.forward") in said[0]
    single = seeded(OnCustomBatches)
    trainer("auto", 1, max_epochs=1, limit_val_batches=0).fit(single, batches)
    torch.testing.assert_close(list(multi.parameters()), list(single.parameters()), rtol=0, atol=1e-10)


class FrequencyScaledEmbedding(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(5, 2, scale_grad_by_freq=True)


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_a_layer_whose_result_depends_on_the_split_is_named_at_setup(strategy):
    with pytest.warns(UserWarning, match=rf"{strategy}: embedding \(scale_grad_by_freq=True\) scales its gradient"):
        trainer(strategy, 2, max_steps=1).fit(seeded(FrequencyScaledEmbedding), loader(4))


def test_dp_names_only_the_layers_of_its_parallel_modules():
    strategy = lightning_mgpu.DataParallelStrategy(parallel_modules=["net"])  # the embedding runs on the root only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy, 2, max_steps=1).fit(seeded(FrequencyScaledEmbedding), loader(4))
    assert not [w for w in caught if "scale_grad_by_freq" in str(w.message)]
