"""Shard losses combined into the whole batch's by their autograd records (:mod:`.loss_graph`).

Each term weighs by what its mean divides by: ``sum(w_i * l_i) / sum(w_i)``, a sum for sums. Differently normalised
terms (MLM + NSP) are recomputed from their saved tensors through the graph and weighted each by its own share (at
most one term, which no saved tensor recomputes, is the remainder of its loss). Numbers a shard divides or multiplies
by are read as counts or constants once the shards or earlier steps tell them apart.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import repeat
from typing import Any

import torch
from torch import Tensor

from lightning_mgpu.parallel.loss_graph import NLL, OF_PARAMETERS, LossRecord, own_count
from lightning_mgpu.parallel.reduce import stack_scalars

_is_tensor = Tensor.__instancecheck__  # isinstance(x, Tensor) in C: map() over it makes no Python frame


def settle_weights(
    records: Sequence[LossRecord], sample_counts: Sequence[int], memory: dict[Any, str] | None = None
) -> list[list[Any]]:
    """Per term, each shard's weight: what its mean divides by, ``None`` for a sum. A ``sum / divisor`` by a tensor
    (``mask.sum()``) is a mean; by a number or over a loss function's sum (``num_items_in_batch``) it is settled by
    :func:`_settle`, a shard's own count being its sample count, summed size or another term's count."""
    weights = [[record.terms[t].count for record in records] for t in range(len(records[0].terms))]
    for t, term in enumerate(records[0].terms):
        if term.summed is None or term.count is None or (any(map(_is_tensor, weights[t])) and not term.of_loss):
            continue  # not a division of a sum
        values = [float(d) for d in weights[t]]
        own = [[float(n) for n in sample_counts], [float(r.terms[t].summed) for r in records]] + [
            [float(w) for w in other]  # another term's count
            for o, other in enumerate(weights)
            if o != t and records[0].terms[o].summed is None and all(w is not None for w in other)
        ]
        key = (records[0].signature(), t, "divisor")
        if _settle(memory, key, len(set(values)) > 1, values in own, "count") == "constant":
            weights[t] = [None] * len(values)
    return weights


def _settle(memory: dict[Any, str] | None, key: Any, differs: bool, candidate: bool, reading: str) -> str:
    """What a number the shards divide or multiply by is: ``reading`` where it differs between shards, a constant where
    it is the same and not ``candidate`` (each shard's own count); else what an earlier step showed, or ``reading``,
    kept for the steps that cannot tell either (``ce * len(x)`` on shards of one sample)."""
    if differs or not candidate:
        decided = reading if differs else "constant"
        if memory is not None:
            memory[key] = decided
        return decided
    return memory.setdefault(key, reading) if memory is not None else reading


@dataclass
class Combined:
    """The whole batch's loss, and per term each shard's weight (``None`` in a sum term)."""

    loss: Tensor
    weights: list[list[Any]]


def term_totals(weights: list[list[Any]], root: torch.device) -> tuple[Tensor | None, ...]:
    """Per term, the whole batch's count (``None`` for a sum), from each shard's weight (:attr:`Combined.weights`)."""
    return tuple(
        None if any(w is None for w in term) else stack_scalars(term, root, torch.float64).sum() for term in weights
    )


def combine_losses_by_record(
    losses: Sequence[Tensor],
    records: Sequence[LossRecord | None],
    sample_counts: Sequence[int],
    root: torch.device,
    scale_gradients: bool = True,
    memory: dict[Any, str] | None = None,
    gathered: bool = False,
) -> Combined | None:
    """The whole batch's loss on ``root`` from the shards' losses and records; ``None`` where they do not say.
    ``scale_gradients``: the result carries the gradient (else a value only). Several terms are recomputed from their
    saved tensors, through the graph, and weighted each by its share. ``memory``: what numbers were read as, across
    steps; ``gathered``: the shards gathered each other's tensors, so a sum may be the whole batch's on each."""
    first = records[0]
    shape = first.signature() if first is not None else None
    if not all(r is not None and not r.unknown and r.terms and r.signature() == shape for r in records):
        return None
    weights = settle_weights(records, sample_counts, memory)
    _once_where_alike(records, losses, weights, gathered)
    guarded = _leave_out_empty_shards(records, weights) if scale_gradients else [{} for _ in records]
    dtype = torch.promote_types(losses[0].dtype, torch.float32)
    if len(weights) == 1 and not _multiplied(records, 0, memory):  # the common case, in few operations
        return Combined(_one_mean(_on(losses, root, dtype), weights[0], root, dtype), weights)
    shares = _shares(weights, records, sample_counts, memory, root, dtype)  # (terms, shards)
    if len(weights) == 1:
        return Combined(_weighted(_on(losses, root, dtype), shares[0]), weights)
    missing = [t for t, term in enumerate(first.terms) if any(r.terms[t].value is None for r in records)]
    if any(not torch.equal(shares[missing[0]], shares[t]) for t in missing[1:]):
        return None  # terms no saved tensor recomputes are one remainder, only where they share their weights
    rest = missing[0] if missing else None
    with torch.set_grad_enabled(scale_gradients):  # each term's gradient, through its recomputed value, times its share
        values = [_term_values(*shard, rest) for shard in zip(records, losses, guarded, strict=True)]
        total = _weighted(_on([shard[t] for t in range(len(weights)) for shard in values], root, dtype), shares)
    return Combined(total, weights)


def _one_mean(losses: Tensor, counts: list[Any], root: torch.device, dtype: torch.dtype) -> Tensor:
    """``sum(count_i * loss_i) / sum(count_i)``, a sum for sums; a shard that counts nothing (NaN) takes no part."""
    if any(map(operator.is_, counts, repeat(None))):
        return losses.sum()
    if not any(map(_is_tensor, counts)):
        total = float(sum(counts))
        shares = [c / total for c in counts]
        if all(shares):
            return torch.dot(losses, torch.tensor(shares, dtype=dtype, device=root))
    weights = _on(counts, root, dtype)
    return torch.dot(torch.where(weights > 0, losses, 0), weights) / weights.sum()


def _leave_out_empty_shards(records: Sequence[LossRecord], weights: list[list[Any]]) -> list[dict[int, Any]]:
    """A shard that counts nothing (0/0) would send NaN through its term's node in backward: 0 there instead
    (``nll_loss`` without class weights writes no gradient for ignored targets). Per shard, the terms guarded so and
    their counts, for the recomputed values' nodes."""
    guarded: list[dict[int, Any]] = [{} for _ in records]
    for t, term in enumerate(records[0].terms):
        if any(map(_is_tensor, weights[t])) and not (term.name in NLL and term.node._saved_weight is None):
            for record, count, shard in zip(records, weights[t], guarded, strict=True):
                record.terms[t].node.register_hook(partial(_zero_where_empty, count))
                shard[t] = count
    return guarded


def _zero_where_empty(count: Any, grad_inputs: tuple[Tensor | None, ...], _: Any) -> tuple[Tensor | None, ...]:
    return tuple(None if g is None else torch.where(torch.as_tensor(count).to(g.device) > 0, g, 0) for g in grad_inputs)


def _once_where_alike(
    records: Sequence[LossRecord], losses: Sequence[Tensor], weights: list[list[Any]], gathered: bool
) -> None:
    """A term every shard computes alike counts once (weight 1 on every shard), as on one device: reductions of the
    parameters alone (a regulariser; else read as what they are) and, after an ``all_gather``, sums (the whole
    batch's, as Barlow Twins' loss). Terms no saved tensor recomputes go together: their value is the remainder."""
    candidates = [t for t, term in enumerate(records[0].terms) if term.name.endswith(OF_PARAMETERS)]
    if not (candidates or gathered):
        return
    missing = [t for t, term in enumerate(records[0].terms) if term.value is None]
    if candidates and not (candidates == missing and _alike(records, losses, missing, missing, True)):
        for t in candidates:  # read as what they are, on each shard
            weights[t] = [own_count(record.terms[t].node) for record in records]
            for record in records:
                record.terms[t] = replace(record.terms[t], name=record.terms[t].name.removesuffix(OF_PARAMETERS))
    sums = [t for t in range(len(weights)) if gathered and all(w is None for w in weights[t])]
    groups = [[t] for t in sums if t not in missing] + ([missing] if missing and set(missing) <= set(sums) else [])
    for group in groups:
        if _alike(records, losses, group, missing, False):
            for t in group:
                weights[t] = [1] * len(records)


def _alike(
    records: Sequence[LossRecord], losses: Sequence[Tensor], group: list[int], missing: list[int], regulariser: bool
) -> bool:
    """Whether terms ``group``'s value is the same on every shard: within rounding of the loss where it is the
    remainder of the parameters' reductions (``regulariser``), else to 1e-12 of it and not 0 (a host sync)."""
    with torch.no_grad():
        values = [
            float(_term_values(r, x, {}, group[0] if group == missing else None)[group[0]])
            for r, x in zip(records, losses, strict=True)
        ]
    if regulariser:
        tolerance = 1e-9 * max(float(loss.detach().abs().max()) for loss in losses) + 1e-12
    else:
        tolerance = 1e-12 * max(map(abs, values))
    return (regulariser or tolerance > 0) and all(abs(v - values[0]) <= tolerance for v in values)


def _term_values(record: LossRecord, loss: Tensor, guarded: dict[int, Any], rest: int | None) -> list[Tensor]:
    """Each term's part of ``loss`` from saved tensors (``guarded``: term -> the shard's count, see
    :func:`_guarded`); term ``rest`` the remainder of ``loss``, other unrecomputed terms 0."""
    values: list[Any] = [
        None if t == rest else torch.zeros(()) if term.value is None else _guarded(term.contribution(), guarded.get(t))
        for t, term in enumerate(record.terms)
    ]
    if rest is None:
        return values
    known = sum((v.to(loss.device, loss.dtype) for v in values if v is not None), torch.zeros((), device=loss.device))
    values[rest] = loss.reshape(()) - known
    return values


def _guarded(value: Tensor, count: Any) -> Tensor:
    """A recomputed term whose shard may count nothing (``count`` 0) sends no NaN back through its node."""
    if count is not None and value.grad_fn is not None:
        value.grad_fn.register_hook(partial(_zero_where_empty, count))
    return value


def _on(values: Sequence[Any], root: torch.device, dtype: torch.dtype) -> Tensor:
    """Numbers and one-element tensors as one 1-D tensor on ``root``: one operation where they can."""
    if not any(map(_is_tensor, values)):
        return torch.tensor(values, dtype=dtype, device=root)
    try:  # one-element tensors on one device (the shards' losses on the root)
        return torch.stack(values).reshape(-1).to(root, dtype)
    except (RuntimeError, TypeError):  # numbers among them, other shapes or devices
        return stack_scalars(values, root, dtype)


def _weighted(values: Tensor, shares: Tensor) -> Tensor:
    """``sum(share * value)`` over as many of each; a shard of share 0 (a mean over nothing: NaN) takes no part."""
    shares = shares.reshape(-1)
    return torch.dot(torch.where(shares > 0, values, 0), shares)


def _shares(
    weights: list[list[Any]],
    records: Sequence[LossRecord],
    sample_counts: Sequence[int],
    memory: Any,
    root: torch.device,
    dtype: torch.dtype,
) -> Tensor:
    """Each term's (rows) share of each shard (columns): its count over the term's total (1 in a sum), times the
    whole batch's multiplier over the shard's where the shards multiply the term by a number."""
    sums = [any(w is None for w in term) for term in weights]
    counts = [1 if summed else w for term, summed in zip(weights, sums, strict=True) for w in term]
    counts = _on(counts, root, dtype).view(len(weights), -1)
    shares = torch.nan_to_num(counts / counts.sum(1, keepdim=True), nan=0.0)  # counts >= 0: NaN where all are 0
    if any(sums):
        shares[torch.tensor(sums, device=root)] = 1.0
    for t in range(len(weights)):
        if _multiplied(records, t, memory):  # each shard's number: settled by value
            coefficients = [record.terms[t].coefficient for record in records]
            key = (records[0].signature(), t, "multiplier")
            shares[t] = _by_multiplier(shares[t], coefficients, sample_counts, memory, key, sums[t])
    return shares


def _multiplied(records: Sequence[LossRecord], t: int, memory: dict[Any, str] | None) -> bool:
    """Whether the shards multiply term ``t`` by a number: one other than 1, or 1 where an earlier step read the number
    as a count (``loss * len(x)`` on shards of one sample each)."""
    if any(isinstance(c, Tensor) or c != 1 for c in (record.terms[t].coefficient for record in records)):
        return True
    return bool(memory) and memory.get((records[0].signature(), t, "multiplier"), "constant") != "constant"


def _by_multiplier(
    shares: Tensor, coefficients: list[Any], sample_counts: Sequence[int], memory: Any, key: Any, summed: bool
) -> Tensor:
    """A term's shares where the shards multiply it by the inverse of their sample count (``sse / len(x)``), by a
    count (``loss * len(x)``) or a constant. A mean times the same number on every shard is no mean over the batch
    (``(ce_a + ce_b) / 2`` on shards of 2) unless the numbers differ."""
    values = [float(c) for c in coefficients]
    counts = [float(n) for n in sample_counts]
    products = [v * n for v, n in zip(values, counts, strict=True)]
    inverse = all(abs(x - products[0]) <= 1e-9 * abs(products[0]) for x in products)
    differs = len(set(values)) > 1
    if inverse and (differs or (products[0] == 1 and summed)):  # a sum over the shard times 1 / its count: a mean
        reading = _settle(memory, key, differs, True, "inverse")
    else:
        reading = _settle(memory, key, differs, values == counts, "count")
    if reading == "inverse":
        return shares * torch.tensor(counts, device=shares.device, dtype=shares.dtype) / sum(counts)
    if reading == "constant":
        return shares
    factors = torch.tensor(values, device=shares.device, dtype=shares.dtype)
    return torch.where(factors != 0, shares * factors.sum() / factors, 0)
