"""Split a batch (nested mappings, sequences, namedtuples, dataclasses) into per-device chunks, and the one walker
over such structures. Tensors split along ``dim`` as ``torch.tensor_split`` does (10 over 4: 3, 3, 2, 2), lists of
plain items as long as the batch (ids) alike; anything else goes whole to every replica. Inputs holding a
``transformers`` cache, which each replica would append to, run once, unsplit (:class:`SharedStateError`).

Given the sample counts the batch may hold (``samples``: its DataLoader's batch size, then its last batch's), a list
or tuple of that many items of one outline (a collate_fn that returns its samples as they are: lightning-bolts-style
SimCLR ``((view1, view2), label)`` pairs) is split by item, as :class:`PerSample` is, where the tensors inside would
otherwise be cut along their own first dimension; a batch whose other parts disagree with that count is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from lightning_mgpu.parallel.devices import DeviceLike, to_device

T = TypeVar("T")


class BatchSplitError(ValueError):
    """The batch cannot be split into per-device chunks (empty, or inconsistent batch sizes)."""


class NothingToSplitError(BatchSplitError):
    """The inputs hold no tensor with a batch dimension (callers may then run once, unsplit)."""


class SharedStateError(BatchSplitError):
    """The inputs hold an object that every replica would change in place (a ``transformers`` cache)."""


class PerSample(list):
    """One item per sample (detection targets, images of different sizes: what no batch dimension can carry), split
    by item and concatenated back. Its length is the batch size, which every batched tensor must agree with."""


def is_namedtuple(obj: Any) -> bool:
    """A ``namedtuple`` / ``typing.NamedTuple`` instance: a fixed structure, never a per-sample sequence."""
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def is_shared_state(obj: Any) -> bool:
    """A ``transformers`` cache (``DynamicCache``...), known by its base class's name: parallel/ never imports it."""
    return any(c.__name__ == "Cache" and c.__module__ == "transformers.cache_utils" for c in type(obj).__mro__)


def shared_state(roots: Sequence[tuple[str, Any]]) -> str | None:
    """Where the inputs (``(name, value)`` pairs) hold a :func:`is_shared_state` object, with its type; else None."""
    found = (f"{p} ({type(n).__name__})" for root, v in roots for p, n in iter_nodes(v, root) if is_shared_state(n))
    return next(found, None)


def contains_tensor(obj: Any) -> bool:
    return any(True for _ in iter_tensors(obj))


def _is_per_sample_list(obj: Any, batch_size: int | None) -> bool:
    """A list of plain items (ids) or a tuple of strings with one item per sample: split like a tensor. Tuples of
    numbers are more often options (``size=(16, 16)``); a list of batch-long sequences is ``default_collate``'s
    structure, whose sequences are split."""
    if batch_size is None or not isinstance(obj, (list, tuple)) or len(obj) != batch_size:
        return False
    if isinstance(obj, tuple):
        return _is_string_sequence(obj)
    collated = all(_is_plain_sequence(item) and len(item) == batch_size for item in obj)
    return not collated and not contains_tensor(obj)


def _is_string_sequence(obj: Any) -> bool:
    return _is_plain_sequence(obj) and all(isinstance(x, str) for x in obj)


def _children(obj: Any) -> tuple[bool, Iterable[tuple[Any, Any]]] | None:
    """``(keys are field names, (key, child) pairs)`` of a container, None for a leaf; :func:`rebuild` closes it."""
    if isinstance(obj, Mapping):  # ModelOutput included
        return False, obj.items()
    if is_namedtuple(obj):
        return True, zip(obj._fields, obj, strict=True)
    if isinstance(obj, (list, tuple)):
        return False, enumerate(obj)
    if is_dataclass_instance(obj):
        return True, ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return None


def _child_path(path: str, key: Any, by_field: bool) -> str:
    return f"{path}.{key}" if by_field else f"{path}[{key!r}]"


def iter_nodes(
    obj: Any,
    path: str = "batch",
    per_sample: list[tuple[str, Sequence[Any]]] | None = None,
    items: Collection[int] = (),
) -> Iterator[tuple[str, Any]]:
    """``(key path, node)`` for ``obj`` and everything in it, outermost first, paths as errors print them
    (``batch['mask']``, ``output.logits``). :class:`PerSample` lists, and the sequences whose ``id`` is in ``items``
    (split by item too), go to a given ``per_sample`` list instead."""
    if per_sample is not None and (isinstance(obj, PerSample) or id(obj) in items):
        per_sample.append((path, obj))
        return
    yield path, obj
    children = _children(obj)
    if children is not None:
        by_field, pairs = children
        for key, child in pairs:
            yield from iter_nodes(child, _child_path(path, key, by_field), per_sample, items)


def iter_tensors(obj: Any, path: str = "batch") -> Iterator[tuple[str, Tensor]]:
    return ((p, node) for p, node in iter_nodes(obj, path) if isinstance(node, Tensor))


def batch_size_of(obj: Any, dim: int = 0, path: str = "batch") -> int:
    return roots_batch_size([(path, obj)], dim, type(obj).__name__)


def roots_batch_size(
    roots: Sequence[tuple[str, Any]], dim: int = 0, what: str = "no tensor argument", *, samples: Sequence[int] = ()
) -> int:
    """The length of the :class:`PerSample` lists, else the size along ``dim`` that every tensor having it shares,
    of the ``(name, value)`` roots; a :class:`BatchSplitError` naming both key paths when two disagree, with the fix
    (``samples``, the DataLoader's counts where known, tells which part is the odd one)."""
    marked: list[tuple[str, Sequence[Any]]] = []
    tensors = [(p, n) for path, obj in roots for p, n in iter_nodes(obj, path, marked) if isinstance(n, Tensor)]
    sized = [(p, len(seq), f"{len(seq)} items") for p, seq in marked]  # PerSample lists first: they set the size
    sized += [(p, t.shape[dim], f"size {t.shape[dim]}") for p, t in tensors if t.dim() > dim]
    if not sized:
        raise NothingToSplitError(
            f"Cannot split the batch along dim {dim}: it holds no tensor with a dimension {dim} "
            f"(got {what}). Pass tensors, or collections of tensors, with the batch along dim {dim}."
        )
    first_path, size, _ = sized[0]
    mismatch = next(((path, shown) for path, other, shown in sized if other != size), None)
    if mismatch is not None:
        first = f"{first_path} is a PerSample of {size} items" if marked else f"{first_path} has size {size}"
        lists = ", and every PerSample list," if marked else ""
        hint = None if marked else _mismatch_hint(roots, tensors, dim, samples)
        raise BatchSplitError(
            f"Cannot split the batch along dim {dim}: {first} but {mismatch[0]} has {mismatch[1]}. Every tensor with "
            f"a batch dimension{lists} must have the same batch size." + (f" {hint}" if hint else "")
        )
    if marked and not size:
        raise BatchSplitError(f"Cannot split an empty batch: {first_path} is an empty PerSample.")
    return size


def _mismatch_hint(
    roots: Sequence[tuple[str, Any]], tensors: Sequence[tuple[str, Tensor]], dim: int, samples: Sequence[int]
) -> str:
    """The advice for tensors of different batch sizes: the first specific one that fits, else the general one."""
    hints: list[Callable[[Sequence[tuple[str, Any]], Sequence[tuple[str, Tensor]], int], str | None]] = [
        _parts_hint,
        functools.partial(_count_hint, samples=samples),
        _per_sample_hint,
        _flat_ids_hint,
    ]
    if dim:  # labels shaped (B, 1) beside (T, B, F) inputs: their samples are on dim 0
        hints.insert(0, functools.partial(_batch_dim_hint, samples=samples))
    return next(filter(None, (h(roots, tensors, dim) for h in hints)), None) or (
        "If one of them is not per sample, keep it out of what is split: class weights in the loss module "
        "(`nn.CrossEntropyLoss(weight=w)`, whose weighting the replicas' losses then follow), other values "
        "(a temperature) as a buffer of the module (`register_buffer`), a 0-dim tensor or a Python number, "
        "which every replica gets whole."
    )


def _batch_dim_hint(
    roots: Sequence[tuple[str, Any]], tensors: Sequence[tuple[str, Tensor]], dim: int, samples: Sequence[int]
) -> str | None:
    """Advice for a tensor whose samples are on another dimension than ``dim`` (``(B, 1)`` labels beside ``(T, B, F)``
    inputs with ``dim=1``): where they are, and how to put them on ``dim`` and back. The batch size is the
    DataLoader's where known (``samples``), else the size most tensors have along ``dim``."""
    along = [(p, t.shape[dim]) for p, t in tensors if t.dim() > dim]
    batch = set(samples) or {Counter(n for _, n in along).most_common(1)[0][0]}
    where = next((p for p, n in along if n in batch), None)
    for path, t in tensors:
        if where is None or t.dim() <= dim or t.shape[dim] in batch:
            continue
        axis = next((a for a, n in enumerate(t.shape) if n in batch and a != dim), None)
        if axis is None:
            continue
        moved = list(t.shape)
        moved.insert(dim, moved.pop(axis))
        return (
            f"{path} has shape {tuple(t.shape)}: its {t.shape[axis]} samples are on dim {axis}, not on dim {dim}, "
            f"which the batch is split along ({where} has {t.shape[axis]} there). Put them on dim {dim} in your "
            f"collate_fn, `.movedim({axis}, {dim})` (shape {tuple(moved)}), and back in the step, "
            f"`.movedim({dim}, {axis})`: each device then gets its samples' rows. (Kept out of the batch, every device "
            "would get all of them.)"
        )
    return None


def _count_hint(
    roots: Sequence[tuple[str, Any]], tensors: Sequence[tuple[str, Tensor]], dim: int, samples: Sequence[int]
) -> str | None:
    """Advice for a sequence of items of one outline, none of them a batch, as long as none of the DataLoader's
    counts, beside tensors that hold one: it cannot hold one item per sample."""
    counted = [(p, t.shape[dim]) for p, t in tensors if t.dim() > dim and t.shape[dim] in samples]
    if not counted:
        return None
    for root, obj in roots:
        for where, seq in iter_nodes(obj, root):
            if not _one_outline(seq) or len(seq) in samples or not _unbatched(seq, samples, dim):
                continue
            path, count = next(((p, n) for p, n in counted if not p.startswith(f"{where}[")), (None, 0))
            if path is None:
                continue
            return (
                f"{where} is a {_container(seq)} of {len(seq)} {_kind_name(seq)}, but the DataLoader's batch holds "
                f"{count} samples ({path} has {count}): a sequence split by item must hold one item per sample. "
                f"Return every sample's item from your collate_fn ({count} of them); if its items are not samples, "
                f"stack its tensors with the batch on dim {dim}, or keep it out of the batch (a buffer of the module)."
            )
    return None


def _parts_hint(roots: Sequence[tuple[str, Any]], tensors: Sequence[tuple[str, Tensor]], dim: int) -> str | None:
    """Advice for a batch whose parts are batches of different sizes (a ``CombinedLoader`` of several dataloaders):
    each part's tensors agree, the parts do not."""
    if len(roots) != 1 or not isinstance(roots[0][1], (Mapping, list, tuple)) or len(roots[0][1]) < 2:
        return None
    root, parts = roots[0]
    keys = parts.keys() if isinstance(parts, Mapping) else range(len(parts))
    if not all(isinstance(parts[key], (Mapping, list, tuple)) for key in keys):  # each part a batch of its own
        return None
    sizes = {}
    for key in keys:
        where = f"{root}[{key!r}]"
        inside = {t.shape[dim] for p, t in tensors if p.startswith(where) and t.dim() > dim}
        if len(inside) != 1:
            return None
        sizes[where] = inside.pop()
    if len(set(sizes.values())) < 2:
        return None
    shown = ", ".join(f"{where} {size}" for where, size in sizes.items())
    return (
        f"Its parts are batches of different sizes ({shown}), as several dataloaders give together (CombinedLoader): "
        "give every DataLoader the same batch_size and drop_last=True, or use strategy='dp', whose forward splits "
        "the inputs of each call apart."
    )


def _flat_ids_hint(roots: Sequence[tuple[str, Any]], tensors: Sequence[tuple[str, Tensor]], dim: int) -> str | None:
    """Advice for flat ids with offsets (``nn.EmbeddingBag``'s input), when the batch is 1-D integer tensors."""
    if len(tensors) < 2 or any(t.dim() != 1 or t.is_floating_point() or t.is_complex() for _, t in tensors):
        return None
    return (
        "If these are flat ids with offsets (as nn.EmbeddingBag takes), pass one item per sample instead, e.g. "
        "lightning_mgpu.PerSample(list_of_bags) from your collate_fn, and flatten it in forward."
    )


def _per_sample_hint(roots: Sequence[tuple[str, Any]], tensors: Sequence[tuple[str, Tensor]], dim: int) -> str | None:
    """Advice to mark a list with :class:`PerSample` when that settles it: a list of dicts, dataclasses or tensors
    as long as the batch size of a tensor outside it, holding a tensor of another size."""
    for root, obj in roots:
        for where, seq in iter_nodes(obj, root):
            if not _is_plain_sequence(seq) or not (
                any(all(isinstance(x, k) for x in seq) for k in (Mapping, Tensor))
                or all(is_dataclass_instance(x) for x in seq)
            ):
                continue
            inside = [t for p, t in tensors if p.startswith(f"{where}[") and t.dim() > dim]
            outside = {t.shape[dim] for p, t in tensors if not p.startswith(f"{where}[") and t.dim() > dim}
            if len(seq) in outside and any(t.shape[dim] != len(seq) for t in inside):
                kind = "dicts" if isinstance(seq[0], Mapping) else type(seq[0]).__name__ + "s"
                container = "tuple" if isinstance(seq, tuple) else "list"
                return (
                    f"{where} is a {container} of {len(seq)} {kind}, as many as the batch: if it holds one item per "
                    "sample (e.g. detection targets, images of different sizes), wrap it in "
                    "lightning_mgpu.PerSample(...) in your collate_fn so that it is split by item."
                )
    return None


def _is_plain_sequence(obj: Any) -> bool:
    """A non-empty list or tuple that is not a namedtuple (a fixed structure)."""
    return isinstance(obj, (list, tuple)) and not is_namedtuple(obj) and bool(obj)


def _is_plain_items(obj: Any) -> bool:
    """A list or tuple of plain items only (ids, strings, numbers): no container, no tensor."""
    return (
        isinstance(obj, (list, tuple))
        and not is_namedtuple(obj)
        and all(_children(x) is None and not isinstance(x, Tensor) for x in obj)
    )


def _outline(obj: Any) -> Any:
    """A hashable outline of ``obj``: its containers' types and keys (a sequence's: its items' outlines), its tensors'
    numbers of dimensions, its other leaves' types; a sequence of plain items whatever its length. The samples of one
    data set share it."""
    if isinstance(obj, Tensor):
        return Tensor, obj.dim()
    children = _children(obj)
    if children is None:
        return type(obj)
    if _is_plain_items(obj):
        return type(obj), "plain items"
    by_field, pairs = children
    keyed = by_field or isinstance(obj, Mapping)
    return type(obj), tuple((key if keyed else None, _outline(child)) for key, child in pairs)


def _batched(obj: Any, count: int, dim: int) -> bool:
    """Whether every part of ``obj`` holds ``count`` samples (tensors with ``count`` along ``dim``, sequences of
    ``count`` plain items, containers of such parts), as ``default_collate``'s structures do; a sample's item does not
    (its image's channels, its label: a number)."""
    if isinstance(obj, Tensor):
        return obj.dim() > dim and obj.shape[dim] == count
    children = _children(obj)
    if children is None:
        return False
    if isinstance(obj, PerSample) or _is_plain_items(obj):
        return len(obj) == count
    values = [child for _, child in children[1]]
    return bool(values) and all(_batched(value, count, dim) for value in values)


def _one_outline(seq: Any) -> bool:
    """A list or tuple (not a :class:`PerSample`) holding tensors, whose items share one :func:`_outline`."""
    if not _is_plain_sequence(seq) or isinstance(seq, PerSample) or not contains_tensor(seq):
        return False
    first = _outline(seq[0])
    return all(_outline(item) == first for item in seq[1:])


def _unbatched(seq: Sequence[Any], counts: Iterable[int], dim: int) -> bool:
    """Whether no item of ``seq`` holds a batch of any of ``counts`` samples."""
    return not any(_batched(item, count, dim) for count in counts for item in seq)


def _samples_sequence(seq: Any, count: int, dim: int, counts: Sequence[int]) -> bool:
    """Whether ``seq`` holds one item per sample of a batch of ``count``: a list or tuple of ``count`` items of one
    outline, holding tensors, that are not batches themselves (of any of the DataLoader's ``counts``: a full batch's
    two stacked views are no last batch of two samples): no tensor item is a batch, and not every container item is
    (a detection target may hold as many boxes as the batch has samples). A tuple whose items are such sequences is
    ``zip(*batch)``'s tuple of per-field tuples (``(images, targets)``), not samples; a list of them is (a
    collate_fn's own list)."""
    if not isinstance(seq, (list, tuple)) or len(seq) != count or not _one_outline(seq):
        return False
    batched = (any(_batched(item, n, dim) for n in counts) for item in seq)  # lazy: any() and all() stop early
    if any(batched) if isinstance(seq[0], Tensor) else all(batched):
        return False
    return not (isinstance(seq, tuple) and all(_samples_sequence(item, count, dim, counts) for item in seq))


def _find_samples(
    obj: Any, path: str, count: int, dim: int, counts: Sequence[int]
) -> Iterator[tuple[str, Sequence[Any]]]:
    """``(key path, sequence)`` for the outermost sequences in ``obj`` that hold one item per sample of ``count``."""
    if isinstance(obj, (Tensor, PerSample)):
        return
    if _samples_sequence(obj, count, dim, counts):
        yield path, obj
        return
    children = _children(obj)
    if children is not None:
        by_field, pairs = children
        for key, child in pairs:
            yield from _find_samples(child, _child_path(path, key, by_field), count, dim, counts)


def _sample_items(roots: Sequence[tuple[str, Any]], dim: int, samples: Sequence[int]) -> list[tuple[str, Any]]:
    """The sequences to split by item, for the first of the DataLoader's counts (``samples``) that any sequence holds
    one item per sample of; none where none does (the batch size is then the tensors'). A batch whose other parts
    disagree with that count is refused."""
    for count in samples:
        found = [hit for root, obj in roots for hit in _find_samples(obj, root, count, dim, samples)]
        if found:
            _check_count(roots, dim, count, found)
            return found
    return []


def _check_count(roots: Sequence[tuple[str, Any]], dim: int, count: int, found: list[tuple[str, Any]]) -> None:
    """A :class:`BatchSplitError` where a tensor outside the sequences ``found`` or a :class:`PerSample` list holds
    another number of samples than ``count``, naming both and the fix."""
    ids = {id(seq) for _, seq in found}
    marked: list[tuple[str, Sequence[Any]]] = []
    for root, obj in roots:
        for path, node in iter_nodes(obj, root, marked, ids):
            if isinstance(node, Tensor) and node.dim() > dim and node.shape[dim] != count:
                raise BatchSplitError(_count_conflict(found[0], count, dim, path, f"size {node.shape[dim]}"))
    for path, seq in marked:
        if isinstance(seq, PerSample) and len(seq) != count:
            raise BatchSplitError(_count_conflict(found[0], count, dim, path, f"{len(seq)} items (a PerSample)"))


def _count_conflict(found: tuple[str, Any], count: int, dim: int, path: str, shown: str) -> str:
    where, seq = found
    return (
        f"Cannot split the batch along dim {dim}: {where} is a {_container(seq)} of {count} {_kind_name(seq)}, one "
        f"per sample of the DataLoader's batch ({count} samples), so it is split by item, but {path} has {shown} "
        f"along dim {dim}. Every part of the batch must hold the same {count} samples: stack per-sample tensors with "
        f"the batch on dim {dim} in your collate_fn (or put each sample's part into its item), and keep what is not "
        "per sample out of the batch (a buffer of the module, a Python number)."
    )


def _container(seq: Sequence[Any]) -> str:
    return "tuple" if isinstance(seq, tuple) else "list"


def _kind_name(seq: Sequence[Any]) -> str:
    return "dicts" if isinstance(seq[0], Mapping) else type(seq[0]).__name__ + "s"


def argument_roots(
    args: Sequence[Any], kwargs: Mapping[str, Any], names: tuple[str, str] = ("args", "kwargs")
) -> list[tuple[str, Any]]:
    """``(name, value)`` for each argument of a call, as error messages name them (``args[0]``)."""
    return [
        *((f"{names[0]}[{i}]", a) for i, a in enumerate(args)),
        *((f"{names[1]}[{k!r}]", v) for k, v in kwargs.items()),
    ]


def split_sizes(batch_size: int, num_devices: int) -> list[int]:
    """Per-replica sizes as ``torch.tensor_split`` makes them, with no empty chunk (tiny batches use fewer)."""
    if batch_size <= 0:
        raise BatchSplitError(
            "Cannot split an empty batch (batch size 0): there is nothing to run. Leave empty batches out where they "
            "are made (the sampler or collate_fn)."
        )
    if num_devices <= 0:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}.")
    used = min(batch_size, num_devices)
    base, extra = divmod(batch_size, used)
    return [base + (1 if i < extra else 0) for i in range(used)]


def rebuild(template: Any, values: Sequence[Any] | Mapping[str, Any]) -> Any:
    """A container of ``template``'s type holding ``values`` (a mapping for mappings)."""
    if isinstance(template, defaultdict):
        return defaultdict(template.default_factory, values)
    if is_namedtuple(template):
        return type(template)(*values)
    if isinstance(template, Mapping) and is_dataclass_instance(template):  # transformers ModelOutput
        return type(template)(**values)
    if isinstance(template, (Mapping, list, tuple)):
        try:
            return type(template)(values)
        except TypeError:  # a subclass with another constructor: rebuilt as its base type
            base = dict if isinstance(template, Mapping) else list if isinstance(template, list) else tuple
            return base(values)
    fields = list(zip(dataclasses.fields(template), values, strict=True))  # a dataclass: else a TypeError
    obj = type(template)(**{f.name: v for f, v in fields if f.init})
    for f, v in fields:
        if not f.init:  # set after construction, frozen dataclasses included
            object.__setattr__(obj, f.name, v)
    return obj


def _map_structure(
    obj: Any,
    leaf_fn: Callable[[Any], list[Any]],
    count: int,
    batch_size: int | None,
    plain_lists: bool = True,
    items: Collection[int] = (),
) -> list[Any]:
    """``count`` versions of ``obj``, leaf ``x`` replaced by ``leaf_fn(x)[i]`` in version ``i``. Leaves: tensors,
    non-containers, the sequences whose ``id`` is in ``items``, and given a ``batch_size``, per-sample lists (plain
    ones only if ``plain_lists``)."""
    if isinstance(obj, Tensor) or (isinstance(obj, PerSample) and batch_size is not None) or id(obj) in items:
        return leaf_fn(obj)
    children = _children(obj)
    if children is None or (plain_lists and _is_per_sample_list(obj, batch_size)):
        return leaf_fn(obj)
    mapped = [
        (key, _map_structure(child, leaf_fn, count, batch_size, plain_lists, items)) for key, child in children[1]
    ]
    if isinstance(obj, Mapping):
        return [rebuild(obj, {key: values[i] for key, values in mapped}) for i in range(count)]
    return [rebuild(obj, [values[i] for _, values in mapped]) for i in range(count)]


def split_batch(
    obj: Any,
    devices: Sequence[DeviceLike],
    dim: int = 0,
    batch_size: int | None = None,
    *,
    sizes: Sequence[int] | None = None,
    samples: Sequence[int] = (),
) -> tuple[list[Any], list[int]]:
    """``(chunks, sizes)``: ``obj`` split into one chunk per device, moved there (differentiably); fewer chunks for a
    smaller batch. ``sizes`` imposes the chunk sizes (to split targets as the outputs were). ``samples``: the sample
    counts the batch may hold, as its DataLoader says (its batch size, then its last batch's): a sequence of that many
    items of one outline is then split by item, and a batch whose other parts disagree is refused."""
    roots = [("batch", obj)]
    (chunks,), sizes = _split_roots(roots, devices, dim, batch_size, sizes, type(obj).__name__, samples=samples)
    return chunks, sizes


def _split_roots(
    roots: Sequence[tuple[str, Any]],
    devices: Sequence[DeviceLike],
    dim: int,
    batch_size: int | None,
    sizes: Sequence[int] | None,
    what: str,
    plain_lists: bool = True,
    samples: Sequence[int] = (),
) -> tuple[list[list[Any]], list[int]]:
    """Each root's chunks, split with one batch size, and the chunk sizes. A given ``batch_size`` serves when nothing
    tells it (a list of ids). ``plain_lists=False``: plain lists go whole to every chunk (torch's ``scatter``).
    ``samples``: the DataLoader's counts (:func:`split_batch`)."""
    found = _sample_items(roots, dim, samples) if plain_lists else []
    items = {id(seq) for _, seq in found}
    inferred = len(found[0][1]) if found else _tensors_batch_size(roots, dim, batch_size, what, samples)
    if batch_size is not None and batch_size != inferred:
        raise BatchSplitError(f"batch_size={batch_size} was given but the tensors have size {inferred}.")
    _say_whole_parts(roots, dim, inferred, items)
    targets = [to_device(d) for d in devices]
    chunks = split_sizes(inferred, len(targets)) if sizes is None else [int(n) for n in sizes]
    if sum(chunks) != inferred or any(n <= 0 for n in chunks) or len(chunks) > len(targets):
        raise BatchSplitError(
            f"Cannot split a batch of {inferred} into chunks of {chunks} over {len(targets)} device(s): the "
            "sizes must be positive, one per device at most, and add up to the batch size."
        )
    bounds = list(itertools.accumulate(chunks[:-1]))
    slices = [slice(a, b) for a, b in itertools.pairwise([0, *bounds, inferred])]

    def split_leaf(leaf: Any) -> list[Any]:
        if isinstance(leaf, Tensor):
            parts = torch.tensor_split(leaf, bounds, dim=dim) if bounds and leaf.dim() > dim else [leaf] * len(chunks)
            return [p.to(d) for p, d in zip(parts, targets, strict=False)]
        if isinstance(leaf, PerSample):  # before the plain-list rule: slices stay PerSample
            return [PerSample(move_to(leaf[s], d)) for s, d in zip(slices, targets, strict=False)]
        if id(leaf) in items:  # one item per sample: slices of the same type
            return [move_to(leaf[s], d) for s, d in zip(slices, targets, strict=False)]
        if plain_lists and _is_per_sample_list(leaf, inferred):
            return [leaf[s] for s in slices]
        if is_shared_state(leaf):
            raise SharedStateError(
                f"Cannot split inputs that hold a {type(leaf).__name__}: every replica would change that one object "
                "(appending its shard's keys and values to the cache)."
            )
        return [leaf] * len(chunks)

    mapped = [_map_structure(value, split_leaf, len(chunks), inferred, plain_lists, items) for _, value in roots]
    return mapped, chunks


def _tensors_batch_size(
    roots: Sequence[tuple[str, Any]], dim: int, batch_size: int | None, what: str, samples: Sequence[int]
) -> int:
    """:func:`roots_batch_size`, or a given ``batch_size`` where no tensor tells it (a list of ids)."""
    try:
        return roots_batch_size(roots, dim, what, samples=samples)
    except NothingToSplitError:
        if batch_size is None:
            raise
        return batch_size


def _say_whole_parts(roots: Sequence[tuple[str, Any]], dim: int, size: int, items: Collection[int] = ()) -> None:
    """Warn (once per part) where a part that may hold one value per sample goes whole to every device: a tensor
    without dimension ``dim`` but as long as the batch (1-D labels with ``dim=1``), or an object the split does not
    open holding tensors of the batch's size along ``dim``. Sequences split by item (``items``) are not opened."""
    for root, obj in roots:
        for path, node in iter_nodes(obj, root, [], items):
            if isinstance(node, Tensor):
                if not 0 < node.dim() <= dim or size not in node.shape:  # as long as the batch: maybe per sample
                    continue
                reason = f"has no dimension {dim} to split"
            elif (
                _children(node) is not None or isinstance(node, (PerSample, nn.Module)) or not hasattr(node, "__dict__")
            ):
                continue
            elif any(isinstance(v, Tensor) and v.dim() > dim and v.shape[dim] == size for v in vars(node).values()):
                kind = type(node).__name__
                reason = (
                    f"is an object ({kind}) holding tensors of {size} along dim {dim}, which the split does not open"
                )
            else:
                continue
            warnings.warn(
                f"{path} {reason}: every device gets it whole. If it holds one value per sample, pass it as a tensor "
                f"with the batch on dim {dim}, in a dict, list, tuple or dataclass (or a PerSample list of items).",
                UserWarning,
                stacklevel=4,
            )


def split_arguments(
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    devices: Sequence[DeviceLike],
    dim: int = 0,
    batch_size: int | None = None,
    *,
    sizes: Sequence[int] | None = None,
    names: tuple[str, str] = ("args", "kwargs"),
    samples: Sequence[int] = (),
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]], list[int]]:
    """:func:`split_batch` for call arguments (one batch size): per-device args and kwargs, and the sizes."""
    roots = argument_roots(args, kwargs, names)
    chunks, sizes = _split_roots(roots, devices, dim, batch_size, sizes, "no tensor argument", samples=samples)
    per_device = [[c[i] for c in chunks] for i in range(len(sizes))]  # each device's chunk of every argument
    n = len(args)
    return [tuple(c[:n]) for c in per_device], [dict(zip(kwargs, c[n:], strict=True)) for c in per_device], sizes


def scatter(inputs: Any, target_devices: Sequence[DeviceLike], dim: int = 0) -> list[Any]:
    """``torch.nn.parallel.scatter``'s contract on any devices, chunks balanced as by :func:`split_batch`; plain lists
    and inputs without a batch dimension go whole to every device, as torch passes them."""
    try:
        (chunks,), _ = _split_roots([("inputs", inputs)], target_devices, dim, None, None, "", plain_lists=False)
        return chunks
    except NothingToSplitError:
        return [inputs for _ in target_devices]


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """``torch.nn.parallel.gather``'s contract on any devices (differentiable): tensors concatenated along ``dim``,
    0-dim ones stacked with torch's warning, containers field by field, ``None`` kept."""
    device = to_device(target_device)

    def gather_map(values: Sequence[Any]) -> Any:
        first = values[0]
        if isinstance(first, Tensor):
            if dim == 0 and all(t.dim() == 0 for t in values):
                warnings.warn(
                    "Was asked to gather along dimension 0, but all input tensors were scalars; will instead unsqueeze "
                    "and return a vector.",
                    stacklevel=2,
                )
                values = [t.view(1) for t in values]
            return torch.cat([t.to(device) for t in values], dim=dim)
        if first is None:
            return None
        if isinstance(first, dict):
            if not all(len(first) == len(d) for d in values):
                raise ValueError("All dicts must have the same number of keys")
            return type(first)((k, gather_map([d[k] for d in values])) for k in first)
        if is_namedtuple(first):
            return type(first)._make(map(gather_map, zip(*values, strict=True)))
        return type(first)(map(gather_map, zip(*values, strict=True)))

    return gather_map(outputs)


def move_to(obj: Any, device: DeviceLike) -> Any:
    """``obj`` with every tensor moved to ``device`` (differentiable)."""
    target = to_device(device)
    return _map_structure(obj, lambda leaf: [leaf.to(target) if isinstance(leaf, Tensor) else leaf], 1, None)[0]


def split_or_run_once(split: Callable[[], T], roots: Sequence[tuple[str, Any]]) -> T | None:
    """``split()``, or ``None`` (run once, unsplit, as ``nn.DataParallel`` does) when the ``(name, value)`` roots
    hold nothing to split or a :func:`is_shared_state` object; an error for strings alone, whose count is unknown.
    The one "run once" rule of the modules and both strategies."""
    try:
        return split()
    except SharedStateError:
        return None
    except NothingToSplitError:
        pass
    for where, value in roots:
        for path, node in iter_nodes(value, where):
            if _is_string_sequence(node):
                raise BatchSplitError(
                    f"Cannot split the batch: it holds no tensor with a batch dimension, only {path}, a sequence of "
                    f"{len(node)} strings, and nothing says that it holds one item per sample. Wrap it in "
                    "lightning_mgpu.PerSample(...) in your collate_fn (or before the call) so that it is split by "
                    "item across the devices."
                )
    return None
