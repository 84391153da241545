"""Lightning callbacks: per-device memory and balance monitoring (for throughput, Lightning's ``ThroughputMonitor``),
and ``ExactLoss`` (the optimizer step equals one device's on the whole global batch, across micro-batches and
processes). Imported on first use, so that a ``pytorch_lightning`` project imports no ``lightning.pytorch``."""

import importlib
from typing import Any

_MEMORY = ("DeviceMemoryMonitor", "distinct_devices", "imbalance", "read_device_memory", "reset_device_peaks")
__all__ = sorted([*_MEMORY, "ExactLoss", "PytorchLightningExactLoss"])


def __getattr__(name: str) -> Any:
    """The public names, each imported from its module on first use."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{'device_memory' if name in _MEMORY else 'exact_loss'}"), name)
