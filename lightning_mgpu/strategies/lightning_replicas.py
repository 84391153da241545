"""Lasting replicas of a LightningModule for its steps: per replica a ``log`` recorder, its own ``self.device`` and a
clone of every torchmetrics metric the module holds (as a submodule, or in a dict, list or tuple attribute).

After the step every metric of a clone's tree folds into the root metric at the same place by each state's
``dist_reduce_fx``, as DDP combines ranks (``Metric.merge_state`` refuses ``full_state_update`` metrics and moves no
state between devices). A logged value a clone's forward returned becomes one device's batch value, computed on the
replicas' batch states of that call; an aggregation metric (``MeanMetric``...) given one scalar per replica is called
on the root with the merged scalar (a loss by its rule). What states cannot carry is refused."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
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
_DEPTH = 3  # dicts, lists and tuples searched this deep: {"train": {"f1": F1Score()}}
_AGGREGATES = {MeanMetric: "mean", SumMetric: "sum", MaxMetric: "max", MinMetric: "min", CatMetric: "cat"}
#: Merges one call's scalar inputs of an aggregation metric over the replicas: see ``merge_scalars``.
ScalarMerge = Callable[[list[tuple[int, Any]], list[Any] | None, str], Tensor | None]


class LightningReplicas:
    """Replicas of ``module`` on ``devices`` for steps of a LightningModule of ``namespace``."""

    def __init__(self, module: nn.Module, devices: Sequence[torch.device], namespace: LightningNamespace) -> None:
        self.module = module
        self.devices = list(devices)
        self._namespace = namespace
        self.recorders = [LogRecorder() for _ in self.devices]
        self._lightning_attributes = _attributes_of(namespace.lightning_module)  # they hold no metrics
        self.metrics = MetricReplicas(self._lightning_attributes)
        self.hook: str | None = None  # the step hook of the last run
        self.replica_set = ReplicaSet(
            module, self.devices, on_build=self._install, overrides=_PER_REPLICA, shared=lambda m: isinstance(m, Metric)
        )

    def _install(self, replicas: list[nn.Module]) -> None:
        for replica, device, recorder in zip(replicas, self.devices, self.recorders, strict=True):
            for sub in replica.modules():
                if isinstance(sub, self._namespace.lightning_module):
                    sub.log = recorder.log
                if device != self.devices[0] and isinstance(sub, self._namespace.device_dtype_mixin):
                    sub._device = device
        self.metrics.install(self.module, replicas, self.devices)

    def run(self, count: int, call: Callable[[int, nn.Module], Any], mode: ExecutionMode) -> list[Any]:
        """``call(i, replica_i)`` for the first ``count`` replicas; a failed step leaves no recorded state."""
        replicas = self.replica_set.prepare(count)
        self.metrics.refresh(self.module, self.replica_set.replicas)  # metrics put in or taken out of containers
        try:
            outputs = run_replicas([partial(call, i, r) for i, r in enumerate(replicas)], self.devices[:count], mode)
        except BaseException:
            self.metrics.discard()
            for recorder in self.recorders:
                recorder.calls.clear()
            raise
        self.replica_set.watch(outputs)  # the backward pass through them reduces the gradients
        return outputs

    def merge_into(
        self, root: Any, sample_counts: Sequence[int], loss_copy: LossCopy | None, outputs: Sequence[Any]
    ) -> dict[str, int]:
        """Fold the metric clones into the root metrics and log every recorded name once on ``root``; return the names
        one replica alone logged, of unknown one-device value (see :func:`.replica_logging.merge_and_log`)."""
        recorders = self.recorders[: len(sample_counts)]
        scalars = partial(merge_scalars, sample_counts=sample_counts, replicas=len(recorders), loss_copy=loss_copy)
        values = self.metrics.merge(recorders, root._current_fx_name == "training_step", scalars)
        return merge_and_log(root, recorders, sample_counts, self.metrics.owner_of, loss_copy, values, outputs)

    def release(self) -> None:
        """Free the replicas and metric clones on the other devices."""
        self.metrics = MetricReplicas(self._lightning_attributes)
        self.replica_set.release()


@functools.cache
def _attributes_of(module_class: type[nn.Module]) -> frozenset[str]:
    """The attributes every instance of ``module_class`` (nn.Module, a LightningModule) sets for itself."""
    return frozenset(vars(module_class()))


# --- where metrics are held ------------------------------------------------------------------------------------------
def _is_container(value: Any) -> bool:
    """A dict, list or tuple that may hold metrics (a larger one, a vocabulary or a cache, is not searched)."""
    return (isinstance(value, (dict, list)) or type(value) is tuple) and len(value) <= ENTRIES_READ


def _entries(container: Any) -> Any:
    return container.items() if isinstance(container, dict) else enumerate(container)


def _items(container: Any) -> Any:
    return container.values() if isinstance(container, dict) else container


def _swapped(value: Any, path: str, swap: Callable[[str, Metric], Metric], depth: int = _DEPTH) -> Any:
    """``value`` for one replica: every metric in it replaced by ``swap(path, metric)``, the containers and modules
    (``MetricCollection``) around them copied; ``value`` itself where it holds no metric."""
    if isinstance(value, Metric):
        return swap(path, value)
    if isinstance(value, nn.Module):
        items = [(k, m, m if m is None else _swapped(m, f"{path}.{k}", swap)) for k, m in value._modules.items()]
    elif depth and _is_container(value):
        items = [(k, v, _swapped(v, f"{path}[{k!r}]", swap, depth - 1)) for k, v in _entries(value)]
    else:
        return value
    if all(new is old for _, old, new in items):
        return value
    if type(value) is tuple:
        return tuple(new for _, _, new in items)
    copied = value._replicate_for_data_parallel() if isinstance(value, nn.Module) else copy.copy(value)
    for key, _, new in items:  # a dict or list subclass keeps its type (a defaultdict its factory)
        (copied._modules if isinstance(value, nn.Module) else copied)[key] = new
    return copied


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


# --- per-replica clones ----------------------------------------------------------------------------------------------
@dataclass
class _Call:
    """One call of a replica's clone in a step, ``forward`` or ``update``: an aggregation metric's arguments, and a
    forward's batch states (its shard's alone) and value."""

    forward: bool
    arguments: dict[str, Any] | None
    states: dict[str, Any] | None = None
    value: Any = None


def _shard_clone(path: str, metric: Metric, calls: list[_Call]) -> Metric:
    """A reset clone of ``metric`` for one replica that appends each of its calls in a step to ``calls`` (a forward
    once, its own updates inside it not) and refuses ``compute()`` (of a shard) outside its forward. Without gradients
    an aggregation metric gets ``detach()`` aliases of its tensors: evaluation reads its losses by object while the
    step runs, and the metric's own reads must not count as the step's."""
    clone = metric.clone()
    clone.reset()
    forward, update, compute = clone.forward, clone.update, clone.compute
    aggregate = type(clone) in _AGGREGATES
    inside = False

    def recorded(method: Callable[..., Any], is_forward: bool) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            nonlocal inside
            if inside:
                return method(*args, **kwargs)
            named = {**dict(zip(("value", "weight"), args, strict=False)), **kwargs} if aggregate else None
            calls.append(call := _Call(is_forward, named))
            if named is not None and not torch.is_grad_enabled():
                args, kwargs = (), {k: v.detach() if isinstance(v, Tensor) else v for k, v in named.items()}
            inside = True
            try:
                call.value = method(*args, **kwargs)
            finally:
                inside = False
            return call.value

        return record

    def guarded_compute(*args: Any, **kwargs: Any) -> Any:
        if clone._should_unsync:  # torchmetrics' forward turns it off while it computes the batch value
            raise RuntimeError(
                f"compute() was called on self.{path} inside a step run on several replicas, where it holds only "
                f"this replica's shard of the batch. Log the metric object instead (self.log(name, self.{path})), or "
                "call compute() after the step (on_train_batch_end, on_*_epoch_end)."
            )
        if calls and calls[-1].forward and calls[-1].states is None:  # lists copied: they may grow
            states = {k: getattr(clone, k) for k in clone._defaults}
            calls[-1].states = {k: list(v) if isinstance(v, list) else v for k, v in states.items()}
        return compute(*args, **kwargs)

    clone.forward, clone.update, clone.compute = recorded(forward, True), recorded(update, False), guarded_compute
    return clone


def _reset(clone: Metric) -> None:
    clone.reset()
    clone._forward_cache = None  # a wrapper's reset may keep it (CompositionalMetric's does)


def _counted(clone: Metric) -> bool:
    """Whether ``clone`` counted an update or ran its forward in the step (a wrapper counts no updates)."""
    return bool(clone._update_count) or clone._forward_cache is not None


def _mark_folded(metric: Metric, step_value: Any = None) -> None:
    """Record on ``metric`` what its own ``update``/``forward`` would (torchmetrics has no setters for them)."""
    metric._update_count += 1
    metric._computed = None
    if step_value is not None:
        metric._forward_cache = step_value


_MISSING = object()
# nn.Module's and torchmetrics' own bookkeeping, which every metric sets: that of a metric with nothing of its own.
_METRIC_ATTRS = frozenset(vars(type("_Bare", (Metric,), {"update": lambda self: None, "compute": lambda self: None})()))


def _plain_attributes(metric: Metric) -> dict[str, Any]:
    """What ``metric`` keeps outside its states and every metric's bookkeeping: merging states cannot carry it."""
    return {k: v for k, v in vars(metric).items() if k not in _METRIC_ATTRS and k not in metric._defaults}


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """``(path, leaf)`` of a metric's value: itself, or the items of its dicts, lists and tuples."""
    if not isinstance(value, (dict, list, tuple)):
        return [(path, value)]
    return [leaf for key, item in _entries(value) for leaf in _leaves(item, (*path, key))]


# --- states ----------------------------------------------------------------------------------------------------------
def _combine(values: Sequence[Any], reduce_fx: Any, device: torch.device) -> Any:
    """Combine states as ``Metric._sync_dist`` combines ranks (lists of tensors for "cat" states stay lists)."""
    if isinstance(values[0], list):
        return [t.to(device) for v in values for t in v]
    moved = [v.to(device) for v in values]
    if reduce_fx is dim_zero_cat:
        return dim_zero_cat(moved)
    return torch.stack(moved) if reduce_fx is None else reduce_fx(torch.stack(moved))


def _combined(metric: Metric, states: Sequence[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """The replicas' ``states`` of ``metric`` combined as DDP combines ranks'."""
    combined = {}
    for attr in states[0]:
        values = [s[attr] for s in states]
        if not isinstance(values[0], (Tensor, list)):
            raise TypeError(
                f"The torchmetrics metric {type(metric).__name__} keeps its state {attr!r} as a "
                f"{type(values[0]).__name__}, which cannot be merged across replicas (only tensors and lists of "
                "tensors can). Update it outside the replicated step (e.g. in on_train_batch_end), or use "
                "strategy='dp' or 'ddp'."
            )
        combined[attr] = _combine(values, metric._reductions[attr], device)
    return combined


def _folded(current: Any, value: Any, reduce_fx: Any, device: torch.device, folded: int, n: int) -> Any:
    """A state holding ``folded`` replica states (0: fresh) and a batch's ``value`` from ``n`` more, in one."""
    if folded == 0 and not isinstance(current, list):
        return value
    if isinstance(current, list) or reduce_fx not in (None, dim_zero_mean):  # lists (retrieval, mAP...): in order
        return _combine([current, value], reduce_fx, device)
    if reduce_fx is None:  # unreduced (PearsonCorrCoef's): one row per contributor, as DDP stacks ranks
        return torch.cat([current.to(device), value])
    return (current.to(device) * folded + value * n) / (folded + n)  # DDP's equal-weight mean over every state


@dataclass
class _Node:
    """One metric of a root metric's subtree (the root itself included) and its counterparts in the clones."""

    path: str
    metric: Metric
    clones: list[Metric]
    folds: bool  # holds its own states (a wrapper may expose its child's, as ClasswiseWrapper does)
    wraps: bool  # metrics below it hold states
    aggregate: str | None  # an aggregation metric's kind ("mean"...), see MetricReplicas._replayed


def _nodes(path: str, metric: Metric, clones: Sequence[Metric]) -> list[_Node]:
    """Every metric of ``metric``'s subtree paired with the clones' metric at the same place, children first."""
    trees = [list(c.modules()) for c in clones]
    nodes: list[_Node] = []
    seen: set[int] = set()
    for k, (name, sub) in reversed(list(enumerate(metric.named_modules()))):
        if isinstance(sub, Metric):
            folds = bool(sub._defaults) and id(sub._defaults) not in seen
            wraps = any(isinstance(m, Metric) and m._defaults for m in list(sub.modules())[1:])
            seen.add(id(sub._defaults))
            path_k = f"{path}.{name}" if name else path
            nodes.append(_Node(path_k, sub, [t[k] for t in trees], folds, wraps, _AGGREGATES.get(type(sub))))
    return nodes


_Calls = list[tuple[int, list[_Call]]]  # each used clone's replica index and calls, paired over the replicas


@dataclass
class _Step:
    """One step's merge: the ids of the root metrics logged on_step and of the values logged, and one device's value
    of each logged value a metric call returned: id(value) -> (the call's key, the same on every replica; the value)."""

    on_step: set[int]
    logged: set[int]
    scalars: ScalarMerge | None
    values: dict[int, tuple[tuple[Any, ...], Any]] = field(default_factory=dict)

    def note(self, metric: Metric, k: int, calls: _Calls, value: Any) -> None:
        """Map each logged leaf of the replicas' k-th call's value to the same leaf of one device's ``value``."""
        merged = dict(_leaves(value))
        for path, leaf in self.logged_leaves(calls, k):
            if path in merged:
                self.values[id(leaf)] = ((id(metric), k, path), merged[path])

    def logged_leaves(self, calls: _Calls, k: int) -> list[tuple[tuple[Any, ...], Any]]:
        return [(p, leaf) for _, c in calls for p, leaf in _leaves(c[k].value) if id(leaf) in self.logged]


class MetricReplicas:
    """The per-device metric clones of one LightningModule, merged back after each step. ``ignored``: attributes of
    the module's own class hierarchy (Lightning's), not searched for metrics."""

    def __init__(self, ignored: frozenset[str] = frozenset()) -> None:
        self._ignored = _attributes_of(nn.Module) | ignored
        self._clones: dict[tuple[int, int], Metric] = {}  # (id(root metric), replica index) -> clone
        self._calls: dict[int, list[_Call]] = {}  # id(clone) -> its calls in this step
        self._owners: dict[int, Metric] = {}  # id(a clone or a metric in it) -> the root metric it stands for
        self._plain: dict[int, dict[str, Any]] = {}  # id(a clone's metric) -> its plain attributes when installed
        self._scratch: dict[int, Metric] = {}  # id(root metric) -> a copy to compute batch values on
        self._folded: dict[int, int] = {}  # id(root metric) -> replica states folded into it since its reset
        self._trees: list[list[_Node]] = []  # per root metric, its subtree's nodes
        self._devices: Sequence[torch.device] = ()
        self._watched: dict[int, nn.Module] = {}  # the root and the modules whose containers hold metrics
        self._holding: set[tuple[int, str]] = set()  # (id(module), attribute) of those containers
        self._copies: list[tuple[nn.Module, str, Any]] = []  # (replica's module, attribute, the copy installed)
        self._signature: list[Any] = []

    def install(self, root: nn.Module, replicas: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
        """Put a clone of each root metric into every replica: on the replica's device for a submodule; in a copy of
        each container attribute holding metrics where the root metric is (Lightning moves none of them). A metric
        held twice has one clone and folds once."""
        found: dict[int, tuple[str, Metric, list[Any]]] = {}  # id(root metric) -> path, metric, clones

        def clone_of(index: int, device: torch.device | None, path: str, metric: Metric) -> Metric:
            clone = self._clones.get((id(metric), index))
            if clone is None:
                clone = self._clones[id(metric), index] = _shard_clone(path, metric, calls := [])
                self._calls[id(clone)] = calls
            found.setdefault(id(metric), (path, metric, [None] * len(replicas)))[2][index] = clone
            return clone if device is None else clone.to(device)

        self._devices, self._watched, self._holding, self._copies = devices, {id(root): root}, set(), []
        for module_path, module in _module_paths(root):
            prefix = f"{module_path}." if module_path else ""
            targets = [replica.get_submodule(module_path) for replica in replicas]
            for name, child in module._modules.items():
                if isinstance(child, Metric):
                    for index, target in enumerate(targets):
                        target._modules[name] = clone_of(index, devices[index], prefix + name, child)
            for name, value in vars(module).items():
                if name not in self._ignored and _is_container(value):
                    self._install_copies(module, name, prefix + name, targets, clone_of)
        self._trees = [self._register(_nodes(*entry)) for entry in found.values()]
        self._signature = self._current()

    def _register(self, nodes: list[_Node]) -> list[_Node]:
        """Note each clone's root metric and plain attributes."""
        for node in nodes:
            for clone in node.clones:
                self._owners[id(clone)] = node.metric
                self._plain[id(clone)] = _plain_attributes(clone)
        return nodes

    def _install_copies(
        self, module: nn.Module, name: str, path: str, targets: list[nn.Module], clone_of: Callable[..., Metric]
    ) -> None:
        """Give each replica (``targets``) a copy of ``module``'s container attribute ``name`` with its clones."""
        value = vars(module)[name]
        for index, target in enumerate(targets):
            if (copied := _swapped(value, path, partial(clone_of, index, None))) is value:
                return
            target.__dict__[name] = copied
            self._copies.append((target, name, copied))
            self._holding.add((id(module), name))
            self._watched[id(module)] = module

    def refresh(self, root: nn.Module, replicas: Sequence[nn.Module]) -> None:
        """Install again where a container attribute of a watched module was rebound, one holding metrics changed its
        items, or a rebinding on the root reached a replica's copy (else one comparison)."""
        if self._current() != self._signature:
            self.install(root, replicas, self._devices)

    def _current(self) -> list[Any]:
        """The watched modules' container attributes, the items of those holding metrics (a list of outputs grown every
        step changes nothing here; a metric put in place into it is not seen), whether each replica keeps its copy."""
        state: list[Any] = [
            (id(module), name, id(value), *(map(id, _items(value)) if (id(module), name) in self._holding else ()))
            for module in self._watched.values()
            for name, value in vars(module).items()
            if (isinstance(value, (dict, list)) or type(value) is tuple) and name not in self._ignored
        ]
        for target, name, copied in self._copies:
            state.append(vars(target).get(name) is copied)
        return state

    def discard(self) -> None:
        """Reset the clones of a failed step, so no partial update reaches a later step."""
        for nodes in self._trees:
            for node in nodes:
                for clone in node.clones:
                    _reset(clone)
        for calls in self._calls.values():
            calls.clear()

    def owner_of(self, value: Any) -> Metric | None:
        """The root metric a replica's clone (or a metric inside it) stands for."""
        return self._owners.get(id(value)) if isinstance(value, Metric) else None

    def merge(
        self, recorders: Sequence[LogRecorder], in_training: bool, scalars: ScalarMerge | None = None
    ) -> dict[int, tuple[tuple[Any, ...], Any]]:
        """Fold every used clone's states into the root metric at the same place, children first, then reset the
        clones; return one device's values of what metric calls returned and the step logged (see :class:`_Step`).
        ``scalars`` merges an aggregation metric's scalar inputs (``None``: its states fold as any metric's)."""
        if not self._trees:
            return {}
        step = _Step(set(), set(), scalars)
        for call in (call for recorder in recorders for call in recorder.calls):
            step.logged.add(id(call.value))
            on_step = call.options.get("on_step")
            if (owner := self.owner_of(call.value)) is not None and (in_training if on_step is None else on_step):
                step.on_step.add(id(owner))
        for nodes in self._trees:
            self._merge_tree(nodes, step)
        return step.values

    def _merge_tree(self, nodes: list[_Node], step: _Step) -> None:
        """Check and fold the used clones of one root metric's subtree, children first, then reset them."""
        used = [(n, [(i, c) for i, c in enumerate(n.clones) if _counted(c) or self._calls.get(id(c))]) for n in nodes]
        for node, clones in used:  # all of a wrapper's: torchmetrics' WrapperMetric counts no updates of its own
            for clone in node.clones if node.wraps else [c for _, c in clones]:
                self._check(node, clone)
        batch_states: dict[int, dict[str, Any]] = {}  # id(root metric) -> the replicas' states combined
        for node, clones in used:
            if clones:
                self._fold(node, clones, batch_states, step)
        for _, clones in used:
            for _, clone in clones:
                _reset(clone)
                self._calls.get(id(clone), []).clear()

    def _check(self, node: _Node, clone: Metric) -> None:
        """Refuse what the replicas' states cannot reproduce: torchmetrics' own forward of a wrapper (on one device it
        resets the metrics it wraps) and a plain attribute rebound or added; set on the root metric those set for the
        first time (absent, ``None`` or ``False`` before: ``MeanIoU``'s inferred ``num_classes``), as one device's
        metric sets them."""
        wrapped = [m for m in clone.modules() if m is not clone and isinstance(m, Metric)] if node.wraps else ()
        if wrapped and clone._forward_cache is not None and all(m._forward_cache is None for m in wrapped):
            raise TypeError(
                f"self.{node.path}(...) ({type(clone).__name__}) ran torchmetrics' forward in a replicated step: on "
                "one device it resets the metrics it wraps, which the replicas cannot reproduce. Call "
                f"self.{node.path}.update(...) in the step instead, or use strategy='dp' or 'ddp'."
            )
        before = self._plain[id(clone)]
        changed = {k: v for k, v in _plain_attributes(clone).items() if before.get(k, _MISSING) is not v}
        if refused := [k for k in changed if all(before.get(k, _MISSING) is not u for u in (_MISSING, None, False))]:
            raise TypeError(
                f"self.{node.path} ({type(clone).__name__}) changed {', '.join(map(repr, refused))} in a replicated "
                "step: outside its metric states, the replicas' updates cannot be merged. Update it outside the "
                "replicated step (e.g. in on_train_batch_end or on_validation_batch_end), or use strategy='dp' or "
                "'ddp'."
            )
        for name, value in changed.items():
            setattr(node.metric, name, value)

    def _fold(
        self, node: _Node, clones: list[tuple[int, Metric]], batch_states: dict[int, dict[str, Any]], step: _Step
    ) -> None:
        """Fold the used clones' states into one root metric and count the update, with the batch value where the
        metric is logged on_step and the step ran its forward."""
        metric = node.metric
        calls = [(index, self._calls.get(id(clone))) for index, clone in clones]
        kinds = {tuple(call.forward for call in c) if c else None for _, c in calls}
        # Calls pair up where every replica made the same sequence of forwards and updates (the k-th call of each is
        # one device's k-th call); a wrapper's only where it ran one forward (its batch states are the whole step's).
        aligned = len(kinds) == 1 and None not in kinds and (not node.wraps or kinds == {(True,)})
        if aligned and node.aggregate is not None and self._replayed(metric, node.aggregate, calls, step):
            return
        device = next((v.device for v in metric.metric_state.values() if isinstance(v, Tensor)), metric.device)
        own = [{attr: getattr(c, attr) for attr in metric._reductions} for _, c in clones] if node.folds else [{}]
        states = batch_states[id(metric)] = _combined(metric, own, device)
        last = self._call_values(node, calls, batch_states, device, step) if aligned else None
        step_value = None
        if id(metric) in step.on_step and any(c._forward_cache is not None for _, c in clones):
            step_value = last if last is not None else self._value(node, batch_states)
        if states:
            folded = 0 if metric._update_count == 0 else self._folded.get(id(metric), 1)
            for attr, value in states.items():
                current, reduce_fx = getattr(metric, attr), metric._reductions[attr]
                setattr(metric, attr, _folded(current, value, reduce_fx, device, folded, len(clones)))
            self._folded[id(metric)] = folded + len(clones)
        if any(_counted(c) for _, c in clones):  # as its own update or forward would (a wrapper's counts nothing)
            _mark_folded(metric, step_value)

    def _replayed(self, metric: Metric, kind: str, calls: _Calls, step: _Step) -> bool:
        """Call ``metric``, an aggregation metric, on the root as one device calls it, each call's scalar inputs merged
        as ``self.log`` merges them (``self.mean_loss(loss)``: the loss by its rule), a ``weight`` passed on every
        replica summed; ``False`` where they are not one number per replica (its clones' states then fold, exact for
        per-sample values)."""
        if step.scalars is None:
            return False
        inputs = []
        for k in range(len(calls[0][1])):
            arguments = [(index, c[k].arguments or {}) for index, c in calls]
            weights = [a.get("weight") for _, a in arguments]
            if len({w is None for w in weights}) > 1:
                return False
            given = None if weights[0] is None else weights
            if (value := step.scalars([(index, a.get("value")) for index, a in arguments], given, kind)) is None:
                return False
            inputs.append({"value": value} if given is None else {"value": value, "weight": sum(map(float, given))})
        for k, merged in enumerate(inputs):
            if calls[0][1][k].forward:
                step.note(metric, k, calls, metric(**merged))
            else:
                metric.update(**merged)
        return True

    def _call_values(
        self, node: _Node, calls: _Calls, batch_states: dict[int, dict[str, Any]], device: torch.device, step: _Step
    ) -> Any:
        """Note one device's value of each forward whose value was logged: on the replicas' batch states of that call
        combined (a wrapper's, called once: on the batch states of the metrics it wraps). Return the last forward's
        value where the metric itself is logged on_step, else ``None``."""
        metric, last = node.metric, None
        forwards = [k for k, call in enumerate(calls[0][1]) if call.forward]
        for k in forwards:
            on_step = k == forwards[-1] and id(metric) in step.on_step
            states = [c[k].states for _, c in calls]
            if not (on_step or step.logged_leaves(calls, k)) or (not node.wraps and None in states):
                continue
            value = self._value(node, batch_states if node.wraps else {id(metric): _combined(metric, states, device)})
            step.note(metric, k, calls, value)
            last = value if on_step else last
        return last

    def _value(self, node: _Node, batch_states: dict[int, dict[str, Any]]) -> Any:
        """The node's metric's value on the given states alone (those of the metrics it wraps too), on a scratch copy
        made again when the metric moved or changed dtype (``64-true`` converts metrics after the module was built)."""
        metric = node.metric
        scratch = self._scratch.get(id(metric))
        if scratch is None or scratch.dtype != metric.dtype or scratch.device != metric.device:
            scratch = self._scratch[id(metric)] = metric.clone()
        pairs = zip(metric.modules(), scratch.modules(), strict=True) if node.wraps else [(metric, scratch)]
        for original, copied in pairs:  # parents before children
            if isinstance(copied, Metric):
                copied.reset()
                if (states := batch_states.get(id(original))) is not None:
                    for attr, value in states.items():
                        setattr(copied, attr, value)
                    _mark_folded(copied)
        return scratch.compute()
