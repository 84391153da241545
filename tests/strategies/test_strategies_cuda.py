"""CUDA paths of the strategies (run on a lent GPU; skipped without CUDA).

With one GPU, "two devices" are two replicas of cuda:0 (virtual devices); with two or more GPUs the real
broadcast/reduce path of torch.nn.parallel.replicate runs too.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from strategy_models import Classifier, clone, flat_params, loader, seeded, trainer

import lightning_mgpu

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _devices(n: int) -> list[torch.device]:
    count = torch.cuda.device_count()
    return [torch.device("cuda", i % count) for i in range(n)]


def _gpu_trainer(strategy: Any, **kwargs: Any):
    return trainer(strategy, 1, accelerator="gpu", **kwargs)


@pytest.mark.parametrize("cls", [lightning_mgpu.ParallelCriterionStrategy, lightning_mgpu.DataParallelStrategy])
def test_float32_training_on_gpu_replicas_equals_one_gpu(cls):
    torch.backends.cuda.matmul.allow_tf32 = False
    base = seeded(Classifier, dtype=torch.float32)
    single, multi = clone(base), clone(base)
    _gpu_trainer("auto", max_steps=4, limit_val_batches=0).fit(single, loader(10, dtype=torch.float32))
    strategy = cls(parallel_devices=_devices(3), execution_mode="threads")
    _gpu_trainer(strategy, max_steps=4, limit_val_batches=0).fit(multi, loader(10, dtype=torch.float32))
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-5)


class RecordsAutocast(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, torch.dtype, torch.device]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        self.records.append((threading.current_thread().name, logits.dtype, x.device))
        return torch.nn.functional.cross_entropy(logits.float(), y)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_mixed_precision_dtype_reaches_gpu_worker_threads(precision, dtype):
    module = seeded(RecordsAutocast, dtype=torch.float32)
    strategy = lightning_mgpu.ParallelCriterionStrategy(parallel_devices=_devices(2), execution_mode="threads")
    t = _gpu_trainer(strategy, max_steps=3, limit_val_batches=0, precision=precision)
    t.fit(module, loader(8, dtype=torch.float32))
    assert len(module.records) == 6
    assert {r[1] for r in module.records} == {dtype}
    threads = {r[0] for r in module.records}
    assert threading.main_thread().name in threads and len(threads) >= 2  # replica 1 ran in a worker thread
    assert torch.isfinite(flat_params(module)).all()
