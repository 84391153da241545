"""``DeviceMemoryMonitor``: peak memory of every device a strategy uses, and how unevenly it is spread (the root
device, where ``nn.DataParallel`` piles outputs, loss and optimizer state, runs out of memory first)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

MIB = 1024**2


def cpu_memory() -> dict[str, float]:
    """This process's peak and current resident set size in MiB (``cpu_peak_mib``, ``cpu_rss_mib``): Linux's ``VmHWM``
    and ``VmRSS``; elsewhere the peak alone, ``ru_maxrss`` (not resettable; none on Windows)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            fields = dict(line.split(":", 1) for line in status)
        return {name: int(fields[key].split()[0]) / 1024 for key, name in (("VmHWM", "cpu_peak"), ("VmRSS", "cpu_rss"))}
    except (OSError, ValueError, IndexError, KeyError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return {}
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB elsewhere
    return {"cpu_peak": maxrss / (MIB if sys.platform == "darwin" else 1024)}


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux 4.0+); ``False`` where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def imbalance(peaks: Mapping[str, float]) -> float | None:
    """Largest / smallest peak: 1.0 is perfectly even. ``None`` for fewer than two devices or a zero peak."""
    values = list(peaks.values())
    return max(values) / min(values) if len(values) > 1 and min(values) > 0 else None


def distinct_devices(devices: Sequence[torch.device]) -> list[torch.device]:
    """``devices`` without repeats, in order (``cpu`` and ``cpu:0`` are one)."""
    return list(dict.fromkeys(torch.device("cpu") if d.type == "cpu" else d for d in devices))


def strategy_devices(trainer: L.Trainer) -> list[torch.device]:
    """Devices this process drives, repeats kept: a single-process strategy's ``parallel_devices``, else the root."""
    listed = getattr(trainer.strategy, "parallel_devices", None) if trainer.world_size == 1 else None
    return list(listed or [trainer.strategy.root_device])


def read_device_memory(devices: Sequence[torch.device]) -> dict[str, float]:
    """Peak memory of each device in MiB, keyed ``"<device>_peak_mib"``: on CUDA the allocator's peak allocated and
    reserved bytes (no synchronisation), on the CPU the process's peak and current RSS."""
    values: dict[str, float] = {}
    for device in devices:
        if device.type == "cuda":
            values[f"{device}_peak"] = torch.cuda.max_memory_allocated(device) / MIB
            values[f"{device}_reserved_peak"] = torch.cuda.max_memory_reserved(device) / MIB
        elif device.type == "cpu":
            values.update(cpu_memory())
    return {f"{name}_mib": value for name, value in values.items()}


def reset_device_peaks(devices: Sequence[torch.device]) -> None:
    """Start a new peak on every device (on the CPU, the process's peak RSS)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        elif device.type == "cpu":
            reset_peak_rss()


class DeviceMemoryMonitor(L.Callback):
    """Log ``memory/<device>_peak_mib`` of every device the strategy uses (on CUDA also ``_reserved_peak_mib``; under
    ``ddp`` every rank's, as ``memory/rank<r>_<device>_peak_mib``) and ``memory/imbalance`` (largest / smallest peak) to
    the loggers and ``trainer.callback_metrics``, as ``LearningRateMonitor`` logs. A device listed several times
    (virtual devices) is reported once and sets ``virtual``: no imbalance then.

    Args:
        logging_interval: log every this many training batches; ``None`` or ``0`` turns the monitor off.
        reset_peak: start a new peak after each log (on the CPU this needs Linux's ``/proc/self/clear_refs``).
    """

    def __init__(self, logging_interval: int | None = 50, reset_peak: bool = False) -> None:
        super().__init__()
        if logging_interval is not None and (isinstance(logging_interval, bool) or logging_interval < 0):
            raise ValueError(f"logging_interval must be a positive number of batches or None, got {logging_interval!r}")
        self.logging_interval = int(logging_interval or 0)
        self.enabled = self.logging_interval > 0
        self.reset_peak = reset_peak
        self.devices: list[torch.device] = []
        self.virtual = False
        self.last: dict[str, float] = {}  # the figures last logged

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        listed = strategy_devices(trainer)
        self.devices = distinct_devices(listed)
        self.virtual = len(self.devices) < len(listed)
        if self.virtual and self.enabled:
            rank_zero_info(
                f"DeviceMemoryMonitor: the strategy's devices {[str(d) for d in listed]} repeat a device; each "
                f"physical device is reported once ({[str(d) for d in self.devices]}), without memory/imbalance."
            )

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.enabled and (trainer.fit_loop.total_batch_idx + 1) % self.logging_interval == 0:
            self.log_memory(trainer)

    def read_memory(self) -> dict[str, float]:
        return read_device_memory(self.devices)

    def reset_peaks(self) -> None:
        reset_device_peaks(self.devices)

    def log_memory(self, trainer: L.Trainer) -> None:
        """Read, gather across processes (each monitors its one device, named ``rank<r>_<device>_...``) and log."""
        values = self.read_memory()
        if trainer.world_size > 1:
            device, names = self.devices[0], [name.split("_", 1)[1] for name in values]  # "cuda:1_peak_mib" -> ...
            local = torch.tensor([-1 if device.index is None else device.index, *values.values()], dtype=torch.float64)
            gathered = trainer.strategy.all_gather(local.to(trainer.strategy.root_device)).reshape(-1, local.numel())
            values = {}
            for rank, (index, *row) in enumerate(gathered.tolist()):
                label = device.type if index < 0 else f"{device.type}:{int(index)}"
                values.update({f"rank{rank}_{label}_{name}": value for name, value in zip(names, row, strict=True)})
        peaks = {k: v for k, v in values.items() if k.endswith("_peak_mib") and "_reserved" not in k}
        ratio = None if self.virtual else imbalance(peaks)  # replicas on one device share its memory
        self.last = values if ratio is None else {**values, "imbalance": ratio}
        metrics = {f"memory/{name}": value for name, value in self.last.items()}
        for logger in trainer.loggers:  # at the step self.log uses (Lightning's LearningRateMonitor reads it alike)
            logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)
        trainer.callback_metrics.update({name: torch.tensor(value) for name, value in metrics.items()})
        if self.reset_peak:
            self.reset_peaks()
