"""``device_ids`` as validated ``torch.device`` objects. A device may repeat (``["cpu", "cpu"]``: virtual devices, which
run the multi-device code paths on a machine with fewer devices)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

DeviceLike = int | str | torch.device


def to_device(device: DeviceLike) -> torch.device:
    """One device from an int (CUDA index), a string (``"cuda:1"``, ``"cpu"``) or a ``torch.device``."""
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(
            f"Invalid device {device!r}: expected an int index, a string such as 'cuda:0', or a torch.device."
        )
    if isinstance(device, int) and device < 0:
        raise ValueError(f"Invalid device index {device}: CUDA device indices are >= 0.")
    try:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"Invalid device string {device!r}: use e.g. 'cpu', 'cuda:0' or an int index.") from err
    if device.type == "cpu":  # tensors report `cpu` (no index), and torch.device("cpu:0") != torch.device("cpu")
        return torch.device("cpu")
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"Device {device} was requested but CUDA is not available on this machine.")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"Device {device} was requested but only {torch.cuda.device_count()} CUDA device(s) are visible."
        )
    return torch.device("cuda", index)


def resolve_devices(
    device_ids: Sequence[DeviceLike] | None, fallback: torch.device | None = None
) -> list[torch.device]:
    """Validate ``device_ids`` as ``torch.device`` objects of one type (a CPU replica would pace GPU ones). ``None``
    means every visible CUDA device, or ``[fallback]`` (the module's device) without CUDA."""
    if device_ids is None:
        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [fallback if fallback is not None else torch.device("cpu")]
    if isinstance(device_ids, (str, int, torch.device)):
        raise TypeError(f"device_ids must be a list of devices, got a single device {device_ids!r}; wrap it in a list.")
    devices = [to_device(d) for d in device_ids]
    if not devices:
        raise ValueError("device_ids is empty: pass at least one device (e.g. [0, 1] or ['cpu', 'cpu']), or None.")
    if len({d.type for d in devices}) > 1:
        raise ValueError(f"device_ids mixes device types ({[str(d) for d in devices]}): use devices of one type.")
    return devices


def module_device(module: torch.nn.Module) -> torch.device | None:
    """Device of the module's first parameter or buffer, or ``None`` for a module without state."""
    tensor = next(chain(module.parameters(), module.buffers()), None)
    return None if tensor is None else tensor.device


def check_module_on(module: torch.nn.Module, device: torch.device, what: str = "module") -> None:
    """Raise if any parameter or buffer of ``module`` is not on ``device`` (the root device)."""
    for name, tensor in chain(module.named_parameters(), module.named_buffers()):
        if tensor.device != device:  # device comes from to_device: a CPU one has no index, as tensors report
            raise ValueError(
                f"The {what} must have all parameters and buffers on the root device {device} (device_ids[0]), "
                f"but {name!r} is on {tensor.device}. Call `.to({str(device)!r})` first."
            )
