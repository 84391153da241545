"""Checks that say, once, what a step does that one process with replicas does not do as one device, read without
running the step again:

* :func:`distributed_gathers`, read at set-up: code in the module that gathers through ``torch.distributed`` (a loss
  built with ``gather_distributed=True``, an autograd ``Function`` or a helper calling
  ``torch.distributed.all_gather``). In one process ``torch.distributed`` is not initialized (world size 1), so such
  code gathers nothing and each replica computes it on its own shard, unlike one device on the whole batch. Found by
  reading the bytecode of the user's own step and ``forward`` methods and of what they call, once per class: no source
  file needed, nothing run.
* :class:`StepChecks`, over the first two replicated calls of each hook (a step does the same things every time):
  what the step did to the module's state that one device would not — :class:`HeldObjects`, dict entries the replicas
  share, schedulers stepped per replica, attributes rebound to values that differ between replicas. Never around
  every step.
* :class:`HeldObjects`, over the first replicated steps: plain Python objects the module holds (an environment, a replay
  buffer, a list of outputs) that the step changed. Every replica shares them with the module, so a step changes them
  once per replica, each time with its own shard.
"""

from __future__ import annotations

import collections
import dis
import functools
import inspect
import itertools
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import LRScheduler

# --- what is the user's code --------------------------------------------------------------------------------------
_LIBRARIES = frozenset(
    {"torch", "lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "lightning_mgpu", "numpy"}
    | {"typing_extensions", "transformers", "omegaconf", "hydra", "jsonargparse", "yaml"}
    | set(sys.stdlib_module_names)
)
"""Top-level packages whose code is not read and whose objects are not watched: they gather nothing through
``torch.distributed`` in a step, and their objects (configs, loggers, metrics) are not what a step changes by
mistake."""


def _is_library(obj: Any) -> bool:
    """Whether ``obj`` (a class, a function or an object's class) comes from a library of :data:`_LIBRARIES`."""
    owner = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
    return (getattr(owner, "__module__", None) or "builtins").partition(".")[0] in _LIBRARIES


# --- code that gathers through torch.distributed ------------------------------------------------------------------
_GATHERS = frozenset(
    {"all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object", "all_gather_tensor"}
    | {"gather", "gather_object", "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"}
    | {"all_to_all", "all_to_all_single"}
)
"""``torch.distributed`` calls whose result depends on the other ranks' values (a broadcast or a barrier in one
process changes nothing one device would not do)."""

_FLAG = re.compile(r"gather.*dist|dist.*gather", re.IGNORECASE)  # gather_distributed (lightly), distributed_gather...
_STEP_ENTRIES = ("training_step", "validation_step", "test_step", "predict_step", "forward")
_MAX_DEPTH = 4  # calls followed from a step or forward: class -> helper -> autograd Function -> torch.distributed
_CHAIN_STARTS = frozenset(
    {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"}
)
_CHAIN_LINKS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_MISSING = object()


def distributed_gathers(module: nn.Module) -> list[str]:
    """What in ``module`` gathers through ``torch.distributed``, one "what and where" line per finding: a submodule
    with a ``gather_distributed``-style flag set, or a class of the user's whose step or ``forward`` calls a
    ``torch.distributed`` collective (directly, or through helpers and autograd Functions). Library classes (torch,
    Lightning, torchmetrics...) are skipped; each class is read once (cached), never run."""
    found: dict[str, list[str]] = {}  # what -> the module paths that do it
    for path, sub in module.named_modules():
        what = _flag_finding(sub)
        if what is None and not _opted_out(sub):
            entries = _STEP_ENTRIES if sub is module else ("forward",)
            what = _code_finding(type(sub), entries, "gather")
        if what is not None:
            found.setdefault(what, []).append(f"self.{path}" if path else "self")
    return [f"{_paths(paths)} {what}" for what, paths in found.items()]


def _paths(paths: list[str]) -> str:
    named = ", ".join(f"`{p}`" for p in paths[:2])
    return named if len(paths) <= 2 else f"{named} and {len(paths) - 2} more"


def _flag_finding(module: nn.Module) -> str | None:
    """``"(NTXentLoss) has gather_distributed=True"`` for a module whose gathering flag is set."""
    flags = [name for name, value in vars(module).items() if value is True and _FLAG.search(name)]
    return f"({type(module).__name__}) has {flags[0]}=True" if flags else None


def _opted_out(module: nn.Module) -> bool:
    """Whether the module has a gathering flag and it is off (``gather_distributed=False``): its code gathers only
    when it is on, so reading it would find a call that never runs."""
    return any(value is False and _FLAG.search(name) for name, value in vars(module).items())


@functools.cache
def _code_finding(cls: type, entries: tuple[str, ...], kind: str) -> str | None:
    """``"(MoCo) calls torch.distributed.all_gather through MoCo.training_step -> concat_all_gather"``, or ``None``:
    read once per class from the bytecode of its ``entries`` methods (those of its user-defined base classes too,
    which ``super()`` reaches) and of what they call, for a call of ``kind`` (see :data:`_WANTED`)."""
    wanted = _WANTED[kind]
    for klass in cls.__mro__:
        for name in entries if not _is_library(klass) else ():
            function = _unwrap(vars(klass).get(name))
            route = (
                _route(function, cls, _MAX_DEPTH, set(), wanted) if isinstance(function, types.FunctionType) else None
            )
            if route is not None:
                *through, call = [function.__qualname__, *route]
                return f"({cls.__name__}) calls {call} through {' -> '.join(through)}"
    return None


Wanted = Callable[[Any], "str | None"]


def _route(target: Any, owner: type | None, depth: int, seen: set[int], wanted: Wanted) -> list[str] | None:
    """The names from ``target`` (a function, or a class whose methods are read) to a call ``wanted`` names (a
    ``torch.distributed`` collective), ending with that name; ``None`` when none is found within ``depth`` calls."""
    if depth == 0 or id(target) in seen:
        return None
    seen.add(id(target))
    if isinstance(target, type):
        return _class_route(target, depth, seen, wanted)
    for chain in _chains(target.__code__):
        for obj in _resolve(chain, target, owner):
            if (name := wanted(obj)) is not None:
                return [name]
            if _is_user_code(obj):
                route = _route(obj, obj if isinstance(obj, type) else owner, depth - 1, seen, wanted)
                if route is not None:
                    return [_name(obj), *route]
    return None


def _class_route(cls: type, depth: int, seen: set[int], wanted: Wanted) -> list[str] | None:
    """:func:`_route` through the methods a user class (an autograd Function, a helper class) defines."""
    for klass in cls.__mro__:
        if _is_library(klass):
            continue
        for value in vars(klass).values():
            function = _unwrap(value)
            route = _route(function, cls, depth, seen, wanted) if isinstance(function, types.FunctionType) else None
            if route is not None:
                return route
    return None


def _chains(code: types.CodeType) -> Iterator[list[tuple[str, Any]]]:
    """The dotted names ``code`` (and the code nested in it) loads: ``torch.distributed.all_gather`` is
    ``[("LOAD_GLOBAL", "torch"), ("LOAD_ATTR", "distributed"), ("LOAD_ATTR", "all_gather")]``."""
    chain: list[tuple[str, Any]] = []
    for instruction in dis.get_instructions(code):
        if chain and instruction.opname in _CHAIN_LINKS:
            chain.append((instruction.opname, instruction.argval))
            continue
        if chain:
            yield chain
        chain = [(instruction.opname, instruction.argval)] if instruction.opname in _CHAIN_STARTS else []
    if chain:
        yield chain
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _chains(const)


def _resolve(chain: list[tuple[str, Any]], function: types.FunctionType, owner: type | None) -> Iterator[Any]:
    """The objects a chain's names stand for, from its head (a global, a closure variable, ``self``/``cls``: the
    ``owner`` class, not itself yielded) along its attributes, looked up statically (no property or ``__getattr__``
    runs)."""
    (opname, head), *links = chain
    obj = _head(opname, str(head), function, owner)
    if obj is not _MISSING and not opname.startswith("LOAD_FAST"):
        yield obj
    for _, attribute in links:
        if obj is _MISSING:
            return
        obj = _unwrap(inspect.getattr_static(obj, str(attribute), _MISSING))
        if obj is not _MISSING:
            yield obj


def _head(opname: str, name: str, function: types.FunctionType, owner: type | None) -> Any:
    """What a chain's first name stands for in ``function``: ``self``/``cls`` the owner class; another local its
    global or module of that name (a local ``import torch.distributed.nn`` binds ``torch``); a closure variable its
    cell's value."""
    if opname.startswith("LOAD_FAST"):
        if name in ("self", "cls") and function.__code__.co_varnames[:1] == (name,):
            return owner if owner is not None else _MISSING
        return _unwrap(function.__globals__.get(name, sys.modules.get(name, _MISSING)))
    if opname in ("LOAD_DEREF", "LOAD_CLASSDEREF"):
        cells = dict(zip(function.__code__.co_freevars, function.__closure__ or (), strict=False))
        try:
            return _unwrap(cells[name].cell_contents) if name in cells else _MISSING
        except ValueError:  # an empty cell
            return _MISSING
    return _unwrap(function.__globals__.get(name, _MISSING))


def _unwrap(value: Any) -> Any:
    """The function a static or class method, or a decorated function (``@torch.no_grad()``), stands for."""
    value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    if isinstance(value, types.FunctionType) and hasattr(value, "__wrapped__"):
        try:
            return inspect.unwrap(value)
        except ValueError:  # a cycle of __wrapped__
            return value
    return value


def _gather(obj: Any) -> str | None:
    """``"torch.distributed.all_gather"`` for a ``torch.distributed`` collective, else ``None``."""
    module = getattr(obj, "__module__", None) or ""
    if not (callable(obj) and module.startswith("torch.distributed") and getattr(obj, "__name__", "") in _GATHERS):
        return None
    return f"torch.distributed{'.nn' if module.startswith('torch.distributed.nn') else ''}.{obj.__name__}"


def _functional_metric(obj: Any) -> str | None:
    """``"torchmetrics.functional.f1_score"`` for a function of ``torchmetrics.functional``, else ``None``."""
    module = getattr(obj, "__module__", None) or ""
    if not (isinstance(obj, types.FunctionType) and module.startswith("torchmetrics.functional")):
        return None
    return f"torchmetrics.functional.{obj.__name__}"


_WANTED: dict[str, Wanted] = {"gather": _gather, "functional metric": _functional_metric}


def _is_user_code(obj: Any) -> bool:
    return isinstance(obj, (type, types.FunctionType)) and not _is_library(obj)


def _name(obj: Any) -> str:
    return obj.__name__ if isinstance(obj, type) else obj.__qualname__


#: Lightning's collectives as a module calls them (``self.all_gather``, ``self.trainer.strategy.barrier``...).
_LIGHTNING_COLLECTIVES = frozenset({"all_gather", "reduce_boolean_decision", "barrier", "broadcast"})


@functools.cache
def lightning_collectives(cls: type) -> str | None:
    """Where the module's own classes (not a library's) call Lightning's collectives, which make the replicas meet
    inside a step (so they run in threads): ``"MoCo calls all_gather in the module's code"``. Read once per class
    from the bytecode of every function it defines (the names a call goes through, not what they resolve to: an
    attribute of ``self.trainer`` cannot be looked up without running it), never run; ``torch.distributed``'s
    calls of those names are not Lightning's."""
    for klass in cls.__mro__:
        if _is_library(klass):
            continue
        for value in vars(klass).values():
            function = _unwrap(value)
            if not isinstance(function, types.FunctionType):
                continue
            for chain in _chains(function.__code__):
                *through, last = [str(name) for _, name in chain]
                if "distributed" in through or "dist" in through:
                    continue
                if (last in _LIGHTNING_COLLECTIVES and through) or (last == "reduce" and "strategy" in through):
                    return f"{klass.__name__} calls {last} in the module's code"
    return None


_LOGGED_STEPS = ("training_step", "validation_step", "test_step")


def functional_metrics(module: nn.Module) -> str | None:
    """Where ``module``'s step calls a ``torchmetrics.functional`` metric (read once per class, never run)."""
    what = _code_finding(type(module), _LOGGED_STEPS, "functional metric")
    return None if what is None else f"`self` {what}"


def functional_metric_message(strategy_name: str, finding: str) -> str:
    """The notice for :func:`functional_metrics`' finding under ``parallel_criterion``, with a fix that equals one
    device: the metric's object, whose logged value the strategy computes from the replicas' combined states."""
    return (
        f"{strategy_name}: {finding}. Each device computes it on its own shard, and a logged value of it merges as "
        "a sample-weighted mean of the devices' values, which equals one device's only for a mean over samples (not "
        "for F1, precision, recall, AUROC, a macro average). For one device's value, use the metric's object: "
        "`self.f1 = torchmetrics.F1Score(...)` in `__init__`, then `self.log('f1', self.f1(preds, y))` or "
        "`self.f1.update(preds, y); self.log('f1', self.f1)` in the step (its states are combined across the devices)."
    )


def distributed_gather_message(strategy_name: str, findings: Sequence[str]) -> str:
    """The warning for :func:`distributed_gathers`' findings under ``parallel_criterion``, with fixes that equal one
    device: gather through the strategy's own collective (it meets across the replicas of the step), or ``dp``."""
    return (
        f"{strategy_name}: {'; '.join(findings)}. torch.distributed gathers nothing here: the strategy runs one "
        "process (torch.distributed is not initialized, world size 1), so that code computes each device's result on "
        "its own shard, unlike one device on the whole batch (and unlike DDP, where it gathers across the ranks). For "
        "one device's result, gather through the strategy: `z = self.all_gather(z, sync_grads=True)` in the step "
        "meets across the replicas and returns the whole batch (on one device it is an identity; under DDP it returns "
        "(world_size, B, ...): `.flatten(0, 1)` when `self.trainer.world_size > 1`), then compute the loss on it with "
        "the loss's own gathering off (`gather_distributed=False`) or without the torch.distributed call; or use "
        "strategy='dp', where the step runs once on the whole batch (BatchNorm synchronised), so the loss as written "
        "equals one device."
    )


# --- plain Python objects a replicated step changed ---------------------------------------------------------------
_MODULE_REGISTRIES = frozenset(vars(nn.Module()))  # nn.Module's own dicts and sets: parameters, buffers, hooks...
_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_SEQUENCES = (list, collections.deque)
_CONTAINERS = (list, collections.deque, set, dict)


@dataclass(frozen=True)
class HeldChange:
    """One object held by the module that a replicated step changed: ``path`` from the module (``"buffer"``,
    ``"agent.env"``, ``"outputs['loss']"``), its type's name, what changed, ``"grew"`` or ``"changed"``, and whether
    it is a collection that grew (entries per device: collect them on the root) rather than something the step changed
    in place (do that once per step, on the root)."""

    path: str
    kind: str
    detail: str
    verb: str
    collection: bool

    @property
    def key(self) -> str:
        """What to say once: the attribute of the module (a dict's entries share their dict's key)."""
        return f"held:{self.path.partition('[')[0]}"


class HeldObjects:
    """A snapshot of the plain Python objects that ``module`` and its user-defined submodules hold (not modules,
    tensors, functions, classes or library objects): each list's, deque's, set's and dict's length (and a list's last
    entry), and a shallow copy of ``vars()`` of each other object. Taken before a replicated step, :meth:`changes`
    after it says what the step changed. Replicas share these objects with the module, so a step that changes one
    changes it once per replica. O(attributes): meant for the first steps only."""

    def __init__(self, module: nn.Module) -> None:
        self._held = list(_held(module))
        self._before = [_state(value) for _, value in self._held]

    def changes(self) -> list[HeldChange]:
        """What changed since the snapshot, in attribute order."""
        found: list[HeldChange] = []
        for (path, value), before in zip(self._held, self._before, strict=True):
            found.extend(_compare(path, value, before))
        return found


def _held(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """(path, value) of each watched attribute of ``module`` and its user-defined submodules."""
    skipped = _MODULE_REGISTRIES | _lightning_attributes(type(module))
    for prefix, sub in module.named_modules():
        if _is_library(type(sub)):
            continue
        for name, value in vars(sub).items():
            if name not in skipped and _watched(value):
                yield (f"{prefix}.{name}" if prefix else name), value


_NOT_PLAIN = (nn.Module, Tensor, type, types.FunctionType, types.MethodType, types.ModuleType)


def _watched(value: Any) -> bool:
    """A container, or a plain object of the user's (not a module, tensor, function, class or library object)."""
    if isinstance(value, _CONTAINERS):
        return type(value).__module__ in ("builtins", "collections") or not _is_library(value)
    return hasattr(value, "__dict__") and not isinstance(value, _NOT_PLAIN) and not _is_library(value)


@functools.cache
def _lightning_attributes(cls: type) -> frozenset[str]:
    """The attributes a bare LightningModule of ``cls``'s Lightning sets (``_trainer``, ``_metric_attributes``...):
    Lightning's, not the user's."""
    for klass in cls.__mro__:
        if klass.__name__ == "LightningModule" and _is_library(klass):
            return frozenset(vars(klass()))
    return frozenset()


ENTRIES_READ = 1024
"""The most entries of a container the module holds that a check reads: a larger one (a vocabulary, a cache) is
compared by its length alone, so that the first steps' checks stay cheap."""


def _state(value: Any) -> Any:
    """What :func:`_compare` compares: a collection's size (a sequence's last entry, a dict's collections' sizes), or
    an object's attributes and the sizes of its collections."""
    if isinstance(value, dict):
        if len(value) > ENTRIES_READ:
            return len(value), None, {}
        return len(value), {k: _size(v) for k, v in value.items() if isinstance(v, _CONTAINERS)}, dict(value)
    if isinstance(value, _CONTAINERS):
        return _size(value)
    attributes = dict(vars(value))
    return attributes, {k: _size(v) for k, v in attributes.items() if isinstance(v, _CONTAINERS)}


def _size(value: Any) -> tuple[int, Any]:
    """A collection's length, and its last entry (a full deque that was appended to keeps its length), held until
    :meth:`HeldObjects.changes` compares it by identity."""
    return len(value), value[-1] if isinstance(value, _SEQUENCES) and value else _MISSING


def _compare(path: str, value: Any, before: Any) -> list[HeldChange]:
    kind = type(value).__name__
    if isinstance(value, dict):
        return _dict_changes(path, value, before)
    if isinstance(value, _CONTAINERS):
        detail = _size_change(before, _size(value))
        return [] if detail is None else [HeldChange(path, kind, detail, _verb(detail), _verb(detail) == "grew")]
    details = _object_changes(value, *before)
    return [HeldChange(path, kind, "; ".join(details), "changed", False)] if details else []


def _size_change(before: tuple[int, Any], after: tuple[int, Any]) -> str | None:
    """``"3 entries more"``, ``"2 entries fewer"``, ``"its last entry replaced"`` or ``None``."""
    grown = after[0] - before[0]
    if grown:
        return f"{_entries(abs(grown))} {'more' if grown > 0 else 'fewer'}"
    return "its last entry replaced" if after[1] is not before[1] else None


def _entries(count: int) -> str:
    return f"{count} {'entry' if count == 1 else 'entries'}"


def _verb(detail: str) -> str:
    return "grew" if detail.endswith("more") else "changed"


def _dict_changes(
    path: str, value: dict[Any, Any], before: tuple[int, dict[Any, Any] | None, dict[Any, Any]]
) -> list[HeldChange]:
    """A dict's collections that changed (``outputs['loss']``); else the dict itself, where entries other than
    tensors (a dict of tensors is the shared-entries check's) or flags (a library's warned-once dict) were added, or
    its plain entries were rebound (a counter, ``self.counts['steps'] += 1``)."""
    length, sizes, entries = before
    changes = [
        HeldChange(f"{path}[{key!r}]", type(entry).__name__, detail, _verb(detail), _verb(detail) == "grew")
        for key, entry in (value.items() if sizes is not None else ())  # only the dicts whose entries were read
        if isinstance(entry, _CONTAINERS) and (detail := _size_change(sizes.get(key, (0, _MISSING)), _size(entry)))
    ]
    new = list(itertools.islice(value.values(), length, length + ENTRIES_READ))
    if not changes and new and not any(_holds_tensors(v) or isinstance(v, (bool, type(None))) for v in new):
        changes.append(HeldChange(path, type(value).__name__, f"{_entries(len(new))} more", "grew", True))
    rebound = [repr(k) for k, old in entries.items() if k in value and _rebound_entry(old, value[k])]
    if rebound:
        detail = f"its entr{'ies' if len(rebound) > 1 else 'y'} {', '.join(rebound)} changed"
        changes.append(HeldChange(path, type(value).__name__, detail, "changed", False))
    return changes


def _rebound_entry(old: Any, new: Any) -> bool:
    """Whether a dict's plain entry was rebound (not a collection: those are compared by size; not tensors)."""
    return not _same(old, new) and not isinstance(new, _CONTAINERS) and not _holds_tensors(new)


def _holds_tensors(value: Any) -> bool:
    return isinstance(value, Tensor) or (isinstance(value, (tuple, list)) and bool(value) and _holds_tensors(value[0]))


def _object_changes(value: Any, attributes: dict[str, Any], sizes: dict[str, tuple[int, Any]]) -> list[str]:
    """``["its attributes steps, state changed", "its memory: 3 entries more"]`` for an object's rebound, added or
    removed attributes (a plain value rebound to an equal one does not count) and grown collections."""
    current = vars(value)
    rebound = [
        name
        for name in dict.fromkeys([*attributes, *current])
        if not _same(attributes.get(name, _MISSING), current.get(name, _MISSING))
    ]
    details = [f"its attribute{'s' if len(rebound) > 1 else ''} {', '.join(rebound)} changed"] if rebound else []
    for name, size in sizes.items():
        entry = current.get(name)
        detail = _size_change(size, _size(entry)) if isinstance(entry, _CONTAINERS) and name not in rebound else None
        if detail is not None:
            details.append(f"its {name}: {detail}")
    return details


def _same(old: Any, new: Any) -> bool:
    return old is new or (type(old) is type(new) and type(new) in _PLAIN and old == new)


_BATCH_HOOKS = {
    "training_step": "on_train_batch",
    "validation_step": "on_validation_batch",
    "test_step": "on_test_batch",
    "predict_step": "on_predict_batch",
}


def held_objects_message(owner: str, changes: Sequence[HeldChange], replicas: int, hook: str = "training_step") -> str:
    """The warning for :meth:`HeldObjects.changes` after a call of ``hook`` on ``replicas`` replicas of the module
    of class ``owner``. Collections grown alone: collect step outputs on the root (the message of the list check this
    replaces); objects changed: do that work once per step on the root (a batch hook, or the data pipeline for an
    environment); under dp (``hook="forward"``): move it from ``forward`` into the step, which runs once there."""
    firsts = {c.key: c for c in reversed(changes)}  # one head per attribute: a dict's first entry that changed
    said = (
        f"{_listed([f'`{owner}.{c.path}` {c.verb}' for c in reversed(firsts.values())])} during a step that ran on "
        f"{replicas} replicas ({'; '.join(f'`{c.path}` ({c.kind}): {c.detail}' for c in changes)})"
    )
    several = len(changes) > 1
    if hook == "forward":
        return (
            f"{said}: `forward` ran once per device, each with its shard, so it changed {'them' if several else 'it'} "
            "once per device. Do that in the step (under dp it runs once, on the root, with the whole batch), or in "
            "`on_train_batch_start` / `on_train_batch_end`."
        )
    if all(c.collection for c in changes):
        batch_end = f"{_BATCH_HOOKS.get(hook, 'on_train_batch')}_end"
        return (
            f"{said}: {'they hold' if several else 'it holds'} one entry per device per step (each of its shard), "
            f"so a per-step value computed from {'them' if several else 'it'} (a mean of the step losses, a count) "
            f"differs from one device's, while per-sample values concatenated in order do not. Collect step outputs "
            f"in `{batch_end}(outputs, ...)`, which runs once, on the root, with the gathered outputs, or use a "
            "torchmetrics metric."
        )
    return f"{said}: {_per_replica(several, replicas)} {_once_on_root(_BATCH_HOOKS.get(hook, 'on_train_batch'))}"


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _per_replica(several: bool, replicas: int) -> str:
    it, them = ("they", "them") if several else ("it", "it")
    return (
        f"each replica changed {them} with its own shard, in no fixed order, so {it} changed {replicas} times in a "
        f"step where one device changes {them} once."
    )


def _once_on_root(batch: str) -> str:
    """The fix: once per step, on the root (for a DQN, where Lightning's example plays its environment)."""
    dqn = (
        " (Lightning's DQN example plays its environment in `training_step`: move that call to "
        "`on_train_batch_start`, before the step, as on one device)"
        if batch == "on_train_batch"
        else ""
    )
    return (
        f"Do that work once per step, on the root: in `{batch}_start` or `{batch}_end`, which run once, with the "
        f"whole batch{dqn}; or, for an environment and its replay buffer, in the data pipeline (an IterableDataset "
        f"that plays the environment and yields batches from the buffer). Return per-step values from the step and "
        f"collect them in `{batch}_end(outputs, ...)`."
    )


# --- the first replicated steps -----------------------------------------------------------------------------------
_ON_ROOT = (
    "in `on_train_batch_end` / `on_validation_batch_end` (they run once, on the root, with the whole batch and the "
    "gathered outputs)"
)


class StepChecks:
    """Around the first two replicated calls of each hook (:meth:`before` / :meth:`after`), what the call did to the
    module's state that one device would not: Python objects it holds changed once per replica, tensors written into
    dicts every replica shares, learning-rate schedulers stepped once per replica (an error), attributes rebound to
    values that differ between replicas. Each said once (``warn_once(key, message)``, keys in ``announced``).
    ``step_per_replica``: the step itself runs per replica (``parallel_criterion``), not only ``forward`` (``dp``)."""

    def __init__(self, step_per_replica: bool, announced: set[str], warn_once: Callable[[str, str], None]) -> None:
        self._step_per_replica = step_per_replica
        self._announced = announced
        self._warn_once = warn_once
        self._calls: dict[str, int] = {}  # replicated calls per hook
        self._dicts: tuple[int, int, list[tuple[nn.Module, str, str]]] | None = None  # (root, builds, dict attributes)
        self._before: tuple[Any, ...] | None = None

    def before(self, hook: str, module: nn.Module, root: Any, builds: int) -> bool:
        """Snapshot what the call may change, if it is among the first two of ``hook``; whether it is."""
        seen = self._calls.get(hook, 0)
        self._calls[hook] = seen + 1
        if seen >= 2:
            return False
        if self._dicts is None or self._dicts[:2] != (id(root), builds):  # found again after a structural change
            self._dicts = (id(root), builds, _dict_attributes(root))
        dicts = self._dicts[2]
        self._before = (module, root, HeldObjects(module), dicts, _dict_entries(dicts), _scheduler_steps(root))
        return True

    def after(
        self, hook: str, kept: dict[str, Any], others: Sequence[dict[str, Any]], *, manual: bool, interleaved: bool
    ) -> None:
        """Say what the call changed: ``kept`` are the attributes replica 0 rebound (the module keeps them),
        ``others`` the other replicas'."""
        assert self._before is not None, "after() without before()"
        (module, root, held, dicts, entries, steps), self._before = self._before, None
        count = len(others) + 1
        _check_scheduler_steps(root, hook, steps, count, manual)
        self._say_held(module, held, count, hook if self._step_per_replica else "forward")
        self._say_rebound(module, kept, others)
        self._say_shared_entries(root, dicts, entries, interleaved)

    def _say_held(self, module: nn.Module, held: HeldObjects, count: int, hook: str) -> None:
        changes = [c for c in held.changes() if c.key not in self._announced]
        if changes:
            self._warn_once(changes[0].key, held_objects_message(type(module).__name__, changes, count, hook))
            self._announced.update(c.key for c in changes)

    def _say_rebound(self, module: nn.Module, kept: dict[str, Any], others: Sequence[dict[str, Any]]) -> None:
        for name, value in kept.items():
            if all(name in other and _alike(value, other[name]) for other in others):
                continue
            self._warn_once(
                f"rebound:{name}",
                f"`{type(module).__name__}.{name}` was rebound during a step that ran on {len(others) + 1} replicas "
                "to values that differ between the replicas (each computed from its shard): the module keeps replica "
                f"0's, where one device keeps the whole batch's. Compute it {_ON_ROOT}, keep it in a torchmetrics "
                "metric or log it.",
            )

    def _say_shared_entries(
        self,
        root: nn.Module,
        places: Sequence[tuple[nn.Module, str, str]],
        before: dict[tuple[str, Any], Any],
        interleaved: bool,
    ) -> None:
        """Once per dict that the module and every replica share, in which the replicated call wrote tensors (a
        forward hook's feature maps, a step's outputs by index): one replica's entry is what remains."""
        written = [path for (path, key), value in _dict_entries(places).items() if before.get((path, key)) is not value]
        for path in dict.fromkeys(written):
            consequence, fix = _shared_entries_advice(self._step_per_replica, interleaved)
            self._warn_once(
                f"entries:{path}",
                f"`{type(root).__name__}.{path}` got tensors during a call that ran on several replicas, which share "
                f"that dict: {consequence}. {fix}.",
            )


def _shared_entries_advice(step_per_replica: bool, interleaved: bool) -> tuple[str, str]:
    """What a write into a dict the replicas share leaves, and how to keep such values as one device does."""
    if not step_per_replica:
        return (
            "the step reads the last replica's entries: one shard's, not the whole batch's",
            "Return them from `forward`: dp gathers its outputs over the devices",
        )
    consequence = (
        "the replicas ran interleaved (they hand over at SyncBatchNorm layers or collectives), so a replica may have "
        "read another's entry, another shard's tensor, in its step"
        if interleaved
        else "after the step it holds the last replica's entries (one shard's, where they are computed from the shard)"
    )
    fix = (
        "Keep such values per replica: from a forward hook, set them on the hooked module, the hook's first argument "
        "(`lambda module, args, output: setattr(module, 'features', output)`, read as `self.<layer>.features`), or "
        f"return them from `forward`; step outputs: return them and collect them {_ON_ROOT}. A cache of values alike "
        "on every replica (a memo of positions) is unaffected on one device's virtual replicas, but on distinct GPUs "
        "an entry may lie on another replica's device: key it by device, or hold it as a buffer "
        "(`register_buffer(..., persistent=False)`)"
    )
    return consequence, fix


def _dict_attributes(module: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(module, attribute, qualified name) of each dict attribute of ``module`` and its submodules (not nn.Module's
    registries): every replica shares these dicts with the module."""
    return [
        (m, name, f"{prefix}.{name}" if prefix else name)
        for prefix, m in module.named_modules()
        for name, value in vars(m).items()
        if isinstance(value, dict) and name not in _MODULE_REGISTRIES
    ]


def _dict_entries(places: Sequence[tuple[nn.Module, str, str]]) -> dict[tuple[str, Any], Any]:
    """The values that hold tensors (a tensor, or a tuple or list that starts with one, as an LSTM's output) in the
    dicts at ``places``, by (qualified name, key)."""
    entries = {}
    for module, name, path in places:
        held = vars(module).get(name) or {}
        if len(held) > ENTRIES_READ:  # a vocabulary or a cache: not a forward hook's few feature maps
            continue
        for key, value in held.items():
            if _holds_tensors(value):
                entries[(path, key)] = value
    return entries


def _scheduler_steps(root: Any) -> list[tuple[str, Any]]:
    """Each learning-rate scheduler of the trainer or held by ``root``, by class name, with its ``last_epoch`` (how
    often it stepped)."""
    configs = root.trainer.lr_scheduler_configs if getattr(root, "_trainer", None) is not None else []
    held = [value for value in vars(root).values() if isinstance(value, LRScheduler)]
    schedulers = {id(s): s for s in [*(c.scheduler for c in configs), *held]}.values()
    return [(type(s).__name__, getattr(s, "last_epoch", None)) for s in schedulers]


def _check_scheduler_steps(root: Any, hook: str, before: list[tuple[str, Any]], count: int, manual: bool) -> None:
    """Raise if a scheduler stepped during a call that ran on ``count`` > 1 replicas: once per replica. Under manual
    optimization ``self.lr_schedulers()`` steps once (replica 0's), so only a move by a multiple of ``count`` (a
    scheduler the module holds, stepped by every replica) is one."""
    moved = [
        (b, a)
        for b, a in zip(before, _scheduler_steps(root), strict=False)
        if b != a and not (manual and isinstance(a[1], int) and isinstance(b[1], int) and (a[1] - b[1]) % count)
    ]
    if moved:
        (name, first), (_, last) = moved[0]
        batch_end = _BATCH_HOOKS.get(hook, "on_train_batch") + "_end"
        raise RuntimeError(
            f"`{hook}` stepped the learning-rate scheduler {name} on each of the {count} replicas (its last_epoch went "
            f"from {first} to {last} in one step): it advanced {count} times where one device advances it once. Step "
            f"it once per step, on the root: in `{batch_end}`, or let Lightning step it (configure_optimizers "
            "returning {'optimizer': ..., 'lr_scheduler': {'scheduler': ..., 'interval': 'step'}})."
        )


def _alike(a: Any, b: Any) -> bool:
    """Whether two replicas' values of an attribute are the same value (equal tensors, or equal by ``==``)."""
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b.to(a)))
    try:
        return bool(a == b)
    except Exception:
        return False
