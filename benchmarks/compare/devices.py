"""Which devices a benchmark uses, and whether its replicas share a physical device ("virtual devices").

Kept free of Lightning so the parent process and the report can use it. A GPU run asks for ``--devices N`` replicas:
with N GPUs or more visible they are ``cuda:0 … cuda:N-1``; with fewer, replicas are dealt round-robin over the
visible GPUs (``--devices 2`` on one GPU is ``[cuda:0, cuda:0]``). CPU replicas are always virtual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ACCELERATORS = ("auto", "cpu", "gpu", "cuda")


@dataclass(frozen=True)
class DevicePlan:
    """One entry per replica, e.g. ``("cuda:0", "cuda:1")`` or ``("cpu", "cpu")``."""

    accelerator: str  # "cpu" or "gpu"
    devices: tuple[str, ...]

    @property
    def physical(self) -> tuple[str, ...]:
        """The distinct devices, in order."""
        return tuple(dict.fromkeys(self.devices))

    @property
    def virtual(self) -> bool:
        """True when replicas share a physical device: not a multi-device result."""
        return len(self.physical) < len(self.devices)

    def describe(self) -> str:
        """One plain sentence for the report header."""
        n, physical = len(self.devices), ", ".join(self.physical)
        if n == 1:
            return f"1 device ({physical})."
        if not self.virtual:
            return f"{n} distinct devices ({physical})."
        return (
            f"VIRTUAL DEVICES: {n} replicas share {len(self.physical)} physical device(s) ({physical}). This is not a "
            "multi-GPU result: replicas on one device share its memory and compute, so memory is reported per "
            "physical device (the sum of its replicas) and step times show the cost of splitting the batch, not a "
            "speed-up."
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "accelerator": self.accelerator,
            "replicas": list(self.devices),
            "physical_devices": list(self.physical),
            "virtual": self.virtual,
            "description": self.describe(),
        }


def plan_devices(accelerator: str, devices: int | None, cuda_count: int) -> DevicePlan:
    """Devices for ``--accelerator`` / ``--devices`` given ``cuda_count`` visible GPUs.

    ``auto`` is ``gpu`` when a GPU is visible; ``cuda`` is an alias of ``gpu``. ``devices=None`` means every visible
    GPU, or 2 CPU replicas.
    """
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    kind = ("gpu" if cuda_count > 0 else "cpu") if accelerator == "auto" else accelerator
    kind = "gpu" if kind == "cuda" else kind
    if kind == "gpu" and cuda_count < 1:
        raise ValueError("--accelerator gpu was requested but no CUDA device is visible")
    if devices is None:
        devices = cuda_count if kind == "gpu" else 2
    if devices < 1:
        raise ValueError(f"--devices must be >= 1, got {devices}")
    if kind == "cpu":
        return DevicePlan("cpu", ("cpu",) * devices)
    return DevicePlan("gpu", tuple(f"cuda:{i % cuda_count}" for i in range(devices)))
