"""Lasting replicas of a module run in a LightningModule's step: per replica a ``log`` recorder, its own
``self.device`` and a clone of every torchmetrics metric. After the step every metric of a clone's tree is folded into
the root metric at the same place by each state's ``dist_reduce_fx``, as DDP combines ranks (``Metric.merge_state``
refuses ``full_state_update=True`` metrics). What states cannot carry is refused with the fix."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import is_
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_mean

from lightning_mgpu.parallel.replicas import ReplicaSet
from lightning_mgpu.parallel.run_replicas import ExecutionMode, run_replicas
from lightning_mgpu.strategies.replica_logging import LogRecorder, LossCopy, merge_and_log

if TYPE_CHECKING:
    from lightning_mgpu.strategies.single_process import LightningNamespace

_PER_REPLICA = ("log", "_device")


class LightningReplicas:
    """Replicas of ``module`` on ``devices`` for steps of a LightningModule of ``namespace``."""

    def __init__(self, module: nn.Module, devices: Sequence[torch.device], namespace: LightningNamespace) -> None:
        self.module = module
        self.devices = list(devices)
        self._namespace = namespace
        self.recorders = [LogRecorder() for _ in self.devices]
        self.metrics = MetricReplicas()
        self.hook: str | None = None  # the step hook of the last run
        self.replica_set = ReplicaSet(
            module, self.devices, on_build=self._install, overrides=_PER_REPLICA, shared=lambda m: isinstance(m, Metric)
        )

    def _install(self, replicas: list[nn.Module]) -> None:
        root_device = self.devices[0]
        for replica, device, recorder in zip(replicas, self.devices, self.recorders, strict=True):
            for sub in replica.modules():
                if isinstance(sub, self._namespace.lightning_module):
                    sub.log = recorder.log
                if device != root_device and isinstance(sub, self._namespace.device_dtype_mixin):
                    sub._device = device
        self.metrics.install(self.module, replicas, self.devices)

    def run(self, count: int, call: Callable[[int, nn.Module], Any], mode: ExecutionMode) -> list[Any]:
        """``call(i, replica_i)`` for the first ``count`` replicas; a failed step leaves no recorded state."""
        replicas = self.replica_set.prepare(count)
        try:
            outputs = run_replicas(
                [lambda i=i, r=r: call(i, r) for i, r in enumerate(replicas)], self.devices[:count], mode
            )
        except BaseException:
            self.metrics.discard()
            for recorder in self.recorders:
                recorder.calls.clear()
            raise
        self.replica_set.watch(outputs)  # the backward pass through them reduces the gradients
        return outputs

    def merge_into(self, root: Any, sample_counts: Sequence[int], loss_copy: LossCopy | None) -> None:
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
        merge_and_log(root, recorders, sample_counts, self.metrics.owner_of, loss_copy)

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
    """Combine states as ``Metric._sync_dist`` combines ranks (lists of tensors for "cat" states stay lists)."""
    if isinstance(values[0], list):
        return [t.to(device) for v in values for t in v]
    moved = [v.to(device) for v in values]
    if reduce_fx is dim_zero_cat:
        return dim_zero_cat(moved)
    return torch.stack(moved) if reduce_fx is None else reduce_fx(torch.stack(moved))


def _mark_folded(metric: Metric, step_value: Any = None) -> None:
    """Record on ``metric`` what its own ``update``/``forward`` would (torchmetrics has no setters for them)."""
    metric._update_count += 1
    metric._computed = None
    if step_value is not None:
        metric._forward_cache = step_value


class _Bare(Metric):
    """A metric with nothing of its own: what it sets, every metric sets."""

    def update(self) -> None:
        """Nothing."""

    def compute(self) -> None:
        """Nothing."""


_MISSING = object()
_METRIC_ATTRS = frozenset(vars(_Bare()))  # nn.Module's and torchmetrics' own bookkeeping, set by every metric


def _plain_attributes(metric: Metric) -> dict[str, Any]:
    """What ``metric`` keeps outside its states and every metric's bookkeeping: merging states cannot carry it."""
    return {k: v for k, v in vars(metric).items() if k not in _METRIC_ATTRS and k not in metric._defaults}


def _reset(clone: Metric) -> None:
    clone.reset()
    if clone._forward_cache is not None:  # a wrapper's reset may keep it (CompositionalMetric's does)
        clone._forward_cache = None


def _shard_clone(path: str, metric: Metric) -> Metric:
    """A reset clone of ``metric`` for one replica, on which a direct ``compute()`` (of a shard) is an error;
    torchmetrics' ``forward`` computes with ``_should_unsync`` off, and goes through."""
    clone = metric.clone()
    clone.reset()
    compute = clone.compute

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if clone._should_unsync:
            raise RuntimeError(
                f"compute() was called on self.{path} inside a step run on several replicas, where it holds only "
                f"this replica's shard of the batch. Log the metric object instead (self.log(name, self.{path})), or "
                "call compute() after the step (on_train_batch_end, on_*_epoch_end)."
            )
        return compute(*args, **kwargs)

    clone.compute = guarded
    return clone


@dataclass
class _Node:
    """One metric of a root metric's subtree (the root itself included) and its counterparts in the clones."""

    path: str
    metric: Metric
    clones: list[Metric]
    folds: bool  # holds its own states (a wrapper may expose its child's, as ClasswiseWrapper does)
    wraps: bool  # metrics below it hold states


def _nodes(path: str, metric: Metric, clones: Sequence[Metric]) -> list[_Node]:
    """Every metric of ``metric``'s subtree paired with the clones' metric at the same place, children first."""
    trees = [list(c.named_modules()) for c in clones]
    nodes: list[_Node] = []
    seen: set[int] = set()
    for k, (name, sub) in reversed(list(enumerate(metric.named_modules()))):
        if isinstance(sub, Metric):
            folds = bool(sub._defaults) and id(sub._defaults) not in seen
            wraps = any(isinstance(m, Metric) and m._defaults for m in list(sub.modules())[1:])
            seen.add(id(sub._defaults))
            node_path = f"{path}.{name}" if name else path
            nodes.append(_Node(node_path, sub, [tree[k][1] for tree in trees], folds, wraps))
    return nodes


def _check_step(node: _Node, clone: Metric, installed: tuple[int, dict[str, Any]]) -> dict[str, Any]:
    """Refuse what the replicas' states cannot reproduce: torchmetrics' own forward of a wrapper (on one device it
    resets the wrapped metrics) and a rebound or added plain attribute; return those set for the first time (absent,
    ``None`` or ``False`` before: ``MeanIoU``'s inferred ``num_classes``), as one device's metric sets them.
    ``installed``: the clone's attribute count and plain attributes when installed."""
    if node.wraps and clone._forward_cache is not None:
        wrapped = [m for m in clone.modules() if m is not clone and isinstance(m, Metric)]
        if all(m._forward_cache is None for m in wrapped):
            raise TypeError(
                f"self.{node.path}(...) ({type(clone).__name__}) ran torchmetrics' forward in a replicated step: on "
                "one device it resets the metrics it wraps, which the replicas cannot reproduce. Call "
                f"self.{node.path}.update(...) in the step instead, or use strategy='dp' or 'ddp'."
            )
    size, before = installed
    attrs = vars(clone)
    if len(attrs) == size and all(map(is_, map(attrs.get, before), before.values())):
        return {}
    changed = {k: v for k, v in _plain_attributes(clone).items() if before.get(k, _MISSING) is not v}
    settled = {k: v for k, v in changed.items() if any(before.get(k, _MISSING) is u for u in (_MISSING, None, False))}
    if refused := [k for k in changed if k not in settled]:
        raise TypeError(
            f"self.{node.path} ({type(clone).__name__}) changed {', '.join(map(repr, refused))} in a replicated step: "
            "outside its metric states, the replicas' updates cannot be merged. Update it outside the replicated "
            "step (e.g. in on_train_batch_end or on_validation_batch_end), or use strategy='dp' or 'ddp'."
        )
    return settled


class MetricReplicas:
    """The per-device metric clones of one LightningModule, merged back after each step."""

    def __init__(self) -> None:
        self._clones: dict[tuple[int, int], Metric] = {}  # (id(root metric), replica index) -> clone
        self._owner: dict[int, Metric] = {}  # id(clone or a metric in it) -> the root metric it stands for
        self._installed: dict[int, tuple[int, dict[str, Any]]] = {}  # id(clone's metric) -> see _check_step
        self._scratch: dict[int, Metric] = {}  # id(root metric) -> clone used to compute the batch value
        self._active: list[list[_Node]] = []
        self._contributions: dict[int, int] = {}  # id(root metric) -> replica states folded in since its reset

    def install(self, root: nn.Module, replicas: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
        """Put a clone of each root metric, on the replica's device, into every replica."""
        self._active = []
        for path, metric in _outermost_metrics(root):
            clones = []
            for index, (replica, device) in enumerate(zip(replicas, devices, strict=True)):
                clone = self._clones.get((id(metric), index))
                if clone is None:
                    clone = self._clones[id(metric), index] = _shard_clone(path, metric)
                clone.to(device)
                replica.set_submodule(path, clone)
                clones.append(clone)
            nodes = _nodes(path, metric, clones)
            for node in nodes:
                for clone in node.clones:
                    self._owner[id(clone)] = node.metric
                    self._installed[id(clone)] = (len(vars(clone)), _plain_attributes(clone))
            self._active.append(nodes)

    def discard(self) -> None:
        """Reset the clones of a failed step, so no partial update reaches a later step."""
        for nodes in self._active:
            for node in nodes:
                for clone in node.clones:
                    _reset(clone)

    def owner_of(self, value: Any) -> Metric | None:
        """The root metric a replica's clone (or a metric inside it) stands for."""
        return self._owner.get(id(value)) if isinstance(value, Metric) else None

    def merge(self, compute_step_value: set[int]) -> None:
        """Fold every used clone's states into the root metric at the same place, children first, then reset the
        clones. ``compute_step_value``: ids of the root metrics logged with ``on_step``."""
        for nodes in self._active:
            used = [
                (node, [c for c in node.clones if c.update_count or c._forward_cache is not None]) for node in nodes
            ]
            for node, clones in used:  # all of a wrapper's: torchmetrics' WrapperMetric counts no updates of its own
                for clone in node.clones if node.wraps else clones:
                    for name, value in _check_step(node, clone, self._installed[id(clone)]).items():
                        setattr(node.metric, name, value)  # set on a first update: the root's would set it alike
            batch_states: dict[int, dict[str, Any]] = {}  # id(root metric) -> the replicas' states combined
            for node, clones in used:
                if clones:
                    self._fold(node, clones, batch_states, compute_step_value)
            for _, clones in used:
                for clone in clones:
                    _reset(clone)

    def _fold(
        self, node: _Node, clones: list[Metric], batch_states: dict[int, dict[str, Any]], step_values: set[int]
    ) -> None:
        """Fold the used clones' states into one root metric and record the update, with the batch value where the
        metric is logged on_step and the step ran its forward."""
        metric = node.metric
        reductions = metric._reductions  # each state's dist_reduce_fx
        device = next((v.device for v in metric.metric_state.values() if isinstance(v, Tensor)), metric.device)
        states: dict[str, Any] = {}
        for attr, fx in reductions.items() if node.folds else ():
            values = [c.metric_state[attr] for c in clones]
            if not isinstance(values[0], (Tensor, list)):
                raise TypeError(
                    f"The torchmetrics metric {type(metric).__name__} keeps its state {attr!r} as a "
                    f"{type(values[0]).__name__}, which cannot be merged across replicas (only tensors and lists of "
                    "tensors can). Update it outside the replicated step (e.g. in on_train_batch_end), or use "
                    "strategy='dp' or 'ddp'."
                )
            states[attr] = _combine(values, fx, device)
        batch_states[id(metric)] = states
        forwarded = id(metric) in step_values and any(c._forward_cache is not None for c in clones)
        step_value = self._batch_value(metric, batch_states) if forwarded else None
        if states:
            folded = 0 if metric.update_count == 0 else self._contributions.get(id(metric), 1)
            for attr, value in states.items():
                current = getattr(metric, attr)
                setattr(metric, attr, _folded(current, value, reductions[attr], device, folded, len(clones)))
            self._contributions[id(metric)] = folded + len(clones)
        _mark_folded(metric, step_value)

    def _batch_value(self, metric: Metric, batch_states: dict[int, dict[str, Any]]) -> Any:
        """``metric``'s value on this batch alone: a scratch copy of it holding the replicas' combined states."""
        if (scratch := self._scratch.get(id(metric))) is None:
            scratch = self._scratch[id(metric)] = metric.clone()
        for original, copy in zip(metric.modules(), scratch.modules(), strict=True):  # parents before children
            if isinstance(copy, Metric):
                copy.reset()
                if (states := batch_states.get(id(original))) is not None:
                    for attr, value in states.items():
                        setattr(copy, attr, value)
                    _mark_folded(copy)
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
