"""Lasting replicas of a module run in a LightningModule's step: per replica a ``log`` recorder, its own
``self.device`` and a clone of every torchmetrics metric the module holds (as a submodule, or in a dict, list or tuple
attribute). After the step every metric of a clone's tree is folded into the root metric at the same place by each
state's ``dist_reduce_fx``, as DDP combines ranks (``Metric.merge_state`` refuses ``full_state_update=True`` metrics).
What a clone's call returns is its shard's value; logged, it becomes one device's batch value: the value of the
replicas' batch states of that call combined. An aggregation metric (``MeanMetric``...) fed a scalar per replica is
replayed on the merged scalar (a loss by its rule), as one device's update. What states cannot carry is refused with
the fix."""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import is_
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.aggregation import CatMetric, MaxMetric, MeanMetric, MinMetric, SumMetric
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_mean

from lightning_mgpu.parallel.replicas import ReplicaSet
from lightning_mgpu.parallel.run_replicas import ExecutionMode, run_replicas
from lightning_mgpu.strategies.checks import ENTRIES_READ
from lightning_mgpu.strategies.replica_logging import LogRecorder, LossCopy, merge_and_log, merge_scalars

if TYPE_CHECKING:
    from lightning_mgpu.strategies.single_process import LightningNamespace

_PER_REPLICA = ("log", "_device")
#: Merges one call's inputs of an aggregation metric over the replicas: ``(entries, weights, kind)``, see
#: :func:`.replica_logging.merge_scalars`.
ScalarMerge = Callable[[list[tuple[int, Any]], list[Any] | None, str], Tensor | None]


class LightningReplicas:
    """Replicas of ``module`` on ``devices`` for steps of a LightningModule of ``namespace``."""

    def __init__(self, module: nn.Module, devices: Sequence[torch.device], namespace: LightningNamespace) -> None:
        self.module = module
        self.devices = list(devices)
        self._namespace = namespace
        self.recorders = [LogRecorder() for _ in self.devices]
        # Lightning's own attributes hold no metrics: not searched for them.
        self._lightning_attributes = _attributes_of(namespace.lightning_module)
        self.metrics = MetricReplicas(self._lightning_attributes)
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
        self.metrics.refresh(self.module, self.replica_set.replicas)  # metrics put in or taken out of containers
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
        logged = {id(call.value) for recorder in recorders for call in recorder.calls}
        scalars = functools.partial(
            merge_scalars, sample_counts=sample_counts, replicas=len(recorders), loss_copy=loss_copy
        )
        try:
            self.metrics.merge(step_metrics, logged, scalars)
            merge_and_log(root, recorders, sample_counts, self.metrics.owner_of, loss_copy, self.metrics.step_value)
        finally:
            self.metrics.end_step()

    def release(self) -> None:
        """Free the replicas and metric clones on the other devices."""
        self.metrics = MetricReplicas(self._lightning_attributes)
        self.replica_set.release()


@functools.cache
def _attributes_of(module_class: type[nn.Module]) -> frozenset[str]:
    """The attributes every instance of ``module_class`` (nn.Module, a LightningModule) sets for itself."""
    return frozenset(vars(module_class()))


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


# --- metrics held in plain containers --------------------------------------------------------------------------------
_CONTAINER_DEPTH = 3  # dicts, lists and tuples searched this deep: {"train": {"f1": F1Score()}}


def _is_container(value: Any) -> bool:
    """A dict, list or tuple that may hold metrics (a larger one, a vocabulary or a cache, is not searched)."""
    return (isinstance(value, (dict, list)) or type(value) is tuple) and len(value) <= ENTRIES_READ


def _items(container: Any) -> Any:
    return container.values() if isinstance(container, dict) else container


def _holds_metrics(value: Any, depth: int = _CONTAINER_DEPTH) -> bool:
    """Whether ``value`` is a metric, a module with metrics (a ``MetricCollection``) or a container holding one."""
    if isinstance(value, Metric):
        return True
    if isinstance(value, nn.Module):
        return bool(_outermost_metrics(value))
    if depth and _is_container(value):
        return any(_holds_metrics(item, depth - 1) for item in _items(value))
    return False


def _swapped(value: Any, path: str, swap: Callable[[str, Metric], Metric], depth: int = _CONTAINER_DEPTH) -> Any:
    """A copy of ``value`` (a container attribute) for one replica: every metric in it replaced by ``swap(path,
    metric)``, modules with metrics (``MetricCollection``) shallow-copied around theirs; what holds none is kept."""
    if isinstance(value, Metric):
        return swap(path, value)
    if not _holds_metrics(value, depth):
        return value
    if isinstance(value, nn.Module):
        replica = value._replicate_for_data_parallel()
        for name, child in value._modules.items():
            replica._modules[name] = child if child is None else _swapped(child, f"{path}.{name}", swap)
        return replica
    if type(value) is tuple:
        return tuple(_swapped(item, f"{path}[{k}]", swap, depth - 1) for k, item in enumerate(value))
    replica = copy.copy(value)  # dict and list subclasses keep their type (a defaultdict its factory)
    for key, item in value.items() if isinstance(value, dict) else enumerate(value):
        replica[key] = _swapped(item, f"{path}[{key!r}]", swap, depth - 1)
    return replica


def _module_paths(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module of ``root``'s tree outside metrics (whose own attributes hold no user metrics)."""
    stack = [("", root)]
    while stack:
        path, module = stack.pop()
        yield path, module
        stack.extend(
            (f"{path}.{name}" if path else name, child)
            for name, child in module._modules.items()
            if child is not None and not isinstance(child, Metric)
        )


def _containers(module: nn.Module, ignored: frozenset[str]) -> Iterator[tuple[str, Any]]:
    """``module``'s own container attributes, outside ``ignored`` (torch's and Lightning's bookkeeping)."""
    return ((name, value) for name, value in vars(module).items() if name not in ignored and _is_container(value))


@dataclass
class _Holder:
    """A container attribute that holds metrics: on which module, and the copy installed on each replica."""

    path: str  # the module's path in the tree ("" for the root)
    attribute: str
    installed: list[tuple[nn.Module, Any]] = field(default_factory=list)  # (replica's module, its copy)

    def in_place(self) -> bool:
        """Whether every replica still holds its copy (a rebinding on the root reaches the replicas as it is)."""
        return all(vars(module).get(self.attribute) is value for module, value in self.installed)


# --- per-replica clones ----------------------------------------------------------------------------------------------
@dataclass
class _Call:
    """One call of a replica's metric clone in a step: ``forward`` (``self.metric(...)``) or ``update``. A forward
    keeps the batch states its shard alone gave and the value it returned; an aggregation metric its arguments."""

    forward: bool
    arguments: dict[str, Any] | None = None
    states: dict[str, Any] | None = None
    value: Any = None


_AGGREGATES: dict[type[Metric], str] = {
    MeanMetric: "mean",
    SumMetric: "sum",
    MaxMetric: "max",
    MinMetric: "min",
    CatMetric: "cat",
}


@functools.cache
def _update_signature(metric_class: type[Metric]) -> inspect.Signature:
    return inspect.signature(metric_class.update)


def _arguments(metric: Metric, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """An aggregation metric's update arguments by name (``value``, ``weight``); ``None`` for other metrics."""
    if type(metric) not in _AGGREGATES:
        return None
    try:
        return dict(_update_signature(type(metric)).bind(metric, *args, **kwargs).arguments)
    except TypeError:  # update itself will say what is wrong
        return {}


def _states_of(metric: Metric) -> dict[str, Any]:
    """``metric``'s states now (lists copied: the metric may extend them later)."""
    states = {attr: getattr(metric, attr) for attr in metric._defaults}
    return {attr: list(value) if isinstance(value, list) else value for attr, value in states.items()}


def _aliases(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Tensor arguments as ``detach()`` aliases, where gradients are off (the same tensors there): evaluation reads
    its losses by object while the step runs, and an aggregation metric's own reads of them (``value.shape``) must
    not count as the step's."""
    if torch.is_grad_enabled():
        return args, kwargs
    return tuple(map(_alias, args)), {k: _alias(v) for k, v in kwargs.items()}


def _alias(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value


def _record_calls(clone: Metric, calls: list[_Call]) -> None:
    """Append each call of ``clone`` in a step to ``calls``: a forward once (it updates once or twice inside). An
    aggregation metric keeps its arguments, and gets aliases of its tensors (see :func:`_aliases`)."""
    forward, update = clone.forward, clone.update
    inside = [False]
    shield = _aliases if type(clone) in _AGGREGATES else lambda args, kwargs: (args, kwargs)

    def recorded_forward(*args: Any, **kwargs: Any) -> Any:
        call = _Call(True, _arguments(clone, args, kwargs))
        calls.append(call)
        inside[0] = True
        try:
            args, kwargs = shield(args, kwargs)
            call.value = forward(*args, **kwargs)
        finally:
            inside[0] = False
        return call.value

    def recorded_update(*args: Any, **kwargs: Any) -> Any:
        if not inside[0]:
            calls.append(_Call(False, _arguments(clone, args, kwargs)))
            args, kwargs = shield(args, kwargs)
        return update(*args, **kwargs)

    clone.forward, clone.update = recorded_forward, recorded_update


def _shard_clone(path: str, metric: Metric, calls: list[_Call]) -> Metric:
    """A reset clone of ``metric`` for one replica, recording its calls in ``calls``. A direct ``compute()`` (of a
    shard) is an error; torchmetrics' ``forward`` computes with ``_should_unsync`` off, and goes through: the batch
    states it computes on are its shard's, kept for the merged batch value."""
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
        if calls and calls[-1].forward and calls[-1].states is None:  # forward computes its batch value
            calls[-1].states = _states_of(clone)
        return compute(*args, **kwargs)

    clone.compute = guarded
    _record_calls(clone, calls)
    return clone


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
    """The per-device metric clones of one LightningModule, merged back after each step. ``ignored``: attributes of
    the module's own class hierarchy (Lightning's), not searched for metrics."""

    def __init__(self, ignored: frozenset[str] = frozenset()) -> None:
        self._ignored = _attributes_of(nn.Module) | ignored
        self._clones: dict[tuple[int, int], Metric] = {}  # (id(root metric), replica index) -> clone
        self._calls: dict[int, list[_Call]] = {}  # id(clone) -> its calls in this step
        self._owner: dict[int, Metric] = {}  # id(clone or a metric in it) -> the root metric it stands for
        self._installed: dict[int, tuple[int, dict[str, Any]]] = {}  # id(clone's metric) -> see _check_step
        self._scratch: dict[int, Metric] = {}  # id(root metric) -> clone used to compute batch values
        self._in_modules: list[list[_Node]] = []  # the submodule metrics' nodes
        self._in_containers: list[list[_Node]] = []  # those of metrics held in container attributes
        self._holders: list[_Holder] = []
        self._signature: list[tuple[Any, ...]] = []  # the containers of the root and of _holders' modules
        self._contributions: dict[int, int] = {}  # id(root metric) -> replica states folded in since its reset
        self._step_values: dict[int, tuple[tuple[Any, ...], Any]] = {}  # see step_value

    @property
    def _active(self) -> list[list[_Node]]:
        return self._in_modules + self._in_containers

    def install(self, root: nn.Module, replicas: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
        """Put a clone of each root metric, on the replica's device, into every replica (submodules), and a copy of
        each container attribute holding metrics, with clones where they stay (Lightning moves none of them)."""
        self._in_modules = []
        for path, metric in _outermost_metrics(root):
            clones = [self._clone(path, metric, i, device) for i, device in enumerate(devices)]
            for replica, clone in zip(replicas, clones, strict=True):
                replica.set_submodule(path, clone)
            self._in_modules.append(self._register(path, metric, clones))
        self._install_containers(root, replicas)

    def refresh(self, root: nn.Module, replicas: Sequence[nn.Module]) -> None:
        """Install the container attributes again where the root's changed (a metric added, a dict rebound) or a
        rebinding reached the replicas; a cheap comparison of their items' identities otherwise."""
        if self._container_signature(root) != self._signature or not all(h.in_place() for h in self._holders):
            self._install_containers(root, replicas)

    def _clone(self, path: str, metric: Metric, index: int, device: torch.device | None) -> Metric:
        clone = self._clones.get((id(metric), index))
        if clone is None:
            calls: list[_Call] = []
            clone = self._clones[id(metric), index] = _shard_clone(path, metric, calls)
            self._calls[id(clone)] = calls
        if device is not None:
            clone.to(device)
        return clone

    def _register(self, path: str, metric: Metric, clones: list[Metric]) -> list[_Node]:
        nodes = _nodes(path, metric, clones)
        for node in nodes:
            for clone in node.clones:
                self._owner[id(clone)] = node.metric
                self._installed[id(clone)] = (len(vars(clone)), _plain_attributes(clone))
        return nodes

    def _install_containers(self, root: nn.Module, replicas: Sequence[nn.Module]) -> None:
        in_modules = {id(node.metric) for nodes in self._in_modules for node in nodes}
        found: dict[int, tuple[str, Metric, dict[int, Metric]]] = {}  # id(root metric) -> path, metric, clones

        def swap(index: int, path: str, metric: Metric) -> Metric:
            clone = self._clone(path, metric, index, None)
            found.setdefault(id(metric), (path, metric, {}))[2][index] = clone  # held twice: one clone
            return clone

        self._holders = []
        for module_path, module in _module_paths(root):
            for name, value in _containers(module, self._ignored):
                if not _holds_metrics(value):
                    continue
                holder = _Holder(module_path, name)
                path = f"{module_path}.{name}" if module_path else name
                for index, replica in enumerate(replicas):
                    target = replica.get_submodule(module_path)
                    target.__dict__[name] = installed = _swapped(value, path, functools.partial(swap, index))
                    holder.installed.append((target, installed))
                self._holders.append(holder)
        self._in_containers = [  # a metric also held as a submodule folds once
            self._register(path, metric, [clones[i] for i in range(len(replicas))])
            for path, metric, clones in found.values()
            if id(metric) not in in_modules
        ]
        self._signature = self._container_signature(root)

    def _container_signature(self, root: nn.Module) -> list[tuple[Any, ...]]:
        """The root's and the holders' modules' container attributes, and the items of those holding metrics (a list
        of outputs grown every step changes nothing here; a metric put in place into it is not seen)."""
        holding = {(h.path, h.attribute) for h in self._holders}
        paths = dict.fromkeys(["", *(h.path for h in self._holders)])
        return [
            (path, name, id(value), *(map(id, _items(value)) if (path, name) in holding else ()))
            for path in paths
            for name, value in _containers(root.get_submodule(path), self._ignored)
        ]

    def discard(self) -> None:
        """Reset the clones of a failed step, so no partial update reaches a later step."""
        for nodes in self._active:
            for node in nodes:
                for clone in node.clones:
                    _reset(clone)
        for calls in self._calls.values():
            calls.clear()

    def owner_of(self, value: Any) -> Metric | None:
        """The root metric a replica's clone (or a metric inside it) stands for."""
        return self._owner.get(id(value)) if isinstance(value, Metric) else None

    def step_value(self, value: Any) -> tuple[tuple[Any, ...], Any] | None:
        """For what a replica's metric call returned in this step and logged: the call's key (the same on every
        replica) and one device's value, from the replicas' batch states of that call; ``None`` for other values."""
        return self._step_values.get(id(value))

    def end_step(self) -> None:
        """Drop the step's batch values (after logging)."""
        self._step_values = {}

    def merge(self, compute_step_value: set[int], logged: set[int], scalars: ScalarMerge | None = None) -> None:
        """Fold every used clone's states into the root metric at the same place, children first, then reset the
        clones. ``compute_step_value``: ids of the root metrics logged with ``on_step``; ``logged``: ids of the
        values logged in the step (a call's returned value among them gets one device's); ``scalars`` merges an
        aggregation metric's scalar inputs (``None``: its clones' states fold as any metric's)."""
        self._step_values = {}
        wanted = _Wanted(compute_step_value, logged, scalars)
        for nodes in self._active:
            used = [(node, [(i, c) for i, c in enumerate(node.clones) if self._used(c)]) for node in nodes]
            for node, clones in used:  # all of a wrapper's: torchmetrics' WrapperMetric counts no updates of its own
                for clone in node.clones if node.wraps else (c for _, c in clones):
                    for name, value in _check_step(node, clone, self._installed[id(clone)]).items():
                        setattr(node.metric, name, value)  # set on a first update: the root's would set it alike
            batch_states: dict[int, dict[str, Any]] = {}  # id(root metric) -> the replicas' states combined
            for node, clones in used:
                if clones:
                    self._fold(node, clones, batch_states, wanted)
            for _, clones in used:
                for _, clone in clones:
                    _reset(clone)
                    self._calls.get(id(clone), []).clear()

    def _fold(
        self, node: _Node, clones: list[tuple[int, Metric]], batch_states: dict[int, dict[str, Any]], wanted: _Wanted
    ) -> None:
        """Fold the used clones' states into one root metric and record the update, with the batch value where the
        metric is logged on_step and the step ran its forward."""
        metric = node.metric
        device = next((v.device for v in metric.metric_state.values() if isinstance(v, Tensor)), metric.device)
        calls = self._aligned_calls(node, clones)
        replay = self._replay(metric, calls, wanted.scalars) if calls is not None and not node.wraps else None
        states = replay[0] if replay is not None else _combined_states(node, [c for _, c in clones], device)
        batch_states[id(metric)] = states
        last = None
        if calls is not None:
            last = self._call_values(metric, calls, self._values(node, calls, replay, batch_states, device), wanted)
        forwarded = id(metric) in wanted.on_step and any(c._forward_cache is not None for _, c in clones)
        step_value = None if not forwarded else last if last is not None else self._batch_value(metric, batch_states)
        if states:
            folded = 0 if metric.update_count == 0 else self._contributions.get(id(metric), 1)
            n = 1 if replay is not None else len(clones)  # a replay is one device's update
            reductions = metric._reductions  # each state's dist_reduce_fx
            for attr, value in states.items():
                current = getattr(metric, attr)
                setattr(metric, attr, _folded(current, value, reductions[attr], device, folded, n))
            self._contributions[id(metric)] = folded + n
        if any(_counted(c) for _, c in clones):  # as its own update or forward would (a wrapper's counts nothing)
            _mark_folded(metric, step_value)

    def _used(self, clone: Metric) -> bool:
        """Whether the step updated or called ``clone`` (a wrapper counts no updates of its own)."""
        return _counted(clone) or bool(self._calls.get(id(clone)))

    def _aligned_calls(self, node: _Node, clones: list[tuple[int, Metric]]) -> list[tuple[int, list[_Call]]] | None:
        """Each used clone's calls in the step, where they pair up (the same sequence of forwards and updates on
        every replica: the k-th call of each is one device's k-th call); ``None`` otherwise, for metrics inside
        another (not called by the step) and for a wrapper called otherwise than once (its batch states, those of
        the metrics it wraps, are the whole step's)."""
        calls = [(index, self._calls.get(id(clone))) for index, clone in clones]
        if any(not c for _, c in calls):
            return None
        kinds = {tuple(call.forward for call in c) for _, c in calls}
        if len(kinds) != 1 or (node.wraps and kinds != {(True,)}):
            return None
        return calls

    def _scratch_of(self, metric: Metric) -> Metric:
        """A copy of ``metric`` to compute on, made again when the metric moved or changed dtype since (Lightning's
        ``64-true`` converts metrics after the module was built)."""
        scratch = self._scratch.get(id(metric))
        if scratch is None or scratch.dtype != metric.dtype or scratch.device != metric.device:
            scratch = self._scratch[id(metric)] = metric.clone()
        return scratch

    def _replay(
        self, metric: Metric, calls: list[tuple[int, list[_Call]]], scalars: ScalarMerge | None
    ) -> tuple[dict[str, Any], list[dict[str, Any] | None]] | None:
        """For an aggregation metric given a scalar per replica in each call (``self.mean_loss(loss)``): its states
        after one device's calls on the merged scalars, for the step and for each call alone; ``None`` otherwise
        (its clones' states fold, exact for per-sample values)."""
        kind = _AGGREGATES.get(type(metric))
        inputs = None if kind is None or scalars is None else _merged_inputs(calls, scalars, kind)
        if inputs is None:
            return None
        scratch = self._scratch_of(metric)
        per_call: list[dict[str, Any] | None] = []
        for merged in inputs:
            scratch.reset()
            scratch.update(**merged)
            per_call.append(_states_of(scratch))
        if len(inputs) > 1:
            scratch.reset()
            for merged in inputs:
                scratch.update(**merged)
        return _states_of(scratch), per_call

    def _values(
        self,
        node: _Node,
        calls: list[tuple[int, list[_Call]]],
        replay: tuple[dict[str, Any], list[dict[str, Any] | None]] | None,
        batch_states: dict[int, dict[str, Any]],
        device: torch.device,
    ) -> Callable[[int], Any]:
        """How to compute one device's value of the step's k-th call of ``node``'s metric (``None``: no way)."""
        if node.wraps:  # called once (see _aligned_calls): the batch states of the metrics it wraps are that call's
            return lambda k: self._batch_value(node.metric, batch_states)
        per_call = replay[1] if replay is not None else _per_call_states(node.metric, calls, device)
        return lambda k: None if (states := per_call[k]) is None else self._value_of(node.metric, states)

    def _call_values(
        self, metric: Metric, calls: list[tuple[int, list[_Call]]], value_of: Callable[[int], Any], wanted: _Wanted
    ) -> Any:
        """Map each logged value a forward returned (or an item of it) to one device's value of that call; return
        the last forward's value where the metric itself is logged on_step, else ``None``."""
        forwards = [k for k, call in enumerate(calls[0][1]) if call.forward]
        last = None
        for k in forwards:
            logged = [(p, leaf) for _, c in calls for p, leaf in _leaves(c[k].value) if id(leaf) in wanted.logged]
            on_step = k == forwards[-1] and id(metric) in wanted.on_step
            value = value_of(k) if logged or on_step else None
            if value is None:
                continue
            merged = dict(_leaves(value))
            for path, leaf in logged:
                if path in merged:
                    self._step_values[id(leaf)] = ((id(metric), k, path), merged[path])
            last = value if on_step else last
        return last

    def _value_of(self, metric: Metric, states: dict[str, Any]) -> Any:
        """``metric``'s value on ``states`` alone (a scratch copy of it holds them)."""
        scratch = self._scratch_of(metric)
        scratch.reset()
        for attr, value in states.items():
            setattr(scratch, attr, value)
        _mark_folded(scratch)
        return scratch.compute()

    def _batch_value(self, metric: Metric, batch_states: dict[int, dict[str, Any]]) -> Any:
        """``metric``'s value on this batch alone: a scratch copy of it holding the replicas' combined states."""
        scratch = self._scratch_of(metric)
        for original, copied in zip(metric.modules(), scratch.modules(), strict=True):  # parents before children
            if isinstance(copied, Metric):
                copied.reset()
                if (states := batch_states.get(id(original))) is not None:
                    for attr, value in states.items():
                        setattr(copied, attr, value)
                    _mark_folded(copied)
        return scratch.compute()


@dataclass
class _Wanted:
    """What a step's merge must produce: batch values of the metrics logged on_step (``on_step``: their ids) and of
    the logged values calls returned (``logged``: ids of the values logged), and how to merge scalar inputs."""

    on_step: set[int]
    logged: set[int]
    scalars: ScalarMerge | None


def _counted(clone: Metric) -> bool:
    """Whether ``clone`` counted an update or ran its forward in the step."""
    return bool(clone.update_count) or clone._forward_cache is not None


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """``(path, leaf)`` of a metric's value: itself, or the items of its dicts, lists and tuples."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        for k, item in enumerate(value):
            yield from _leaves(item, (*path, k))
    else:
        yield path, value


def _combined_states(node: _Node, clones: list[Metric], device: torch.device) -> dict[str, Any]:
    """The clones' states combined as DDP combines ranks' (none where the node holds none of its own)."""
    return {attr: _combine(_state_values(node, clones, attr), fx, device) for attr, fx in _own_reductions(node)}


def _own_reductions(node: _Node) -> list[tuple[str, Any]]:
    return list(node.metric._reductions.items()) if node.folds else []


def _state_values(node: _Node, clones: Sequence[Metric], attr: str) -> list[Any]:
    values = [c.metric_state[attr] for c in clones]
    if not isinstance(values[0], (Tensor, list)):
        raise TypeError(
            f"The torchmetrics metric {type(node.metric).__name__} keeps its state {attr!r} as a "
            f"{type(values[0]).__name__}, which cannot be merged across replicas (only tensors and lists of "
            "tensors can). Update it outside the replicated step (e.g. in on_train_batch_end), or use "
            "strategy='dp' or 'ddp'."
        )
    return values


def _per_call_states(
    metric: Metric, calls: list[tuple[int, list[_Call]]], device: torch.device
) -> list[dict[str, Any] | None]:
    """For each call (paired over the replicas), the batch states one device's call would have computed on: the
    replicas' forward batch states combined; ``None`` for updates and where one is missing."""
    per_call: list[dict[str, Any] | None] = []
    for k in range(len(calls[0][1])):
        states = [c[k].states for _, c in calls]
        if any(s is None for s in states):
            per_call.append(None)
            continue
        reductions = metric._reductions
        per_call.append({attr: _combine([s[attr] for s in states], reductions[attr], device) for attr in states[0]})
    return per_call


def _merged_inputs(
    calls: list[tuple[int, list[_Call]]], scalars: ScalarMerge, kind: str
) -> list[dict[str, Any]] | None:
    """The update arguments one device's calls of an aggregation metric would get: per call, the replicas' scalar
    ``value`` merged by ``scalars``, and a ``weight`` passed on every replica summed (each weighs its shard, as
    ``self.log``'s ``batch_size=``); ``None`` where a call's inputs cannot be merged so (they fold instead)."""
    inputs = []
    for k in range(len(calls[0][1])):
        arguments = [(index, c[k].arguments or {}) for index, c in calls]
        weights = [a.get("weight") for _, a in arguments]
        if any(w is None for w in weights) and not all(w is None for w in weights):
            return None
        given = None if weights[0] is None else weights
        value = scalars([(index, a.get("value")) for index, a in arguments], given, kind)
        if value is None:
            return None
        merged: dict[str, Any] = {"value": value}
        if given is not None:
            merged["weight"] = sum(float(w) for w in given)
        inputs.append(merged)
    return inputs


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
