"""How a scalar loss was normalised, read from its autograd record, and shard losses combined by it.

The top nodes' saved attributes (``_saved_*``: ``nll_loss``'s reduction, ignore index, weight and target, a mean's
element count, a divisor) say what each shard's loss divides by, so the shards' losses combine into the whole batch's
exactly: ``sum(w_i * l_i) / sum(w_i)`` per term, a sum for sums; differently normalised terms (MLM + NSP) are
recomputed from their saved tensors through the graph and weighted each by its own share (at most one term, which no
saved tensor recomputes, is the remainder of its loss).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import repeat
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mgpu.parallel.reduce import stack_scalars

Node = Any  # torch.autograd.graph.Node
#: Nodes that pass a scalar's gradient through unchanged (dtype casts under autocast, views of a scalar).
_PASS = frozenset(
    [f"{name}Backward0" for name in ("ToCopy", "Clone", "View", "ReshapeAlias", "UnsafeView", "Alias", "Squeeze")]
    + ["SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0"]
)
_MEANS = frozenset({"MeanBackward0", "MeanBackward1"})
_SUMS = frozenset({"SumBackward0", "SumBackward1"})
_PRODUCTS = frozenset({"MulBackward0", "MulBackward1"})
_QUOTIENTS = frozenset({"DivBackward0", "DivBackward1"})
_NLL = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})
_REDUCTION = {1: "mean", 2: "sum"}  # torch's Reduction enum as saved (0: none, no scalar)
_ONCE = " of the parameters"  # a reduction that may read the parameters alone
_is_tensor = Tensor.__instancecheck__  # isinstance(x, Tensor) in C: map() over it makes no Python frame


def _signed(value: int) -> int:
    """A saved integer as torch stores it, unsigned: -100 comes back as 2**64 - 100."""
    return value - 2**64 if value >= 2**63 else value


def count_targets(target: Tensor, weight: Tensor | None, ignore_index: int) -> Tensor:
    """What a class-index cross-entropy's mean divides by: its targets not ``ignore_index``, class-weighted."""
    kept = target != ignore_index
    return kept.sum() if weight is None else torch.where(kept, weight.double()[target.where(kept, 0)], 0).sum()


def _nll(node: Node) -> tuple[Tensor, Callable[[], Tensor]]:
    """The saved total weight has the input's dtype: exact in float32 and float64 means, rounded in half precision
    (bf16 reads 2736 for 2731), where the targets are counted instead. Saved tensors are read when needed only."""
    count, reduction = node._saved_total_weight, _REDUCTION[node._saved_reduction]
    if count.dtype not in (torch.float32, torch.float64) or reduction == "sum":
        count = count_targets(node._saved_target, node._saved_weight, _signed(node._saved_ignore_index))

    def value() -> Tensor:
        weight, ignore = node._saved_weight, _signed(node._saved_ignore_index)
        return F.nll_loss(node._saved_self, node._saved_target, weight, ignore_index=ignore, reduction=reduction)

    return count, value


def _elementwise(spec: tuple[Any, ...], node: Node) -> tuple[int, Callable[[], Tensor]]:
    (function, *options), reduction = spec, _REDUCTION[node._saved_reduction]
    inputs, target, kwargs = node._saved_self, node._saved_target, {o: getattr(node, f"_saved_{o}") for o in options}
    count = torch.broadcast_shapes(inputs.shape, target.shape).numel()
    return count, lambda: function(inputs, target, reduction=reduction, **kwargs)


#: The elementwise losses the reader knows, with the options their nodes save.
_ELEMENTWISE = {
    "MseLossBackward0": (F.mse_loss,),
    "HuberLossBackward0": (F.huber_loss, "delta"),
    "SmoothL1LossBackward0": (F.smooth_l1_loss, "beta"),
    "BinaryCrossEntropyBackward0": (F.binary_cross_entropy, "weight"),
    "BinaryCrossEntropyWithLogitsBackward0": (F.binary_cross_entropy_with_logits, "weight", "pos_weight"),
}
#: The loss nodes the reader knows: what their mean counts and how saved tensors recompute their value.
LOSS_NODES: dict[str, Callable[[Node], tuple[Any, Callable[[], Tensor]]]] = {
    **dict.fromkeys(_NLL, _nll),
    **{name: partial(_elementwise, spec) for name, spec in _ELEMENTWISE.items()},
}
#: Each node a term enters the loss at, in words (the rule said once).
TERM_WORDS = {
    **dict.fromkeys(_NLL, "cross_entropy / nll_loss over its counted targets"),
    **{name: f"{spec[0].__name__} over elements" for name, spec in _ELEMENTWISE.items()},
    **dict.fromkeys(_MEANS, ".mean() over elements"),
    **dict.fromkeys(_SUMS, ".sum()"),
    "sum / divisor": ".sum() / divisor",
}


@dataclass
class Term:
    """One additive part of a loss: its node, what its mean divides by (``None``: a sum), its coefficient, its value
    where saved tensors recompute it; for ``sum / divisor`` the summed size and whether a loss function summed."""

    node: Node
    name: str
    count: Any
    coefficient: Any = 1.0
    value: Callable[[], Tensor] | None = None
    summed: Any = None
    of_loss: bool = False
    scaled: bool = False  # reached through a product or quotient by a number (``ce * len(x)``, even where it is 1)

    def contribution(self, count: Any = None) -> Tensor | None:
        """The term's part of the loss, recomputed from saved tensors (through the graph where gradients are on);
        ``count``: the shard's, where a count of 0 must send no NaN back through the recomputed node."""
        if self.value is None:
            return None
        value = self.value()
        if count is not None and value.grad_fn is not None:
            value.grad_fn.register_hook(partial(_zero_where_empty, count))
        unit = isinstance(self.coefficient, (int, float)) and self.coefficient == 1
        return value if unit else value * self.coefficient


@dataclass
class LossRecord:
    """What a loss's graph says: its terms, or the first node it cannot explain (``unknown``)."""

    terms: list[Term] = field(default_factory=list)
    unknown: str | None = None
    samples: int | None = None  # the shard's sample count, where known: what data looks like in saved tensors
    _signature: tuple[str, ...] | None = field(default=None, repr=False, compare=False)

    def signature(self) -> tuple[str, ...]:
        """The record's shape: each term's node and whether it is a mean (kept until its terms change)."""
        if self._signature is None:
            self._signature = tuple(
                f"{t.name}{' scaled' * t.scaled}:{'sum' if t.count is None else 'mean'}" for t in self.terms
            )
        return self._signature


def read_loss(loss: Tensor, samples: int | None = None) -> LossRecord | None:
    """The record of a scalar ``loss``, or ``None`` when it has none (computed without autograd, or detached)."""
    if not isinstance(loss, Tensor) or loss.grad_fn is None or loss.numel() != 1:
        return None
    record = LossRecord(samples=samples)
    _walk(loss.grad_fn, 1.0, record)
    by_node: dict[int, Term] = {}
    for term in record.terms:  # a node reached twice (loss + 0.1 * loss) is one term: one share
        kept = by_node.setdefault(id(term.node), term)
        if kept is not term:
            kept.coefficient = kept.coefficient + term.coefficient
    record.terms = list(by_node.values())
    return record


def _walk(node: Node, coefficient: Any, record: LossRecord) -> None:
    """Add the terms below ``node`` (reached with ``coefficient``) to ``record``; note a node it cannot explain."""
    name = type(node).__name__
    children = [child for child, _ in node.next_functions]
    if name in LOSS_NODES and node._saved_reduction in _REDUCTION:
        count, value = LOSS_NODES[name](node)
        record.terms.append(Term(node, name, None if node._saved_reduction == 2 else count, coefficient, value))
    elif name in _MEANS or name in _SUMS:
        _reduction(node, name, children[0], coefficient, record)
    elif name in _PASS or name == "NegBackward0":
        _walk(children[0], -coefficient if name == "NegBackward0" else coefficient, record)
    elif name in ("AddBackward0", "SubBackward0"):
        alpha = node._saved_alpha * (-1 if name == "SubBackward0" else 1)
        for child, scale in zip(children, (1, alpha), strict=True):
            if child is not None:
                _walk(child, coefficient * scale, record)
    elif (name in _PRODUCTS or name in _QUOTIENTS) and _constant_other(node, children):
        _scaled(node, name in _QUOTIENTS, children[0], coefficient, record)
    else:
        record.unknown = record.unknown or name


def _scaled(node: Node, divides: bool, child: Node, coefficient: Any, record: LossRecord) -> None:
    """A product or quotient by a constant: a coefficient, or ``sum / divisor`` where a sum (of a tensor or a loss
    function's) lies below casts, signs and constant products (``0.5 * sse / n``): see :func:`settle_weights`."""
    other, below, factor = _as_written(node._saved_other), child, 1
    while divides:
        name = type(below).__name__
        children = [child for child, _ in below.next_functions]
        if name in _PASS or name == "NegBackward0":
            factor, below = -factor if name == "NegBackward0" else factor, children[0]
        elif name in _PRODUCTS and _constant_other(below, children):
            factor, below = factor * _as_written(below._saved_other), children[0]  # not through a division: its own
        else:
            break
    name = type(below).__name__
    if divides and name in _SUMS:
        size, value = int(torch.Size(below._saved_self_sym_sizes).numel()), None
    elif divides and name in LOSS_NODES and _REDUCTION.get(below._saved_reduction) == "sum":
        size, value = LOSS_NODES[name](below)
    else:
        first = len(record.terms)
        _walk(child, coefficient / other if divides else coefficient * other, record)
        for term in record.terms[first:]:  # their multiplier's reading is their own, kept across steps
            term.scaled = True
        return
    quotient = None if value is None else (lambda: value() / other)
    record.terms.append(Term(node, "sum / divisor", other, coefficient * factor, quotient, size, value is not None))


def _reduction(node: Node, name: str, child: Node, coefficient: Any, record: LossRecord) -> None:
    """``.mean()`` / ``.sum()``: over scalars (``torch.stack([a, b]).sum()``), its parts; of the parameters alone, a
    regulariser candidate; else a mean over its elements, or a sum."""
    sizes = torch.Size(node._saved_self_sym_sizes)
    parts = [part for part, _ in child.next_functions] if type(child).__name__ == "StackBackward0" else []
    # A scalar, or a view of one (loss.view(1)); another shape (1,) tensor is a batch of one (a shard of one sample).
    if len(sizes) == 0 or (sizes.numel() == 1 and type(child).__name__ in _PASS):
        _walk(child, coefficient, record)
    elif len(sizes) == 1 and len(parts) == sizes[0] and getattr(child, "_saved_dim", None) in (0, 2**64 - 1):
        for part in parts:
            if part is not None:
                _walk(part, coefficient / len(parts) if name in _MEANS else coefficient, record)
    elif _of_parameters(node, record.samples):
        record.terms.append(Term(node, f"{name}{_ONCE}", 1, coefficient))
    else:
        record.terms.append(Term(node, name, _own(node), coefficient))


def _of_parameters(node: Node, samples: int | None, limit: int = 256) -> bool:
    """Whether a reduction may read the parameters alone: its leaves are parameters and no node saves data (a tensor
    without gradient, of the shard's ``samples`` rows). Data also enters unsaved (``lin(x - mu)``): a candidate."""
    seen, stack = 0, [child for child, _ in node.next_functions]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if type(node).__name__ == "AccumulateGrad":
            if not isinstance(node.variable, nn.Parameter):
                return False  # an input that requires gradients (a PINN's coordinates)
            continue
        seen += 1
        if seen > limit or _saves_data(node, samples):
            return False
        stack.extend(child for child, _ in node.next_functions)
    return True


_SAVED: dict[type, list[str]] = {}  # each node type's saved attributes, listed once (dir() is slow)


def _saves_data(node: Node, samples: int | None) -> bool:
    names = _SAVED.get(type(node))
    if names is None:
        names = _SAVED[type(node)] = [a for a in dir(node) if a.startswith("_saved_")]
    for name in names:
        value = getattr(node, name)
        for tensor in value if isinstance(value, tuple) else (value,):
            data = isinstance(tensor, Tensor) and not tensor.requires_grad and tensor.dim() > 0
            if data and (samples is None or tensor.shape[0] == samples):
                return True
    return False


def _constant_other(node: Node, children: list[Node]) -> bool:
    other = node._saved_other
    return (len(children) < 2 or children[1] is None) and (not isinstance(other, Tensor) or other.numel() == 1)


_PROBES = {True: torch.zeros((), dtype=torch.float16), False: torch.zeros((), dtype=torch.int8)}


def _as_written(value: Any) -> Any:
    """A Python number the call was given, as written (``0.7`` is saved as float32's 0.699999988); tensors stay."""
    if not isinstance(value, Tensor) or value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
        return value
    probe = _PROBES[value.is_floating_point()]
    if torch.result_type(probe, value) != probe.dtype:  # the promotion alone, no kernel run
        return value  # a tensor: it takes part in type promotion, a Python number does not
    number = value.item()
    return float(repr(np.float32(number))) if value.dtype == torch.float32 else number


def _own(node: Node) -> int | None:
    """What a reduction divides by: a mean its elements, a sum nothing (``None``)."""
    return torch.Size(node._saved_self_sym_sizes).numel() if type(node).__name__ in _MEANS else None


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
    if first is None or not all(
        r is not None and not r.unknown and r.terms and r.signature() == first.signature() for r in records
    ):
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
        if any(map(_is_tensor, weights[t])) and not (term.name in _NLL and term.node._saved_weight is None):
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
    candidates = [t for t, term in enumerate(records[0].terms) if term.name.endswith(_ONCE)]
    if not (candidates or gathered):
        return
    missing = [t for t, term in enumerate(records[0].terms) if term.value is None]
    if candidates and not (candidates == missing and _alike(records, losses, missing, missing, True)):
        for t in candidates:  # read as what they are, on each shard
            weights[t] = [_own(record.terms[t].node) for record in records]
            for record in records:
                record.terms[t] = replace(record.terms[t], name=record.terms[t].name.removesuffix(_ONCE))
                record._signature = None
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
    :meth:`Term.contribution`); term ``rest`` the remainder of ``loss``, other unrecomputed terms 0."""
    values: list[Any] = [
        None if t == rest else torch.zeros(()) if term.value is None else term.contribution(guarded.get(t))
        for t, term in enumerate(record.terms)
    ]
    if rest is None:
        return values
    known = sum((v.to(loss.device, loss.dtype) for v in values if v is not None), torch.zeros((), device=loss.device))
    values[rest] = loss.reshape(()) - known
    return values


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


#: Nodes whose result mixes rows of the batch when they run on it in training: per-shard batch statistics.
_BATCH_STATISTICS = frozenset({"NativeBatchNormBackward0", "CudnnBatchNormBackward0", "MiopenBatchNormBackward0"})
#: Reductions that mix the rows they reduce over: any of them over the batch dimension couples samples.
_ACROSS = frozenset(
    f"{name}Backward{n}"
    for name in ("Logsumexp", "Std", "Var", "Max", "Min", "Amax", "Amin", "Median", "Nanmedian", "Sort", "Topk")
    for n in (0, 1)
)
_VIEWS = frozenset({"TBackward0", "PermuteBackward0", *_PASS})
#: Nonlinear functions of a scalar: of a reduction over the batch (``sqrt(mse)``), they are no mean of the shards'.
_NONLINEAR = frozenset(
    f"{name}Backward0" for name in ("Sqrt", "Rsqrt", "Exp", "Log", "Log1p", "Pow", "Reciprocal", "Sigmoid", "Tanh")
)


def _short(name: str) -> str:
    return name.removesuffix("Backward0").removesuffix("Backward1")


def coupling(loss: Tensor, samples: int, limit: int = 200_000) -> str | None:
    """What in ``loss``'s graph mixes the rows of a shard of ``samples`` samples (batch statistics, a batch-by-batch
    product, a reduction over the batch dimension before the loss), or ``None``: about a microsecond a node."""
    if loss.grad_fn is None or samples < 2:
        return None
    seen, stack = set(), [(loss.grad_fn, True, None)]
    while stack and len(seen) < limit:
        node, top, through = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found = _couples(node, samples, top) or (through and top and _of_batch(node, samples, through))
        if found:
            return found
        name = type(node).__name__
        below = top and name not in LOSS_NODES and name not in _MEANS and name not in _SUMS  # a term's own node
        children = [child for child, _ in node.next_functions]
        quotient = name in _QUOTIENTS and len(children) > 1 and children[1] is not None  # of two computed tensors
        through = through or (name if name in _NONLINEAR or quotient else None)
        stack.extend((child, below, through) for child in children)
    return None


def _of_batch(node: Node, samples: int, through: str) -> str | None:
    """A reduction over the batch (a loss function's, a mean or sum over the shard's rows) below ``through``."""
    name = type(node).__name__
    if name in LOSS_NODES or (
        name in _MEANS | _SUMS
        and (sizes := node._saved_self_sym_sizes)
        and sizes[0] == samples
        and not _of_parameters(node, samples)
    ):
        return (
            f"a nonlinear function ({_short(through)}) of a reduction over the batch ({_short(name)}), as RMSE or Dice"
        )
    return None


def _couples(node: Node, samples: int, top: bool) -> str | None:
    name = type(node).__name__
    if name in _BATCH_STATISTICS and getattr(node, "_saved_training", False):
        return "BatchNorm in training mode (each device normalises its shard with the shard's statistics)"
    if name == "MmBackward0":
        rows, cols, other = node._saved_self_sym_sizes[0], node._saved_mat2_sym_sizes[1], node.next_functions[1][0]
        while other is not None and type(other).__name__ in _VIEWS:  # linear's transposed weight: a layer
            other = other.next_functions[0][0]
        if rows == cols == samples and (other is None or type(other).__name__ != "AccumulateGrad"):
            return "a product of the batch with itself (similarities between samples, as in contrastive losses)"
    # At the loss's top, a mean or sum over a dimension is a term; below it, over the batch dimension, it couples.
    if name in _ACROSS or (name in ("MeanBackward1", "SumBackward1") and not top):
        sizes = node._saved_self_sym_sizes if hasattr(node, "_saved_self_sym_sizes") else node._saved_self.shape
        dim = getattr(node, "_saved_dim", None)  # none saved: a reduction over every element
        dims = [0] if dim is None else [_signed(d) % len(sizes) for d in (dim if isinstance(dim, tuple) else (dim,))]
        if sizes and sizes[0] == samples and 0 in dims and (len(sizes) > 1 or name in _ACROSS):
            return f"a reduction over the batch dimension ({_short(name)})"
    return None
