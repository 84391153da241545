"""Split a batch (nested mappings, sequences, namedtuples, dataclasses) into per-device chunks; :mod:`.merge` brings
outputs back as one device would have returned them, :func:`gather` as ``torch.nn.parallel.gather`` does (0-dim
tensors stacked, with torch's warning).

Tensors are split along ``dim`` as ``torch.tensor_split`` does (10 over 4: 3, 3, 2, 2); a list of plain items as long
as the batch (ids) is split alike; anything else, 0-dim tensors included, goes whole to every replica. Inputs holding
a ``transformers`` cache, which each replica would append to, are not split (:class:`SharedStateError`): run once.
Lists of per-sample items holding tensors (detection targets) look like structures: mark them :class:`PerSample`.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_mgpu.parallel.devices import DeviceLike, to_device

T = TypeVar("T")


class BatchSplitError(ValueError):
    """The batch cannot be split into per-device chunks (empty, or inconsistent batch sizes)."""


class NothingToSplitError(BatchSplitError):
    """The inputs hold no tensor with a batch dimension (callers may then run once, unsplit)."""


class SharedStateError(BatchSplitError):
    """The inputs hold an object that every replica would change in place (a ``transformers`` cache): they run once,
    unsplit, on the first device."""


class PerSample(list):
    """A list with one item per sample, split by item across devices and concatenated back when gathered: per-sample
    items of per-sample sizes (detection targets, images of different sizes), which no batch dimension can carry.
    Its length is the batch size; every tensor with a batch dimension must agree with it."""


def is_namedtuple(obj: Any) -> bool:
    """A ``namedtuple`` / ``typing.NamedTuple`` instance: a fixed structure, never a per-sample sequence."""
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def is_shared_state(obj: Any) -> bool:
    """A ``transformers`` cache (``DynamicCache``...): passed whole to every replica, each would append its shard's
    keys and values to the one object."""
    # By the base class's name: parallel/ never imports transformers (nor waits for its import to ask).
    return any(c.__name__ == "Cache" and c.__module__ == "transformers.cache_utils" for c in type(obj).__mro__)


def shared_state(roots: Sequence[tuple[str, Any]]) -> str | None:
    """Where the inputs (``(name, value)`` pairs) hold a :func:`is_shared_state` object, with its type; else None."""
    found = (f"{p} ({type(n).__name__})" for root, v in roots for p, n in iter_nodes(v, root) if is_shared_state(n))
    return next(found, None)


def contains_tensor(obj: Any) -> bool:
    return any(True for _ in iter_tensors(obj))


def _is_per_sample_list(obj: Any, batch_size: int | None) -> bool:
    """A list of plain items (e.g. ids), or a tuple of strings (``ids, images = zip(*samples)``), with one item per
    sample: split like a tensor. Tuples of numbers are more often options such as ``size=(16, 16)``. A list of
    sequences each as long as the batch is what ``default_collate`` makes of per-sample lists (one sequence per
    position): a structure, whose sequences are split."""
    if batch_size is None or not isinstance(obj, (list, tuple)) or len(obj) != batch_size:
        return False
    if isinstance(obj, tuple):
        return _is_string_sequence(obj)
    collated = all(_is_plain_sequence(item) and len(item) == batch_size for item in obj)
    return not collated and not contains_tensor(obj)


def _is_string_sequence(obj: Any) -> bool:
    return _is_plain_sequence(obj) and all(isinstance(x, str) for x in obj)


def _children(obj: Any) -> tuple[bool, Iterable[tuple[Any, Any]]] | None:
    """For a container, whether its keys are field names (paths print ``.name``, else ``[key]``) and its ``(key,
    child)`` pairs; None for a leaf. The one place that opens structures (:func:`rebuild` closes them)."""
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
    """Yield ``(key path, node)`` for ``obj`` and everything nested in it, outermost first, with paths as error
    messages print them (``batch['mask']``, ``output.logits``). With a ``per_sample`` list, :class:`PerSample` lists
    are appended to it (with their paths) instead of yielded and entered."""
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
    """Yield ``(key path, tensor)`` for every tensor in a nested structure, e.g. ``("batch['mask']", tensor)``."""
    return ((p, node) for p, node in iter_nodes(obj, path) if isinstance(node, Tensor))


def batch_size_of(obj: Any, dim: int = 0, path: str = "batch") -> int:
    """The size along ``dim`` shared by every tensor that has that dim, or the length of the batch's
    :class:`PerSample` lists; a :class:`BatchSplitError` naming both key paths when two disagree, or with no tensor."""
    return _infer_from_roots([(path, obj)], dim, type(obj).__name__)


def _infer_from_roots(roots: Sequence[tuple[str, Any]], dim: int, what: str) -> int:
    """The batch size: the length of the :class:`PerSample` lists, else the size shared by every tensor along dim."""
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
            hint = None if marked else _per_sample_hint(roots, tensors, dim) or _flat_ids_hint(tensors)
            raise BatchSplitError(
                f"Cannot split the batch along dim {dim}: {first} but {path} has {shown}. Every tensor with a batch "
                f"dimension{lists} must have the same batch size." + (f" {hint}" if hint else "")
            )
    if marked and not size:
        raise BatchSplitError(f"Cannot split an empty batch: {first_path} is an empty PerSample.")
    return size


def _flat_ids_hint(tensors: Sequence[tuple[str, Tensor]]) -> str | None:
    """Advice for flat ids with offsets (``nn.EmbeddingBag``'s input), given only when the batch is 1-D integer tensors
    (anything else that disagrees is not helped by marking)."""
    if len(tensors) < 2 or any(t.dim() != 1 or t.is_floating_point() or t.is_complex() for _, t in tensors):
        return None
    return (
        "If these are flat ids with offsets (as nn.EmbeddingBag takes), pass one item per sample instead, e.g. "
        "lightning_mgpu.PerSample(list_of_bags) from your collate_fn, and flatten it in forward."
    )


def _per_sample_hint(roots: Sequence[tuple[str, Any]], tensors: Sequence[tuple[str, Tensor]], dim: int) -> str | None:
    """Advice to mark a list with :class:`PerSample`, given only when that would settle the disagreement: a list (of
    dicts, dataclasses or tensors) is as long as the batch size of a tensor outside it, and a tensor inside it has
    another size."""
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


def args_batch_size(
    args: Sequence[Any], kwargs: Mapping[str, Any], dim: int = 0, names: tuple[str, str] = ("args", "kwargs")
) -> int:
    """:func:`batch_size_of` for call arguments; error messages name e.g. ``args[0]['mask']``."""
    return _infer_from_roots(argument_roots(args, kwargs, names), dim, "no tensor argument")


def argument_roots(
    args: Sequence[Any], kwargs: Mapping[str, Any], names: tuple[str, str] = ("args", "kwargs")
) -> list[tuple[str, Any]]:
    """``(name, value)`` for each argument of a call, named as error messages print them (``args[0]``)."""
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
    """A container of the same type as ``template`` holding ``values`` (a sequence, or a mapping for dicts)."""
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
    """``count`` versions of ``obj``: in version ``i``, each leaf ``x`` replaced by ``leaf_fn(x)[i]``, containers
    rebuilt around them. Leaves: tensors, non-containers and per-sample lists (``PerSample`` ones only when splitting
    a batch, i.e. with a ``batch_size``; lists of plain items too unless ``plain_lists`` is False)."""
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
    """Split ``obj`` into one chunk per device, each moved to its device (differentiably): ``(chunks, sizes)``, fewer
    than the devices when the batch is smaller. ``sizes`` imposes the chunk sizes (e.g. to split targets exactly as
    the model's outputs were split)."""
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
    """Each root's chunks (split with one batch size, so error messages name the root) and the chunk sizes. A given
    ``batch_size`` is used when the roots hold nothing to read it from (e.g. a list of ids). ``plain_lists=False``:
    lists of plain items go whole to every chunk, as ``torch.nn.parallel.scatter`` passes them."""
    try:
        inferred = _infer_from_roots(roots, dim, what)
    except NothingToSplitError:
        if batch_size is None:
            raise
        inferred = batch_size
    if batch_size is not None and batch_size != inferred:
        raise BatchSplitError(f"batch_size={batch_size} was given but the tensors have size {inferred}.")
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
        """The leaf's chunks, chunk ``i`` on ``targets[i]``."""
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
    """:func:`split_batch` for call arguments, which share one batch size: per-device args, kwargs, and the sizes.
    Errors name the argument (``args[0]['mask']``)."""
    roots = argument_roots(args, kwargs, names)
    chunks, sizes = _split_roots(roots, devices, dim, batch_size, sizes, "no tensor argument")
    per_device = [[c[i] for c in chunks] for i in range(len(sizes))]  # each device's chunk of every argument
    n = len(args)
    return [tuple(c[:n]) for c in per_device], [dict(zip(kwargs, c[n:], strict=True)) for c in per_device], sizes


def scatter(inputs: Any, target_devices: Sequence[DeviceLike], dim: int = 0) -> list[Any]:
    """``torch.nn.parallel.scatter``'s contract on any devices: the chunks (balanced as by :func:`split_batch`,
    which also returns their sizes); lists of plain items and inputs without a batch dimension go whole to every
    device, as torch passes them."""
    try:
        (chunks,), _ = _split_roots([("inputs", inputs)], target_devices, dim, None, None, "", plain_lists=False)
        return chunks
    except NothingToSplitError:
        return [inputs for _ in target_devices]


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Gather one output per replica on ``target_device`` (differentiably), as ``torch.nn.parallel.gather`` does:
    tensors concatenated along ``dim``, dicts, namedtuples and other sequences field by field, ``None`` kept."""
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
    """``obj`` with every tensor moved to ``device`` (differentiable), structure preserved."""
    target = to_device(device)
    return _map_structure(obj, lambda leaf: [leaf.to(target) if isinstance(leaf, Tensor) else leaf], 1, None)[0]


def split_or_run_once(split: Callable[[], T], roots: Sequence[tuple[str, Any]]) -> T | None:
    """``split()``, or ``None`` when the inputs (``(name, value)`` pairs) hold nothing to split, or an object every
    replica would change (:func:`is_shared_state`): the caller then runs once, unsplit, as ``nn.DataParallel`` does
    without a batch dimension. Shared by the modules and both strategies."""
    try:
        return split()
    except SharedStateError:
        return None
    except NothingToSplitError:
        pass
    # Unless they hold a sequence of strings: one item per sample, it seems, but nothing tells their count.
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
