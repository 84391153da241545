"""Lasting replicas: copies of a module's tree, built once per device list and synced every step with a number of
tensor operations that does not grow with depth (``nn.DataParallel`` rebuilds its replicas every step)."""

from __future__ import annotations

import operator
import threading
import types
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.modules.module import register_module_buffer_registration_hook
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from lightning_mgpu.parallel.compiled import compiled_call, is_compiled, is_optimized_module
from lightning_mgpu.parallel.devices import DeviceLike, to_device
from lightning_mgpu.parallel.flat_replicas import ReplicaBuffers, ReplicaParameters, Slot
from lightning_mgpu.parallel.run_replicas import ExecutionMode, resolve_mode
from lightning_mgpu.parallel.scatter_gather import is_dataclass_instance, iter_nodes
from lightning_mgpu.parallel.sync_batchnorm import SyncBatchNorm, uses_sync_batchnorm

_NEVER_SYNCED = frozenset({"_parameters", "_buffers", "_modules", "_is_replica", "_compiled_call_impl"})
_WEIGHT_HOOKS = (BasePruningMethod, WeightNorm, SpectralNorm)  # forward pre-hooks that set an attribute: `weight`
_BEFORE_BUILDING: list[Callable[[nn.Module], None]] = []
SYNC_BATCHNORM_THREADS = (
    "SyncBatchNorm layers make the replicas meet inside every BatchNorm layer: replicas run in threads"
)


def before_building_replicas(prepare: Callable[[nn.Module], None]) -> None:
    """Run ``prepare(module)`` on the original module each time its replicas are built: a library's one-time set-up
    that the copies would otherwise each repeat (see :mod:`lightning_mgpu.integrations`)."""
    if prepare not in _BEFORE_BUILDING:
        _BEFORE_BUILDING.append(prepare)


class OriginalOnly:
    """Base of attribute values that stay on the original module (``dp``'s replicated ``forward``): replicas get
    :attr:`replica_value` instead (``None``: nothing, the class attribute serves)."""

    replica_value: Any = None


def replicate(module: nn.Module, devices: Sequence[DeviceLike], detach: bool = False) -> list[nn.Module]:
    """One replica of ``module`` per device, for one call. As ``torch.nn.parallel.replicate``: gradients of the
    replicas' parameters reach the originals, unless ``detach=True`` or gradients are disabled."""
    with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
        return ReplicaSet(module, devices).prepare(linked=True)


class ReplicaSet:
    """Lasting replicas of ``module``, one per device of ``devices`` (devices may repeat: "virtual devices").

    Call :meth:`prepare` before each step and :meth:`watch` right after it. Every replica owns its parameters
    (:class:`.flat_replicas.ReplicaParameters`); replica 0 shares the original buffers, the others hold copies, and a
    buffer a step rebinds takes replica 0's value (``nn.DataParallel``'s rule). Attributes rebound on the originals
    reach the replicas, except ``overrides`` (set per replica by the owner); a structural change rebuilds them
    (:attr:`builds`). Every replica holds the original of a ``shared(submodule)`` (``on_build`` may swap in
    per-replica objects).
    """

    def __init__(
        self,
        module: nn.Module,
        devices: Sequence[DeviceLike],
        on_build: Callable[[list[nn.Module]], None] | None = None,
        overrides: Sequence[str] = (),
        shared: Callable[[nn.Module], bool] | None = None,
    ) -> None:
        self.module = module
        self._shared = shared or _nothing_shared
        self.devices = [to_device(d) for d in devices]
        if not self.devices:
            raise ValueError("A ReplicaSet needs at least one device.")
        self._on_build = on_build
        self._overrides = frozenset(overrides) | _NEVER_SYNCED
        self.builds = 0
        self._structure_checked = False  # by execution_mode(), for the prepare() that follows it
        self.meets_at_batchnorm = False  # set by execution_mode()
        self.defer_reduction = False
        self._owning = False
        self._queued = False
        self._queue_lock = threading.Lock()
        self._run: _Run | None = None  # between prepare() and watch()
        self._build()

    # --- build -------------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        self._end_run(adopt=True)  # a step that raised before watch(): keep what replica 0 rebound
        for prepare in _BEFORE_BUILDING:
            prepare(self.module)
        self._originals = originals = _walk(self.module, self._shared)
        self._hooked_leaves: dict[int, weakref.ref[Tensor]] = {}  # outputs that are replica parameters
        _check_initialized(self.module, originals)
        self._position = {id(m): k for k, m in enumerate(originals)}
        self._params = _unique(p for m in originals for p in m._parameters.values() if p is not None)
        self._param_index = {id(p): j for j, p in enumerate(self._params)}
        self._root = self._params[0].device if self._params else self.devices[0]
        buffers = _unique(b for m in originals for b in m._buffers.values() if b is not None)
        self._copies: list[list[nn.Module]] = []
        self._param_slots: list[list[Slot]] = []
        self._buffer_slots: list[list[Slot]] = []
        self._rnns: list[list[nn.RNNBase]] = []
        self.compiled = any(is_compiled(m) for m in originals)
        uses_sync_batchnorm(self.module)  # names the sync layers built directly, for their errors
        self._sync_layers = [m for m in originals if isinstance(m, SyncBatchNorm)]
        self._weight_hooks = [
            (m, hook) for m in originals for hook in m._forward_pre_hooks.values() if isinstance(hook, _WEIGHT_HOOKS)
        ]
        with torch.inference_mode(False), torch.no_grad():  # copies must be normal tensors, whatever the caller's mode
            for i in range(len(self.devices)):
                self._build_replica(i, {id(b): k for k, b in enumerate(buffers)})
        self._buffers = ReplicaBuffers(buffers, self._buffer_slots, self.devices)
        self._flat: ReplicaParameters | None = None  # built on the first step that needs the replicas' own leaves
        self._pointed = [False] * len(self.devices)  # replicas whose modules hold their own leaves
        self._places = {  # replica modules (not shared ones) -> (replica, position)
            id(c): (i, k)
            for i, copies in enumerate(self._copies)
            for k, c in enumerate(copies)
            if c is not originals[k]
        }
        # Per module its attribute, parameter, buffer and child dicts (none for a shared one: replicas hold it), and
        # shallow copies of them: one ``==`` of the two lists tells whether anything changed.
        self._live = [d for m in originals for d in (({},) * 4 if self._shared(m) else _watched_dicts(m))]
        self._saved = [d.copy() for d in self._live]
        self.builds += 1
        if self._on_build is not None:
            self._on_build(self.replicas)

    def _build_replica(self, i: int, buffer_index: dict[int, int]) -> None:
        copies = self._module_copies()
        slots: list[Slot] = []
        buffer_slots: list[Slot] = []
        for k, (original, copy) in enumerate(zip(self._originals, copies, strict=True)):
            if copy is original or is_optimized_module(original):
                continue  # shared as is, or a compiled wrapper (its tensors are those of the wrapped module)
            copy._modules = self._children(k, copies)
            copy.__dict__ = self._for_replica(copy.__dict__, copies)
            copy._parameters = dict(original._parameters)  # the originals until the first prepare()
            slots += [
                (copy._parameters, n, self._param_index[id(p)])
                for n, p in original._parameters.items()
                if p is not None
            ]
            for name, buffer in original._buffers.items():
                if i == 0 and buffer is not None and buffer.device == self.devices[0]:
                    copy._buffers[name] = buffer  # replica 0 shares the originals (DataParallel's semantics)
                elif buffer is not None:
                    buffer_slots.append((copy._buffers, name, buffer_index[id(buffer)]))
            if original.__dict__.get("_compiled_call_impl") is not None:
                copy._compiled_call_impl = compiled_call(original, copy)
        self._copies.append(copies)
        self._param_slots.append(slots)
        self._buffer_slots.append(buffer_slots)
        self._rnns.append(
            [c for c, o in zip(copies, self._originals, strict=True) if c is not o and isinstance(c, nn.RNNBase)]
        )

    def _module_copies(self) -> list[nn.Module]:
        """One replica's modules: shared ones as they are, shallow copies of the others, and ``torch.compile``
        wrappers built around their wrapped module's copy (innermost first)."""
        copies: list[Any] = [
            m if self._shared(m) else None if is_optimized_module(m) else m._replicate_for_data_parallel()
            for m in self._originals
        ]
        for k in reversed(range(len(copies))):
            if copies[k] is None:
                original = self._originals[k]
                copies[k] = type(original)(self._children(k, copies)["_orig_mod"], original.dynamo_ctx)
        return copies

    def _children(self, k: int, copies: Sequence[nn.Module]) -> dict[str, nn.Module | None]:
        position = self._position
        return {n: None if c is None else copies[position[id(c)]] for n, c in self._originals[k]._modules.items()}

    @property
    def replicas(self) -> list[nn.Module]:
        """Every replica's root module, in device order."""
        return [copies[0] for copies in self._copies]

    def execution_mode(self, requested: ExecutionMode, count: int) -> tuple[ExecutionMode, str | None]:
        """The mode to run ``count`` replicas in, and why it is not ``requested`` (``None`` when it is): compiled
        replicas run one after another (Dynamo is not thread-safe), SyncBatchNorm in training needs threads. Checks
        the structure first, for the next :meth:`prepare`."""
        self._sync_structure()
        sync = count > 1 and any(layer._uses_batch_stats() for layer in self._sync_layers)
        self.meets_at_batchnorm = sync  # the replicas hand over inside their step, at every SyncBatchNorm layer
        if self.compiled and sync:
            raise RuntimeError(
                "SyncBatchNorm needs the replicas to run at the same time (in threads), but the model is compiled "
                "with torch.compile, whose compiler is not thread-safe, so compiled replicas run one after another. "
                "Revert the SyncBatchNorm layers (revert_sync_batchnorm / no sync_batchnorm=True), or do not compile "
                "the model here (DDP runs compiled models with synchronised BatchNorm)."
            )
        self._structure_checked = True
        if self.compiled:
            mode: ExecutionMode = "sequential"
            reason = (
                "the model is compiled, and torch.compile's compiler is not thread-safe: replicas run one after "
                "another from one thread (on distinct GPUs they still overlap)"
            )
        elif sync:
            mode, reason = "threads", SYNC_BATCHNORM_THREADS
        else:
            return requested, None
        return mode, reason if resolve_mode(requested, self.devices[:count]) != mode else None

    # --- every step --------------------------------------------------------------------------------------------------
    def prepare(self, n: int | None = None, linked: bool = False) -> list[nn.Module]:
        """The first ``n`` replicas (default all), synced with the original for a step, each with its own leaves:
        pass their outputs to :meth:`watch`. ``linked=True``: see :func:`replicate`."""
        n = len(self.devices) if n is None else n
        if not 1 <= n <= len(self.devices):
            raise ValueError(f"Asked for {n} replicas of a set of {len(self.devices)}.")
        self._end_run(adopt=True)  # a step that raised before watch(): keep what replica 0 rebound
        if not self._structure_checked:
            self._sync_structure()
        self._structure_checked = False
        self._buffers.refresh(n)
        self._queued = False
        self._owning = not linked
        if linked:
            self._link_parameters(n)
        else:
            self._own_parameters(n)
            self._run = _Run(self._places)
        return self.replicas[:n]

    def _end_run(self, adopt: bool) -> None:
        """Stop recording the run in progress; ``adopt``: buffers it rebound take replica 0's value."""
        run, self._run = self._run, None
        if run is not None:
            run.stop()
            if adopt and run.rebound:
                self._adopt_buffers(run.rebound)

    def watch(self, outputs: Sequence[Any]) -> None:
        """Reduce the replicas' gradients onto the originals after any backward pass that reaches ``outputs`` (this
        step's replica outputs)."""
        self._end_run(adopt=True)
        for module, hook in self._weight_hooks:  # what one device's forward leaves on the module (ModelPruning ranks
            if isinstance(hook, SpectralNorm):  # by it); replica 0's forward already ran the power iteration
                setattr(module, hook.name, hook.compute_weight(module, do_power_iteration=False))
            else:
                hook(module, ())
        if self._owning and self._flat is not None and self._flat.keep_rebound_data():
            for i in range(len(self.devices)):
                if self._pointed[i]:
                    self._point(i, self._flat.leaves[i])
        if not self._owning or not torch.is_grad_enabled():
            return  # replicas linked to the originals (replicate()) need no reduction
        for tensor in _differentiable(outputs):
            if tensor.grad_fn is None:  # a replica parameter returned as is keeps its hook: once
                known = self._hooked_leaves.get(id(tensor))
                if known is not None and known() is tensor:
                    continue
                self._hooked_leaves[id(tensor)] = weakref.ref(tensor)
            tensor.register_hook(self._on_gradient)

    def _on_gradient(self, grad: Tensor) -> None:
        with self._queue_lock:
            if self._queued:
                return
            self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._queued = False
        if self._flat is not None:
            self._flat.backward_done()
        if not self.defer_reduction:
            self.reduce_gradients()

    def reduce_gradients(self, run_hooks: bool = True) -> None:
        """Add the replicas' gradients onto the originals' ``.grad`` (after every backward pass unless
        :attr:`defer_reduction`). ``run_hooks=False``: backward passes ran before the originals had hooks."""
        if self._flat is not None:
            self._flat.reduce(run_hooks)

    def after_manual_backward(self) -> None:
        """Reduce a backward pass inside the step (manual optimization) onto the parameters trainable now."""
        if self._flat is not None:
            self._flat.backward_done()
            self._flat.reduce(only_trainable=True)

    def after_optimizer_step(self, n: int) -> None:
        """Inside a step, after the optimizer stepped the originals: the first ``n`` replicas' copies follow."""
        if self._flat is not None:
            self._flat.copy_values(n)

    def leaves_of(self, param: Tensor) -> list[Tensor]:
        """The replicas' own leaves that stand for the original ``param`` in the graph of the last step, for
        ``backward(inputs=...)``: empty when the replicas held the originals (or ``param`` is none of them)."""
        j = self._param_index.get(id(param))
        if not self._owning or self._flat is None or j is None or self._params[j] is not param:
            return []
        return [leaves[j] for leaves in self._flat.leaves[: self._flat.active]]

    def mark_stale(self) -> None:
        """Copy every parameter and buffer into the replicas at the next :meth:`prepare`, changed or not: writes
        through ``.data`` (Lightning's ``WeightAveraging`` swaps weights so) move no version counter."""
        self._buffers.mark_stale()
        if self._flat is not None:
            self._flat.mark_stale()

    @property
    def pending(self) -> bool:
        """Replicas ran since the last reduction (their gradients may wait for one)."""
        return self._flat is not None and self._flat.pending

    def _adopt_buffers(self, rebound: set[tuple[int, int, str]]) -> None:
        """Buffers the step rebound: replica 0's value becomes the original's (a new value of the same shape and dtype
        is no structural change; anything else rebuilds at the next :meth:`prepare`), and every replica holds the
        buffers this set keeps up to date again (its copies, or the originals for replica 0)."""
        for k, name in sorted({(k, name) for i, k, name in rebound if i == 0}):
            value, buffers = self._copies[0][k]._buffers.get(name), self._originals[k]._buffers
            old = buffers.get(name)
            if value is not None and old is not None:
                value = value.to(old.device)
                if value.shape == old.shape and value.dtype == old.dtype and self._buffers.replace(old, value):
                    self._saved[4 * k + 2][name] = value  # the saved copy of its buffer dict
            buffers[name] = value
        for i in sorted({i for i, _, _ in rebound}):
            self._buffers.restore(i)
            kept = {(id(store), name) for store, name, _ in self._buffer_slots[i]}
            for _, k, name in (r for r in rebound if r[0] == i):
                buffers, original = self._copies[i][k]._buffers, self._originals[k]._buffers
                if name not in original:
                    buffers.pop(name, None)
                elif (id(buffers), name) not in kept:  # replica 0 shares the original
                    buffers[name] = original[name]

    def _own_parameters(self, n: int) -> None:
        """Point the first ``n`` replicas at their own leaf parameters, synced with the originals."""
        flat = self._flat
        if flat is None or not flat.sync(n):
            if flat is not None:
                flat.reduce()  # what the replicas accumulated still belongs to the originals
            # Embedding(max_norm=...) renormalises the rows it looks up in place: on one device, every shard's rows.
            embeddings = [m for m in self._originals if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
            renormed = {id(m.weight) for m in embeddings if isinstance(m, nn.Embedding) and m.max_norm is not None}
            sparse = {id(m.weight) for m in embeddings if m.sparse}
            params = self._params
            flat = self._flat = ReplicaParameters(
                params,
                self.devices,
                self._root,
                [j for j, p in enumerate(params) if id(p) in renormed],
                [j for j, p in enumerate(params) if id(p) in sparse],
            )
            flat.sync(n)
            self._pointed = [False] * len(self.devices)
        for i in range(n):
            if not self._pointed[i]:
                self._point(i, flat.leaves[i])
                self._pointed[i] = True

    def _point(self, i: int, tensors: Sequence[Tensor | None]) -> None:
        """Replica ``i``'s parameters from ``tensors`` (indexed like the unique originals)."""
        for store, name, j in self._param_slots[i]:
            store[name] = tensors[j]
        for rnn in self._rnns[i]:  # RNNs run on a cached list of their weights, which must hold this replica's tensors
            rnn._flat_weights = [getattr(rnn, wn, None) for wn in rnn._flat_weights_names]

    def _link_parameters(self, n: int) -> None:
        """The first ``n`` replicas' parameters for a one-off step: the trainable ones linked to the originals by
        autograd (views on the root's device, copies elsewhere), the others detached."""
        grad = torch.is_grad_enabled()
        for i, device in enumerate(self.devices[:n]):
            tensors = []
            for p in self._params:
                t = p if grad and p.requires_grad else p.detach()
                tensors.append(t.view_as(t) if t.device == device else t.to(device))
            self._point(i, tensors)
        self._pointed[:n] = [False] * n  # back to their own leaves at the next prepare()

    def _sync_structure(self) -> None:
        """Rebuild on a structural change or a (un)compiled module; copy attributes rebound on the originals to every
        replica. One ``==`` of every watched dict against its copy settles the common case (no change)."""
        if _same(self._live, self._saved):
            return
        for k in range(len(self._originals)):
            attrs, params, buffers, children = self._live[4 * k : 4 * k + 4]
            saved = self._saved[4 * k : 4 * k + 4]
            same_structure = _same(params, saved[1]) and _same(buffers, saved[2]) and _same(children, saved[3])
            if same_structure and _same(attrs, saved[0]):
                continue
            if not same_structure or attrs.get("_compiled_call_impl") is not saved[0].get("_compiled_call_impl"):
                self.reduce_gradients()  # what the old replicas accumulated still belongs to the originals
                self._build()
                return
            self._copy_attributes(k, saved[0])

    def keep_first_replicas(self, before: dict[str, Any]) -> dict[str, Any]:
        """Rebind on the original module what replica 0's root module rebound in its step since ``before`` (a copy of
        its ``__dict__``): the original stands for replica 0, as DDP's rank 0 does; the next :meth:`prepare` hands
        the values to every replica. Returns them (per-replica ``overrides`` are never taken)."""
        rebound = rebound_attributes(self._copies[0][0], before, self._overrides)
        self.module.__dict__.update(rebound)
        return rebound

    def _copy_attributes(self, k: int, before: dict[str, Any]) -> None:
        current = self._originals[k].__dict__
        changed = rebound_attributes(self._originals[k], before, self._overrides)
        removed = [key for key in before if key not in current and key not in self._overrides]
        for copies in self._copies:
            replica_dict = copies[k].__dict__
            replica_dict.update(self._for_replica(changed, copies))
            for key in removed:
                replica_dict.pop(key, None)
        self._saved[4 * k : 4 * k + 4] = [d.copy() for d in self._live[4 * k : 4 * k + 4]]

    def _for_replica(self, attributes: dict[str, Any], copies: Sequence[nn.Module]) -> dict[str, Any]:
        """``attributes`` for the replica whose modules are ``copies``: :class:`OriginalOnly` values replaced by what
        replicas get, and methods bound to an original module (a ``forward`` replaced on the instance) bound to its
        copy, else the replica would run on the original's parameters."""
        kept = {}
        for key, value in attributes.items():
            if isinstance(value, OriginalOnly) and (value := value.replica_value) is None:
                continue
            owner = value.__self__ if isinstance(value, types.MethodType) else None
            k = self._position.get(id(owner))
            kept[key] = (
                types.MethodType(value.__func__, copies[k]) if k is not None and self._originals[k] is owner else value
            )
        return kept

    def release(self) -> None:
        """Drop every replica and copy (frees their memory on the other devices); the set is not used again."""
        self._end_run(adopt=False)
        self._copies, self._param_slots, self._buffer_slots, self._rnns, self._places = [], [], [], [], {}
        self._flat, self._buffers = None, ReplicaBuffers([], [], [])


_runs: weakref.WeakSet[_Run] = weakref.WeakSet()  # in progress (replica sets may nest, or run in threads)
_runs_lock = threading.RLock()  # re-entered by _drop_hook when the collector frees a run inside a locked section
_hook: list[Any] = []  # torch's buffer registration hook, installed while runs are in progress


def _drop_hook(_: object = None) -> None:
    """Remove the hook once no run is in progress (the last one stopped, or was freed unstopped by the collector)."""
    with _runs_lock:
        if _hook and not list(_runs):
            _hook.pop().remove()


def _on_buffer(module: nn.Module, name: str, value: Tensor | None) -> None:
    with _runs_lock:
        runs = list(_runs)
    for run in runs:
        place = run.places.get(id(module))
        if place is not None:
            run.rebound.add((*place, name))


class _Run:
    """One step's replicas at work: the buffers they rebind are recorded by torch's global buffer registration hook,
    installed while runs are in progress."""

    def __init__(self, places: dict[int, tuple[int, int]]) -> None:
        self.places = places
        self.rebound: set[tuple[int, int, str]] = set()  # (replica, position, buffer name)
        with _runs_lock:
            _runs.add(self)
            self._ref = weakref.ref(self, _drop_hook)
            if not _hook:
                _hook.append(register_module_buffer_registration_hook(_on_buffer))

    def stop(self) -> None:
        with _runs_lock:
            _runs.discard(self)
            _drop_hook()


_MISSING = object()


def rebound_attributes(module: nn.Module, before: dict[str, Any], skip: Collection[str] = ()) -> dict[str, Any]:
    """The attributes ``module`` rebound since ``before`` (a copy of its ``__dict__``), with their new values, but
    those in ``skip``."""
    current = module.__dict__
    if len(current) == len(before) and all(map(operator.is_, current.values(), before.values())):
        return {}  # the common case, checked at C speed
    return {n: v for n, v in current.items() if n not in skip and v is not before.get(n, _MISSING)}


_NOT_OPAQUE = (type, Mapping, list, tuple, torch.dtype, torch.device, nn.Module)  # opened, tensorless, or a model


def _differentiable(outputs: Any, depth: int = 3) -> Iterator[Tensor]:
    """Tensors that require grad in ``outputs``: in containers, and in the attributes of other objects (a
    ``torch.distributions`` object's parameters), ``depth`` objects deep."""
    for _, node in iter_nodes(outputs, "output"):
        if isinstance(node, Tensor):
            if node.requires_grad:
                yield node
        elif (
            depth
            and hasattr(node, "__dict__")
            and not isinstance(node, _NOT_OPAQUE)
            and not is_dataclass_instance(node)
        ):
            yield from _differentiable(vars(node), depth - 1)


def _nothing_shared(module: nn.Module) -> bool:
    return False


def _walk(module: nn.Module, shared: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """Every distinct module of the tree, parents before children, without entering a ``shared`` module's subtree."""
    seen: set[int] = set()
    order: list[nn.Module] = []
    stack = [module]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        order.append(current)
        if current is module or not shared(current):
            stack.extend(child for child in reversed(current._modules.values()) if child is not None)
    return order


def _check_initialized(root: nn.Module, modules: Iterable[nn.Module]) -> None:
    """Raise, naming the module, where a lazy module (``nn.LazyLinear``) has not made its parameters yet."""
    lazy = next((m for m in modules if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()), None)
    if lazy is not None:
        name = next((n for n, m in root.named_modules() if m is lazy), "") or "the root module"
        raise RuntimeError(
            f"`{name}` ({type(lazy).__name__}) has uninitialized lazy parameters, which replicas cannot copy: they "
            "take their shapes from the first input. Run one forward pass on a sample batch first, on one device "
            "(`model(sample)` before the DataParallelModel call; with Lightning, in the LightningModule's `setup()` "
            "hook, e.g. `self(self.example_input_array)`)."
        )


def _unique(tensors: Iterable[Tensor]) -> list[Tensor]:
    return list({id(t): t for t in tensors}.values())  # first-seen order


def _watched_dicts(module: nn.Module) -> tuple[dict[str, Any], ...]:
    return (module.__dict__, module._parameters, module._buffers, module._modules)


def _same(current: Any, saved: Any) -> bool:
    """Whether a dict still holds what ``saved`` copied from it (identity first, at C speed); a value whose ``==``
    cannot answer (a tensor rebound to another tensor) counts as changed."""
    try:
        return bool(current == saved)
    except Exception:
        return False


class _Entry(Protocol):
    module: nn.Module
    devices: list[torch.device]


R = TypeVar("R", bound=_Entry)


class ReplicaCache(Generic[R]):
    """Lasting replicas per module (``build(module, devices)`` makes an entry), rebuilt when the module object or the
    devices change. A copy or unpickled cache starts empty (replicas hold autograd links to the last step)."""

    def __init__(self, build: Callable[[nn.Module, list[torch.device]], R]) -> None:
        self._build = build
        self._entries: dict[int, R] = {}

    def of(self, module: nn.Module, devices: Sequence[torch.device]) -> R:
        devices = list(devices)
        entry = self._entries.get(id(module))
        if entry is None or entry.module is not module or entry.devices != devices:
            entry = self._entries[id(module)] = self._build(module, devices)
        return entry

    def values(self) -> list[R]:
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def pop_all(self) -> list[R]:
        """Every entry, removed from the cache (to release them)."""
        entries, self._entries = list(self._entries.values()), {}
        return entries

    def __deepcopy__(self, memo: dict[int, Any]) -> ReplicaCache[R]:
        return ReplicaCache(self._build)

    def __getstate__(self) -> dict[str, Any]:
        return {"_build": self._build, "_entries": {}}
