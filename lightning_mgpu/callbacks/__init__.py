"""Lightning callbacks: per-device memory and balance monitoring (for throughput, Lightning's ``ThroughputMonitor``),
and ``ExactLoss`` (the optimizer step equals one device's on the whole global batch, across micro-batches and
processes). Imported on first use, so that a ``pytorch_lightning`` project imports no ``lightning.pytorch``."""

import importlib
from typing import Any

_WHERE = {
    "DeviceMemoryMonitor": "device_memory",
    "distinct_devices": "device_memory",
    "imbalance": "device_memory",
    "read_device_memory": "device_memory",
    "reset_device_peaks": "device_memory",
    "ExactLoss": "exact_loss",
    "PytorchLightningExactLoss": "exact_loss",
}


def __getattr__(name: str) -> Any:
    """The public names, each imported from its module on first use."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


def __dir__() -> list[str]:
    """Every public name, the lazily imported ones included."""
    return sorted({*globals(), *__all__})


__all__ = sorted(_WHERE)
