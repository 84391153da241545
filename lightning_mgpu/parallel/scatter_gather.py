"""Split a batch into per-device chunks and gather per-device outputs back.

Batches are nested tuples, lists, dicts (any ``Mapping``, including ``transformers`` ``ModelOutput``), namedtuples and
dataclasses of tensors. Tensors are split along ``dim`` with ``torch.tensor_split`` (10 over 4 gives 3, 3, 2, 2, better
balanced than ``torch.chunk``'s 3, 3, 3, 1). A list of non-tensor items whose length equals the batch size (strings,
ids) is split the same way; any other non-tensor, and 0-dim tensors, go whole to every replica. A batch smaller than
the number of devices uses fewer replicas.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mgpu.parallel.devices import DeviceLike, to_device


class BatchSplitError(ValueError):
    """The batch cannot be split into per-device chunks (empty, or inconsistent batch sizes)."""


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _contains_tensor(obj: Any) -> bool:
    return any(True for _ in iter_tensors(obj))


def _is_per_sample_list(obj: Any, batch_size: int | None) -> bool:
    """A list of plain items (e.g. strings) with one item per sample: split like a tensor."""
    return isinstance(obj, list) and batch_size is not None and len(obj) == batch_size and not _contains_tensor(obj)


def iter_tensors(obj: Any, path: str = "batch") -> Iterator[tuple[str, Tensor]]:
    """Yield ``(key path, tensor)`` for every tensor in a nested structure, e.g. ``('batch["mask"]', tensor)``."""
    if isinstance(obj, Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from iter_tensors(value, f"{path}[{key!r}]")
    elif _is_namedtuple(obj):
        for field in obj._fields:
            yield from iter_tensors(getattr(obj, field), f"{path}.{field}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from iter_tensors(value, f"{path}[{i}]")
    elif _is_dataclass_instance(obj):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name), f"{path}.{field.name}")


def batch_size_of(obj: Any, dim: int = 0, path: str = "batch") -> int:
    """The size along ``dim`` shared by every tensor that has that dim (0-dim tensors are ignored).

    Raises :class:`BatchSplitError` naming both key paths when two tensors disagree, and when there is no tensor.
    """
    first: tuple[str, int] | None = None
    for key, tensor in iter_tensors(obj, path):
        if tensor.dim() <= dim:
            continue
        size = tensor.shape[dim]
        if first is None:
            first = (key, size)
        elif size != first[1]:
            raise BatchSplitError(
                f"Cannot split the batch along dim {dim}: {first[0]} has size {first[1]} but {key} has size {size}. "
                "Every tensor that has a batch dimension must have the same batch size."
            )
    if first is None:
        raise BatchSplitError(
            f"Cannot split the batch along dim {dim}: it holds no tensor with a dimension {dim} "
            f"(got {type(obj).__name__}). Pass tensors, or collections of tensors, with the batch along dim {dim}."
        )
    return first[1]


def split_sizes(batch_size: int, num_devices: int) -> list[int]:
    """Per-replica sizes as ``torch.tensor_split`` makes them, with no empty chunk (tiny batches use fewer)."""
    if batch_size <= 0:
        raise BatchSplitError("Cannot split an empty batch (batch size 0): there is nothing to run.")
    if num_devices <= 0:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}.")
    used = min(batch_size, num_devices)
    base, extra = divmod(batch_size, used)
    return [base + (1 if i < extra else 0) for i in range(used)]


def rebuild(template: Any, values: Sequence[Any] | Mapping[str, Any]) -> Any:
    """A container of the same type as ``template`` holding ``values`` (a sequence, or a mapping for dicts)."""
    if isinstance(template, Mapping):
        if isinstance(template, defaultdict):
            return defaultdict(template.default_factory, values)
        if _is_dataclass_instance(template):  # transformers ModelOutput: a dataclass and an OrderedDict
            return type(template)(**values)
        try:
            return type(template)(values)
        except TypeError:
            return dict(values)
    if _is_namedtuple(template):
        return type(template)(*values)
    if isinstance(template, (list, tuple)):
        try:
            return type(template)(values)
        except TypeError:
            return list(values) if isinstance(template, list) else tuple(values)
    if _is_dataclass_instance(template):
        init_fields = {f.name: v for f, v in zip(dataclasses.fields(template), values, strict=True) if f.init}
        obj = type(template)(**init_fields)
        for f, v in zip(dataclasses.fields(template), values, strict=True):
            if not f.init:
                object.__setattr__(obj, f.name, v)
        return obj
    raise TypeError(f"Cannot rebuild a {type(template).__name__}.")


def _map_structure(obj: Any, leaf_fn: Callable[[Any], Any], batch_size: int | None) -> Any:
    """Apply ``leaf_fn`` to tensors and per-sample lists; rebuild containers around the results."""
    if isinstance(obj, Tensor) or _is_per_sample_list(obj, batch_size):
        return leaf_fn(obj)
    if isinstance(obj, Mapping):
        return rebuild(obj, {k: _map_structure(v, leaf_fn, batch_size) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return rebuild(obj, [_map_structure(v, leaf_fn, batch_size) for v in obj])
    if _is_dataclass_instance(obj):
        return rebuild(
            obj, [_map_structure(getattr(obj, f.name), leaf_fn, batch_size) for f in dataclasses.fields(obj)]
        )
    return leaf_fn(obj)


def scatter(
    obj: Any, devices: Sequence[DeviceLike], dim: int = 0, batch_size: int | None = None
) -> tuple[list[Any], list[int]]:
    """Split ``obj`` into one chunk per device, moved to that device.

    Returns ``(chunks, sizes)``: ``len(chunks) == len(sizes) <= len(devices)`` (fewer when the batch is smaller than
    the device count). The copy to each device is differentiable.
    """
    devices = [to_device(d) for d in devices]
    if batch_size is None:
        batch_size = batch_size_of(obj, dim)
    sizes = split_sizes(batch_size, len(devices))
    bounds = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    per_replica: list[list[Any]] = []

    cache: dict[int, list[Any]] = {}

    def split_leaf(leaf: Any) -> list[Any]:
        # Each leaf is split and copied once, then picked per replica.
        key = id(leaf)
        if key not in cache:
            cache[key] = _split_leaf(leaf)
        return cache[key]

    def _split_leaf(leaf: Any) -> list[Any]:
        if isinstance(leaf, Tensor):
            if leaf.dim() <= dim:
                return [leaf.to(d) for d in devices[: len(sizes)]]
            parts = torch.tensor_split(leaf, bounds, dim=dim) if bounds else (leaf,)
            return [p.to(d) for p, d in zip(parts, devices, strict=False)]
        if _is_per_sample_list(leaf, batch_size):
            edges = [0, *bounds, batch_size]
            return [leaf[edges[i] : edges[i + 1]] for i in range(len(sizes))]
        return [leaf] * len(sizes)

    for i in range(len(sizes)):
        per_replica.append(_map_structure(obj, lambda leaf, i=i: split_leaf(leaf)[i], batch_size))
    return per_replica, sizes


def scatter_args(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], devices: Sequence[DeviceLike], dim: int = 0
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]], list[int]]:
    """Scatter positional and keyword arguments together (they must share one batch size)."""
    combined = (tuple(args), dict(kwargs))
    chunks, sizes = scatter(combined, devices, dim, batch_size=batch_size_of(combined, dim, path="inputs"))
    return [c[0] for c in chunks], [c[1] for c in chunks], sizes


def move_to(obj: Any, device: DeviceLike) -> Any:
    """``obj`` with every tensor moved to ``device`` (differentiable), structure preserved."""
    target = to_device(device)
    return _map_structure(obj, lambda leaf: leaf.to(target) if isinstance(leaf, Tensor) else leaf, None)


def gather(outputs: Sequence[Any], device: DeviceLike, dim: int = 0) -> Any:
    """Concatenate per-replica outputs on ``device`` along ``dim`` (differentiable), preserving the structure.

    0-dim tensors are stacked (one value per replica); lists of plain items are concatenated; other non-tensor values
    are kept when equal across replicas, else returned as a list with one value per replica.
    """
    if not outputs:
        raise ValueError("gather() needs at least one output.")
    target = to_device(device)
    first = outputs[0]
    if isinstance(first, Tensor):
        tensors = [o.to(target) for o in outputs]
        if first.dim() == 0:
            return torch.stack(tensors)
        return torch.cat(tensors, dim=dim)
    if first is None:
        return None
    if isinstance(first, Mapping):
        return rebuild(first, {k: gather([o[k] for o in outputs], target, dim) for k in first})
    if isinstance(first, list) and not _contains_tensor(first):
        return [item for o in outputs for item in o]
    if isinstance(first, (list, tuple)):
        return rebuild(first, [gather([o[i] for o in outputs], target, dim) for i in range(len(first))])
    if _is_dataclass_instance(first):
        names = [f.name for f in dataclasses.fields(first)]
        return rebuild(first, [gather([getattr(o, n) for o in outputs], target, dim) for n in names])
    if all(o == first for o in outputs[1:]):
        return first
    return list(outputs)
