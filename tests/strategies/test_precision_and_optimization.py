"""Mixed precision reaches the replicas; accumulation and clipping behave as on one device; manual optimization."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from strategy_models import Classifier, clone, flat_params, loader, seeded, trainer

import lightning_mgpu


class RecordsAutocast(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, bool, torch.dtype, torch.dtype]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x.float())
        self.records.append(
            (
                threading.current_thread().name,
                torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"),
                logits.dtype,
            )
        )
        return torch.nn.functional.cross_entropy(logits.float(), y)


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_bf16_autocast_reaches_every_worker_thread(strategy):
    module = seeded(RecordsAutocast, dtype=torch.float32)
    if strategy == "dp":
        module.forward_records = []
        original = module.net.forward

        def recording_forward(x):
            out = original(x)
            module.forward_records.append(
                (
                    threading.current_thread().name,
                    torch.is_autocast_enabled("cpu"),
                    torch.get_autocast_dtype("cpu"),
                    out.dtype,
                )
            )
            return out

        module.net.forward = recording_forward
        chosen = lightning_mgpu.DataParallelStrategy(execution_mode="threads")
    else:
        chosen = lightning_mgpu.ParallelCriterionStrategy(execution_mode="threads")
    trainer(chosen, 3, max_steps=2, precision="bf16-mixed").fit(module, loader(9, dtype=torch.float32))
    records = module.forward_records if strategy == "dp" else module.records
    assert len(records) == 6
    assert {r[0] for r in records} - {threading.main_thread().name}, "replicas 1.. must run in worker threads"
    assert all(r[1:] == (True, torch.bfloat16, torch.bfloat16) for r in records), records


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_gradient_accumulation_and_clipping_equal_single_device(strategy):
    base = seeded(Classifier, lr=2.0)  # a large lr so clipping is active
    kwargs = dict(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
    single, multi = clone(base), clone(base)
    trainer("auto", 1, **kwargs).fit(single, loader(7))
    trainer(strategy, 3, **kwargs).fit(multi, loader(7))
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)


class ManualOptimization(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train_loss", loss)


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_manual_optimization_equals_one_device(strategy):
    base = seeded(ManualOptimization)
    single, multi = clone(base), clone(base)
    trainer("auto", 1, max_steps=3).fit(single, loader(10))
    t = trainer(strategy, 3, max_steps=3)
    t.fit(multi, loader(10))
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)
    assert float(t.callback_metrics["train_loss"]) > 0
