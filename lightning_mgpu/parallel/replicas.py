"""Lasting replicas that own their state, as DDP ranks do: copies of a module's tree built once per device list, whose
parameters and buffers live in flat per-device, per-dtype buffers synced from the root once per optimizer step and
whose gradients are reduced once, in a fixed order; the root module is replica 0."""

from __future__ import annotations

import operator
import sys
import threading
import types
import weakref
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.modules.module import register_module_buffer_registration_hook
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from lightning_mgpu.parallel.compiled import compiled_call, is_compiled, is_optimized_module
from lightning_mgpu.parallel.devices import DeviceLike, to_device
from lightning_mgpu.parallel.run_replicas import ExecutionMode, resolve_mode
from lightning_mgpu.parallel.scatter_gather import is_dataclass_instance, iter_nodes
from lightning_mgpu.parallel.sync_batchnorm import SyncBatchNorm, uses_sync_batchnorm

_version = operator.attrgetter("_version")
_requires_grad = operator.attrgetter("requires_grad")
_grad = operator.attrgetter("grad")
_tensor_hooks = operator.attrgetter("_backward_hooks")
_post_accumulate_hooks = operator.attrgetter("_post_accumulate_grad_hooks")
_data_ptr = Tensor.data_ptr
Slot = tuple[dict[str, Any], str, int]  # (a replica module's _parameters or _buffers, name, index of the original)
# What sys.getrefcount says, through map, of an object two lists alone hold (a root view held by _root_views and
# _train_views only); interpreters differ in whether the call's own reference counts.
_probe = [object()]
_OWN_REFERENCES = next(map(sys.getrefcount, list(_probe)))
del _probe
_NEVER_SYNCED = frozenset({"_parameters", "_buffers", "_modules", "_is_replica", "_compiled_call_impl"})
_WEIGHT_HOOKS = (BasePruningMethod, WeightNorm, SpectralNorm)  # forward pre-hooks that set an attribute: `weight`
_COMPILED_SEQUENTIAL = (
    "the model is compiled, and torch.compile's compiler is not thread-safe: replicas run one after another from one "
    "thread (on distinct GPUs they still overlap)"
)
_BEFORE_BUILDING: list[Callable[[nn.Module], None]] = []
SYNC_BATCHNORM_THREADS = (
    "SyncBatchNorm layers make the replicas meet inside every BatchNorm layer: replicas run in threads"
)


def before_building_replicas(prepare: Callable[[nn.Module], None]) -> None:
    """Run ``prepare(module)`` on the original each time its replicas are built (a library's one-time set-up)."""
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


def _storage_uses(tensor: Tensor) -> int:
    """How many tensors hold ``tensor``'s storage (torch's own check, private API: its CUDA graph trees use it)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def alias(base: Tensor, offset: int, shape: Sequence[int], stride: Sequence[int]) -> Tensor:
    """A tensor over ``base``'s storage from element ``offset`` with its own version counter (``set_``, not a view:
    autograd's in-place accumulation into one alias is then visible on that alias alone)."""
    with torch.no_grad():
        return torch.empty(0, dtype=base.dtype, device=base.device).set_(
            base.untyped_storage(), base.storage_offset() + offset, shape, stride
        )


def _part_strides(tensor: Tensor, strides: Sequence[int] | None = None) -> tuple[int, ...]:
    """The strides of ``tensor``'s (or its layout ``strides``') part of a flat buffer: its own where it is dense, else
    contiguous; never 0 on a dimension of size 1 (autograd's layout contract refuses that in a gradient)."""
    laid = torch.empty_like(tensor, device="meta").stride() if strides is None else strides
    contiguous = torch.empty(tensor.shape, device="meta").stride()
    return tuple(c if size == 1 else st for size, st, c in zip(tensor.shape, laid, contiguous, strict=True))


class DtypeGroups:
    """``tensors`` grouped by dtype, each at an offset in its group's flat buffer, laid out as the tensor is where it
    is dense (a channels_last weight's gradient laid out otherwise costs autograd a copy per accumulation), else
    contiguously. :meth:`flatten` concatenates each group from flat views made once."""

    def __init__(self, tensors: Iterable[Tensor]) -> None:
        self.tensors = list(tensors)
        self.strides = list(map(_part_strides, self.tensors))
        self.indices: dict[torch.dtype, list[int]] = {}
        self.offsets: list[int] = []
        self.totals: dict[torch.dtype, int] = {}
        for j, t in enumerate(self.tensors):
            self.indices.setdefault(t.dtype, []).append(j)
            self.offsets.append(self.totals.get(t.dtype, 0))
            self.totals[t.dtype] = self.offsets[j] + t.numel()
        self._views = {dtype: self._flat_views(indices) for dtype, indices in self.indices.items()}

    def _flat_views(self, indices: list[int]) -> tuple[list[Tensor | None], list[int]]:
        """Flat views of the tensors whose memory is their part; ``None`` (and its position) for the others."""
        views: list[Tensor | None] = []
        for j in indices:
            t = self.tensors[j]
            views.append(t.as_strided((t.numel(),), (1,)) if _part_strides(t, t.stride()) == self.strides[j] else None)
        return views, [k for k, v in enumerate(views) if v is None]

    def flatten(self) -> dict[torch.dtype, Tensor]:
        flats = {}
        for dtype, (views, relaid) in self._views.items():
            if relaid:
                views = list(views)
                for k in relaid:
                    j = self.indices[dtype][k]
                    t = self.tensors[j]
                    laid = torch.empty_strided(t.shape, self.strides[j], dtype=dtype, device=t.device).copy_(t)
                    views[k] = laid.as_strided((t.numel(),), (1,))
            flats[dtype] = torch.cat(views)
        return flats

    def replace(self, j: int, tensor: Tensor) -> None:
        """``tensor`` (shaped like tensor ``j``, same dtype) in place of tensor ``j``."""
        self.tensors[j] = tensor
        self._views[tensor.dtype] = self._flat_views(self.indices[tensor.dtype])

    def flats(self, device: torch.device, zero: bool = False, rows: int | None = None) -> dict[torch.dtype, Tensor]:
        """One flat buffer per dtype on ``device`` (with ``rows``, 2-D)."""
        make = torch.zeros if zero else torch.empty
        return {
            dtype: make((total,) if rows is None else (rows, total), dtype=dtype, device=device)
            for dtype, total in self.totals.items()
        }

    def alias(self, flats: dict[torch.dtype, Tensor], j: int) -> Tensor:
        """Tensor ``j``'s part (of 2-D ``flats``, its columns: any row's change bumps it) as an :func:`alias`."""
        like, flat = self.tensors[j], flats[self.tensors[j].dtype]
        if flat.dim() == 2:
            return alias(flat, self.offsets[j], (len(flat), like.numel()), (flat.stride(0), 1))
        return alias(flat, self.offsets[j], like.shape, self.strides[j])

    def view(self, flats: dict[torch.dtype, Tensor], j: int) -> Tensor:
        """Tensor ``j``'s part of ``flats``, shaped and laid out like it."""
        return self.shaped(flats[self.tensors[j].dtype][self.offsets[j] :], j)

    def shaped(self, part: Tensor, j: int) -> Tensor:
        """``part`` (1-D, from tensor ``j``'s first element) shaped and laid out like tensor ``j``."""
        return part.as_strided(self.tensors[j].shape, self.strides[j])


class ReplicaParameters:
    """Every replica's own parameters and buffers: :attr:`leaves` ``[i][j]``, replica ``i``'s tensor for ``params[j]``,
    then for ``buffers[j - len(params)]``. The first replica on ``root`` stands for the root module: its leaves share
    the originals' storage and version counters. Every other one holds an :func:`alias` per tensor into its flat buffer
    per dtype and kind. A leaf's ``.grad`` is its replica's row of one buffer per device and dtype, whose columns count
    the accumulations. ``renormed`` parameters (``Embedding(max_norm=...)``) keep the originals' storage on the root
    device; ``sparse`` ones get sparse gradients. Call :meth:`sync` before a step, :meth:`backward_done` after each
    backward pass and :meth:`reduce` when the gradients belong on the originals."""

    def __init__(
        self,
        params: Iterable[Tensor],
        devices: Sequence[torch.device],
        root: torch.device,
        renormed: Collection[int] = (),
        sparse: Collection[int] = (),
        buffers: Iterable[Tensor] = (),
    ) -> None:
        self.params, self.buffers, self.devices, self.root = list(params), list(buffers), list(devices), root
        self._groups = groups = DtypeGroups(self.params)
        self._parts = [(groups, 0), (DtypeGroups(self.buffers), len(self.params))]  # (layout, first index in leaves)
        self._alias = next((i for i, d in enumerate(self.devices) if d == root), None)  # stands for the root module
        self._owners = [i for i in range(len(self.devices)) if i != self._alias]
        self._sparse, self._renormed = frozenset(sparse), frozenset(renormed)
        distinct = list(dict.fromkeys(self.devices))
        self._slots = [distinct.index(d) for d in self.devices]  # replica -> its device's place in ``distinct``
        rows = [self.devices[:i].count(d) for i, d in enumerate(self.devices)]  # replica -> its row on its device
        dense = [j for j in range(len(self.params)) if j not in self._sparse]
        with torch.inference_mode(False), torch.no_grad():
            self._storage = {i: [part.flats(self.devices[i]) for part, _ in self._parts] for i in self._owners}
            blocks = [groups.flats(d, zero=True, rows=self.devices.count(d)) for d in distinct]
            self._grads = [
                {dtype: flat[row] for dtype, flat in blocks[k].items()}
                for k, row in zip(self._slots, rows, strict=True)
            ]
            self._counted = [[groups.alias(block, j) for j in range(len(self.params))] for block in blocks]
            count = len(self.params) + len(self.buffers)
            self.leaves = [[self._make_leaf(i, j) for j in range(count)] for i in range(len(self.devices))]
            for i, leaves in enumerate(self.leaves):
                for j in dense:
                    leaves[j].grad = groups.shaped(self._counted[self._slots[i]][j][rows[i]], j)
            self._train_index: list[int] = []
            self._frozen_index: list[int] = []
            self._new_root_grads()
        self._first_grads = [leaves[dense[0]].grad if dense else None for leaves in self.leaves]
        self._dense = dense[0] if dense else None
        self._pointers = list(map(_data_ptr, self.params + self.buffers))
        self._stamps: list[Any] = [None, None]  # per kind, versions of the originals and copies at the last copy
        self._set_trainable(list(map(_requires_grad, self.params)))
        self.active = 0  # how many replicas have run: a backward pass through an older graph may reach any of them
        self.pending = False  # replicas ran since the last reduction: their gradients may not be on the originals yet

    def _make_leaf(self, i: int, j: int) -> Tensor:
        kind = int(j >= len(self.params))
        t = self.buffers[j - len(self.params)] if kind else self.params[j]
        if i == self._alias:
            data = t if kind else t.detach()
        elif not kind and j in self._renormed and self.devices[i] == self.root:
            data = alias(t, 0, t.shape, t.stride())
        else:
            groups, first = self._parts[kind]
            data = groups.alias(self._storage[i][kind], j - first)
        return data if kind else nn.Parameter(data, requires_grad=t.requires_grad)

    def _new_root_grads(self) -> None:
        """The originals' ``.grad`` to be: views of one flat buffer per dtype on the root, reused across steps."""
        with torch.inference_mode(False), torch.no_grad():
            self._root_grads = self._groups.flats(self.root)
            self._root_views = [self._groups.alias(self._root_grads, j) for j in range(len(self.params))]
        self._root_uses = list(map(_storage_uses, self._root_grads.values()))  # held by this class alone
        self._train_views = [self._root_views[j] for j in self._train_index]
        self._frozen_views = [self._root_views[j] for j in self._frozen_index]

    def _set_trainable(self, trainable: list[bool]) -> None:
        self._trainable = trainable
        for leaves in self.leaves:
            for leaf, flag in zip(leaves, trainable, strict=False):  # the parameters' leaves
                if leaf.requires_grad != flag:
                    leaf.requires_grad_(flag)
        dense = [j for j in range(len(self.params)) if j not in self._sparse]
        self._train_index = [j for j in dense if trainable[j]]
        self._frozen_index = [j for j in dense if not trainable[j]]
        self._train_params = [self.params[j] for j in self._train_index]
        self._frozen_params = [self.params[j] for j in self._frozen_index]
        self._train_views = [self._root_views[j] for j in self._train_index]
        self._frozen_views = [self._root_views[j] for j in self._frozen_index]
        self._train_counted = [[counted[j] for j in self._train_index] for counted in self._counted]
        self._seen = [list(map(_version, counted)) for counted in self._train_counted]

    def sync(self, n: int) -> bool:
        """The first ``n`` replicas take the originals' ``requires_grad`` and values; ``False`` (nothing done) when an
        original's tensor was replaced (``param.data = ...``): rebuild."""
        if list(map(_data_ptr, self.params + self.buffers)) != self._pointers:
            return False
        trainable = list(map(_requires_grad, self.params))
        if trainable != self._trainable:
            self.reduce()  # what the replicas accumulated (between micro-batches) belongs to the originals
            self._set_trainable(trainable)
        self.active = max(self.active, n)
        self.pending = True
        self.copy_values(n)
        return True

    def copy_values(self, n: int) -> None:
        """The originals' values into the first ``n`` replicas' copies, per kind where either changed."""
        owners = [i for i in self._owners if i < n]
        for kind, (groups, first) in enumerate(self._parts):
            last = first + len(groups.tensors)
            stamp = (
                sum(map(_version, groups.tensors)),
                [sum(map(_version, self.leaves[i][first:last])) for i in owners],
            )
            if owners and groups.tensors and stamp != self._stamps[kind]:
                with torch.no_grad():
                    for dtype, staged in groups.flatten().items():
                        for i in owners:
                            self._storage[i][kind][dtype].copy_(staged, non_blocking=True)
                self._stamps[kind] = stamp

    def replace(self, old: Tensor, new: Tensor) -> bool:
        """``new`` (like the buffer ``old``), which a step bound in its place, in place of ``old`` (``False``: not
        one of them)."""
        k = next((k for k, b in enumerate(self.buffers) if b is old), None)
        if k is None:
            return False
        self.buffers[k], j = new, len(self.params) + k
        self._parts[1][0].replace(k, new)
        self._pointers[j], self._stamps[1] = new.data_ptr(), None
        if self._alias is not None:
            self.leaves[self._alias][j] = new
        return True

    def keep_rebound_data(self) -> bool:
        """A parameter's ``.data`` rebound on the replica that stands for the root (a momentum update) becomes the
        original's value; every replica gets new leaves (``.grad`` kept): ``True``, point the modules at them again."""
        m = len(self.params)
        if self._alias is None or list(map(_data_ptr, self.leaves[self._alias][:m])) == self._pointers[:m]:
            return False
        rebound = [j for j, leaf in enumerate(self.leaves[self._alias][:m]) if leaf.data_ptr() != self._pointers[j]]
        with torch.no_grad():
            for j in rebound:
                self.params[j].copy_(self.leaves[self._alias][j])  # moves its version: the copies follow at sync
        for i, leaves in enumerate(self.leaves):
            for j in rebound:
                fresh = self._make_leaf(i, j)
                fresh.grad, leaves[j] = leaves[j].grad, fresh
        return True

    def mark_stale(self) -> None:
        """Copy the originals into the replicas at the next :meth:`sync`, whatever the version counters say."""
        self._stamps = [None, None]

    def backward_done(self) -> None:
        """A backward pass through the replicas finished (autograd accumulated into their flat gradients)."""
        for i, leaves in enumerate(self.leaves[: self.active]):
            if self._dense is not None and leaves[self._dense].grad is not self._first_grads[i]:
                raise RuntimeError(
                    "A backward pass replaced the gradient tensors of replica parameters instead of accumulating into "
                    "them (backward(create_graph=True) does that). Replicas hold their own parameters and reduce "
                    "their gradients from flat buffers, so they cannot reduce such gradients. Take higher-order "
                    "gradients with torch.autograd.grad(..., create_graph=True), which leaves .grad alone (a gradient "
                    "penalty), or, in plain PyTorch, replicate per call with lightning_mgpu.replicate(model, devices), "
                    "whose replicas are linked to the originals."
                )

    def reduce(self, run_hooks: bool = True, only_trainable: bool = False) -> None:
        """Add the replicas' gradients onto the originals' ``.grad`` (per device, then one copy to the root per dtype)
        and zero them. A parameter no backward reached keeps its ``.grad``, as does one frozen since the sync with
        ``only_trainable``. The originals' gradient hooks run once, on the sum, unless ``run_hooks=False``."""
        count, self.pending = self.active, False
        self._reduce_sparse(count)
        if count == 0 or not self._train_index:
            return
        slots = sorted(set(self._slots[:count]))
        counters = [list(map(_version, self._train_counted[k])) for k in slots]  # one step per accumulation
        seen = [self._seen[k] for k in slots]
        if counters == seen:
            return
        reached: list[bool] | None = None  # None: every parameter reached, as replica 0's device usually shows
        if not all(map(operator.ne, counters[0], seen[0])):
            changed = [list(map(operator.ne, now, old)) for now, old in zip(counters, seen, strict=True)]
            reached = [any(column) for column in zip(*changed, strict=True)]
        if only_trainable and (now := list(map(_requires_grad, self.params))) != self._trainable:
            reached = [r and now[j] for r, j in zip(reached or repeat(True), self._train_index, strict=False)]
        everywhere = reached is None or all(reached)
        params = self._train_params
        hooked = run_hooks and (any(map(_tensor_hooks, params)) or any(map(_post_accumulate_hooks, params)))
        grads = list(map(_grad, params))
        unset = all(map(operator.is_, grads, repeat(None)))
        # Views that .grad dropped (zero_grad(set_to_none=True)) but something still holds, as such or through another
        # tensor on their storage (PCGrad's kept gradients, a `.detach()` kept to compare with the next step's): this
        # step's gradients go to new tensors, as on one device.
        if any(map(operator.is_, grads, repeat(None))) and (
            any(map(operator.gt, map(sys.getrefcount, self._train_views), repeat(_OWN_REFERENCES)))
            or list(map(_storage_uses, self._root_grads.values())) != self._root_uses
        ):
            self._new_root_grads()
        with torch.no_grad():
            # Whole flat buffers at once where every parameter was reached and no hook runs: written after
            # zero_grad(set_to_none=True), unless a frozen parameter's .grad still is its part of the buffer (frozen
            # between backward passes, as toggle_optimizer does); added where .grad still are the views.
            whole = everywhere and not hooked
            fresh = unset and not any(map(operator.is_, map(_grad, self._frozen_params), self._frozen_views))
            if whole and fresh:
                deque(map(setattr, params, repeat("grad"), self._train_views), maxlen=0)
            if whole and (fresh or all(map(operator.is_, grads, self._train_views))):
                self._sum_into(count, self._root_grads, accumulate=not fresh)
            else:
                totals = {dtype: torch.empty_like(flat) for dtype, flat in self._root_grads.items()}
                self._sum_into(count, totals, accumulate=False)
                self._assign_each(totals, grads, None if everywhere else reached, hooked)
            torch._foreach_zero_([flat for flats in self._grads[:count] for flat in flats.values()])
        for k, now in zip(slots, counters, strict=True):  # zeroing the rows leaves the counting aliases' counters alone
            self._seen[k] = now

    def _reduce_sparse(self, count: int) -> None:
        """Sparse gradients, parameter by parameter: the replicas' sum (in replica order) added to the original's."""
        for j in sorted(self._sparse):
            grads = [leaves[j].grad for leaves in self.leaves[:count] if leaves[j].grad is not None]
            if grads:
                total = sum((grad.to(self.root) for grad in grads[1:]), grads[0].to(self.root))
                param = self.params[j]
                param.grad = total if param.grad is None else param.grad + total
                for leaves in self.leaves[:count]:
                    leaves[j].grad = None

    def _sum_into(self, count: int, targets: dict[torch.dtype, Tensor], accumulate: bool) -> None:
        """``targets`` += (or =) the first ``count`` replicas' gradients: per device in replica order, into the first
        one's, then the devices' sums in device order."""
        sums: dict[torch.device, dict[torch.dtype, Tensor]] = {}
        for i in range(count):
            if self.devices[i] in sums:
                torch._foreach_add_(list(sums[self.devices[i]].values()), list(self._grads[i].values()))
            else:
                sums[self.devices[i]] = self._grads[i]
        for k, per_dtype in enumerate(sums.values()):
            for dtype, flat in per_dtype.items():
                add = targets[dtype].copy_ if k == 0 and not accumulate else targets[dtype].add_
                add(flat.to(self.root, non_blocking=True))

    def _assign_each(
        self, totals: dict[torch.dtype, Tensor], grads: list[Tensor | None], reached: list[bool] | None, hooked: bool
    ) -> None:
        """One parameter at a time (``.grad`` set by someone else, parameters not ``reached``, or hooks, run as
        ``AccumulateGrad`` does: tensor hooks on the incoming gradient, then post-accumulate hooks)."""
        for j, p, grad, hit in zip(self._train_index, self._train_params, grads, reached or repeat(True), strict=False):
            if not hit:
                continue
            part = self._groups.view(totals, j)
            for hook in (p._backward_hooks or {}).values() if hooked else ():
                result = hook(part)
                part = part if result is None else result
            view = self._root_views[j]
            if grad is None:
                view.copy_(part)
                p.grad = view
            elif grad is view:
                view.add_(part)
            else:
                grad.add_(part.to(grad.dtype))
            for hook in (p._post_accumulate_grad_hooks or {}).values() if hooked else ():
                hook(p)


class ReplicaSet:
    """Lasting replicas of ``module``, one per device of ``devices`` (which may repeat: "virtual devices"). Call
    :meth:`prepare` before each step and :meth:`watch` right after it. A buffer a step rebinds takes replica 0's value;
    attributes rebound on the originals reach the replicas, except ``overrides``; a structural change rebuilds them
    (:attr:`builds`). Every replica holds the original of a ``shared(submodule)`` (``on_build`` may swap it)."""

    def __init__(
        self,
        module: nn.Module,
        devices: Sequence[DeviceLike],
        on_build: Callable[[list[nn.Module]], None] | None = None,
        overrides: Sequence[str] = (),
        shared: Callable[[nn.Module], bool] | None = None,
    ) -> None:
        self.module = module
        self._shared = shared or (lambda submodule: False)
        self.devices = [to_device(d) for d in devices]
        if not self.devices:
            raise ValueError("A ReplicaSet needs at least one device.")
        self._on_build = on_build
        self._overrides = frozenset(overrides) | _NEVER_SYNCED
        self.builds = 0
        self._structure_checked = False  # by execution_mode(), for the prepare() that follows it
        self.meets_at_batchnorm = False  # set by execution_mode()
        self.defer_reduction = False
        self._owning = self._queued = False
        self._queue_lock = threading.Lock()
        self._recorder = _Recorder()  # active between prepare() and watch(): the buffers the step rebinds
        self._unregister: Callable[[], Any] | None = None
        self._build()

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
        buffers = _unique(b for m in originals for b in m._buffers.values() if b is not None)
        self._root = next((t.device for t in (*self._params, *buffers)), self.devices[0])
        embeddings = [m for m in originals if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
        renormed = {id(m.weight) for m in embeddings if isinstance(m, nn.Embedding) and m.max_norm is not None}
        sparse = {id(m.weight) for m in embeddings if m.sparse}
        self._renormed = [j for j, p in enumerate(self._params) if id(p) in renormed]
        self._sparse = [j for j, p in enumerate(self._params) if id(p) in sparse]
        self.compiled = any(is_compiled(m) for m in originals)
        uses_sync_batchnorm(self.module)  # names the sync layers built directly, for their errors
        self._sync_layers = [m for m in originals if isinstance(m, SyncBatchNorm)]
        self._weight_hooks = [
            (m, hook) for m in originals for hook in m._forward_pre_hooks.values() if isinstance(hook, _WEIGHT_HOOKS)
        ]
        index = {id(t): j for j, t in enumerate((*self._params, *buffers))}
        with torch.inference_mode(False), torch.no_grad():  # copies must be normal tensors, whatever the caller's mode
            built = [self._replica(index) for _ in self.devices]
        self._copies, self._slots, self._rnns = map(list, zip(*built, strict=True))  # per replica
        self.replicas = [copies[0] for copies in self._copies]  # every replica's root module, in device order
        self._new_flat(buffers)
        self._places = {
            id(c): (i, k) for i, cs in enumerate(self._copies) for k, c in enumerate(cs) if c is not originals[k]
        }
        if self._unregister is not None:
            self._unregister()
        self._unregister = _register(self, self._places, self._recorder)
        # Per module its attribute, parameter, buffer and child dicts (none for a shared one: replicas hold it), and
        # shallow copies of them: one ``==`` of the two lists tells whether anything changed.
        self._live = [
            d
            for m in originals
            for d in (({},) * 4 if self._shared(m) else (m.__dict__, m._parameters, m._buffers, m._modules))
        ]
        self._saved = [d.copy() for d in self._live]
        self.builds += 1
        if self._on_build is not None:
            self._on_build(self.replicas)

    def _replica(self, index: dict[int, int]) -> tuple[list[nn.Module], list[Slot], list[nn.RNNBase]]:
        """One replica's modules (shallow copies; compile wrappers around their module's copy), slots and RNNs."""
        copies: list[Any] = [
            m if self._shared(m) else None if is_optimized_module(m) else m._replicate_for_data_parallel()
            for m in self._originals
        ]
        for k in reversed(range(len(copies))):  # innermost first
            if copies[k] is None:
                original = self._originals[k]
                copies[k] = type(original)(self._children(k, copies)["_orig_mod"], original.dynamo_ctx)
        slots: list[Slot] = []
        for k, (original, copy) in enumerate(zip(self._originals, copies, strict=True)):
            if copy is original or is_optimized_module(original):
                continue  # shared as is, or a compiled wrapper (its tensors are those of the wrapped module)
            copy._modules = self._children(k, copies)
            copy.__dict__ = self._for_replica(copy.__dict__, copies)
            copy._parameters = dict(original._parameters)
            for store, tensors in ((copy._parameters, original._parameters), (copy._buffers, original._buffers)):
                slots += [(store, name, index[id(t)]) for name, t in tensors.items() if t is not None]
            if original.__dict__.get("_compiled_call_impl") is not None:
                copy._compiled_call_impl = compiled_call(original, copy)
        rnns = [c for c, o in zip(copies, self._originals, strict=True) if c is not o and isinstance(c, nn.RNNBase)]
        return copies, slots, rnns

    def _children(self, k: int, copies: Sequence[nn.Module]) -> dict[str, nn.Module | None]:
        position = self._position
        return {n: None if c is None else copies[position[id(c)]] for n, c in self._originals[k]._modules.items()}

    def execution_mode(self, requested: ExecutionMode, count: int) -> tuple[ExecutionMode, str | None]:
        """The mode to run ``count`` replicas in, and why it is not ``requested`` (``None`` when it is). Checks the
        structure first, for the next :meth:`prepare`."""
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
        if not self.compiled and not sync:
            return requested, None
        mode, reason = ("sequential", _COMPILED_SEQUENTIAL) if self.compiled else ("threads", SYNC_BATCHNORM_THREADS)
        return mode, reason if resolve_mode(requested, self.devices[:count]) != mode else None

    def prepare(self, n: int | None = None, linked: bool = False) -> list[nn.Module]:
        """The first ``n`` replicas (default all), synced for a step (``linked=True``: see :func:`replicate`)."""
        n = len(self.devices) if n is None else n
        if not 1 <= n <= len(self.devices):
            raise ValueError(f"Asked for {n} replicas of a set of {len(self.devices)}.")
        self._end_run(adopt=True)  # a step that raised before watch(): keep what replica 0 rebound
        if not self._structure_checked:
            self._sync_structure()
        self._structure_checked = self._queued = False
        self._owning = not linked
        if not self._flat.sync(n):  # an original's tensor was replaced (``param.data = ...``)
            self._flat.reduce()  # what the replicas accumulated still belongs to the originals
            self._new_flat(self._flat.buffers)
            self._flat.sync(n)
        relink = linked or (torch.is_grad_enabled() and any(map(_requires_grad, self._flat.buffers)))
        for i in range(n):
            if relink or not self._pointed[i]:
                self._point(i, self._linked(i, linked) if relink else self._flat.leaves[i])
            self._pointed[i] = not relink
        if not linked:
            self._recorder.rebound = set()
            _set_active(self._recorder, True)
        return self.replicas[:n]

    def _new_flat(self, buffers: list[Tensor]) -> None:
        self._flat = ReplicaParameters(self._params, self.devices, self._root, self._renormed, self._sparse, buffers)
        self._flat.copy_values(len(self.devices))
        for i in range(len(self.devices)):
            self._point(i, self._flat.leaves[i])
        self._pointed = [True] * len(self.devices)  # replicas whose modules hold their own leaves

    def _linked(self, i: int, params: bool) -> list[Tensor]:
        """Replica ``i``'s leaves, but linked to the originals by autograd for one step: the buffers that require grad
        (as under ``nn.DataParallel``) and with ``params`` the parameters (see :func:`replicate`)."""
        grad, flat, device = torch.is_grad_enabled(), self._flat, self.devices[i]
        tensors = list(flat.leaves[i])
        for j, p in enumerate(flat.params if params else ()):
            t = p if grad and p.requires_grad else p.detach()
            tensors[j] = t.view_as(t) if t.device == device else t.to(device)
        for j, b in enumerate(flat.buffers, len(flat.params)):
            if grad and b.requires_grad and tensors[j] is not b:
                tensors[j] = b.to(device, copy=True)
        return tensors

    def _point(self, i: int, tensors: Sequence[Tensor]) -> None:
        """Replica ``i``'s parameters and buffers from ``tensors`` (indexed like :attr:`ReplicaParameters.leaves`)."""
        for store, name, j in self._slots[i]:
            store[name] = tensors[j]
        for rnn in self._rnns[i]:  # RNNs run on a cached list of their weights, which must hold this replica's tensors
            rnn._flat_weights = [getattr(rnn, wn, None) for wn in rnn._flat_weights_names]

    def watch(self, outputs: Sequence[Any]) -> None:
        """Reduce the replicas' gradients after any backward pass that reaches ``outputs`` (this step's)."""
        self._end_run(adopt=True)
        for module, hook in self._weight_hooks:  # what one device's forward leaves on the module (ModelPruning ranks
            if isinstance(hook, SpectralNorm):  # by it); replica 0's forward already ran the power iteration
                setattr(module, hook.name, hook.compute_weight(module, do_power_iteration=False))
            else:
                hook(module, ())
        if self._owning and self._flat.keep_rebound_data():
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
        self._flat.backward_done()
        if not self.defer_reduction:
            self.reduce_gradients()

    def reduce_gradients(self, run_hooks: bool = True) -> None:
        """Add the replicas' gradients onto the originals' ``.grad`` (after every backward unless
        :attr:`defer_reduction`)."""
        self._flat.reduce(run_hooks)

    def after_manual_backward(self) -> None:
        """Reduce a backward pass inside the step (manual optimization) onto the parameters trainable now."""
        self._flat.backward_done()
        self._flat.reduce(only_trainable=True)

    def after_optimizer_step(self, n: int) -> None:
        """Inside a step, after the optimizer stepped the originals: the first ``n`` replicas' copies follow."""
        self._flat.copy_values(n)

    def leaves_of(self, param: Tensor) -> list[Tensor]:
        """The replicas' leaves that stand for ``param`` in the last step's graph, for ``backward(inputs=...)``."""
        j = self._param_index.get(id(param))
        if not self._owning or j is None or self._params[j] is not param:
            return []
        return [leaves[j] for leaves in self._flat.leaves[: self._flat.active]]

    def mark_stale(self) -> None:
        """Copy everything at the next :meth:`prepare` (writes through ``.data`` move no version counter)."""
        self._flat.mark_stale()

    @property
    def pending(self) -> bool:
        """Replicas ran since the last reduction (their gradients may wait for one)."""
        return self._flat.pending

    def _end_run(self, adopt: bool) -> None:
        """Stop recording the step's buffer rebinding; with ``adopt``, buffers replica 0 rebound become the
        original's (of another shape or dtype: a rebuild at the next :meth:`prepare`); every replica holds its own."""
        if not self._recorder.active:
            return
        _set_active(self._recorder, False)
        rebound = self._recorder.rebound
        if not adopt or not rebound:
            return
        for k, name in sorted({(k, name) for i, k, name in rebound if i == 0}):
            value, buffers = self._copies[0][k]._buffers.get(name), self._originals[k]._buffers
            old = buffers.get(name)
            if value is not None and old is not None:
                value = value.to(old.device)
                if value.shape == old.shape and value.dtype == old.dtype and self._flat.replace(old, value):
                    self._saved[4 * k + 2][name] = value  # the saved copy of its buffer dict
            buffers[name] = value
        for i, k, name in rebound:
            if name not in self._originals[k]._buffers:
                self._copies[i][k]._buffers.pop(name, None)
        for i in sorted({i for i, _, _ in rebound}):
            self._point(i, self._flat.leaves[i])

    def _sync_structure(self) -> None:
        """Rebuild on a structural change or a (un)compiled module; copy attributes rebound on the originals to every
        replica. One ``==`` of every watched dict against its copy settles the common case (no change)."""
        if _same(self._live, self._saved):
            return
        for k, original in enumerate(self._originals):
            live, (before, *saved) = self._live[4 * k : 4 * k + 4], self._saved[4 * k : 4 * k + 4]
            if _same(live, [before, *saved]):
                continue
            compiled = live[0].get("_compiled_call_impl") is not before.get("_compiled_call_impl")
            if compiled or not _same(live[1:], saved):
                self.reduce_gradients()  # what the old replicas accumulated still belongs to the originals
                self._build()
                return
            changed = rebound_attributes(original, before, self._overrides)
            removed = [key for key in before if key not in live[0] and key not in self._overrides]
            for copies in self._copies:
                copies[k].__dict__.update(self._for_replica(changed, copies))
                for key in removed:
                    copies[k].__dict__.pop(key, None)
            self._saved[4 * k : 4 * k + 4] = [d.copy() for d in live]

    def keep_first_replicas(self, before: dict[str, Any]) -> dict[str, Any]:
        """Rebind on the original module, and return, what replica 0's root module rebound since ``before`` (a copy of
        its ``__dict__``), ``overrides`` aside; the next :meth:`prepare` hands them to every replica."""
        rebound = rebound_attributes(self._copies[0][0], before, self._overrides)
        self.module.__dict__.update(rebound)
        return rebound

    def _for_replica(self, attributes: dict[str, Any], copies: Sequence[nn.Module]) -> dict[str, Any]:
        """``attributes`` for the replica of ``copies``: :class:`OriginalOnly` values replaced, methods bound to an
        original module (a ``forward`` set on the instance) bound to its copy."""
        kept = {}
        for key, value in attributes.items():
            if isinstance(value, OriginalOnly) and (value := value.replica_value) is None:
                continue
            owner = value.__self__ if isinstance(value, types.MethodType) else None
            k = self._position.get(id(owner))
            bound = k is not None and self._originals[k] is owner
            kept[key] = types.MethodType(value.__func__, copies[k]) if bound else value
        return kept

    def release(self) -> None:
        """Drop every replica and copy; the set is not used again."""
        self._end_run(adopt=False)
        if self._unregister is not None:
            self._unregister()
        self._copies, self._slots, self._rnns, self._places, self.replicas = [], [], [], {}, []
        self._flat = ReplicaParameters([], self.devices, self._root)


class _Recorder:
    """The buffers (replica, position, name) a replica set's modules rebind while it is ``active`` (one run)."""

    def __init__(self) -> None:
        self.active = False
        self.rebound: set[tuple[int, int, str]] = set()


# Replica modules -> (their set's recorder, replica, position), registered once per build; torch's global buffer
# registration hook is installed only while some recorder is active (replica sets may nest, or run in threads).
_recording: dict[int, tuple[_Recorder, int, int]] = {}
_active: set[int] = set()
_lock = threading.RLock()  # re-entered when the collector frees a replica set inside a locked section
_hook: list[Any] = []


def _on_buffer(module: nn.Module, name: str, value: Tensor | None) -> None:
    place = _recording.get(id(module))
    if place is not None and place[0].active:
        place[0].rebound.add((place[1], place[2], name))


def _register(owner: object, places: dict[int, tuple[int, int]], recorder: _Recorder) -> Callable[[], Any]:
    """Map the modules of ``places`` to ``recorder`` until the returned call, or until ``owner`` dies."""
    with _lock:
        _recording.update({key: (recorder, i, k) for key, (i, k) in places.items()})
    return weakref.finalize(owner, _unregister, list(places), recorder)


def _unregister(keys: list[int], recorder: _Recorder) -> None:
    with _lock:
        for key in keys:
            if _recording.get(key, (None,))[0] is recorder:
                del _recording[key]
    _set_active(recorder, False)


def _set_active(recorder: _Recorder, active: bool) -> None:
    """Start or stop ``recorder``'s run; the hook is installed while any recorder runs."""
    with _lock:
        recorder.active = active
        (_active.add if active else _active.discard)(id(recorder))
        if _active and not _hook:
            _hook.append(register_module_buffer_registration_hook(_on_buffer))
        elif not _active and _hook:
            _hook.pop().remove()


_MISSING = object()


def rebound_attributes(module: nn.Module, before: dict[str, Any], skip: Collection[str] = ()) -> dict[str, Any]:
    """The attributes (but ``skip``) ``module`` rebound since ``before`` (a copy of its ``__dict__``)."""
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
        elif depth and hasattr(node, "__dict__") and not (isinstance(node, _NOT_OPAQUE) or is_dataclass_instance(node)):
            yield from _differentiable(vars(node), depth - 1)


def _walk(module: nn.Module, shared: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """Every distinct module of the tree, parents before children, without entering a ``shared`` module's subtree."""
    order: dict[int, nn.Module] = {}
    stack = [module]
    while stack:
        current = stack.pop()
        if id(current) not in order:
            order[id(current)] = current
            if current is module or not shared(current):
                stack.extend(child for child in reversed(current._modules.values()) if child is not None)
    return list(order.values())


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


def _same(current: Any, saved: Any) -> bool:
    """Whether ``current == saved`` (identity first, at C speed); a value whose ``==`` cannot answer counts as
    changed."""
    try:
        return bool(current == saved)
    except Exception:
        return False


R = TypeVar("R")


class ReplicaCache(Generic[R]):
    """Lasting replicas per module (``build(module, devices)`` makes an entry), rebuilt when the module object or the
    devices change. A copy or unpickled cache starts empty (replicas hold autograd links to the last step)."""

    def __init__(self, build: Callable[[nn.Module, list[torch.device]], R]) -> None:
        self._build = build
        self._entries: dict[int, tuple[nn.Module, list[torch.device], R]] = {}

    def of(self, module: nn.Module, devices: Sequence[torch.device]) -> R:
        entry = self._entries.get(id(module))
        if entry is None or entry[0] is not module or entry[1] != list(devices):
            entry = self._entries[id(module)] = (module, list(devices), self._build(module, list(devices)))
        return entry[2]

    def values(self) -> list[R]:
        return list(map(operator.itemgetter(2), self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def pop_all(self) -> list[R]:
        """Every entry, removed from the cache (to release them)."""
        entries, self._entries = self.values(), {}
        return entries

    def __deepcopy__(self, memo: dict[int, Any]) -> ReplicaCache[R]:
        return ReplicaCache(self._build)

    def __getstate__(self) -> dict[str, Any]:
        return {"_build": self._build, "_entries": {}}
