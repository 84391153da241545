"""Merge per-replica outputs into what one device would have returned for the whole batch (``DataParallelModel.gather``,
``dp``'s forward outputs, ``parallel_criterion``'s step outputs): arrays concatenated along ``dim``, differing scalars
averaged by sample counts or given weights, integer counts added, per-sample lists concatenated, containers merged
field by field, anything else kept when equal on every replica, else a :class:`ReplicaValues`. ``None`` or a key on
some replicas only is an error, never a silent drop.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_mgpu.parallel.collectives import is_gathered
from lightning_mgpu.parallel.devices import DeviceLike, to_device
from lightning_mgpu.parallel.reduce import Weight, stack_scalars, weighted_mean
from lightning_mgpu.parallel.scatter_gather import (
    PerSample,
    agreed_size,
    contains_tensor,
    is_dataclass_instance,
    is_namedtuple,
    iter_tensors,
    labelled,
    move_to,
    rebuild,
)


class ReplicaValues(list):
    """A value that differs between replicas and has no rule to merge it (objects, arrays whose non-batch dimensions
    differ): one entry per replica, in batch order. Using it as one device's value fails with an explanation."""

    hint = "Combine them as your statistic needs, or return per-sample values, which are concatenated in batch order."

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"this output differs between the {len(self)} replicas and has no rule to merge it into one device's "
            f"value, so it came back as the list of their values (ReplicaValues), which has no attribute {name!r}. "
            + self.hint
        )


def merge_outputs(
    outputs: Sequence[Any],
    device: DeviceLike,
    dim: int = 0,
    *,
    sizes: Sequence[int] | None = None,
    weights: Mapping[str, Sequence[Weight] | str | Tensor] | None = None,
    counts: bool = False,
) -> Any:
    """Merge per-replica ``outputs`` on ``device`` as one device would have returned them (differentiable).

    ``sizes``: each replica's sample count (read from its tensors when omitted). ``weights``: per value path (as
    messages print it, ``"output['loss']"``), the weights to average that scalar with instead of the sample counts,
    ``"sum"``, or the merged value itself (a loss its record combined). ``counts``: every integer is a count, summed
    (a step's ``correct``); else only integers that differ or equal the sample counts are, and a constant is kept.
    """
    if isinstance(outputs, (Tensor, Mapping, str)) or not isinstance(outputs, Sequence):
        raise TypeError(
            f"merge_outputs() takes the list of per-replica outputs (one entry per device), got a "
            f"{type(outputs).__name__}. Pass e.g. merge_outputs([out_0, out_1], device) or the list DataParallelModel "
            "returned."
        )
    if not outputs:
        raise ValueError("merge_outputs() needs at least one output.")
    if sizes is not None and len(sizes) != len(outputs):
        raise ValueError(f"merge_outputs() got {len(outputs)} outputs but {len(sizes)} sizes.")
    found = list(sizes) if sizes is not None else [agreed_size(o, dim) for o in outputs]
    found = None if None in found else found  # an output with no batch size: no sample counts
    return _Merger(to_device(device), dim, found, weights or {}, counts).merge(list(outputs), "output")


@dataclasses.dataclass
class _Merger:
    device: torch.device
    dim: int
    sizes: list[int] | None
    weights: Mapping[str, Sequence[Weight] | str | Tensor]
    counts: bool  # every integer is a count

    def merge(self, outputs: list[Any], path: str) -> Any:
        first, nones = outputs[0], [i for i, o in enumerate(outputs) if o is None]
        if nones:
            if len(nones) < len(outputs):
                raise _partial(path, "None", nones, len(outputs))
            return None
        if isinstance(first, PerSample):
            _check_kind(outputs, path, PerSample, "a PerSample list")
            return self._concat(outputs)
        if isinstance(first, (Tensor, np.ndarray)):
            _check_kind(outputs, path)
            return self._arrays(outputs, path) if first.ndim else self._scalars(outputs, path)
        if isinstance(first, (int, float, np.number)):  # bool included
            return self._scalars(outputs, path)
        if isinstance(first, Mapping):
            return self._mapping(outputs, path)
        if isinstance(first, (list, tuple)):
            return self._sequence(outputs, path)
        if is_dataclass_instance(first):
            _check_kind(outputs, path)
            return self._fields(outputs, path)
        return first if all_equal(outputs) else ReplicaValues(outputs)

    def _mapping(self, outputs: list[Any], path: str) -> Any:
        _check_kind(outputs, path, Mapping, "a mapping")
        for key in dict.fromkeys(k for o in outputs for k in o):  # every key, in order of first appearance
            if missing := [i for i, o in enumerate(outputs) if key not in o]:
                raise _partial(f"{path}[{key!r}]", "no value", missing, len(outputs), what="key")
        return rebuild(outputs[0], {k: self.merge([o[k] for o in outputs], f"{path}[{k!r}]") for k in outputs[0]})

    def _fields(self, outputs: list[Any], path: str) -> Any:
        """Tuples, lists or dataclasses of one structure merged item by item, as replica 0's type."""
        columns = zip(*(labelled(path, o) for o in outputs), strict=True)
        return rebuild(outputs[0], [self.merge([c for _, c in column], column[0][0]) for column in columns])

    def _arrays(self, outputs: list[Any], path: str) -> Any:
        first, dim = outputs[0], self.dim
        if isinstance(first, Tensor) and len(outputs) > 1 and all(map(is_gathered, outputs)):
            return first.to(self.device)  # every replica's all_gather of the whole batch: one device returns it once
        rest = first.shape[:dim] + first.shape[dim + 1 :]
        if any(o.ndim <= dim or o.shape[:dim] + o.shape[dim + 1 :] != rest for o in outputs):
            values = ReplicaValues(outputs)  # most often each shard padded to its own longest sequence
            values.hint = (
                f"Their shapes {[tuple(o.shape) for o in outputs]} differ beyond dim {dim}, the batch dimension: if "
                "each replica padded to its own longest sequence, pad to one length (pad_packed_sequence(..., "
                "total_length=...), a fixed max_length in the collate function), so that they concatenate in order."
            )
            return values
        # The same size on every device, none its sample count: not the batch's dimension. (Sizes that differ are
        # per-sample data of varying length; the same multiple of every count is samples flattened with time.)
        held = {o.shape[dim] for o in outputs}
        if self.sizes and len(held) == 1 and held.isdisjoint(self.sizes) and not _flattened(held.pop(), self.sizes):
            warnings.warn(  # a message without the step's counts: said once per output
                f"{path}: every device's array has as many entries along dim {dim}, none its sample count: "
                f"concatenated along dim {dim}, as nn.DataParallel does. That is one device's result for rows you "
                "selected (as many on each device by chance), not for a statistic of the batch (x.mean(0): one per "
                "device; return per-sample rows and reduce them in on_*_batch_end) nor where the batch is on another "
                "dimension (an LSTM's (layers, batch, hidden) state): return that batch first (h_n.transpose(0, 1)).",
                UserWarning,
                stacklevel=2,
            )
        if isinstance(first, Tensor):
            return torch.cat([o.to(self.device) for o in outputs], dim=dim)
        return np.concatenate(outputs, axis=dim)

    def _scalars(self, outputs: list[Any], path: str) -> Any:
        tensors, weights = any(isinstance(o, Tensor) for o in outputs), self.weights.get(path, self.sizes)
        if path not in self.weights and all(map(_is_count, outputs)) and self._counts(outputs, path):
            weights = "sum"  # each shard's count: one device's is their sum
        elif all_equal(outputs):
            return outputs[0]
        elif all(isinstance(o, bool) for o in outputs):
            return ReplicaValues(outputs)
        if isinstance(weights, Tensor):  # the caller's merged value (a loss combined by its rule)
            return weights
        if isinstance(weights, str):  # "sum": a sum over each replica's samples
            return _stack(outputs, self.device).sum() if tensors else sum(outputs)
        weights = [1] * len(outputs) if weights is None else weights
        if tensors:
            values = _stack(outputs, self.device)
            dtype = torch.promote_types(values.dtype, torch.float32)
            return weighted_mean(values.to(dtype), stack_scalars(weights, self.device, dtype))
        floats = [float(w) for w in weights]
        return sum(float(o) * w for o, w in zip(outputs, floats, strict=True) if w > 0) / sum(floats)

    def _counts(self, outputs: list[Any], path: str) -> bool:
        """Whether the replicas' integers are counts, which add up: they differ, or each is its replica's sample count
        (``len(x)``); else a constant passed whole, kept (said once: a count can be the same on every shard)."""
        values = [int(o) for o in outputs]
        if self.counts or len(set(values)) > 1 or values == self.sizes:
            return True
        if len(values) > 1 and self.sizes is not None:
            warnings.warn(
                f"{path}: the same integer on every device, not its sample count: kept as one value, as a constant (an "
                "epoch, an index) comes back. If it counts the shard's samples, one device's count is the devices' "
                "sum: integers that differ between devices, or equal their sample counts, are summed so. Return "
                "per-sample values instead ((pred == y), which concatenates) and count them where you read them.",
                UserWarning,
                stacklevel=2,
            )
        return False

    def _concat(self, outputs: list[Sequence[Any]]) -> Any:
        return type(outputs[0])(move_to(x, self.device) for o in outputs for x in o)

    def _sequence(self, outputs: list[Any], path: str) -> Any:
        """Per-sample lists concatenated in batch order: plain items (ids) where the counts or shapes differ, rows of
        strings unless every device returns the same, what :meth:`_per_sample` says; else merged item by item."""
        first = outputs[0]
        plain_lists = all(isinstance(o, list) for o in outputs) and not any(map(contains_tensor, outputs))
        same_shape = all(type(o) is type(first) and len(o) == len(first) for o in outputs)
        strings = all(isinstance(x, str) for o in outputs for x in o) and not all_equal(outputs)
        rows = plain_lists and (self.sizes is None or not same_shape or strings)
        if rows or (not is_namedtuple(first) and self._per_sample(outputs)):
            return self._concat(outputs)
        return self._fields(outputs, path) if same_shape else ReplicaValues(outputs)

    def _per_sample(self, outputs: list[Sequence[Any]]) -> bool:
        """One item per sample on every replica, not a fixed structure such as ``(preds, y)``: strings, numbers in
        lists, records unless every tensor in them is batched, ragged tensors; any items where the counts differ."""
        sizes, dim = self.sizes, self.dim
        if sizes is None or any(len(o) != n for o, n in zip(outputs, sizes, strict=True)):
            return False
        items = [item for o in outputs for item in o]
        if len(set(sizes)) > 1 or all(isinstance(x, str) for x in items):
            return True
        if isinstance(outputs[0], list) and all(map(_is_scalar, items)):
            return True
        if all(isinstance(x, Mapping) for x in items) or all(map(is_dataclass_instance, items)):
            items = [t for x in items for _, t in iter_tensors(x)]
            return not items or not all(t.ndim > dim and t.shape[dim] == sizes[0] for t in items)
        if all(isinstance(x, (Tensor, np.ndarray)) for x in items):
            return all(x.ndim > 0 for x in items) and not all(x.ndim > dim and x.shape[dim] == sizes[0] for x in items)
        return False


def all_equal(values: Sequence[Any]) -> bool:
    """Whether every value equals the first (arrays element-wise; by identity where ``==`` fails)."""
    first, rest = values[0], values[1:]
    try:
        if isinstance(first, (Tensor, np.ndarray)):
            return all(
                v is first or (type(v) is type(first) and v.shape == first.shape and bool((v == first).all()))
                for v in rest
            )
        return all(bool(v == first) for v in rest)
    except Exception:
        return all(v is first for v in rest)


def _stack(values: Sequence[Any], device: torch.device) -> Tensor:
    return torch.stack([torch.as_tensor(v).to(device).reshape(()) for v in values])


def _is_count(value: Any) -> bool:
    """An integer (a Python or numpy int, a 0-dim integer tensor), not a bool."""
    if isinstance(value, Tensor):
        return not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_scalar(value: Any) -> bool:
    if isinstance(value, (Tensor, np.ndarray)):
        return value.ndim == 0
    return isinstance(value, (str, bytes, int, float, bool, type(None), np.number))


def _flattened(held: int, sizes: Sequence[int]) -> bool:
    """Whether every device holds the same whole multiple of its sample count: its samples flattened with another
    dimension (a language model's ``(batch * time, vocab)`` logits), which concatenate as one device's."""
    multiples = {held // n if n and held % n == 0 else None for n in sizes}
    return len(multiples) == 1 and None not in multiples


def _partial(path: str, value: str, replicas: list[int], total: int, what: str = "value") -> ValueError:
    """``replicas`` returned ``value`` (None, or no value) at ``path``; the others returned something."""
    others = [i for i in range(total) if i not in replicas]
    return ValueError(
        f"Cannot merge {path}: replica(s) {replicas} returned {value} there, replica(s) {others} a value. A {what} "
        "present on some replicas only cannot be merged into one device's output (it would be dropped). Return it "
        "from every replica (e.g. a zero, or an empty tensor with the batch dimension), or from none."
    )


def _check_kind(outputs: list[Any], path: str, kind: type | None = None, expected: str = "") -> None:
    """Every output is a ``kind``, by default of replica 0's exact type; else an error naming what each returned."""
    if not all(isinstance(o, kind) if kind else type(o) is type(outputs[0]) for o in outputs):
        raise ValueError(
            f"Cannot merge {path}: replica 0 returned {expected or 'a ' + type(outputs[0]).__name__} but the replicas "
            f"returned {[type(o).__name__ for o in outputs]}. Every replica must return the same structure."
        )
