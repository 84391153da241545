"""Split a batch into per-device chunks; the one walker over batch structures; torch's ``scatter`` and ``gather``.

The walker opens mappings (``ModelOutput``, ``BatchEncoding``), namedtuples, lists, tuples and dataclasses, which
``torch.utils._pytree`` leaves whole, and names key paths for messages. Tensors split as ``torch.tensor_split`` does
(10 over 4: 3, 3, 2, 2); a :class:`PerSample` list, a list of plain items or a tuple of strings as long as the batch,
and given the DataLoader's counts (``samples``) a sequence of that many items of one outline (SimCLR's pairs), split
by item; anything else goes whole to every replica.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from itertools import accumulate
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from lightning_mgpu.parallel.devices import DeviceLike, to_device

T = TypeVar("T")
Roots = Sequence[tuple[str, Any]]  # (name as messages print it, value): a batch, or a call's arguments
Paths = list[tuple[str, Tensor]]


class BatchSplitError(ValueError):
    """The batch cannot be split into per-device chunks (empty, or inconsistent batch sizes)."""


class NothingToSplitError(BatchSplitError):
    """The inputs hold no tensor with a batch dimension (callers may then run once, unsplit)."""


class SharedStateError(BatchSplitError):
    """The inputs hold an object that every replica would change in place (a ``transformers`` cache)."""


class PerSample(list):
    """One item per sample (detection targets, images of different sizes: what no batch dimension can carry), split
    by item and concatenated back. Its length is the batch size, which every batched tensor must agree with."""


# --- the walker -------------------------------------------------------------------------------------------------------
def is_namedtuple(obj: Any) -> bool:
    """A ``namedtuple`` / ``typing.NamedTuple`` instance: a fixed structure, never a per-sample sequence."""
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _children(obj: Any) -> Iterable[tuple[Any, Any]] | None:
    """``(key, child)`` pairs of a container (field names as ``str`` keys outside mappings), None for a leaf."""
    if isinstance(obj, Tensor):
        return None
    if isinstance(obj, Mapping):  # ModelOutput (a dataclass too) included
        return obj.items()
    if isinstance(obj, (list, tuple)):
        return zip(obj._fields, obj, strict=True) if is_namedtuple(obj) else enumerate(obj)
    if is_dataclass_instance(obj):
        return ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return None


def labelled(path: str, obj: Any) -> list[tuple[str, Any]]:
    """``(key path, child)`` for each child of ``obj``: ``path.field``, else ``path[key]``."""
    keyed = isinstance(obj, Mapping)
    return [
        (f"{path}.{k}" if isinstance(k, str) and not keyed else f"{path}[{k!r}]", child)
        for k, child in _children(obj) or ()
    ]


def iter_nodes(obj: Any, path: str = "batch", closed: Callable[[Any], bool] | None = None) -> Iterator[tuple[str, Any]]:
    """``(key path, node)`` for ``obj`` and everything in it, outermost first, but inside ``closed`` nodes."""
    stack = [(path, obj)]
    while stack:
        path, node = stack.pop()
        yield path, node
        if closed is None or not closed(node):
            stack += reversed(labelled(path, node))


def iter_tensors(obj: Any, path: str = "batch") -> Iterator[tuple[str, Tensor]]:
    return ((p, node) for p, node in iter_nodes(obj, path) if isinstance(node, Tensor))


def contains_tensor(obj: Any) -> bool:
    return any(isinstance(node, Tensor) for _, node in iter_nodes(obj))


def rebuild(template: Any, values: Sequence[Any] | Mapping[str, Any]) -> Any:
    """A container of ``template``'s type holding ``values`` (a mapping for mappings), else of its base type."""
    kind = type(template)
    if kind in (list, tuple, dict):
        return kind(values)
    if is_namedtuple(template):
        return kind(*values)
    if isinstance(template, defaultdict):
        return defaultdict(template.default_factory, values)
    if is_dataclass_instance(template):
        if isinstance(template, Mapping):  # transformers ModelOutput
            return kind(**values)
        fields = list(zip(dataclasses.fields(template), values, strict=True))
        obj = kind(**{f.name: v for f, v in fields if f.init})
        for f, v in fields:
            if not f.init:  # set after construction, frozen dataclasses included
                object.__setattr__(obj, f.name, v)
        return obj
    try:
        return kind(values)
    except TypeError:
        return (dict if isinstance(template, Mapping) else list if isinstance(template, list) else tuple)(values)


def _map(obj: Any, leaf: Callable[[Any], Sequence[Any]], count: int, opened: Callable[[Any], bool]) -> list[Any]:
    """``count`` copies of ``obj``, each leaf ``x`` (or shut container) replaced by ``leaf(x)[i]`` in copy i."""
    children = None if isinstance(obj, Tensor) or not opened(obj) else _children(obj)
    if children is None:
        return leaf(obj)
    keys, columns = [], []
    for key, child in children:
        keys.append(key)
        columns.append(_map(child, leaf, count, opened))
    rows = zip(*columns, strict=True) if columns else [()] * count
    keyed = isinstance(obj, Mapping)
    return [rebuild(obj, dict(zip(keys, row, strict=True)) if keyed else row) for row in rows]


def move_to(obj: Any, device: DeviceLike) -> Any:
    """``obj`` with every tensor moved to ``device`` (differentiably)."""
    target = to_device(device)
    return _map(obj, lambda x: [x.to(target) if isinstance(x, Tensor) else x], 1, lambda x: True)[0]


# --- the batch size -------------------------------------------------------------------------------------------------
def argument_roots(
    args: Sequence[Any], kwargs: Mapping[str, Any], names: tuple[str, str] = ("args", "kwargs")
) -> Roots:
    """``(name, value)`` for each argument of a call, as error messages name them (``args[0]``)."""
    return [(f"{names[0]}[{i}]", a) for i, a in enumerate(args)] + [
        (f"{names[1]}[{k!r}]", v) for k, v in kwargs.items()
    ]


def batch_size_of(obj: Any, dim: int = 0, path: str = "batch") -> int:
    return roots_batch_size([(path, obj)], dim, type(obj).__name__)


def _add_sizes(obj: Any, dim: int, sizes: set[int]) -> set[int]:
    """``sizes`` with the sizes along ``dim`` of the tensors in ``obj`` and the lengths of its PerSample lists."""
    if isinstance(obj, Tensor):
        sizes.update(obj.shape[dim : dim + 1])
    elif isinstance(obj, PerSample):
        sizes.add(len(obj))
    else:
        for _, child in _children(obj) or ():
            _add_sizes(child, dim, sizes)
    return sizes


def agreed_size(obj: Any, dim: int = 0) -> int | None:
    """The size along ``dim`` that every tensor having it and every PerSample list in ``obj`` agree on; else None."""
    sizes = _add_sizes(obj, dim, set())
    return sizes.pop() if len(sizes) == 1 else None


def _sized(roots: Roots, dim: int, items: Collection[int] = ()) -> tuple[list[tuple[str, list[Any]]], Paths]:
    """The PerSample lists and tensors in the roots, with key paths (sequences whose id is in ``items`` shut)."""
    nodes = [
        (p, n) for r, v in roots for p, n in iter_nodes(v, r, lambda n: isinstance(n, PerSample) or id(n) in items)
    ]
    return [(p, n) for p, n in nodes if isinstance(n, PerSample)], [(p, n) for p, n in nodes if isinstance(n, Tensor)]


def roots_batch_size(
    roots: Roots, dim: int = 0, what: str = "no tensor argument", *, samples: Sequence[int] = ()
) -> int:
    """The size along ``dim`` that every PerSample list and tensor having it shares; else an error naming two parts that
    disagree, with the fix (``samples``: the DataLoader's counts)."""
    sizes = set().union(*(_add_sizes(obj, dim, set()) for _, obj in roots))
    if len(sizes) == 1 and 0 not in sizes:
        return sizes.pop()
    marked, tensors = _sized(roots, dim)
    sized = [(p, len(s), f"{len(s)} items") for p, s in marked]  # PerSample lists first: they set the size
    sized += [(p, t.shape[dim], f"size {t.shape[dim]}") for p, t in tensors if t.dim() > dim]
    if not sized:
        raise NothingToSplitError(
            f"Cannot split the batch along dim {dim}: it holds no tensor with a dimension {dim} (got {what}). Pass "
            f"tensors, or collections of tensors, with the batch along dim {dim}."
        )
    first, size, _ = sized[0]
    odd = next(((path, shown) for path, n, shown in sized if n != size), None)
    if odd is not None:
        said = f"{first} is a PerSample of {size} items" if marked else f"{first} has size {size}"
        raise BatchSplitError(
            f"Cannot split the batch along dim {dim}: {said} but {odd[0]} has {odd[1]}. Every tensor with a batch "
            f"dimension{', and every PerSample list,' if marked else ''} must have the same batch size."
            + ("" if marked else f" {_Advice(roots, tensors, dim, samples)}")
        )
    if marked and not size:
        raise BatchSplitError(f"Cannot split an empty batch: {first} is an empty PerSample.")
    return size


# --- sequences split by item ------------------------------------------------------------------------------------------
def _plain(obj: Any) -> bool:
    """A non-empty list or tuple that is not a namedtuple (a fixed structure)."""
    return isinstance(obj, (list, tuple)) and not is_namedtuple(obj) and bool(obj)


def _plain_items(obj: Any) -> bool:
    """A list or tuple of plain items only (ids, strings, numbers): no container, no tensor."""
    if not isinstance(obj, (list, tuple)) or is_namedtuple(obj):
        return False
    return not any(isinstance(x, Tensor) or _children(x) is not None for x in obj)


def _outline(obj: Any) -> Any:
    """A hashable outline (types, keys, tensors' numbers of dimensions), which the samples of one data set share."""
    if isinstance(obj, Tensor):
        return Tensor, obj.dim()
    children = _children(obj)
    if children is None or _plain_items(obj):
        return type(obj)
    return type(obj), tuple((key, _outline(child)) for key, child in children)


def _batched(obj: Any, count: int, dim: int) -> bool:
    """Whether every part of ``obj`` holds ``count`` samples along ``dim`` (as ``default_collate``'s structures do)."""
    if isinstance(obj, Tensor):
        return obj.shape[dim : dim + 1] == (count,)
    if isinstance(obj, PerSample) or _plain_items(obj):
        return len(obj) == count
    values = [child for _, child in _children(obj) or ()]
    return bool(values) and all(_batched(value, count, dim) for value in values)


def _one_outline(seq: Any) -> bool:
    """A list or tuple (not a PerSample) holding tensors, whose items share one outline."""
    if not _plain(seq) or isinstance(seq, PerSample) or not contains_tensor(seq):
        return False
    return len({_outline(item) for item in seq}) == 1


def _samples_sequence(seq: Any, count: int, dim: int, counts: Sequence[int]) -> bool:
    """``count`` items of one outline, holding tensors, not batches of the DataLoader's ``counts`` themselves (a full
    batch's two stacked views; a detection target may hold as many boxes as the batch has samples, so not every
    container item); not a tuple of such sequences (``zip(*batch)``'s per-field tuples, opened)."""
    if not isinstance(seq, (list, tuple)) or len(seq) != count or not _one_outline(seq):
        return False
    batched = (any(_batched(item, n, dim) for n in counts) for item in seq)
    if any(batched) if isinstance(seq[0], Tensor) else all(batched):
        return False
    return not (isinstance(seq, tuple) and all(_samples_sequence(item, count, dim, counts) for item in seq))


def _find_samples(obj: Any, path: str, count: int, dim: int, counts: Sequence[int]) -> list[tuple[str, Any]]:
    """``(key path, sequence)`` for the outermost sequences in ``obj`` holding one item per sample of ``count``."""
    if isinstance(obj, (Tensor, PerSample)):
        return []
    if _samples_sequence(obj, count, dim, counts):
        return [(path, obj)]
    return [hit for p, child in labelled(path, obj) for hit in _find_samples(child, p, count, dim, counts)]


def _sample_items(roots: Roots, dim: int, samples: Sequence[int]) -> list[tuple[str, Any]]:
    """The outermost sequences holding one item per sample of the first of the DataLoader's counts that any does."""
    for count in samples:
        found = [hit for root, obj in roots for hit in _find_samples(obj, root, count, dim, samples)]
        if not found:
            continue
        marked, tensors = _sized(roots, dim, {id(seq) for _, seq in found})
        odd = [(p, f"size {t.shape[dim]}") for p, t in tensors if t.shape[dim : dim + 1] not in ((count,), ())]
        odd += [(p, f"{len(seq)} items (a PerSample)") for p, seq in marked if len(seq) != count]
        if odd:
            raise BatchSplitError(
                f"Cannot split the batch along dim {dim}: {found[0][0]} is a {_kind(found[0][1])}, one per sample of "
                f"the DataLoader's batch ({count} samples), so it is split by item, but {odd[0][0]} has {odd[0][1]} "
                f"along dim {dim}. Every part of the batch must hold the same {count} samples: stack per-sample "
                f"tensors with the batch on dim {dim} in your collate_fn (or put each sample's part into its item), "
                "and keep what is not per sample out of the batch (a buffer of the module, a Python number)."
            )
        return found
    return []


def _kind(seq: Sequence[Any]) -> str:
    """``"list of 5 tuples"``, as messages describe a sequence."""
    items = "dicts" if isinstance(seq[0], Mapping) else type(seq[0]).__name__ + "s"
    return f"{'tuple' if isinstance(seq, tuple) else 'list'} of {len(seq)} {items}"


# --- advice for batch sizes that disagree -----------------------------------------------------------------------------
_KEEP_OUT = (
    "If one of them is not per sample, keep it out of what is split: class weights in the loss module "
    "(`nn.CrossEntropyLoss(weight=w)`, whose weighting the replicas' losses then follow), other values (a "
    "temperature) as a buffer of the module (`register_buffer`), a 0-dim tensor or a Python number."
)


@dataclasses.dataclass
class _Advice:
    """What to do about tensors of different batch sizes: the first specific advice that fits, else the general one."""

    roots: Roots
    tensors: Paths
    dim: int
    samples: Sequence[int]

    def __str__(self) -> str:
        hints = [self.batch_dim] * bool(self.dim) + [self.parts, self.count, self.per_sample, self.flat_ids]
        return next(filter(None, (hint() for hint in hints)), _KEEP_OUT)  # batch_dim: (B, 1) labels, dim=1

    def along(self, inside: str = "", outside: str | None = None) -> list[tuple[str, int]]:
        """``(path, size along dim)`` of the tensors having ``dim`` under the path ``inside``, not ``outside``."""
        return [
            (p, t.shape[self.dim])
            for p, t in self.tensors
            if t.dim() > self.dim and p.startswith(inside) and not (outside and p.startswith(outside))
        ]

    def sequences(self) -> Iterator[tuple[str, Any]]:
        return ((p, n) for root, obj in self.roots for p, n in iter_nodes(obj, root) if _plain(n))

    def batch_dim(self) -> str | None:
        """A tensor whose samples (the DataLoader's count, else the commonest size) are on another dim than ``dim``."""
        dim, along = self.dim, self.along()
        batch = set(self.samples) or {Counter(n for _, n in along).most_common(1)[0][0]}
        where = next((p for p, n in along if n in batch), None)
        for path, t in self.tensors if where else ():
            axis = next((a for a, n in enumerate(t.shape) if n in batch and a != dim), None)
            if t.dim() > dim and t.shape[dim] not in batch and axis is not None:
                return (
                    f"{path} has shape {tuple(t.shape)}: its {t.shape[axis]} samples are on dim {axis}, not on dim "
                    f"{dim}, which the batch is split along ({where} has {t.shape[axis]} there). Put them on dim "
                    f"{dim} in your collate_fn, `.movedim({axis}, {dim})` (shape {tuple(t.movedim(axis, dim).shape)}), "
                    f"and back in the step, `.movedim({dim}, {axis})`: each device then gets its samples' rows (kept "
                    "out of the batch, every device would get all of them)."
                )
        return None

    def parts(self) -> str | None:
        """A batch whose parts are batches of different sizes (a ``CombinedLoader`` of several dataloaders)."""
        (root, parts), *others = self.roots
        keys = parts.keys() if isinstance(parts, Mapping) else range(len(parts)) if _plain(parts) else ()
        if others or len(keys) < 2 or not all(isinstance(parts[k], (Mapping, list, tuple)) for k in keys):
            return None
        sizes = {f"{root}[{k!r}]": {n for _, n in self.along(f"{root}[{k!r}]")} for k in keys}
        if any(len(s) != 1 for s in sizes.values()) or len({min(s) for s in sizes.values()}) < 2:
            return None
        return (
            f"Its parts are batches of different sizes ({', '.join(f'{w} {min(s)}' for w, s in sizes.items())}), as "
            "several dataloaders give together (CombinedLoader): give every DataLoader the same batch_size and "
            "drop_last=True, or use strategy='dp', whose forward splits the inputs of each call apart."
        )

    def count(self) -> str | None:
        """A sequence of items of one outline, none a batch, of a length none of the DataLoader's counts is."""
        counts, dim = self.samples, self.dim
        for where, seq in self.sequences() if any(n in counts for _, n in self.along()) else ():
            if not _one_outline(seq) or len(seq) in counts or any(_batched(x, n, dim) for n in counts for x in seq):
                continue
            path, count = next(((p, n) for p, n in self.along(outside=f"{where}[") if n in counts), ("", 0))
            if path:
                return (
                    f"{where} is a {_kind(seq)}, but the DataLoader's batch holds {count} samples ({path} has "
                    f"{count}): a sequence split by item must hold one item per sample. Return every sample's item "
                    f"from your collate_fn ({count} of them); if its items are not samples, stack its tensors with "
                    f"the batch on dim {dim}, or keep it out of the batch (a buffer of the module)."
                )
        return None

    def per_sample(self) -> str | None:
        """A list of dicts, dataclasses or tensors as long as the batch, holding tensors of other sizes: a PerSample."""
        kinds = (lambda x: isinstance(x, Mapping), lambda x: isinstance(x, Tensor), is_dataclass_instance)
        for where, seq in self.sequences():
            if not any(all(map(kind, seq)) for kind in kinds):
                continue
            outside = {n for _, n in self.along(outside=f"{where}[")}
            if len(seq) in outside and any(n != len(seq) for _, n in self.along(f"{where}[")):
                return (
                    f"{where} is a {_kind(seq)}, as many as the batch: if it holds one item per sample (e.g. detection "
                    "targets, images of different sizes), wrap it in lightning_mgpu.PerSample(...) in your collate_fn "
                    "so that it is split by item."
                )
        return None

    def flat_ids(self) -> str | None:
        """Flat ids with offsets (``nn.EmbeddingBag``'s input), when the batch is 1-D integer tensors."""
        ids = all(t.dim() == 1 and not (t.is_floating_point() or t.is_complex()) for _, t in self.tensors)
        if len(self.tensors) < 2 or not ids:
            return None
        return (
            "If these are flat ids with offsets (as nn.EmbeddingBag takes), pass one item per sample instead, e.g. "
            "lightning_mgpu.PerSample(list_of_bags) from your collate_fn, and flatten it in forward."
        )


# --- the split --------------------------------------------------------------------------------------------------------
def split_sizes(batch_size: int, num_devices: int) -> list[int]:
    """Per-replica sizes as ``torch.tensor_split`` makes them, with no empty chunk (tiny batches use fewer)."""
    if batch_size <= 0:
        raise BatchSplitError(
            "Cannot split an empty batch (batch size 0): there is nothing to run. Leave empty batches out where they "
            "are made (the sampler or collate_fn)."
        )
    if num_devices <= 0:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}.")
    base, extra = divmod(batch_size, min(batch_size, num_devices))
    return [base + (i < extra) for i in range(min(batch_size, num_devices))]


def is_shared_state(obj: Any) -> bool:
    """A ``transformers`` cache (``DynamicCache``...), known by its base class's name: parallel/ never imports it."""
    return any(c.__name__ == "Cache" and c.__module__ == "transformers.cache_utils" for c in type(obj).__mro__)


def shared_state(roots: Roots) -> str | None:
    """Where the roots hold a :func:`is_shared_state` object, with its type; else None."""
    return next(
        (f"{p} ({type(n).__name__})" for r, v in roots for p, n in iter_nodes(v, r) if is_shared_state(n)), None
    )


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
    smaller batch. ``sizes`` imposes the chunk sizes; ``samples``: the DataLoader's counts (batch, last batch)."""
    (chunks,), sizes = _split_roots([("batch", obj)], devices, dim, batch_size, sizes, type(obj).__name__, samples)
    return chunks, sizes


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
    chunks, sizes = _split_roots(roots, devices, dim, batch_size, sizes, "no tensor argument", samples)
    per_device = list(zip(*chunks, strict=True)) or [()] * len(sizes)  # each device's chunk of every argument
    n = len(args)
    return [c[:n] for c in per_device], [dict(zip(kwargs, c[n:], strict=True)) for c in per_device], sizes


def _split_roots(
    roots: Roots,
    devices: Sequence[DeviceLike],
    dim: int,
    batch_size: int | None,
    sizes: Sequence[int] | None,
    what: str,
    samples: Sequence[int] = (),
    plain_lists: bool = True,
) -> tuple[list[list[Any]], list[int]]:
    """Each root's chunks and the chunk sizes; ``batch_size`` serves when nothing tells it (a list of ids).
    ``plain_lists=False``: plain lists go whole to every chunk (torch's ``scatter``)."""
    flat = None if sizes is not None else _split_flat(roots, devices, dim, batch_size, samples)
    if flat is not None:
        return flat
    found = _sample_items(roots, dim, samples) if plain_lists and samples else []
    try:
        size = len(found[0][1]) if found else roots_batch_size(roots, dim, what, samples=samples)
    except NothingToSplitError:
        if batch_size is None:
            raise
        size = batch_size
    if batch_size is not None and batch_size != size:
        raise BatchSplitError(f"batch_size={batch_size} was given but the tensors have size {size}.")
    split = _Split(dim, size, [to_device(d) for d in devices], {id(seq) for _, seq in found}, plain_lists, sizes)
    mapped = [_map(value, split.leaf, len(split.chunks), split.opened) for _, value in roots]
    for leaf, reason in split.whole:
        path = next(p for root, value in roots for p, n in iter_nodes(value, root) if n is leaf)
        warnings.warn(
            f"{path} {reason}: every device gets it whole. If it holds one value per sample, pass it as a tensor with "
            f"the batch on dim {dim}, in a dict, list, tuple or dataclass (or a PerSample list of items).",
            UserWarning,
            stacklevel=3,
        )
    return mapped, split.chunks


def _split_flat(
    roots: Roots, devices: Sequence[DeviceLike], dim: int, batch_size: int | None, samples: Sequence[int]
) -> tuple[list[list[Any]], list[int]] | None:
    """The common batch in one pass: tensors, or a list, tuple or dict of tensors, all of one size along ``dim`` (one
    of the DataLoader's counts, so no part can hold one item per sample); ``None`` for anything else."""
    parts = [list(v.values()) if type(v) is dict else v if type(v) in (list, tuple) else [v] for _, v in roots]
    tensors = [t for part in parts for t in part]
    if not tensors or not all(isinstance(t, Tensor) and t.dim() > dim for t in tensors):
        return None
    size = tensors[0].shape[dim]
    if not size or any(t.shape[dim] != size for t in tensors) or (samples and size not in samples):
        return None
    if batch_size not in (None, size):
        return None  # the general path says what disagrees
    chunks = split_sizes(size, len(devices))
    bounds, targets = list(accumulate(chunks[:-1])), [to_device(d) for d in devices]
    columns = [[p.to(d) for p, d in zip(torch.tensor_split(t, bounds, dim), targets, strict=False)] for t in tensors]
    rows, mapped, start = list(zip(*columns, strict=True)), [], 0
    for (_, value), part in zip(roots, parts, strict=True):
        end = start + len(part)
        if type(value) is dict:
            mapped.append([dict(zip(value, row[start:end], strict=True)) for row in rows])
        else:
            mapped.append([row[start] if part is not value else type(value)(row[start:end]) for row in rows])
        start = end
    return mapped, chunks


class _Split:
    """How one batch is split; ``whole``: the parts that go whole though they may hold one value per sample."""

    def __init__(
        self, dim: int, size: int, targets: list[torch.device], items: set[int], plain: bool, sizes: Any
    ) -> None:
        self.chunks = split_sizes(size, len(targets)) if sizes is None else [int(n) for n in sizes]
        if sizes is not None and (sum(self.chunks) != size or min(self.chunks) <= 0 or len(sizes) > len(targets)):
            raise BatchSplitError(
                f"Cannot split a batch of {size} into chunks of {self.chunks} over {len(targets)} device(s): the "
                "sizes must be positive, one per device at most, and add up to the batch size."
            )
        self.dim, self.size, self.targets, self.items, self.plain = dim, size, targets, items, plain
        self.bounds = list(accumulate(self.chunks[:-1]))
        self.whole: list[tuple[Any, str]] = []

    def opened(self, node: Any) -> bool:
        """Whether ``node`` is split part by part: not a PerSample, nor a list of plain items (ids) or a tuple of
        strings as long as the batch (tuples of numbers are options, ``size=(16, 16)``; a list of batch-long
        sequences is ``default_collate``'s structure, opened)."""
        if isinstance(node, PerSample) or id(node) in self.items:
            return False
        if not (self.plain and _plain(node) and len(node) == self.size):
            return True
        if isinstance(node, tuple):
            return not all(isinstance(x, str) for x in node)
        return all(_plain(item) and len(item) == self.size for item in node) or contains_tensor(node)

    def leaf(self, leaf: Any) -> list[Any]:
        """``leaf``'s chunks, one per device, moved there."""
        dim, targets, n = self.dim, self.targets, len(self.chunks)
        if isinstance(leaf, Tensor):
            if self.bounds and leaf.dim() > dim:
                return [p.to(d) for p, d in zip(torch.tensor_split(leaf, self.bounds, dim), targets, strict=False)]
            if 0 < leaf.dim() <= dim and self.size in leaf.shape:
                self.whole.append((leaf, f"has no dimension {dim} to split"))
            return [leaf.to(d) for d in targets[:n]]
        if isinstance(leaf, (list, tuple)):  # a PerSample, one item per sample, or plain items (ids): by item
            cuts = zip([0, *self.bounds], [*self.bounds, self.size], strict=True)
            parts = [PerSample(leaf[a:b]) if isinstance(leaf, PerSample) else leaf[a:b] for a, b in cuts]
            moved = isinstance(leaf, PerSample) or id(leaf) in self.items  # plain items stay as they are
            return [move_to(part, d) if moved else part for part, d in zip(parts, targets, strict=False)]
        if is_shared_state(leaf):
            raise SharedStateError(
                f"Cannot split inputs that hold a {type(leaf).__name__}: every replica would change that one object "
                "(appending its shard's keys and values to the cache)."
            )
        attributes = vars(leaf).values() if hasattr(leaf, "__dict__") and not isinstance(leaf, nn.Module) else ()
        if any(isinstance(v, Tensor) and v.shape[dim : dim + 1] == (self.size,) for v in attributes):
            said = f"holding tensors of {self.size} along dim {dim}, which the split does not open"
            self.whole.append((leaf, f"is an object ({type(leaf).__name__}) {said}"))
        return [leaf] * n


def split_or_run_once(split: Callable[[], T], roots: Roots) -> T | None:
    """``split()``, or ``None`` (run once, unsplit, as ``nn.DataParallel`` does) when the roots hold nothing to split
    or a :func:`is_shared_state` object; an error for strings alone, whose count is unknown."""
    try:
        return split()
    except SharedStateError:
        return None
    except NothingToSplitError:
        nodes = [(p, n) for root, v in roots for p, n in iter_nodes(v, root)]
    for path, strings in nodes:
        if _plain(strings) and all(isinstance(x, str) for x in strings):
            raise BatchSplitError(
                f"Cannot split the batch: it holds no tensor with a batch dimension, only {path}, a sequence of "
                f"{len(strings)} strings, and nothing says that it holds one item per sample. Wrap it in "
                "lightning_mgpu.PerSample(...) in your collate_fn (or before the call) so that it is split by item."
            )
    return None


# --- torch.nn.parallel's contracts ------------------------------------------------------------------------------------
def scatter(inputs: Any, target_devices: Sequence[DeviceLike], dim: int = 0) -> list[Any]:
    """``torch.nn.parallel.scatter``'s contract on any devices, chunks balanced as by :func:`split_batch`; plain lists
    and inputs without a batch dimension go whole to every device, as torch passes them."""
    try:
        return _split_roots([("inputs", inputs)], target_devices, dim, None, None, "", plain_lists=False)[0][0]
    except NothingToSplitError:
        return [inputs for _ in target_devices]


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """``torch.nn.parallel.gather``'s contract on any devices (differentiable): tensors concatenated along ``dim``,
    0-dim ones stacked with torch's warning, containers field by field, ``None`` kept."""
    first, device = outputs[0], to_device(target_device)
    if isinstance(first, Tensor):
        if dim == 0 and all(t.dim() == 0 for t in outputs):
            warnings.warn(
                "Was asked to gather along dimension 0, but all input tensors were scalars; will instead unsqueeze "
                "and return a vector.",
                stacklevel=2,
            )
            outputs = [t.view(1) for t in outputs]
        return torch.cat([t.to(device) for t in outputs], dim=dim)
    if first is None:
        return None
    if isinstance(first, dict):
        if any(len(first) != len(d) for d in outputs):
            raise ValueError("All dicts must have the same number of keys")
        return rebuild(first, {k: gather([d[k] for d in outputs], device, dim) for k in first})
    return rebuild(first, [gather(values, device, dim) for values in zip(*outputs, strict=True)])
