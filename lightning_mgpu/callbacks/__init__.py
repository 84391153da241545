"""Lightning callbacks: per-device memory and balance monitoring (for throughput, Lightning's ``ThroughputMonitor``)."""

from lightning_mgpu.callbacks.device_memory import (
    DeviceMemoryMonitor,
    distinct_devices,
    imbalance,
    read_device_memory,
    reset_device_peaks,
)

__all__ = ["DeviceMemoryMonitor", "distinct_devices", "imbalance", "read_device_memory", "reset_device_peaks"]
