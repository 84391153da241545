"""Collectives across the replicas of one call: the k-th collective of every replica meets the k-th of the others
(one that calls another one there, skips it or raises fails the others clearly, never a hang), then each replica
combines every replica's value on its own device. Outside a replicated call, or with one replica: identities."""

from __future__ import annotations

import builtins
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_mgpu.parallel.replica_group import PeerFailedError, RendezvousError, current_replica
from lightning_mgpu.parallel.scatter_gather import move_to

_HINT = (
    "Every replica must call the same collectives (all_gather, reduce, broadcast, barrier) in the same order: "
    "branch on something every replica shares, not on one shard's values or size."
)
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
_REDUCTIONS = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}


class CollectiveShapeError(RendezvousError):
    """The replicas passed a collective tensors whose shapes it cannot combine; raised in the replica(s) whose shape
    differs from the others' (they fail with :class:`PeerFailedError`, naming it)."""


class _Met(NamedTuple):
    values: list[Any]  # every replica's value
    index: int  # this replica's
    device: torch.device  # this replica's
    where: str  # the collective, as errors name it


def _meet(name: str, value: Any, sequential_hint: str) -> _Met | None:
    """Meet the other replicas at this replica's next collective (``name``); None outside a replicated call."""
    replica = current_replica()
    if replica is None or replica.group.size < 2:
        return None
    group, index, call = replica.group, replica.index, replica.next_call("collective")
    where, site = f"{name} (collective {call} of this step)", ("collective", call, name)
    values = group.rendezvous(index, site, value, lambda vs: [vs] * len(vs), where, _HINT, sequential_hint)
    return _Met(values, index, group.devices[index], where)


def _check_shapes(met: _Met, keys: list[Any], why: str) -> None:
    """Raise when ``keys`` (what of each replica's shape must match) differ: CollectiveShapeError, saying ``why``, in
    each replica whose key is not the most common one (on a tie, the earliest replica's); PeerFailedError in others."""
    common = max(keys, key=keys.count)
    differing = [i for i, key in enumerate(keys) if key != common]
    if not differing:
        return
    shapes = ", ".join(f"replica {i}: {tuple(v.shape)}" for i, v in enumerate(met.values))
    which = f"replica {differing[0]}" if len(differing) == 1 else f"replicas {differing}"
    if met.index not in differing:
        raise PeerFailedError(
            f"{met.where}: {which} passed a tensor of another shape ({shapes}); its error is the one to read."
        )
    raise CollectiveShapeError(
        f"{met.where}: the replicas passed tensors whose shapes cannot be combined ({shapes}); {which} "
        f"differ{'s' if len(differing) == 1 else ''} from the others. {why}"
    )


def all_gather(tensor: Tensor, sync_grads: bool = False, *, sequential_hint: str = "") -> Tensor:
    """Every replica's ``tensor``, concatenated along dim 0 in replica order (0-dim: stacked), on this replica's
    device. A loss over it backpropagates into every replica's share, ``sync_grads`` or not: on one device
    ``all_gather`` is an identity, through which gradients flow (DDP detaches without ``sync_grads``)."""
    met = _meet("all_gather", tensor, sequential_hint)
    if met is None:
        return tensor
    ranks = {v.dim() for v in met.values}
    why = f"{_GATHER_SHAPES} {_SQUEEZED if 0 in ranks and len(ranks) > 1 else _SHARD_SIZED}"
    _check_shapes(met, [(v.dim(), v.shape[1:]) for v in met.values], why)
    parts = [v.to(met.device) for v in met.values]
    gathered = torch.stack(parts) if ranks == {0} else torch.cat(parts)
    _gathered.add(_place(gathered))
    return gathered


def reduce(tensor: Any, reduce_op: Any = "mean", *, sequential_hint: str = "") -> Any:
    """``tensor`` summed, averaged, or the elementwise max or min over the replicas (differentiable), on this
    replica's device; anything but a tensor is returned as it is, as Lightning's strategies do."""
    op = str(getattr(reduce_op, "name", reduce_op)).lower().rpartition(".")[2]  # "avg", "ReduceOp.AVG", ...
    op = {"avg": "mean"}.get(op, op)
    if op not in _REDUCTIONS:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported across replicas: use one of {tuple(_REDUCTIONS)}.")
    met = _meet(f"reduce({op})", tensor, sequential_hint) if isinstance(tensor, Tensor) else None
    if met is None:
        return tensor
    _check_shapes(met, [v.shape for v in met.values], _REDUCE_SHAPES)
    return _REDUCTIONS[op](torch.stack([v.to(met.device) for v in met.values]), 0)


def broadcast(obj: Any, src: int = 0, *, sequential_hint: str = "") -> Any:
    """Replica ``src``'s ``obj`` in every replica (its tensors moved to each replica's device)."""
    met = _meet(f"broadcast(src={src})", obj, sequential_hint)
    if met is None:
        return obj
    if not 0 <= src < len(met.values):
        raise ValueError(f"broadcast(src={src}): the source must be one of the {len(met.values)} replicas.")
    return move_to(met.values[src], met.device)


def barrier(*, sequential_hint: str = "") -> None:
    """Wait until every replica reaches this point."""
    _meet("barrier", None, sequential_hint)


def all_true(decision: bool, all: bool = True, *, sequential_hint: str = "") -> bool:
    """Whether every replica decided ``True`` (``all=True``) or any did (``all=False``)."""
    met = _meet(f"reduce_boolean_decision(all={all})", bool(decision), sequential_hint)
    return decision if met is None else (builtins.all if all else any)(met.values)


def local_rows(size: int) -> slice:
    """The rows of an ``all_gather``-ed batch that this replica (or this DDP rank) holds, for a loss over one's own rows
    of a whole-batch matrix. A collective: every replica (every rank) must call it."""
    met = _meet("local_rows", size, "")
    if met is not None:
        sizes, index = met.values, met.index
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        sizes, index = [None] * torch.distributed.get_world_size(), torch.distributed.get_rank()
        torch.distributed.all_gather_object(sizes, size)
    else:
        return slice(0, size)
    offset = sum(sizes[:index])
    return slice(offset, offset + size)


# Where the all_gather results of the last replicated call lie: the whole batch, which a step may return once.
_gathered: set[tuple[Any, ...]] = set()
forget_gathered = _gathered.clear  # a new replicated call starts


def _place(tensor: Tensor) -> tuple[Any, ...]:
    return tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)


def gathered_in_call() -> bool:
    """Whether the last replicated call gathered tensors (``all_gather``): its replicas may hold the whole batch."""
    return bool(_gathered)


def is_gathered(tensor: Tensor) -> bool:
    """Whether ``tensor`` (or a detached alias of it) is a result of an ``all_gather`` of the last replicated call."""
    # Nothing gathered (every call without all_gather) reads no storage; meta tensors have no address.
    return bool(_gathered) and tensor.device.type != "meta" and _place(tensor) in _gathered
