"""``gather`` with ``torch.nn.parallel.gather``'s contract (0-dim tensors stacked, with torch's warning), on any
devices. To merge outputs as one device would have returned them (scalars averaged), use :mod:`.merge`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mgpu.parallel.devices import DeviceLike, to_device
from lightning_mgpu.parallel.scatter_gather import is_namedtuple


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Gather one output per replica on ``target_device`` (differentiably), as ``torch.nn.parallel.gather`` does:
    tensors concatenated along ``dim``, dicts, namedtuples and other sequences field by field, ``None`` kept."""
    device = to_device(target_device)

    def gather_map(values: Sequence[Any]) -> Any:
        first = values[0]
        if isinstance(first, Tensor):
            if dim == 0 and all(t.dim() == 0 for t in values):
                warnings.warn(
                    "Was asked to gather along dimension 0, but all input tensors were scalars; will instead unsqueeze "
                    "and return a vector.",
                    stacklevel=2,
                )
                values = [t.view(1) for t in values]
            return torch.cat([t.to(device) for t in values], dim=dim)
        if first is None:
            return None
        if isinstance(first, dict):
            if not all(len(first) == len(d) for d in values):
                raise ValueError("All dicts must have the same number of keys")
            return type(first)((k, gather_map([d[k] for d in values])) for k in first)
        if is_namedtuple(first):
            return type(first)._make(map(gather_map, zip(*values, strict=True)))
        return type(first)(map(gather_map, zip(*values, strict=True)))

    return gather_map(outputs)
