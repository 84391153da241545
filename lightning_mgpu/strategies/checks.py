"""Checks of user code that make a run on replicas differ from one device, said once, never around every step: at
set-up, read from the bytecode of the user's classes (nothing runs): ``torch.distributed`` gathers, ``torchmetrics``
functional metrics and Lightning's collectives; on the first two replicated calls of each hook, :class:`StepChecks`."""

from __future__ import annotations

import collections
import contextlib
import dis
import functools
import importlib
import inspect
import itertools
import re
import sys
import types
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import LRScheduler

from lightning_mgpu.parallel.replicas import rebound_attributes

# Packages whose code is not read and whose objects (configs, loggers, metrics) are not watched.
_LIBRARIES = frozenset(
    {"torch", "lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "lightning_mgpu", "numpy"}
    | {"typing_extensions", "transformers", "omegaconf", "hydra", "jsonargparse", "yaml"}
    | set(sys.stdlib_module_names)
)
_MISSING = object()


def _is_library(obj: Any) -> bool:
    """Whether ``obj`` (a class, a function or an object's class) comes from a library of :data:`_LIBRARIES`."""
    owner = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
    return (getattr(owner, "__module__", None) or "builtins").partition(".")[0] in _LIBRARIES


def _unwrap(value: Any) -> Any:
    """The function a static or class method, or a decorated function (``@torch.no_grad()``), stands for."""
    value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    if isinstance(value, types.FunctionType):
        with contextlib.suppress(ValueError):  # a cycle of __wrapped__
            return inspect.unwrap(value)
    return value


def _functions(cls: type, names: Sequence[str] | None = None) -> Iterator[tuple[type, types.FunctionType]]:
    """The functions (those of ``names``, or all) that the user's classes in ``cls``'s MRO define."""
    for klass in cls.__mro__:
        for name in () if _is_library(klass) else vars(klass) if names is None else names:
            if isinstance(function := _unwrap(vars(klass).get(name)), types.FunctionType):
                yield klass, function


# --- reading the user's code ----------------------------------------------------------------------------------------
_CHAIN_STARTS = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FAST")  # LOAD_FAST_CHECK...
_MAX_DEPTH = 4  # calls followed from a step or forward: class -> helper -> autograd Function -> torch.distributed
# torch.distributed calls whose result depends on the other ranks' values (not a broadcast or a barrier).
_GATHERS = frozenset(
    {"all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object", "all_gather_tensor", "gather"}
    | {"gather_object", "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all"}
    | {"all_to_all_single"}
)
# What each finding looks for: a function of a module under these prefixes, of these names (None: any).
_WANTED = {
    "gather": (("torch.distributed.nn", "torch.distributed"), _GATHERS),
    "metric": (("torchmetrics.functional",), None),
}
_FLAG = re.compile(r"gather.*dist|dist.*gather", re.IGNORECASE)  # gather_distributed (lightly), distributed_gather...
_LIGHTNING_COLLECTIVES = frozenset(("all_gather", "reduce_boolean_decision", "barrier", "broadcast"))
_STEPS = ("training_step", "validation_step", "test_step")


def _chains(code: types.CodeType) -> Iterator[tuple[str, list[str]]]:
    """The dotted names ``code`` and the code nested in it load, with the instruction loading the first name:
    ``torch.distributed.all_gather`` is ``("LOAD_GLOBAL", ["torch", "distributed", "all_gather"])``."""
    ops = [(instruction.opname, str(instruction.argval)) for instruction in dis.get_instructions(code)]
    for k, (opname, name) in enumerate(ops):
        if opname.startswith(_CHAIN_STARTS):
            links = itertools.takewhile(lambda op: op[0] in ("LOAD_ATTR", "LOAD_METHOD"), ops[k + 1 :])
            yield opname, [name, *(link for _, link in links)]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _chains(const)


def _loaded(function: types.FunctionType, owner: type | None) -> Iterator[Any]:
    """The objects the dotted names in ``function`` stand for, looked up statically (nothing runs): ``self``/``cls``
    stands for ``owner`` (not yielded), another local for the global or module of its name (a local ``import``)."""
    code, cells = function.__code__, {}
    for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=False):
        with contextlib.suppress(ValueError):  # an empty cell
            cells[name] = cell.cell_contents
    scope = collections.ChainMap(cells, function.__globals__, sys.modules)
    for opname, names in _chains(code):
        local = opname.startswith("LOAD_FAST")
        is_self = local and names[0] in ("self", "cls") and code.co_varnames[:1] == (names[0],)
        obj = (owner or _MISSING) if is_self else scope.get(names[0], _MISSING)
        for step, name in enumerate(names):
            obj = _unwrap(inspect.getattr_static(obj, name, _MISSING) if step else obj)
            if obj is _MISSING:
                break
            if step or not local:
                yield obj


def _wanted(finding: str, obj: Any) -> str | None:
    """``"torch.distributed.all_gather"`` where ``obj`` is a call that ``finding`` (of :data:`_WANTED`) looks for."""
    prefixes, names = _WANTED[finding]
    module, name = getattr(obj, "__module__", None) or "", getattr(obj, "__name__", "")
    prefix = next((p for p in prefixes if module.startswith(p)), None)
    return f"{prefix}.{name}" if prefix and callable(obj) and (names is None or name in names) else None


def _route(target: Any, owner: type | None, depth: int, seen: set[int], finding: str) -> list[str] | None:
    """The names from ``target`` (a function, or a class whose functions are read) to a call ``finding`` looks for:
    ``["MoCo.training_step", "concat_all_gather", "torch.distributed.all_gather"]``."""
    if depth == 0 or id(target) in seen:
        return None
    seen.add(id(target))
    functions = [function for _, function in _functions(target)] if isinstance(target, type) else [target]
    label = target.__name__ if isinstance(target, type) else target.__qualname__
    for obj in itertools.chain.from_iterable(_loaded(function, owner) for function in functions):
        if (name := _wanted(finding, obj)) is not None:
            return [label, name]
        followed = isinstance(obj, (type, types.FunctionType)) and not _is_library(obj)
        if followed and (route := _route(obj, obj if isinstance(obj, type) else owner, depth - 1, seen, finding)):
            return [label, *route]
    return None


@functools.cache
def _code_finding(cls: type, entries: tuple[str, ...], finding: str) -> str | None:
    """``"(MoCo) calls torch.distributed.all_gather through MoCo.training_step -> concat_all_gather"``, or ``None``:
    a call ``finding`` looks for in the ``entries`` methods of ``cls`` and its user-defined bases, or what they call."""
    for _, function in _functions(cls, entries):
        if route := _route(function, cls, _MAX_DEPTH, set(), finding):
            return f"({cls.__name__}) calls {route[-1]} through {' -> '.join(route[:-1])}"
    return None


def distributed_gathers(module: nn.Module) -> list[str]:
    """What in ``module`` gathers through ``torch.distributed``, one line per finding: a submodule whose
    ``gather_distributed``-style flag is set, or a user class whose step or ``forward`` calls a collective."""
    found: dict[str, list[str]] = {}  # what -> the paths of the modules that do it
    for path, sub in module.named_modules():
        flags = {name: value for name, value in vars(sub).items() if isinstance(value, bool) and _FLAG.search(name)}
        on = [f"({type(sub).__name__}) has {name}=True" for name, value in flags.items() if value]
        entries = (*_STEPS, "predict_step", "forward") if sub is module else ("forward",)
        what = on[0] if on else (None if flags else _code_finding(type(sub), entries, "gather"))  # flag off: not read
        if what is not None:
            found.setdefault(what, []).append(f"`self.{path}`" if path else "`self`")
    return [
        ", ".join(paths[:2]) + (f" and {len(paths) - 2} more" if len(paths) > 2 else "") + f" {what}"
        for what, paths in found.items()
    ]


def distributed_gather_message(strategy_name: str, findings: Sequence[str]) -> str:
    """The warning for :func:`distributed_gathers`' findings, with the fixes that equal one device."""
    return (
        f"{strategy_name}: {'; '.join(findings)}. torch.distributed gathers nothing here: the strategy runs one "
        "process (torch.distributed is not initialized, world size 1), so that code computes each device's result on "
        "its own shard, unlike one device on the whole batch (or DDP). For one device's result, gather through the "
        "strategy: `z = self.all_gather(z, sync_grads=True)` in the step returns the whole batch (under DDP, "
        "`.flatten(0, 1)` it when `self.trainer.world_size > 1`), then compute the loss on it without the "
        "torch.distributed call (`gather_distributed=False`); or use strategy='dp', where the step runs once on the "
        "whole batch, so the loss as written equals one device."
    )


def functional_metric_message(strategy_name: str, module: nn.Module) -> str | None:
    """The notice where ``module``'s step calls a ``torchmetrics.functional`` metric (read once per class, never run),
    with the fix that equals one device: the metric's object (``multiclass_accuracy`` -> ``MulticlassAccuracy``)."""
    finding = _code_finding(type(module), _STEPS, "metric")
    if finding is None:
        return None
    function = finding.partition("torchmetrics.functional.")[2].partition(" ")[0]
    modules = [importlib.import_module(f"torchmetrics{m}") for m in ("", ".classification", ".regression")]
    found = ((m, n) for m in modules for n in dir(m) if n.lower() == function.replace("_", "").lower())
    metric = next((f"{m.__name__}.{n}" for m, n in found if isinstance(getattr(m, n), type)), None)
    example = (
        f"`self.metric = {metric}(...)` in `__init__`, `self.log('metric', self.metric(preds, y))` in the step"
        if metric
        else "torchmetrics' class of the same name, created in `__init__` and called in the step"
    )
    return (
        f"{strategy_name}: `self` {finding}. Each device computes it on its own shard, and its logged value is a "
        "sample-weighted mean of the devices' values: one device's only for a mean over samples (not F1, precision, "
        f"recall, AUROC). Log the metric's object, whose states are combined across the devices: {example}."
    )


@functools.cache
def lightning_collectives(cls: type) -> str | None:
    """``"MoCo calls all_gather in the module's code"``: the module's classes call Lightning's collectives (read by
    name: ``self.trainer`` cannot be looked up statically; ``torch.distributed``'s are not Lightning's)."""
    for klass, function in _functions(cls):
        for _, (*through, last) in _chains(function.__code__):
            lightning = (last in _LIGHTNING_COLLECTIVES and through) or (last == "reduce" and "strategy" in through)
            if lightning and "distributed" not in through and "dist" not in through:
                return f"{klass.__name__} calls {last} in the module's code"
    return None


# --- plain Python objects a replicated step changed -----------------------------------------------------------------
_MODULE_REGISTRIES = frozenset(vars(nn.Module()))  # nn.Module's own dicts and sets: parameters, buffers, hooks...
_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_COLLECTIONS = (list, collections.deque, set)
_CONTAINERS = (*_COLLECTIONS, dict)
_NOT_PLAIN = (nn.Module, Tensor, type, types.FunctionType, types.MethodType, types.ModuleType)
ENTRIES_READ = 1024  # the most entries of a dict read: a larger one (a vocabulary, a cache) is compared by its length


@dataclass(frozen=True)
class HeldChange:
    """An object the module holds that a replicated step changed: its path (``"outputs['loss']"``), type name, what
    changed, and whether it is a collection that grew (collect on the root) or an object changed (act on the root)."""

    path: str
    kind: str
    detail: str
    collection: bool

    @property
    def key(self) -> str:  # said once per attribute of the module
        return f"held:{self.path.partition('[')[0]}"


class HeldObjects:
    """A snapshot of the plain Python objects ``module`` and its user-defined submodules hold, which every replica
    shares: taken before a replicated step, :meth:`changes` says what the step changed (once per replica)."""

    def __init__(self, module: nn.Module) -> None:
        self._held = [(path, value, _state(value)) for path, value in _held(module)]

    def changes(self) -> list[HeldChange]:
        """What changed since the snapshot, in attribute order."""
        return [change for path, value, before in self._held for change in _compare(path, value, before)]


def _held(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """(path, value) of the containers and the user's plain objects that ``module``'s user-defined modules hold."""
    skipped = _MODULE_REGISTRIES | _lightning_attributes(type(module))
    for prefix, sub in module.named_modules():
        for name, value in () if _is_library(type(sub)) else vars(sub).items():
            if isinstance(value, _CONTAINERS):
                watched = type(value).__module__ in ("builtins", "collections") or not _is_library(value)
            else:
                watched = hasattr(value, "__dict__") and not isinstance(value, _NOT_PLAIN) and not _is_library(value)
            if watched and name not in skipped:
                yield (f"{prefix}.{name}" if prefix else name), value


@functools.cache
def _lightning_attributes(cls: type) -> frozenset[str]:
    """The attributes a bare LightningModule sets (Lightning's, not the user's)."""
    lightning = [k for k in cls.__mro__ if k.__name__ == "LightningModule" and _is_library(k)]
    return frozenset(vars(lightning[0]()) if lightning else ())


def _state(value: Any) -> Any:
    """A collection's size; a dict's or an object's length, entries (``None``: a dict too large to read) and their
    collections' sizes."""
    if isinstance(value, _COLLECTIONS):
        return _size(value)
    if isinstance(value, dict) and len(value) > ENTRIES_READ:
        return len(value), None, {}
    entries = dict(value if isinstance(value, dict) else vars(value))
    return len(entries), entries, {key: _size(e) for key, e in entries.items() if isinstance(e, _CONTAINERS)}


def _size(value: Any) -> tuple[int, Any]:
    """A collection's length and a sequence's last entry (a full deque appended to keeps its length)."""
    return len(value), value[-1] if isinstance(value, (list, collections.deque)) and value else _MISSING


def _size_change(before: tuple[int, Any], after: tuple[int, Any]) -> str | None:
    """``"3 entries more"``, ``"2 entries fewer"``, ``"its last entry replaced"`` or ``None``."""
    if grown := after[0] - before[0]:
        return f"{abs(grown)} {'entry' if abs(grown) == 1 else 'entries'} {'more' if grown > 0 else 'fewer'}"
    return "its last entry replaced" if after[1] is not before[1] else None


def _compare(path: str, value: Any, before: Any) -> list[HeldChange]:
    """What changed since :func:`_state`. A collection: its size. An object, as one change: its attributes rebound (a
    plain value rebound to an equal one does not count) and its collections' sizes. A dict: each collection it holds
    that changed (``outputs['loss']``), else entries added (not tensors: the shared-entries check's; nor flags: a
    warned-once dict); and plain entries rebound (``self.counts['steps'] += 1``)."""
    kind = type(value).__name__
    if isinstance(value, _COLLECTIONS):
        detail = _size_change(before, _size(value))
        return [] if detail is None else [HeldChange(path, kind, detail, detail.endswith("more"))]
    length, entries, sizes = before
    if not isinstance(value, dict):
        now = vars(value)
        rebound = [n for n in {**entries, **now} if not _same(entries.get(n, _MISSING), now.get(n, _MISSING))]
        details = [f"its attribute{'s' if len(rebound) > 1 else ''} {', '.join(rebound)} changed"] if rebound else []
        details += [  # the same collection unless rebound
            f"its {name}: {detail}"
            for name, size in sizes.items()
            if name not in rebound and (detail := _size_change(size, _size(now[name])))
        ]
        return [HeldChange(path, kind, "; ".join(details), False)] if details else []
    changes = [
        HeldChange(f"{path}[{key!r}]", type(entry).__name__, detail, detail.endswith("more"))
        for key, entry in (value.items() if entries is not None else ())
        if isinstance(entry, _CONTAINERS) and (detail := _size_change(sizes.get(key, (0, _MISSING)), _size(entry)))
    ]
    new = list(itertools.islice(value.values(), length, length + ENTRIES_READ))
    if not changes and new and not any(_holds_tensors(v) or isinstance(v, (bool, type(None))) for v in new):
        changes.append(HeldChange(path, kind, _size_change((0, None), (len(new), None)), True))
    plain = [k for k in entries or {} if k in value and not isinstance(value[k], _CONTAINERS)]
    if rebound := [repr(k) for k in plain if not _holds_tensors(value[k]) and not _same(entries[k], value[k])]:
        detail = f"its entr{'ies' if len(rebound) > 1 else 'y'} {', '.join(rebound)} changed"
        changes.append(HeldChange(path, kind, detail, False))
    return changes


def _holds_tensors(value: Any) -> bool:
    """A tensor, or a tuple or list that starts with one (an LSTM's output)."""
    return isinstance(value, Tensor) or (isinstance(value, (tuple, list)) and bool(value) and _holds_tensors(value[0]))


def _same(old: Any, new: Any) -> bool:
    return old is new or (type(old) is type(new) and type(new) in _PLAIN and old == new)


_BATCH_HOOKS = {"training_step": "on_train_batch", "validation_step": "on_validation_batch"}
_BATCH_HOOKS.update(test_step="on_test_batch", predict_step="on_predict_batch")


def held_objects_message(owner: str, changes: Sequence[HeldChange], replicas: int, hook: str = "training_step") -> str:
    """The warning for :meth:`HeldObjects.changes` after ``hook`` ran on ``replicas`` replicas of an ``owner``; under dp
    ``hook="forward"`` (the step runs once there)."""
    heads = {c.key: c for c in reversed(changes)}  # one per attribute: a dict's first entry that changed
    named = [f"`{owner}.{c.path}` {'grew' if c.collection else 'changed'}" for c in reversed(heads.values())]
    listed = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"
    what = "; ".join(f"`{c.path}` ({c.kind}): {c.detail}" for c in changes)
    said = f"{listed} during a step that ran on {replicas} replicas ({what})"
    it, them, holds = ("they", "them", "they hold") if len(changes) > 1 else ("it", "it", "it holds")
    batch = _BATCH_HOOKS.get(hook, "on_train_batch")
    if hook == "forward":
        return (
            f"{said}: `forward` ran once per device, each with its shard, so it changed {them} once per device. Do "
            "that in the step (under dp it runs once, on the root, with the whole batch), or in "
            "`on_train_batch_start` / `on_train_batch_end`."
        )
    if all(c.collection for c in changes):
        return (
            f"{said}: {holds} one entry per device per step (each of its shard), so a per-step value computed from "
            f"{them} (a mean of the step losses, a count) differs from one device's. Collect step outputs in "
            f"`{batch}_end(outputs, ...)`, which runs once, on the root, with the gathered outputs, or use a "
            "torchmetrics metric."
        )
    dqn = " (Lightning's DQN example plays in `training_step`: move that call to `on_train_batch_start`)"
    return (
        f"{said}: each replica changed {them} with its own shard, in no fixed order, so {it} changed {replicas} times "
        f"in a step where one device changes {them} once. Do that work once per step, on the root: in `{batch}_start` "
        f"or `{batch}_end`{dqn if batch == 'on_train_batch' else ''}, or, for an environment and its replay buffer, "
        "in the data pipeline (an IterableDataset that plays it and yields batches from the buffer)."
    )


# --- the first replicated calls of each hook ------------------------------------------------------------------------
_ON_ROOT = "in `on_train_batch_end` / `on_validation_batch_end` (once, on the root, with the gathered outputs)"


class StepChecks:
    """Around the first two replicated calls of each hook (:attr:`calls` counts them), what the call did that one
    device would not: held objects changed, tensors written into shared dicts, schedulers stepped (an error),
    attributes rebound and buffers updated to values that differ between the replicas."""

    def __init__(self, strategy: Any) -> None:  # the strategy's name, step_per_replica flag, announced keys, warn_once
        self._strategy_name, self._step_per_replica = strategy.strategy_name, strategy._STEP_PER_REPLICA
        self._announced, self._warn_once = strategy._announced, strategy._warn_once
        self.calls: collections.Counter[str] = collections.Counter()  # replicated calls per hook
        self._before: tuple[Any, ...] | None = None

    def before(self, hook: str, module: nn.Module, root: Any) -> None:
        """Count a checked call of ``hook`` (the caller checks the first two) and snapshot what it may change."""
        self.calls[hook] += 1
        dicts = [  # the dicts every replica shares with the root (not nn.Module's registries nor large ones)
            (f"{prefix}.{name}" if prefix else name, value)
            for prefix, m in root.named_modules()
            for name, value in vars(m).items()
            if isinstance(value, dict) and name not in _MODULE_REGISTRIES and len(value) <= ENTRIES_READ
        ]
        configs = root.trainer.lr_scheduler_configs if getattr(root, "_trainer", None) is not None else []
        held = [value for value in vars(root).values() if isinstance(value, LRScheduler)]
        schedulers = {id(s): (s, getattr(s, "last_epoch", None)) for s in [*(c.scheduler for c in configs), *held]}
        self._before = (module, root, HeldObjects(module), dicts, _dict_entries(dicts), schedulers.values())

    def after(
        self,
        hook: str,
        kept: dict[str, Any],
        replicas: Sequence[nn.Module],
        snapshots: Sequence[dict[str, Any]],
        *,
        manual: bool,
        interleaved: bool,
    ) -> None:
        """Say what the call on ``replicas`` changed: ``kept``, the attributes replica 0 rebound (the module's);
        ``snapshots``, each replica's ``__dict__`` before it."""
        assert self._before is not None, "after() without before()"
        (module, root, held, dicts, entries, schedulers), self._before = self._before, None
        count, owner = len(replicas), type(module).__name__
        _check_scheduler_steps(hook, schedulers, count, manual)
        if changes := [c for c in held.changes() if c.key not in self._announced]:
            said = hook if self._step_per_replica else "forward"
            self._warn_once(changes[0].key, held_objects_message(owner, changes, count, said))
            self._announced.update(c.key for c in changes)
        others = [rebound_attributes(r, b) for r, b in zip(replicas[1:], snapshots[1:], strict=True)]
        for name, value in kept.items():
            if not all(name in other and _alike(value, other[name]) for other in others):
                self._warn_once(
                    f"rebound:{name}",
                    f"`{owner}.{name}` was rebound during a step that ran on {count} replicas to values that differ "
                    "between the replicas (each computed from its shard): the module keeps replica 0's, where one "
                    f"device keeps the whole batch's. Compute it {_ON_ROOT}, keep it in a torchmetrics metric or log "
                    "it.",
                )
        # Tensors written into a dict every replica shares (a forward hook's feature maps): one replica's remain.
        written = [path for (path, key), value in _dict_entries(dicts).items() if entries.get((path, key)) is not value]
        for path in dict.fromkeys(written):
            self._warn_once(
                f"entries:{path}",
                f"`{type(root).__name__}.{path}` got tensors during a call that ran on several replicas, which share "
                f"that dict: {self._shared_entries_advice(interleaved)}.",
            )
        if names := _diverged_buffers(replicas):
            self._warn_once(f"buffers:{','.join(names)}", self._diverged_buffers_message(hook, names))

    def _shared_entries_advice(self, interleaved: bool) -> str:
        """What a write into a dict the replicas share leaves, and how to keep such values as one device does."""
        if not self._step_per_replica:
            return "the step reads the last replica's entries, one shard's. Return them from `forward`: dp gathers them"
        consequence = (
            "the replicas ran interleaved (at SyncBatchNorm layers or collectives), so a replica may have read "
            "another's entry, another shard's tensor"
            if interleaved
            else "after the step it holds the last replica's entries, one shard's"
        )
        return (
            f"{consequence}. Keep such values per replica: from a forward hook, set them on the hooked module (`lambda "
            "module, args, output: setattr(module, 'features', output)`, read as `self.<layer>.features`), or return "
            f"them from `forward`; step outputs: return them and collect them {_ON_ROOT}. A cache alike on every "
            "replica: key it by device, or hold it as a buffer (`register_buffer(..., persistent=False)`), for "
            "distinct GPUs"
        )

    def _diverged_buffers_message(self, hook: str, names: list[str]) -> str:
        fix = (
            "compute the update from the whole batch (`self.all_gather(...)`, or `torch.distributed.all_reduce` of "
            "the batch statistic, as DINO's update_center does: it runs across the replicas here)"
            if self._step_per_replica
            else "update it in `training_step` from the gathered outputs (the step runs once, on the root)"
        )
        return (
            f"{self._strategy_name}: buffer(s) {', '.join(f'`{n}`' for n in names)} changed differently on each "
            f"replica during `{hook}` (each updated from its shard, e.g. an average of inputs in forward): the module "
            f"keeps replica 0's, where one device updates it from the whole batch. For one device's value, {fix}."
        )


def _dict_entries(dicts: Sequence[tuple[str, dict]]) -> dict[tuple[str, Any], Any]:
    """The values holding tensors in ``dicts``, by (path, key)."""
    return {(path, key): value for path, held in dicts for key, value in held.items() if _holds_tensors(value)}


def _diverged_buffers(replicas: Sequence[nn.Module]) -> list[str]:
    """Buffers (BatchNorm's statistics aside) that a call changed differently on the replicas, synced alike before
    it: updated from each shard (an EMA of inputs in ``forward``, DINO's center)."""
    others = [dict(replica.named_buffers()) for replica in replicas[1:]]
    statistics = {
        f"{path}.{name}".lstrip(".")
        for path, module in replicas[0].named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        for name, _ in module.named_buffers(recurse=False)
    }
    return [
        name
        for name, buffer in replicas[0].named_buffers()
        if name not in statistics
        and not all(torch.equal(buffer, other[name].to(buffer.device)) for other in others if name in other)
    ]


def _check_scheduler_steps(hook: str, before: Iterable[tuple[Any, Any]], count: int, manual: bool) -> None:
    """Raise if a scheduler stepped during a call on ``count`` replicas (under manual optimization
    ``self.lr_schedulers()`` steps replica 0's only: a move by a multiple of ``count`` is one per replica)."""
    fix = (  # under manual optimization Lightning steps none
        "Under manual optimization step it through self.lr_schedulers() in the step (replica 0 steps it for all), "
        "e.g. `self.lr_schedulers().step()`, with the scheduler returned by configure_optimizers."
        if manual
        else f"Step it once per step, on the root: in `{_BATCH_HOOKS.get(hook, 'on_train_batch')}_end`, or let "
        "Lightning step it (configure_optimizers returning {'optimizer': ..., 'lr_scheduler': {'scheduler': ..., "
        "'interval': 'step'}})."
    )
    for scheduler, first in before:
        last = getattr(scheduler, "last_epoch", None)
        counted = manual and isinstance(first, int) and isinstance(last, int) and (last - first) % count
        if first != last and not counted:
            raise RuntimeError(
                f"`{hook}` stepped the learning-rate scheduler {type(scheduler).__name__} on each of the {count} "
                f"replicas (its last_epoch went from {first} to {last} in one step): it advanced {count} times where "
                f"one device advances it once. {fix}"
            )


def _alike(a: Any, b: Any) -> bool:
    """Whether two replicas' values are the same (equal tensors, or equal by ``==``)."""
    if a is not b and (isinstance(a, Tensor) or isinstance(b, Tensor)):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b.to(a)))
    with contextlib.suppress(Exception):
        return a is b or bool(a == b)
    return False
