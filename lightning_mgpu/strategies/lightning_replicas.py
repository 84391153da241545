"""Lasting replicas of a module run in a LightningModule's step: per replica a ``log`` recorder, its own
``self.device`` and a clone of every torchmetrics metric, folded into the root metric after the step by each state's
``dist_reduce_fx``, as DDP combines ranks (``Metric.merge_state`` refuses ``full_state_update=True`` metrics).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_mean

from lightning_mgpu.parallel.replicas import ReplicaSet
from lightning_mgpu.parallel.run_replicas import ExecutionMode, run_replicas
from lightning_mgpu.strategies.replica_logging import LogRecorder, merge_and_log

if TYPE_CHECKING:
    from lightning_mgpu.strategies.single_process import LightningNamespace

_PER_REPLICA = ("log", "_device", "forward")


class LightningReplicas:
    """Replicas of ``module`` on ``devices`` for steps of a LightningModule of ``namespace``."""

    def __init__(self, module: nn.Module, devices: Sequence[torch.device], namespace: LightningNamespace) -> None:
        self.module = module
        self.devices = list(devices)
        self._namespace = namespace
        self.recorders = [LogRecorder() for _ in self.devices]
        self.metrics = MetricReplicas()
        self.replica_set = ReplicaSet(
            module, self.devices, on_build=self._install, overrides=_PER_REPLICA, shared=lambda m: isinstance(m, Metric)
        )

    def _install(self, replicas: list[nn.Module]) -> None:
        root_device = self.devices[0]
        for replica, device, recorder in zip(replicas, self.devices, self.recorders, strict=True):
            replica.__dict__.pop("forward", None)  # dp's parallel forward belongs to the original only
            for sub in replica.modules():
                if isinstance(sub, self._namespace.lightning_module):
                    sub.log = recorder.log  # shadows LightningModule.log on this replica only
                if device != root_device and isinstance(sub, self._namespace.device_dtype_mixin):
                    sub._device = device
        self.metrics.install(self.module, replicas, self.devices)

    def run(self, count: int, call: Callable[[int, nn.Module], Any], mode: ExecutionMode) -> list[Any]:
        """``call(i, replica_i)`` for the first ``count`` replicas; a failed step leaves no recorded state behind."""
        replicas = self.replica_set.prepare(count, mode)
        try:
            outputs = run_replicas(
                [lambda i=i, r=r: call(i, r) for i, r in enumerate(replicas)], self.devices[:count], mode
            )
        except BaseException:
            self.metrics.discard()
            for recorder in self.recorders:
                recorder.calls.clear()
            raise
        self.replica_set.watch(outputs)  # the backward pass through them reduces the replicas' gradients
        return outputs

    def merge_into(self, root: Any, sample_counts: Sequence[int], implied: Sequence[dict[int, Any]] | None) -> None:
        """Log every recorded name once on ``root`` and fold the metric clones into the root metrics."""
        recorders = self.recorders[: len(sample_counts)]
        in_training = root._current_fx_name == "training_step"
        step_metrics = {
            id(owner)
            for recorder in recorders
            for logged in recorder.calls
            if (owner := self.metrics.owner_of(logged.value)) is not None
            and (in_training if logged.options.get("on_step") is None else logged.options["on_step"])
        }
        self.metrics.merge(step_metrics)
        merge_and_log(root, recorders, sample_counts, self.metrics.owner_of, implied)

    def release(self) -> None:
        """Free the replicas and metric clones on the other devices."""
        self.metrics = MetricReplicas()
        self.replica_set.release()


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
    """Record on ``metric`` what its own ``update``/``forward`` would (torchmetrics has no setters for them)."""
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
    """The per-device metric clones of one LightningModule, merged back after each step."""

    def __init__(self) -> None:
        self._clones: dict[tuple[int, int], Metric] = {}  # (id(root metric), replica index) -> clone
        self._owner: dict[int, Metric] = {}  # id(clone) -> root metric
        self._scratch: dict[int, Metric] = {}  # id(root metric) -> clone used to compute the batch value
        self._active: list[tuple[Metric, list[Metric]]] = []
        self._contributions: dict[int, int] = {}  # id(root metric) -> replica states folded in since its reset

    def install(self, root: nn.Module, replicas: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
        """Put a clone of each root metric, on the replica's device, into every replica."""
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
                replica.set_submodule(path, clone)
                clones.append(clone)
            self._active.append((metric, clones))

    def discard(self) -> None:
        """Reset the clones of a failed step, so no partial update reaches a later step."""
        for _, clones in self._active:
            for clone in clones:
                clone.reset()

    def owner_of(self, value: Any) -> Metric | None:
        """The root metric a replica's clone stands for."""
        return self._owner.get(id(value)) if isinstance(value, Metric) else None

    def merge(self, compute_step_value: set[int]) -> None:
        """Fold every updated clone's state into its root metric, then reset the clones. ``compute_step_value``: ids
        of the root metrics logged with ``on_step``, whose batch value is computed."""
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
            step_value = self._batch_value(metric, batch_state) if id(metric) in compute_step_value else None
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
