"""Lightning callbacks: per-device memory and balance monitoring.

For samples/s, tokens/s and FLOP/s use Lightning's own ``lightning.pytorch.callbacks.ThroughputMonitor``; the
benchmark (``python -m benchmarks.compare``) runs both side by side.
"""

from lightning_mgpu.callbacks.device_memory import (
    DeviceMemoryMonitor,
    distinct_devices,
    imbalance,
    read_device_memory,
    reset_device_peaks,
)

__all__ = ["DeviceMemoryMonitor", "distinct_devices", "imbalance", "read_device_memory", "reset_device_peaks"]
