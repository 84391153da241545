"""Collectives across the replicas of one call. The k-th collective of every replica meets the k-th of the others;
a replica that calls another one there, skips it or raises fails the others clearly, never a hang. Outside a
replicated call, or with one replica, each is an identity."""

from __future__ import annotations

import builtins
import collections
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

from lightning_mgpu.parallel.replica_group import PeerFailedError, RendezvousError, ReplicaContext, current_replica
from lightning_mgpu.parallel.scatter_gather import move_to

_HINT = (
    "Every replica must call the same collectives (all_gather, reduce, broadcast, barrier) in the same order: "
    "branch on something every replica shares, not on one shard's values or size."
)


class CollectiveShapeError(RendezvousError):
    """The replicas passed a collective tensors whose shapes it cannot combine; raised in the replica(s) whose shape
    differs from the others' (they fail with :class:`PeerFailedError`, naming it)."""


_GATHER_SHAPES = (
    "all_gather concatenates the replicas' tensors along dim 0 (0-dim ones are stacked), so every dim but dim 0 must "
    "match, and all of them are 0-dim or none; dim 0 may differ (uneven shards)."
)
_SQUEEZED = (
    "A tensor that is 0-dim in some replicas only is often `.squeeze()` of a shard of one sample, which drops its "
    "batch dim: squeeze a named dim (`.squeeze(1)`) or keep `(len(x), ...)`."
)
_SHARD_SIZED = (
    "A size taken from the shard (its longest sequence, its count of something) differs by replica: pad to a size "
    "every replica shares, a fixed one or the largest (`self.trainer.strategy.reduce(torch.tensor(n), "
    "reduce_op='max')`)."
)
_REDUCE_SHAPES = (
    "reduce combines the replicas' tensors elementwise, so each must pass the same shape: reduce a per-shard value "
    "(`t.sum()`, with reduce_op='sum'), or gather per-sample values with `self.all_gather`."
)


def all_gather(tensor: Tensor, sync_grads: bool = False, *, sequential_hint: str = "") -> Tensor:
    """Every replica's ``tensor``, concatenated along dim 0 in replica order (0-dim: stacked), on this replica's
    device. A loss over it backpropagates into every replica's share, ``sync_grads`` or not: on one device
    ``all_gather`` is an identity, through which gradients flow (DDP detaches without ``sync_grads``)."""
    replica = _replica("all_gather", sequential_hint)
    if replica is None:
        return tensor
    return _meet(replica, "all_gather", tensor, _gather, _gather_refusals)


def reduce(tensor: Any, reduce_op: Any = "mean", *, sequential_hint: str = "") -> Any:
    """``tensor`` summed, averaged, or the elementwise max or min over the replicas (differentiable), on this
    replica's device; anything but a tensor is returned as it is, as Lightning's strategies do."""
    op = _op_name(reduce_op)
    replica = _replica("reduce", sequential_hint)
    if replica is None or not isinstance(tensor, Tensor):
        return tensor
    return _meet(
        replica,
        f"reduce({op})",
        tensor,
        lambda values, device: _REDUCTIONS[op](_stack(values, device), 0),
        _reduce_refusals,
    )


def broadcast(obj: Any, src: int = 0, *, sequential_hint: str = "") -> Any:
    """Replica ``src``'s ``obj`` in every replica (its tensors moved to each replica's device)."""
    replica = _replica("broadcast", sequential_hint)
    if replica is None:
        return obj
    if not 0 <= src < replica.group.size:
        raise ValueError(f"broadcast(src={src}): the source must be one of the {replica.group.size} replicas.")
    return _meet(replica, f"broadcast(src={src})", obj, lambda values, device: move_to(values[src], device))


def barrier(*, sequential_hint: str = "") -> None:
    """Wait until every replica reaches this point."""
    replica = _replica("barrier", sequential_hint)
    if replica is not None:
        _meet(replica, "barrier", None, lambda values, device: None)


def all_true(decision: bool, all: bool = True, *, sequential_hint: str = "") -> bool:
    """Whether every replica decided ``True`` (``all=True``) or any did (``all=False``)."""
    replica = _replica("reduce_boolean_decision", sequential_hint)
    if replica is None:
        return decision
    verdict = builtins.all if all else any
    return _meet(replica, f"reduce_boolean_decision(all={all})", bool(decision), lambda values, device: verdict(values))


def _replica(name: str, sequential_hint: str) -> ReplicaContext | None:
    replica = current_replica()
    if replica is None or replica.group.size < 2:
        return None
    replica.group.require_threads(name, sequential_hint or "Run the call with execution_mode=threads.")
    return replica


class _Refused:
    """What a replica gets from a collective that cannot combine the values: the error it raises, so that the replica
    at fault raises the error that names the cause, whichever replica arrived last and checked."""

    __slots__ = ("error",)

    def __init__(self, error: RendezvousError) -> None:
        self.error = error


Refusals = Callable[[str, list[Any]], "list[_Refused] | None"]


def _meet(
    replica: ReplicaContext,
    name: str,
    value: Any,
    combine: Callable[[list[Any], torch.device], Any],
    refusals: Refusals | None = None,
) -> Any:
    """Meet the other replicas; return ``combine(values in replica order, this replica's device)``, or raise what
    ``refusals(where, values)`` says each replica raises when the values cannot be combined."""
    call = replica.next_call("collective")
    label = f"collective {call} of this step"

    def checked(arrivals: list[tuple[str, Any]]) -> list[Any]:
        names, values = zip(*arrivals, strict=True)
        if len(set(names)) > 1:
            calls = ", ".join(f"replica {i}: {n}" for i, n in enumerate(names))
            raise RendezvousError(f"The replicas called different collectives as {label} ({calls}). {_HINT}")
        refused = refusals(f"{name} ({label})", list(values)) if refusals is not None else None
        return refused or [combine(list(values), device) for device in replica.group.devices]

    result = replica.group.rendezvous(
        replica.index, ("collective", call), (name, value), checked, f"{name} ({label})", _HINT
    )
    if isinstance(result, _Refused):
        raise result.error
    return result


def _differing(keys: list[Hashable]) -> list[int]:
    """The replicas whose key differs from the most common one (on a tie, the earliest replica's of those)."""
    counts = collections.Counter(keys)
    common = max(counts, key=lambda key: (counts[key], -keys.index(key)))
    return [i for i, key in enumerate(keys) if key != common]


def _shape_refusals(where: str, values: list[Tensor], keys: list[Hashable], why: str) -> list[_Refused] | None:
    """Each replica's error when ``keys`` (what of each replica's shape must match) differ; ``None`` when they match.
    The message names the collective, every replica's shape and the replica(s) that differ."""
    differing = _differing(keys)
    if not differing:
        return None
    shapes = ", ".join(f"replica {i}: {tuple(v.shape)}" for i, v in enumerate(values))
    which = f"replica {differing[0]}" if len(differing) == 1 else f"replicas {differing}"
    cause = (
        f"{where}: the replicas passed tensors whose shapes cannot be combined ({shapes}); {which} "
        f"differ{'s' if len(differing) == 1 else ''} from the others. {why}"
    )
    peer = f"{where}: {which} passed a tensor of another shape ({shapes}); its error is the one to read."
    errors = [CollectiveShapeError(cause) if i in differing else PeerFailedError(peer) for i in range(len(keys))]
    return [_Refused(error) for error in errors]


def _gather_refusals(where: str, values: list[Tensor]) -> list[_Refused] | None:
    """``all_gather``'s: all but dim 0 must match, and the number of dims (0-dim tensors are stacked)."""
    ranks = {v.dim() for v in values}
    why = f"{_GATHER_SHAPES} {_SQUEEZED if 0 in ranks and len(ranks) > 1 else _SHARD_SIZED}"
    return _shape_refusals(where, values, [(v.dim(), tuple(v.shape[1:])) for v in values], why)


def _reduce_refusals(where: str, values: list[Tensor]) -> list[_Refused] | None:
    """``reduce``'s: every shape must match (the replicas' tensors combine elementwise)."""
    return _shape_refusals(where, values, [tuple(v.shape) for v in values], _REDUCE_SHAPES)


def _stack(values: list[Tensor], device: torch.device) -> Tensor:
    return torch.stack([v.to(device) for v in values])


def _gather(values: list[Tensor], device: torch.device) -> Tensor:
    gathered = (
        _stack(values, device) if all(v.dim() == 0 for v in values) else torch.cat([v.to(device) for v in values])
    )
    _gathered.add(_place(gathered))
    return gathered


_gathered: set[tuple[Any, ...]] = set()  # where the all_gather results of the last replicated call lie


def _place(tensor: Tensor) -> tuple[Any, ...]:
    return tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)


def forget_gathered() -> None:
    """A new replicated call starts: the last one's ``all_gather`` results are no longer its replicas' outputs."""
    _gathered.clear()


def gathered_in_call() -> bool:
    """Whether the last replicated call gathered tensors (``all_gather``): its replicas may hold the whole batch."""
    return bool(_gathered)


def is_gathered(tensor: Tensor) -> bool:
    """Whether ``tensor`` (or a detached alias of it) is a result of an ``all_gather`` of the last replicated call:
    the whole batch, which one device returns once."""
    # Nothing gathered (every call without all_gather) reads no storage; meta tensors have no address.
    return bool(_gathered) and tensor.device.type != "meta" and _place(tensor) in _gathered


_REDUCTIONS = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}


def _op_name(reduce_op: Any) -> str:
    """``"mean"`` for ``"mean"``/``"avg"``/``ReduceOp.AVG``, and so on; an error naming the choices otherwise."""
    name = str(getattr(reduce_op, "name", reduce_op)).lower().rpartition(".")[2]
    name = {"avg": "mean"}.get(name, name)
    if name not in _REDUCTIONS:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported across replicas: use one of {tuple(_REDUCTIONS)}.")
    return name


def local_rows(size: int) -> slice:
    """The rows of an ``all_gather``-ed batch that this replica (or this DDP rank) holds, for a loss over one's own rows
    of a whole-batch matrix. A collective: every replica (every rank) must call it."""
    replica = _replica("local_rows", "")
    if replica is not None:
        sizes, index = _meet(replica, "local_rows", size, lambda values, device: values), replica.index
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        sizes, index = [None] * torch.distributed.get_world_size(), torch.distributed.get_rank()
        torch.distributed.all_gather_object(sizes, size)
    else:
        return slice(0, size)
    offset = sum(sizes[:index])
    return slice(offset, offset + size)
