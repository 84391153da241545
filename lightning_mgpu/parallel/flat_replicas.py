"""Replica parameters, gradients and buffers held in flat buffers: a step syncs and reduces them with a few tensor
operations per device, whatever the model's depth."""

from __future__ import annotations

import operator
import sys
from collections import deque
from collections.abc import Collection, Sequence
from itertools import repeat
from typing import Any

import torch
from torch import Tensor, nn

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


def _storage_uses(tensor: Tensor) -> int:
    """How many tensors hold ``tensor``'s storage (torch's own check, private API: its CUDA graph trees use it)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def alias(base: Tensor, offset: int, shape: torch.Size, stride: Sequence[int] = ()) -> Tensor:
    """A tensor over ``base``'s storage from element ``offset`` (relative to ``base``; contiguous unless ``stride``),
    with its own version counter (``set_``, not a view: autograd's in-place accumulation into one alias is then
    visible on that alias alone)."""
    with torch.no_grad():
        return torch.empty(0, dtype=base.dtype, device=base.device).set_(
            base.untyped_storage(), base.storage_offset() + offset, shape, stride
        )


class DtypeGroups:
    """``tensors`` grouped by dtype, each at an offset in its group's flat buffer, laid out as the tensor is where it
    is dense (a channels_last weight's gradient laid out otherwise costs autograd a copy per accumulation), else
    contiguously. :meth:`flatten` concatenates each group from flat views made once."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.tensors = list(tensors)
        self.indices: dict[torch.dtype, list[int]] = {}
        self.offsets: list[int] = [0] * len(self.tensors)
        self.totals: dict[torch.dtype, int] = {}
        self.strides = list(map(_part_strides, self.tensors))
        for j, t in enumerate(self.tensors):
            self.indices.setdefault(t.dtype, []).append(j)
            self.offsets[j] = self.totals.get(t.dtype, 0)
            self.totals[t.dtype] = self.offsets[j] + t.numel()
        self._views = {dtype: self._flat_views(indices) for dtype, indices in self.indices.items()}

    def _flat_views(self, indices: list[int]) -> tuple[list[Tensor | None], list[int]]:
        """The group's tensors as flat views in memory order, and the positions of those not laid out as their part
        (``None`` there, copied into that layout at every :meth:`flatten`)."""
        views: list[Tensor | None] = []
        for j in indices:
            tensor = self.tensors[j]
            if _part_strides(tensor) != self.strides[j]:
                views.append(None)
            elif tensor.is_contiguous():
                views.append(tensor.view(-1))
            else:
                views.append(tensor.as_strided((tensor.numel(),), (1,)) if _dense(tensor) else None)
        return views, [k for k, v in enumerate(views) if v is None]

    def flatten(self) -> dict[torch.dtype, Tensor]:
        flats = {}
        for dtype, (views, relaid) in self._views.items():
            if relaid:
                views = list(views)
                for k in relaid:
                    j = self.indices[dtype][k]
                    tensor = self.tensors[j]
                    laid = torch.empty_strided(tensor.shape, self.strides[j], dtype=dtype, device=tensor.device)
                    views[k] = laid.copy_(tensor).as_strided((tensor.numel(),), (1,))
            flats[dtype] = torch.cat(views)
        return flats

    def replace(self, j: int, tensor: Tensor) -> None:
        """``tensor`` (shaped like tensor ``j``, same dtype) in place of tensor ``j``."""
        self.tensors[j] = tensor
        self._views[tensor.dtype] = self._flat_views(self.indices[tensor.dtype])

    def flats(self, device: torch.device, zero: bool = False, rows: int | None = None) -> dict[torch.dtype, Tensor]:
        """One flat buffer per dtype on ``device`` (``rows`` of them stacked: a 2-D buffer per dtype)."""
        make = torch.zeros if zero else torch.empty
        return {
            dtype: make((total,) if rows is None else (rows, total), dtype=dtype, device=device)
            for dtype, total in self.totals.items()
        }

    def columns(self, blocks: dict[torch.dtype, Tensor], j: int) -> Tensor:
        """Tensor ``j``'s columns of 2-D ``blocks`` (one row per copy), an alias with its own version counter: an
        in-place change of any row's part bumps it."""
        like, block = self.tensors[j], blocks[self.tensors[j].dtype]
        return alias(block, self.offsets[j], (len(block), like.numel()), (block.stride(0), 1))

    def alias(self, flats: dict[torch.dtype, Tensor], j: int) -> Tensor:
        """Tensor ``j``'s part of ``flats``, shaped and laid out like it, with a version counter of its own."""
        like = self.tensors[j]
        return alias(flats[like.dtype], self.offsets[j], like.shape, self.strides[j])

    def view(self, flats: dict[torch.dtype, Tensor], j: int) -> Tensor:
        """Tensor ``j``'s part of ``flats`` (one flat tensor per dtype), shaped and laid out like it."""
        like, start = self.tensors[j], self.offsets[j]
        return self.shaped(flats[like.dtype][start : start + like.numel()], j)

    def shaped(self, part: Tensor, j: int) -> Tensor:
        """``part`` (tensor ``j``'s elements, 1-D, in memory order) as a view shaped and laid out like tensor ``j``."""
        return part.as_strided(self.tensors[j].shape, self.strides[j])


def _part_strides(tensor: Tensor) -> tuple[int, ...]:
    """The strides of ``tensor``'s part of a flat buffer: its own where it is dense and not contiguous, else the
    contiguous ones; never 0 on a dimension of size 1 (autograd's layout contract refuses that in a gradient)."""
    contiguous = torch.empty(tensor.shape, device="meta").stride()
    if tensor.is_contiguous() or not _dense(tensor):
        return contiguous
    return tuple(c if size == 1 else st for size, st, c in zip(tensor.shape, tensor.stride(), contiguous, strict=True))


def _dense(tensor: Tensor) -> bool:
    """Whether ``tensor``'s elements fill one block of its storage, each once (contiguous in some dimension order)."""
    step = 1
    for stride, size in sorted((st, s) for s, st in zip(tensor.shape, tensor.stride(), strict=True) if s != 1):
        if stride != step:
            return False
        step *= size
    return True


class ReplicaParameters:
    """Every replica's own leaf parameters for the unique original parameters ``params`` (on ``root``).

    :attr:`leaves` ``[i][j]``, replica ``i``'s parameter for ``params[j]``: the first replica on the root holds the
    originals' storage and version counters (it stands for the root module, as DDP's rank 0 does); every other replica
    holds its own copy in one flat buffer per replica and dtype, even on the same device, each leaf an alias with a
    version counter of its own (a write into one, a target network copied after its loss was computed, leaves the
    others' saved tensors valid). A leaf's ``.grad`` is its replica's row of one buffer per device and dtype; an alias
    per device and parameter spanning the rows counts the accumulations into that parameter's gradients there.
    ``renormed`` parameters (``Embedding(max_norm=...)`` renormalises the rows it looks up in place: idempotent, and
    one device would renormalise every shard's rows) stay over the originals' storage on the root device; ``sparse``
    ones (``Embedding(sparse=True)``) get sparse gradients, summed one by one. Call :meth:`sync` before a step,
    :meth:`backward_done` after each backward pass and :meth:`reduce` when the gradients belong on the originals.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        devices: Sequence[torch.device],
        root: torch.device,
        renormed: Collection[int] = (),
        sparse: Collection[int] = (),
    ) -> None:
        self.params = list(params)
        self.devices = list(devices)
        self.root = root
        self._groups = groups = DtypeGroups(self.params)
        self._alias = next((i for i, d in enumerate(self.devices) if d == root), None)  # stands for the root module
        self._owners = [i for i in range(len(self.devices)) if i != self._alias]
        self._sparse = frozenset(sparse)
        self._renormed = frozenset(renormed)
        distinct = list(dict.fromkeys(self.devices))
        self._slots = [distinct.index(d) for d in self.devices]  # replica -> its device's place in ``distinct``
        rows = [self.devices[:i].count(d) for i, d in enumerate(self.devices)]  # replica -> its row on its device
        with torch.inference_mode(False), torch.no_grad():
            self._storage = {i: groups.flats(self.devices[i]) for i in self._owners}
            blocks = [groups.flats(d, zero=True, rows=self.devices.count(d)) for d in distinct]
            self._grads = [
                {dtype: flat[row] for dtype, flat in blocks[k].items()}
                for k, row in zip(self._slots, rows, strict=True)
            ]
            self._counted = [[groups.columns(block, j) for j in range(len(self.params))] for block in blocks]
            self.leaves = [[self._make_leaf(i, j) for j in range(len(self.params))] for i in range(len(self.devices))]
            for i, leaves in enumerate(self.leaves):
                for j, leaf in enumerate(leaves):
                    if j not in self._sparse:
                        leaf.grad = groups.shaped(self._counted[self._slots[i]][j][rows[i]], j)
            self._train_index: list[int] = []
            self._frozen_index: list[int] = []
            self._new_root_grads()
        self._dense = next((j for j in range(len(self.params)) if j not in self._sparse), None)
        self._first_grads = [None if self._dense is None else leaves[self._dense].grad for leaves in self.leaves]
        self._pointers = list(map(_data_ptr, self.params))
        self._stamp: tuple[int, tuple[int, ...]] | None = None  # versions of the originals and copies at the last copy
        self._set_trainable(list(map(_requires_grad, self.params)))
        self.active = 0  # how many replicas have run: a backward pass through an older graph may reach any of them
        self.pending = False  # replicas ran since the last reduction: their gradients may not be on the originals yet

    def _make_leaf(self, i: int, j: int) -> nn.Parameter:
        p = self.params[j]
        if i == self._alias:
            data = p.detach()
        elif j in self._renormed and self.devices[i] == self.root:
            data = alias(p, 0, p.shape, p.stride())
        else:
            data = self._groups.alias(self._storage[i], j)
        return nn.Parameter(data, requires_grad=p.requires_grad)

    def _new_root_grads(self) -> None:
        """The originals' ``.grad`` to be: views of one flat buffer per dtype on the root, reused from step to step."""
        with torch.inference_mode(False), torch.no_grad():
            self._root_grads = self._groups.flats(self.root)
            self._root_views = [self._groups.alias(self._root_grads, j) for j in range(len(self.params))]
        self._root_uses = list(map(_storage_uses, self._root_grads.values()))  # held by this class alone
        self._index_views()

    def _index_views(self) -> None:
        self._train_views = [self._root_views[j] for j in self._train_index]
        self._frozen_views = [self._root_views[j] for j in self._frozen_index]

    def _set_trainable(self, trainable: list[bool]) -> None:
        self._trainable = trainable
        for leaves in self.leaves:
            for leaf, flag in zip(leaves, trainable, strict=True):
                if leaf.requires_grad != flag:
                    leaf.requires_grad_(flag)
        self._train_index = [j for j, flag in enumerate(trainable) if flag and j not in self._sparse]
        self._frozen_index = [j for j, flag in enumerate(trainable) if not flag and j not in self._sparse]
        self._train_params = [self.params[j] for j in self._train_index]
        self._frozen_params = [self.params[j] for j in self._frozen_index]
        self._index_views()
        self._train_counted = [[counted[j] for j in self._train_index] for counted in self._counted]
        self._seen = [list(map(_version, counted)) for counted in self._train_counted]

    def sync(self, n: int) -> bool:
        """Bring the first ``n`` replicas' parameters up to date with the originals (``requires_grad``, values).
        ``False`` (nothing done) when an original's tensor was replaced (``param.data = ...``): rebuild."""
        if list(map(_data_ptr, self.params)) != self._pointers:
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
        """The originals' values into the first ``n`` replicas' copies, where the originals (an optimizer step) or the
        copies (a replica's in-place change of its own) changed since the last copy."""
        owners = [i for i in self._owners if i < n]
        stamp = (sum(map(_version, self.params)), self._copy_versions(owners)) if owners else None
        if stamp != self._stamp:
            with torch.no_grad():
                for dtype, staged in self._groups.flatten().items():
                    for i in owners:
                        self._storage[i][dtype].copy_(staged, non_blocking=True)
            self._stamp = (stamp[0], self._copy_versions(owners)) if stamp is not None else None

    def _copy_versions(self, owners: list[int]) -> tuple[int, ...]:
        return tuple(sum(map(_version, self.leaves[i])) for i in owners)

    def keep_rebound_data(self) -> bool:
        """After a step that rebound a parameter's ``.data`` on the replica that stands for the root (MoCo's momentum
        update): the original takes its new value, and every replica gets new leaves over its storage (their ``.grad``
        kept); ``True`` when the caller must point its modules at :attr:`leaves` again."""
        if self._alias is None or list(map(_data_ptr, self.leaves[self._alias])) == self._pointers:
            return False
        rebound = [j for j, leaf in enumerate(self.leaves[self._alias]) if leaf.data_ptr() != self._pointers[j]]
        with torch.no_grad():
            for j in rebound:
                self.params[j].copy_(self.leaves[self._alias][j])  # moves its version: the copies follow at sync
        for i, leaves in enumerate(self.leaves):
            for j in rebound:
                fresh = self._make_leaf(i, j)
                fresh.grad, leaves[j] = leaves[j].grad, fresh
        return True

    def mark_stale(self) -> None:
        """Copy the originals into the replicas at the next :meth:`sync`, whatever their version counters say."""
        self._stamp = None

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
        """Add the replicas' gradients onto the originals' ``.grad`` and zero the replicas' flat gradients.

        Order: per device its replicas, then the devices, each moved to the root with one copy per dtype. A parameter
        no replica's backward reached (no gradient version counter moved) keeps its ``.grad``, as on one device. The
        originals' gradient hooks run once per reduction on the summed gradient (``run_hooks=False``: the gradients of
        backward passes that ran before the hooks existed). ``only_trainable``: a parameter frozen on the original
        since the sync (``toggle_optimizer``) gets nothing, as on one device.
        """
        count = self.active
        self.pending = False
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
        fast = everywhere and not hooked  # whole flat buffers at once
        grads = list(map(_grad, params))
        # Views that .grad dropped (zero_grad(set_to_none=True)) but something still holds, as such or through another
        # tensor on their storage (PCGrad's kept gradients, a `.detach()` kept to compare with the next step's): this
        # step's gradients go to new tensors, as on one device.
        if any(map(operator.is_, grads, repeat(None))) and (
            any(map(operator.gt, map(sys.getrefcount, self._train_views), repeat(_OWN_REFERENCES)))
            or list(map(_storage_uses, self._root_grads.values())) != self._root_uses
        ):
            self._new_root_grads()
        with torch.no_grad():
            # After zero_grad(set_to_none=True), unless a frozen parameter's .grad still is its part of the buffer
            # (frozen between backward passes, as toggle_optimizer does): a whole-buffer copy would overwrite it.
            if (
                fast
                and all(map(operator.is_, grads, repeat(None)))
                and not any(map(operator.is_, map(_grad, self._frozen_params), self._frozen_views))
            ):
                deque(map(setattr, params, repeat("grad"), self._train_views), maxlen=0)
                self._sum_into(count, self._root_grads, accumulate=False)
            elif fast and all(map(operator.is_, grads, self._train_views)):  # .grad still the views
                self._sum_into(count, self._root_grads, accumulate=True)
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
        """``targets`` (flat, per dtype, on the root) += (or =) the first ``count`` replicas' gradients: per device
        its replicas in replica order (in place, into the first one's), then the devices' sums in device order."""
        sums: dict[torch.device, dict[torch.dtype, Tensor]] = {}
        for i in range(count):
            if self.devices[i] not in sums:
                sums[self.devices[i]] = self._grads[i]
                continue
            for dtype, flat in self._grads[i].items():
                sums[self.devices[i]][dtype].add_(flat)
        for k, per_dtype in enumerate(sums.values()):
            for dtype, flat in per_dtype.items():
                flat = flat.to(self.root, non_blocking=True)
                if k == 0 and not accumulate:
                    targets[dtype].copy_(flat)
                else:
                    targets[dtype].add_(flat)

    def _assign_each(
        self, totals: dict[torch.dtype, Tensor], grads: list[Tensor | None], reached: list[bool] | None, hooked: bool
    ) -> None:
        """The general case, one parameter at a time: ``.grad`` set by someone else, parameters not every replica's
        backward reached (skipped where ``reached`` says none did), or, when ``hooked``, gradient hooks to run as
        ``AccumulateGrad`` does: tensor hooks on the incoming gradient, then post-accumulate hooks."""
        hits = repeat(True) if reached is None else reached
        for j, p, grad, hit in zip(self._train_index, self._train_params, grads, hits, strict=False):
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


class ReplicaBuffers:
    """The buffers replicas own: copies of the originals ``sources``, one flat buffer per replica and dtype.

    ``slots[i]`` lists replica ``i``'s entries (replica 0 shares the originals on its device: the caller leaves those
    out). Buffers that require grad get a differentiable copy instead, so they get gradients as under DataParallel.
    """

    def __init__(self, sources: Sequence[Tensor], slots: Sequence[Sequence[Slot]], devices: Sequence[torch.device]):
        self._groups = DtypeGroups(sources)
        self.sources = self._groups.tensors
        self.slots = [list(s) for s in slots]
        self.devices = list(devices)
        self._flats: list[dict[torch.dtype, Tensor]] = []  # per replica with slots, a full copy: one copy per dtype
        self._copies: list[dict[int, Tensor]] = []  # per replica: index of the original -> its copy
        with torch.inference_mode(False), torch.no_grad():
            for i, replica_slots in enumerate(self.slots):
                flats = self._groups.flats(self.devices[i]) if replica_slots else {}
                self._copies.append({k: self._groups.view(flats, k) for _, _, k in replica_slots})
                for store, name, k in replica_slots:
                    store[name] = self._copies[i][k].copy_(self.sources[k])
                self._flats.append(flats)
        self._stamp: int | None = None
        self._marks = self._replica_marks()
        self._linked = [False] * len(self.slots)

    def _replica_marks(self) -> list[int]:
        return [sum(f._version for f in flats.values()) for flats in self._flats]

    def refresh(self, n: int) -> None:
        """Give the first ``n`` replicas the originals' buffer values (when the originals or the copies changed since
        the last refresh), and autograd-linked copies of buffers that require grad while grad mode is on."""
        if not self.sources:
            return
        n = min(n, len(self.slots))
        link = torch.is_grad_enabled() and any(map(_requires_grad, self.sources))
        stamp = sum(map(_version, self.sources))
        marks = self._replica_marks()
        with torch.no_grad():
            staged: dict[torch.dtype, Tensor] = {}
            for i in range(n):
                if self._linked[i] and not link:
                    self.restore(i)
                if self.slots[i] and (stamp != self._stamp or marks[i] != self._marks[i]):
                    staged = staged or self._groups.flatten()  # flattened once per refresh, shared by the replicas
                    for dtype, flat in self._flats[i].items():
                        flat.copy_(staged[dtype], non_blocking=True)
        if link:
            for i in range(n):
                for store, name, k in self.slots[i]:
                    if self.sources[k].requires_grad:  # differentiable: gradients reach the original
                        store[name] = self.sources[k].to(self.devices[i], copy=True)
                self._linked[i] = True
        self._stamp = stamp
        self._marks = self._replica_marks()

    def mark_stale(self) -> None:
        """Copy the originals into every replica at the next :meth:`refresh`, whatever their version counters say."""
        self._stamp = None

    def restore(self, i: int) -> None:
        """Replica ``i``'s buffer entries back to the copies this class keeps up to date (a step rebound some)."""
        for store, name, k in self.slots[i]:
            store[name] = self._copies[i][k]
        self._linked[i] = False

    def replace(self, old: Tensor, new: Tensor) -> bool:
        """Keep ``new`` (shaped like ``old``, same dtype) up to date in the replicas instead of the original buffer
        ``old``, which a step rebound; ``False`` when ``old`` is none of the originals."""
        k = next((k for k, source in enumerate(self.sources) if source is old), None)
        if k is not None:
            self._groups.replace(k, new)
            self._stamp = None
        return k is not None
