"""Split a batch (nested mappings, sequences, namedtuples, dataclasses) into per-device chunks, and the one walker
over such structures. Tensors split along ``dim`` as ``torch.tensor_split`` does (10 over 4: 3, 3, 2, 2), lists of
plain items as long as the batch (ids) alike; anything else goes whole to every replica. Inputs holding a
``transformers`` cache, which each replica would append to, run once, unsplit (:class:`SharedStateError`).
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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


def iter_nodes(
    obj: Any, path: str = "batch", per_sample: list[tuple[str, PerSample]] | None = None
) -> Iterator[tuple[str, Any]]:
    """``(key path, node)`` for ``obj`` and everything in it, outermost first, paths as errors print them
    (``batch['mask']``, ``output.logits``). :class:`PerSample` lists go to a given ``per_sample`` list instead."""
    if per_sample is not None and isinstance(obj, PerSample):
        per_sample.append((path, obj))
        return
    yield path, obj
    children = _children(obj)
    if children is not None:
        by_field, items = children
        for key, child in items:
            yield from iter_nodes(child, f"{path}.{key}" if by_field else f"{path}[{key!r}]", per_sample)


def iter_tensors(obj: Any, path: str = "batch") -> Iterator[tuple[str, Tensor]]:
    return ((p, node) for p, node in iter_nodes(obj, path) if isinstance(node, Tensor))


def batch_size_of(obj: Any, dim: int = 0, path: str = "batch") -> int:
    return roots_batch_size([(path, obj)], dim, type(obj).__name__)


def roots_batch_size(roots: Sequence[tuple[str, Any]], dim: int = 0, what: str = "no tensor argument") -> int:
    """The length of the :class:`PerSample` lists, else the size along ``dim`` that every tensor having it shares,
    of the ``(name, value)`` roots; a :class:`BatchSplitError` naming both key paths when two disagree."""
    marked: list[tuple[str, PerSample]] = []
    tensors = [(p, n) for path, obj in roots for p, n in iter_nodes(obj, path, marked) if isinstance(n, Tensor)]
    sized = [(p, len(seq), f"{len(seq)} items") for p, seq in marked]  # PerSample lists first: they set the size
    sized += [(p, t.shape[dim], f"size {t.shape[dim]}") for p, t in tensors if t.dim() > dim]
    if not sized:
        raise NothingToSplitError(
            f"Cannot split the batch along dim {dim}: it holds no tensor with a dimension {dim} "
            f"(got {what}). Pass tensors, or collections of tensors, with the batch along dim {dim}."
        )
    first_path, size, _ = sized[0]
    first = f"{first_path} is a PerSample of {size} items" if marked else f"{first_path} has size {size}"
    for path, other, shown in sized:
        if other != size:
            lists = ", and every PerSample list," if marked else ""
            hints = (_parts_hint, _per_sample_hint, _flat_ids_hint)
            hint = None if marked else next(filter(None, (h(roots, tensors, dim) for h in hints)), None)
            hint = hint or (
                "If one of them is not per sample, keep it out of what is split: class weights in the loss module "
                "(`nn.CrossEntropyLoss(weight=w)`, whose weighting the replicas' losses then follow), other values "
                "(a temperature) as a buffer of the module (`register_buffer`), a 0-dim tensor or a Python number, "
                "which every replica gets whole."
            )
            raise BatchSplitError(
                f"Cannot split the batch along dim {dim}: {first} but {path} has {shown}. Every tensor with a batch "
                f"dimension{lists} must have the same batch size." + (f" {hint}" if hint else "")
            )
    if marked and not size:
        raise BatchSplitError(f"Cannot split an empty batch: {first_path} is an empty PerSample.")
    return size


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
    obj: Any, leaf_fn: Callable[[Any], list[Any]], count: int, batch_size: int | None, plain_lists: bool = True
) -> list[Any]:
    """``count`` versions of ``obj``, leaf ``x`` replaced by ``leaf_fn(x)[i]`` in version ``i``. Leaves: tensors,
    non-containers, and given a ``batch_size``, per-sample lists (plain ones only if ``plain_lists``)."""
    if isinstance(obj, Tensor) or (isinstance(obj, PerSample) and batch_size is not None):
        return leaf_fn(obj)
    children = _children(obj)
    if children is None or (plain_lists and _is_per_sample_list(obj, batch_size)):
        return leaf_fn(obj)
    mapped = [(key, _map_structure(child, leaf_fn, count, batch_size, plain_lists)) for key, child in children[1]]
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
) -> tuple[list[Any], list[int]]:
    """``(chunks, sizes)``: ``obj`` split into one chunk per device, moved there (differentiably); fewer chunks for a
    smaller batch. ``sizes`` imposes the chunk sizes (to split targets as the outputs were)."""
    (chunks,), sizes = _split_roots([("batch", obj)], devices, dim, batch_size, sizes, type(obj).__name__)
    return chunks, sizes


def _split_roots(
    roots: Sequence[tuple[str, Any]],
    devices: Sequence[DeviceLike],
    dim: int,
    batch_size: int | None,
    sizes: Sequence[int] | None,
    what: str,
    plain_lists: bool = True,
) -> tuple[list[list[Any]], list[int]]:
    """Each root's chunks, split with one batch size, and the chunk sizes. A given ``batch_size`` serves when nothing
    tells it (a list of ids). ``plain_lists=False``: plain lists go whole to every chunk (torch's ``scatter``)."""
    try:
        inferred = roots_batch_size(roots, dim, what)
    except NothingToSplitError:
        if batch_size is None:
            raise
        inferred = batch_size
    if batch_size is not None and batch_size != inferred:
        raise BatchSplitError(f"batch_size={batch_size} was given but the tensors have size {inferred}.")
    _say_whole_parts(roots, dim, inferred)
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
        if plain_lists and _is_per_sample_list(leaf, inferred):
            return [leaf[s] for s in slices]
        if is_shared_state(leaf):
            raise SharedStateError(
                f"Cannot split inputs that hold a {type(leaf).__name__}: every replica would change that one object "
                "(appending its shard's keys and values to the cache)."
            )
        return [leaf] * len(chunks)

    return [_map_structure(value, split_leaf, len(chunks), inferred, plain_lists) for _, value in roots], chunks


def _say_whole_parts(roots: Sequence[tuple[str, Any]], dim: int, size: int) -> None:
    """Warn (once per part) where a part that may hold one value per sample goes whole to every device: a tensor
    without dimension ``dim`` but as long as the batch (1-D labels with ``dim=1``), or an object the split does not
    open holding tensors of the batch's size along ``dim``."""
    for root, obj in roots:
        for path, node in iter_nodes(obj, root):
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
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]], list[int]]:
    """:func:`split_batch` for call arguments (one batch size): per-device args and kwargs, and the sizes."""
    roots = argument_roots(args, kwargs, names)
    chunks, sizes = _split_roots(roots, devices, dim, batch_size, sizes, "no tensor argument")
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
