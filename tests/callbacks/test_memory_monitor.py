"""DeviceMemoryMonitor: real figures on the CPU (and on CUDA when present), logging cadence, virtual devices."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu
from lightning_mgpu.callbacks import DeviceMemoryMonitor, imbalance
from lightning_mgpu.callbacks.device_memory import reset_peak_rss

BIG_MIB = 200


class HoldsBigTensor(L.LightningModule):
    """A tiny classifier whose training step holds a ``BIG_MIB`` MiB tensor on the chosen batches."""

    def __init__(self, big_at: tuple[int, ...] = (), big_device: str = "cpu") -> None:
        super().__init__()
        self.layer = nn.Linear(8, 2)
        self.big_at = big_at
        self.big_device = big_device

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.layer(x), y)
        if batch_idx in self.big_at:
            big = torch.ones(BIG_MIB * 1024 * 1024 // 4, device=self.big_device)  # written: resident, not just mapped
            loss = loss + 0 * big[0]
            del big
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordLogged(Logger):
    """What reached the logger, per step (the Trainer writes logs every step in these tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[int, dict[str, float]] = {}
        self.callback_metrics: dict[str, torch.Tensor] = {}

    @property
    def name(self) -> str:
        return "record"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        memory = {k: float(v) for k, v in metrics.items() if k.startswith("memory/")}
        if memory:
            assert step is not None
            self.steps[step] = memory


class CountingMonitor(DeviceMemoryMonitor):
    """Counts statistics calls: the logging-off path must make none."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads = 0
        self.resets = 0

    def read_memory(self) -> dict[str, float]:
        self.reads += 1
        return super().read_memory()

    def reset_peaks(self) -> None:
        self.resets += 1
        super().reset_peaks()


def fit(model: L.LightningModule, monitor: DeviceMemoryMonitor, batches: int, **trainer_kwargs: Any) -> RecordLogged:
    data = TensorDataset(torch.randn(4 * batches, 8), torch.randint(0, 2, (4 * batches,)))
    recorder = RecordLogged()
    trainer_kwargs = {"accelerator": "cpu", "devices": 1, **trainer_kwargs}
    trainer = L.Trainer(
        max_steps=batches,
        logger=recorder,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
        **trainer_kwargs,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    recorder.callback_metrics = dict(trainer.callback_metrics)
    return recorder


def test_cpu_peak_rises_with_a_held_tensor_and_resets_per_interval() -> None:
    can_reset = reset_peak_rss()
    recorder = fit(HoldsBigTensor(big_at=(2,)), DeviceMemoryMonitor(logging_interval=1, reset_peak=True), batches=4)
    peaks = {step: values["memory/cpu_peak_mib"] for step, values in recorder.steps.items()}
    assert sorted(peaks) == [0, 1, 2, 3]
    assert peaks[2] - peaks[1] >= 0.95 * BIG_MIB, peaks
    assert all(values["memory/cpu_rss_mib"] > 0 for values in recorder.steps.values())
    assert "memory/imbalance" not in recorder.steps[2]  # one device: nothing to compare
    if can_reset:  # the peak of batch 3's interval no longer holds batch 2's tensor
        assert peaks[2] - peaks[3] >= 0.75 * BIG_MIB, peaks


def test_logs_only_on_interval_batches_and_makes_no_stats_calls_between() -> None:
    monitor = CountingMonitor(logging_interval=3, reset_peak=True)
    recorder = fit(HoldsBigTensor(), monitor, batches=7)
    assert sorted(recorder.steps) == [2, 5]  # batches 3 and 6 (1-based) of 7
    assert (monitor.reads, monitor.resets) == (2, 2)


def test_off_logs_nothing_and_reads_nothing() -> None:
    for interval in (None, 0):
        monitor = CountingMonitor(logging_interval=interval, reset_peak=True)
        recorder = fit(HoldsBigTensor(), monitor, batches=3)
        assert recorder.steps == {}
        assert (monitor.enabled, monitor.reads, monitor.resets) == (False, 0, 0)


def test_virtual_cpu_replicas_are_one_device_without_imbalance() -> None:
    monitor = DeviceMemoryMonitor(logging_interval=1)
    recorder = fit(HoldsBigTensor(), monitor, batches=2, devices=2, strategy="parallel_criterion")
    assert monitor.virtual
    assert monitor.devices == [torch.device("cpu")]
    assert set(recorder.steps[1]) == {"memory/cpu_peak_mib", "memory/cpu_rss_mib"}
    # also where ModelCheckpoint / EarlyStopping look
    assert float(recorder.callback_metrics["memory/cpu_peak_mib"]) == recorder.steps[1]["memory/cpu_peak_mib"]


def test_imbalance_ratio() -> None:
    assert imbalance({"cuda:0_peak_mib": 300.0, "cuda:1_peak_mib": 100.0}) == 3.0
    assert imbalance({"cuda:0_peak_mib": 300.0}) is None
    assert imbalance({"a": 1.0, "b": 0.0}) is None


def test_rejects_a_negative_interval() -> None:
    with pytest.raises(ValueError, match="logging_interval"):
        DeviceMemoryMonitor(logging_interval=-1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_per_device() -> None:
    recorder = fit(
        HoldsBigTensor(big_at=(1,), big_device="cuda:0"),
        DeviceMemoryMonitor(logging_interval=1, reset_peak=True),
        batches=3,
        accelerator="gpu",
        devices=1,
    )
    peaks = {step: values["memory/cuda:0_peak_mib"] for step, values in recorder.steps.items()}
    assert peaks[1] - peaks[0] >= BIG_MIB - 1, peaks
    assert peaks[1] - peaks[2] >= BIG_MIB - 1, peaks  # reset after batch 1
    assert recorder.steps[1]["memory/cuda:0_reserved_peak_mib"] >= peaks[1]

    monitor = DeviceMemoryMonitor(logging_interval=1)
    strategy = lightning_mgpu.DataParallelStrategy(parallel_devices=[torch.device("cuda", 0)] * 2)
    recorder = fit(HoldsBigTensor(), monitor, batches=2, accelerator="gpu", devices=1, strategy=strategy)
    assert monitor.virtual and monitor.devices == [torch.device("cuda", 0)]
    assert set(recorder.steps[1]) == {"memory/cuda:0_peak_mib", "memory/cuda:0_reserved_peak_mib"}


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_report_both_devices_and_the_imbalance() -> None:
    monitor = DeviceMemoryMonitor(logging_interval=1)
    strategy = lightning_mgpu.DataParallelStrategy(parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 1)])
    recorder = fit(
        HoldsBigTensor(big_at=(1,), big_device="cuda:0"),
        monitor,
        batches=2,
        accelerator="gpu",
        devices=1,
        strategy=strategy,
    )
    logged = recorder.steps[1]
    assert {"memory/cuda:0_peak_mib", "memory/cuda:1_peak_mib", "memory/imbalance"} <= set(logged)
    assert logged["memory/imbalance"] == pytest.approx(
        max(logged["memory/cuda:0_peak_mib"], logged["memory/cuda:1_peak_mib"])
        / min(logged["memory/cuda:0_peak_mib"], logged["memory/cuda:1_peak_mib"])
    )
