"""torchmetrics inside replicas: per-device clones whose state is merged into the root metric after each step.

A metric's ``update`` is bound to the original object, so each replica gets a lasting clone on its own device. After
the step the clones' states are folded into the root metric with each state's ``dist_reduce_fx``, as DDP combines
ranks, and the step value Lightning logs is computed from the merged batch state. ``Metric.merge_state`` is not used:
it refuses ``full_state_update=True`` metrics, puts the incoming state first and leaves the bookkeeping untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_mean


def _outermost_metrics(module: nn.Module, prefix: str = "") -> list[tuple[str, Metric]]:
    """``(dotted path, metric)`` for every metric not nested inside another metric."""
    found = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, Metric):
            found.append((path, child))
        else:
            found.extend(_outermost_metrics(child, f"{path}."))
    return found


def _set_submodule(root: nn.Module, path: str, value: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    parent._modules[name] = value


def _combine(values: Sequence[Any], reduce_fx: Any, device: torch.device) -> Any:
    """Combine states the way ``Metric._sync_dist`` combines ranks (lists of tensors for "cat" states stay lists)."""
    if isinstance(values[0], list):
        return [t.to(device) for v in values for t in v]
    stacked = [v.to(device) for v in values]
    if reduce_fx is None:
        return torch.stack(stacked)
    if reduce_fx is dim_zero_cat:
        return torch.cat([s.reshape(1) if s.dim() == 0 else s for s in stacked])
    return reduce_fx(torch.stack(stacked))


def _mark_folded(metric: Metric, step_value: Any = None) -> None:
    """Record on ``metric`` what its own ``update``/``forward`` would: one more update, no stale ``compute()`` result,
    and (when logged per step) the batch's value that Lightning reads; torchmetrics has no setters for them."""
    metric._update_count += 1
    metric._computed = None
    if step_value is not None:
        metric._forward_cache = step_value


def _check_mergeable(metric: Metric) -> None:
    for attr, value in metric.metric_state.items():
        if not isinstance(value, (Tensor, list)):
            raise TypeError(
                f"The torchmetrics metric {type(metric).__name__} keeps its state {attr!r} as a "
                f"{type(value).__name__}, which cannot be merged across replicas (only tensors and lists of tensors "
                "can). Update it outside the replicated step (e.g. in on_train_batch_end from the gathered outputs), "
                "or use strategy='dp' or 'ddp'."
            )


class MetricReplicas:
    """Owns the per-device metric clones of one LightningModule and merges them back after each step."""

    def __init__(self) -> None:
        self._clones: dict[tuple[int, int], Metric] = {}  # (id(root metric), replica index) -> clone
        self._owner: dict[int, Metric] = {}  # id(clone) -> root metric
        self._scratch: dict[int, Metric] = {}  # id(root metric) -> clone used to compute the batch value
        self._active: list[tuple[Metric, list[Metric]]] = []
        self._contributions: dict[int, int] = {}  # id(root metric) -> replica states folded in since its reset

    def install(self, root: nn.Module, replicas: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
        """Put a clone of each root metric, on the replica's device, into every replica (once per replica build)."""
        self._active = []
        for path, metric in _outermost_metrics(root):
            clones = []
            for index, (replica, device) in enumerate(zip(replicas, devices, strict=True)):
                key = (id(metric), index)
                clone = self._clones.get(key)
                if clone is None:
                    clone = metric.clone()
                    clone.reset()
                    self._clones[key] = clone
                    self._owner[id(clone)] = metric
                clone.to(device)
                _set_submodule(replica, path, clone)
                clones.append(clone)
            self._active.append((metric, clones))

    def clear(self) -> None:
        """Drop every clone (at teardown): frees their memory on the other devices, forgets ids that may be reused."""
        self._clones.clear()
        self._owner.clear()
        self._scratch.clear()
        self._contributions.clear()
        self._active = []

    def discard(self) -> None:
        """Forget the step in progress (it failed): reset its clones so no partial update reaches a later step."""
        for _, clones in self._active:
            for clone in clones:
                clone.reset()

    def owner_of(self, value: Any) -> Metric | None:
        """The root metric a replica's clone stands for."""
        return self._owner.get(id(value)) if isinstance(value, Metric) else None

    def merge(self, compute_step_value: set[int] | None = None) -> None:
        """Fold every updated clone's state into its root metric, then reset the clones.

        ``compute_step_value``: ids of root metrics whose per-step value is needed (logged with ``on_step``).
        """
        for metric, clones in self._active:
            updated = [c for c in clones if c.update_count > 0]
            if not updated:
                continue
            _check_mergeable(updated[0])
            device = _metric_device(metric)
            reductions = metric._reductions  # each state's dist_reduce_fx (read only)
            batch_state = {
                attr: _combine([c.metric_state[attr] for c in updated], reductions[attr], device) for attr in reductions
            }
            step_value = None
            if compute_step_value and id(metric) in compute_step_value:
                step_value = self._batch_value(metric, batch_state)
            folded = 0 if metric.update_count == 0 else self._contributions.get(id(metric), 1)
            for attr, value in batch_state.items():
                current = getattr(metric, attr)
                setattr(metric, attr, _folded(current, value, reductions[attr], device, folded, len(updated)))
            self._contributions[id(metric)] = folded + len(updated)
            _mark_folded(metric, step_value)
            for clone in updated:
                clone.reset()

    def _batch_value(self, metric: Metric, batch_state: dict[str, Any]) -> Any:
        if (scratch := self._scratch.get(id(metric))) is None:
            scratch = self._scratch[id(metric)] = metric.clone()
        scratch.reset()
        for attr, value in batch_state.items():
            setattr(scratch, attr, value)
        _mark_folded(scratch)
        return scratch.compute()


def _folded(current: Any, value: Any, reduce_fx: Any, device: torch.device, folded: int, n: int) -> Any:
    """A state holding ``folded`` replica states (0: fresh) and a batch's ``value`` from ``n`` more, in one."""
    if isinstance(current, list):  # list states (retrieval, SSIM, mAP...): every element, in order
        return _combine([current, value], reduce_fx, device)
    if folded == 0:
        return value
    if reduce_fx is None:  # unreduced states (PearsonCorrCoef's): one row per contributor, as DDP stacks ranks
        return torch.cat([current.to(device), value])
    if reduce_fx is dim_zero_mean:  # DDP's equal-weight mean over ranks: over every replica state folded in so far
        return (current.to(device) * folded + value * n) / (folded + n)
    return _combine([current, value], reduce_fx, device)


def _metric_device(metric: Metric) -> torch.device:
    for value in metric.metric_state.values():
        if isinstance(value, Tensor):
            return value.device
    return metric.device
