"""How a scalar loss was normalised, read from its own autograd record, and shard losses combined by it.

torch's loss functions and reductions keep their arguments on the loss's graph as saved attributes (``_saved_*``):
``nll_loss``'s reduction, ignore index, class weight and target, a mean's element count, a division's divisor. Read
after the step ran and before backward, they say what each shard's loss divides by, so the shards' losses combine
into the whole batch's exactly: ``sum(w_i * l_i) / sum(w_i)`` per term, a plain sum for sums. Nothing is run again
and no source is read. A loss adding differently normalised terms (MLM over tokens + NSP over sequences) gets one
gradient scale per term through a pre-hook on the term's node (``torch.autograd.graph.Node.register_prehook``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
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
    [
        "ToCopyBackward0",
        "CloneBackward0",
        "ViewBackward0",
        "ReshapeAliasBackward0",
        "UnsafeViewBackward0",
        "AliasBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "UnsqueezeBackward0",
    ]
)
_MEANS = frozenset({"MeanBackward0", "MeanBackward1"})
_SCALINGS = frozenset({"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1"})
_ONCE = " of the parameters"  # a reduction that may read the parameters alone
_SUMS = frozenset({"SumBackward0", "SumBackward1"})
_REDUCTION = {1: "mean", 2: "sum"}  # torch's Reduction enum as saved (0: none)
_NLL = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})
_is_tensor = Tensor.__instancecheck__  # isinstance(x, Tensor) in C: map() over it makes no Python frame


def _signed(value: int) -> int:
    """A saved integer as torch stores it, unsigned: -100 comes back as 2**64 - 100."""
    return value - 2**64 if value >= 2**63 else value


def count_targets(target: Tensor, weight: Tensor | None, ignore_index: int) -> Tensor:
    """What a class-index cross-entropy's mean divides by: its targets that are not ``ignore_index``, each counted by
    its class weight where there are weights."""
    kept = target != ignore_index
    return kept.sum() if weight is None else torch.where(kept, weight.double()[target.where(kept, 0)], 0).sum()


def _nll(node: Node) -> tuple[Tensor, Callable[[], Tensor]]:
    target, weight, ignore = node._saved_target, node._saved_weight, _signed(node._saved_ignore_index)
    inputs = node._saved_self
    # The saved total weight is what the mean divided by, in the input's dtype: exact in float32 and float64 (no
    # operation to count), rounded in half precision (bf16 reads 2736 for 2731): there, counted from the targets.
    exact = inputs.dtype in (torch.float32, torch.float64) and node._saved_reduction == 1
    count = node._saved_total_weight if exact else count_targets(target, weight, ignore)
    reduction = _REDUCTION[node._saved_reduction]
    return count, lambda: F.nll_loss(inputs, target, weight, ignore_index=ignore, reduction=reduction)


def _elementwise(function: Callable[..., Tensor], *options: str) -> Callable[[Node], tuple[int, Any]]:
    def read(node: Node) -> tuple[int, Callable[[], Tensor]]:
        inputs, target = node._saved_self, node._saved_target
        kwargs = {name: getattr(node, f"_saved_{name}") for name in options}
        count = torch.broadcast_shapes(inputs.shape, target.shape).numel()
        return count, lambda: function(inputs, target, reduction=_REDUCTION[node._saved_reduction], **kwargs)

    return read


#: The loss nodes the reader knows: what their mean counts and how their value is recomputed from saved tensors.
LOSS_NODES: dict[str, Callable[[Node], tuple[Any, Callable[[], Tensor]]]] = {
    "NllLossBackward0": _nll,
    "NllLoss2DBackward0": _nll,
    "MseLossBackward0": _elementwise(F.mse_loss),
    "HuberLossBackward0": _elementwise(F.huber_loss, "delta"),
    "SmoothL1LossBackward0": _elementwise(F.smooth_l1_loss, "beta"),
    "BinaryCrossEntropyBackward0": _elementwise(F.binary_cross_entropy, "weight"),
    "BinaryCrossEntropyWithLogitsBackward0": _elementwise(F.binary_cross_entropy_with_logits, "weight", "pos_weight"),
}


@dataclass
class Term:
    """One additive part of a loss: the node where it enters the loss, what its mean divides by (``None``: a sum),
    its value times its coefficient when saved tensors recompute it, and for ``sum / divisor`` what settles whether
    the divisor is a count or a constant (the summed tensor's size)."""

    node: Node
    name: str
    count: Any
    coefficient: Any = 1.0
    value: Callable[[], Tensor] | None = None
    summed: Any = None
    of_loss: bool = False  # the sum is a loss function's reduction="sum" (its divisor may be the whole batch's count)

    def contribution(self) -> Tensor | None:
        if self.value is None:
            return None
        unit = isinstance(self.coefficient, (int, float)) and self.coefficient == 1
        return self.value() if unit else self.value() * self.coefficient


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
            self._signature = tuple(f"{t.name}:{'sum' if t.count is None else 'mean'}" for t in self.terms)
        return self._signature


def read_loss(loss: Tensor, samples: int | None = None) -> LossRecord | None:
    """The record of a scalar ``loss``, or ``None`` when it has none (computed without autograd, or detached)."""
    if not isinstance(loss, Tensor) or loss.grad_fn is None or loss.numel() != 1:
        return None
    record = LossRecord(samples=samples)
    _walk(loss.grad_fn, 1.0, record)
    by_node: dict[int, Term] = {}
    for term in record.terms:  # a node reached twice (loss + 0.1 * loss) is one term: one gradient scale
        if id(term.node) in by_node:
            by_node[id(term.node)].coefficient = by_node[id(term.node)].coefficient + term.coefficient
        else:
            by_node[id(term.node)] = term
    record.terms = list(by_node.values())
    return record


def _walk(node: Node, coefficient: Any, record: LossRecord) -> None:
    """Add the terms below ``node`` (reached with ``coefficient``) to ``record``; note a node it cannot explain."""
    name = type(node).__name__
    children = [child for child, _ in node.next_functions]
    if name in LOSS_NODES:
        _loss_term(node, name, coefficient, record)
    elif name in _MEANS or name in _SUMS:
        _reduction_term(node, name, coefficient, record)
    elif name in _PASS or name == "NegBackward0":
        _walk(children[0], -coefficient if name == "NegBackward0" else coefficient, record)
    elif name in ("AddBackward0", "SubBackward0"):
        alpha = node._saved_alpha * (-1 if name == "SubBackward0" else 1)
        for child, scale in zip(children, (1, alpha), strict=True):
            if child is not None:
                _walk(child, coefficient * scale, record)
    elif name in _SCALINGS and _constant_other(node, children):
        _scaled(node, name, children[0], coefficient, record)
    else:
        record.unknown = record.unknown or name


def _loss_term(node: Node, name: str, coefficient: Any, record: LossRecord) -> None:
    """A loss function's output: a mean over what it counts, or a sum (``reduction="none"`` is no scalar)."""
    if node._saved_reduction not in _REDUCTION:
        record.unknown = record.unknown or name
        return
    count, value = LOSS_NODES[name](node)
    sums = _REDUCTION[node._saved_reduction] == "sum"
    record.terms.append(Term(node, name, None if sums else count, coefficient, value))


def _reduction_term(node: Node, name: str, coefficient: Any, record: LossRecord) -> None:
    """``.mean()`` / ``.sum()``: over scalars, their parts; of the parameters alone, a regulariser candidate (counted
    once if alike on every shard); else a mean over its elements, or a sum."""
    if _over_scalars(node, coefficient, record):
        return  # loss.mean() of a scalar, torch.stack(losses).sum(): the parts are the terms
    if _of_parameters(node, record.samples):
        record.terms.append(Term(node, f"{name}{_ONCE}", 1, coefficient))
    else:
        count = torch.Size(node._saved_self_sym_sizes).numel() if name in _MEANS else None
        record.terms.append(Term(node, name, count, coefficient))


def _scaled(node: Node, name: str, child: Node, coefficient: Any, record: LossRecord) -> None:
    """A product or quotient by a constant: a coefficient, or ``sum / divisor`` (a mean over a count, or a sum over
    a constant, settled across shards)."""
    other = _as_written(node._saved_other)
    divides = name.startswith("Div")
    summed = _summed(child) if divides else None
    if summed is None:
        _walk(child, coefficient / other if divides else coefficient * other, record)
        return
    size, value, factor = summed
    quotient = None if value is None else (lambda: value() / other)
    record.terms.append(Term(node, "sum / divisor", other, coefficient * factor, quotient, size, value is not None))


def _of_parameters(node: Node, samples: int | None, limit: int = 256) -> bool:
    """Whether a reduction may read the parameters alone (a weight regulariser, ``sum(p.pow(2).sum() for p in
    ...)``): every leaf it reaches is an ``nn.Parameter`` and nothing it saves is data (a tensor without gradient whose
    first dimension is the shard's ``samples``; any such tensor where that count is unknown). A candidate only: data
    also enters unsaved (``lin(x - mu)``), so :func:`combine_losses_by_record` counts it once only where every
    shard's value is the same."""
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


_SAVED: dict[type, list[str]] = {}  # each node type's saved attributes, listed once


def _saves_data(node: Node, samples: int | None) -> bool:
    """Whether a node saves data: a tensor without gradient, batch-shaped where the shard's size is known."""
    names = _SAVED.get(type(node))
    if names is None:  # listed once per node type (dir() is slow), not at every step
        names = _SAVED[type(node)] = [a for a in dir(node) if a.startswith("_saved_")]
    for name in names:
        value = getattr(node, name)
        for tensor in value if isinstance(value, tuple) else (value,):
            data = isinstance(tensor, Tensor) and not tensor.requires_grad and tensor.dim() > 0
            if data and (samples is None or tensor.shape[0] == samples):
                return True
    return False


def _constant_other(node: Node, children: list[Node]) -> bool:
    """A product or quotient by a value with no gradient: a number, or a one-element tensor (a count, a weight)."""
    other = node._saved_other
    return (len(children) < 2 or children[1] is None) and (not isinstance(other, Tensor) or other.numel() == 1)


_PROBES = {True: torch.zeros((), dtype=torch.float16), False: torch.zeros((), dtype=torch.int8)}


def _as_written(value: Any) -> Any:
    """A Python number the call was given (torch saves it as a 0-dim tensor that promotes as a scalar, a float in the
    default dtype) as that number: ``0.7`` comes back as float32's 0.699999988, which would shift a logged value.
    Tensors (a count such as ``mask.sum()``) stay tensors."""
    if not isinstance(value, Tensor) or value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
        return value
    probe = _PROBES[value.is_floating_point()]
    if torch.result_type(probe, value) != probe.dtype:  # the promotion alone, no kernel run
        return value  # a tensor: it takes part in type promotion, a Python number does not
    number = value.item()
    return float(repr(np.float32(number))) if value.dtype == torch.float32 else number


def _summed(node: Node) -> tuple[Any, Callable[[], Tensor] | None, Any] | None:
    """What a sum (reached through casts, sign changes and constant products: ``0.5 * sse / n``) adds up: how many
    values, for a loss function's ``reduction="sum"`` its recomputed value (a ``transformers`` loss over
    ``num_items_in_batch``), and the factor on the way; ``None``: no sum."""
    factor: Any = 1
    while True:
        name = type(node).__name__
        children = [child for child, _ in node.next_functions]
        if name in _PASS:
            node = children[0]
        elif name == "NegBackward0":
            factor, node = -factor, children[0]
        elif name in ("MulBackward0", "MulBackward1") and _constant_other(node, children):
            factor, node = factor * _as_written(node._saved_other), children[0]  # not through a division: its own
        else:
            break
    if name in _SUMS:
        return int(torch.Size(node._saved_self_sym_sizes).numel()), None, factor
    if name in LOSS_NODES and _REDUCTION.get(node._saved_reduction) == "sum":
        count, value = LOSS_NODES[name](node)
        return count, value, factor
    return None


def _over_scalars(node: Node, coefficient: Any, record: LossRecord) -> bool:
    """A sum or mean over one value, or over stacked scalars (``loss.mean()``, ``torch.stack([a, b]).sum()``): walk
    the parts instead, a mean's divided by their number. ``False`` for a reduction over more than scalars."""
    sizes = torch.Size(node._saved_self_sym_sizes)
    child = node.next_functions[0][0]
    # A scalar, or a view of one (loss.view(1)); another shape (1,) tensor is a batch of one (a shard of one sample).
    if len(sizes) == 0 or (sizes.numel() == 1 and type(child).__name__ in _PASS):
        _walk(child, coefficient, record)
        return True
    parts = [part for part, _ in child.next_functions] if type(child).__name__ == "StackBackward0" else []
    if len(sizes) != 1 or len(parts) != sizes[0] or getattr(child, "_saved_dim", None) not in (0, 2**64 - 1):
        return False
    share = coefficient / len(parts) if type(node).__name__ in _MEANS else coefficient
    for part in parts:
        if part is not None:
            _walk(part, share, record)
    return True


def settle_weights(
    records: Sequence[LossRecord], sample_counts: Sequence[int], memory: dict[Any, str] | None = None
) -> list[list[Any]]:
    """Per term, each shard's weight: what its mean divides by, or ``None`` for a sum. In ``sum / divisor``, a tensor
    dividing a plain sum (``mask.sum()``) is a count. Otherwise (a Python number, or a tensor dividing a loss
    function's sum, as ``num_items_in_batch`` does) the divisor is a count where it differs between shards, a
    constant where it is the same on every shard and no shard's own count (the whole batch's ``num_items_in_batch``,
    ``sum() / 4``); where it is the same on every shard and each shard's own count (sample count, summed size,
    another term's count), what an earlier step showed (``memory``, kept by the caller), else a count."""
    weights = [[record.terms[t].count for record in records] for t in range(len(records[0].terms))]
    for t, term in enumerate(records[0].terms):
        tensors = any(map(_is_tensor, weights[t]))
        if term.summed is None or term.count is None or (tensors and not term.of_loss):
            continue  # not a division of a sum
        values = [float(d) for d in weights[t]]
        others = [
            [float(w) for w in other]
            for o, other in enumerate(weights)
            if o != t and records[0].terms[o].summed is None and all(w is not None for w in other)
        ]
        own = (
            values == [float(n) for n in sample_counts]
            or all(v == float(r.terms[t].summed) for v, r in zip(values, records, strict=True))
            or values in others
        )
        seen = _settle(memory, (records[0].signature(), t, "divisor"), len(set(values)) > 1, own, "count")
        if seen == "constant":
            weights[t] = [None] * len(values)
    return weights


def _settle(memory: dict[Any, str] | None, key: Any, differs: bool, candidate: bool, reading: str) -> str:
    """What a number that shards divide or multiply by is: ``reading`` (a count, its inverse) where it differs
    between shards, a constant where it is the same on every shard and not ``candidate``; where it is the same and
    ``candidate`` (equal to each shard's count: ``/ len(x)`` or ``/ 5.0`` on shards of 5), what an earlier step of
    the run showed, else ``reading``."""
    if differs or not candidate:
        decided = reading if differs else "constant"
        if memory is not None:
            memory[key] = decided
        return decided
    return memory.get(key, reading) if memory is not None else reading


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
    """The whole batch's loss on ``root`` from the shards' ``losses`` and their records, or ``None`` when the
    records do not say (no record, a node the reader does not know, shards whose losses were built differently,
    several terms whose values no saved tensor recomputes). One term: the shards' losses weighted by their shares.
    Several: the weighted value, with a gradient scale per term and shard (``scale_gradients``; else a value only).
    ``memory`` keeps, across steps, what each number a loss divides or multiplies by was read as. ``gathered``: the
    shards gathered each other's tensors in this step (``all_gather``), so a sum may be the whole batch's on every
    shard. A few tensor operations in all, whatever the number of terms and shards: no host sync (but one where a
    term reads the parameters alone, or sums after a gather)."""
    if not _alike(records):
        return None
    weights = settle_weights(records, sample_counts, memory)
    _once_where_alike(records, losses, weights)
    if gathered:
        _whole_batch_sums_once(records, losses, weights)
    dtype = torch.promote_types(losses[0].dtype, torch.float32)
    stacked = _on(losses, root, dtype)
    if len(weights) == 1 and all(r.terms[0].coefficient == 1 for r in records) and _mean_safe(records[0], weights[0]):
        return Combined(_one_mean(stacked, weights[0], root, dtype), weights)  # the common case, in few operations
    shares = _shares(weights, records, sample_counts, root, dtype, memory)  # (terms, shards)
    if scale_gradients:
        _leave_out_empty_shards(records, weights, shares)
    if len(weights) == 1:
        return Combined(_weighted(stacked, shares[0]), weights)
    possible, rest = _remainder(records, shares)
    if not possible:
        return None
    values = [_term_values(record, loss, rest) for record, loss in zip(records, losses, strict=True)]
    total = _weighted(_on([v for shard in values for v in shard], root, dtype).view(len(losses), -1).T, shares)
    if not scale_gradients:
        return Combined(total, weights)
    each = iter(shares.flatten().unbind())  # term by term, shard by shard: one view per share
    for t in range(len(weights)):
        for record in records:
            record.terms[t].node.register_prehook(_scaled_by(next(each)))
    # The value is the total; the shards' losses carry each term's scaled gradient (a NaN over nothing included).
    return Combined(total.detach() + _GradientOnly.apply(stacked.sum()), weights)


def _mean_safe(record: LossRecord, counts: list[Any]) -> bool:
    """Whether a one-term loss combines as a plain weighted mean: a sum, numbers, or ``nll_loss``'s counts without
    class weights (an empty shard's NaN gradient is no concern there, see :func:`_leave_out_empty_shards`)."""
    term = record.terms[0]
    plain = not any(map(_is_tensor, counts))
    return plain or (term.name in _NLL and term.node._saved_weight is None)


def _one_mean(losses: Tensor, counts: list[Any], root: torch.device, dtype: torch.dtype) -> Tensor:
    """One term's whole-batch value: ``sum(count_i * loss_i) / sum(count_i)`` (a sum where ``counts`` are
    ``None``); a shard that counts nothing (its mean is NaN) takes no part."""
    if any(map(operator.is_, counts, repeat(None))):
        return losses.sum()
    if not any(map(_is_tensor, counts)):
        total = float(sum(counts))
        shares = [c / total for c in counts]
        if all(shares):
            return torch.dot(losses, torch.tensor(shares, dtype=dtype, device=root))
    weights = _on(counts, root, dtype)
    return torch.dot(torch.where(weights > 0, losses, 0), weights) / weights.sum()


def _leave_out_empty_shards(records: Sequence[LossRecord], weights: list[list[Any]], shares: Tensor) -> None:
    """A shard whose count is 0 (no target in its part of a token mean: 0/0) takes no part in backward: its term's
    node divides a gradient of 0 by that 0, and the NaN would poison the parameters, which one device never sees. The
    node's gradients are replaced by 0 there, in backward: no host sync. (``nll_loss`` without class weights writes
    no gradient for ignored targets: it needs none.)"""
    for t, term in enumerate(weights):
        if not any(map(_is_tensor, term)) or (
            records[0].terms[t].name in _NLL and records[0].terms[t].node._saved_weight is None
        ):
            continue
        for record, share in zip(records, shares[t].unbind(), strict=True):
            record.terms[t].node.register_hook(_zero_where_empty(share))


def _zero_where_empty(share: Tensor) -> Callable[[tuple[Tensor | None, ...], Any], tuple[Tensor | None, ...]]:
    def hook(grad_inputs: tuple[Tensor | None, ...], _: Any) -> tuple[Tensor | None, ...]:
        return tuple(None if g is None else torch.where(share.to(g.device) > 0, g, 0) for g in grad_inputs)

    return hook


def _once_where_alike(records: Sequence[LossRecord], losses: Sequence[Tensor], weights: list[list[Any]]) -> None:
    """Reductions that may read the parameters alone count once (weight 1 on every shard: their mean) only where
    every shard's value of them is the same, as a regulariser's is; else they are read as what they are (a sum, a
    mean over their elements). Their joint value is each shard's remainder: one comparison (a host sync) a step."""
    candidates = [t for t, term in enumerate(records[0].terms) if term.name.endswith(_ONCE)]
    if not candidates:
        return
    missing = [t for t, term in enumerate(records[0].terms) if term.value is None]
    alike = False
    if missing == candidates:
        rest = [_term_values(r, loss, candidates[0])[candidates[0]] for r, loss in zip(records, losses, strict=True)]
        scale = max(float(loss.detach().abs().max()) for loss in losses)
        alike = all(abs(float(r) - float(rest[0])) <= 1e-9 * scale + 1e-12 for r in rest[1:])
    if alike:
        return
    for t in candidates:  # read as what they are, on each shard
        weights[t] = [_own_count(record.terms[t].node) for record in records]
        for record in records:
            record.terms[t] = replace(record.terms[t], name=record.terms[t].name.removesuffix(_ONCE))
            record._signature = None


def _whole_batch_sums_once(records: Sequence[LossRecord], losses: Sequence[Tensor], weights: list[list[Any]]) -> None:
    """After an ``all_gather``, a sum whose value is the same on every shard is the whole batch's, computed by each
    (Barlow Twins' loss over the gathered cross-correlation): counted once (weight 1 on every shard: their mean), as
    one device computes it once. A sum over each shard's own rows differs between shards and stays a sum."""
    sums = [t for t in range(len(weights)) if all(w is None for w in weights[t])]
    missing = [t for t, term in enumerate(records[0].terms) if term.value is None]
    # Terms no saved tensor recomputes go together (their joint value is the remainder): only if all are sums.
    groups = [[t] for t in sums if t not in missing] + ([missing] if missing and set(missing) <= set(sums) else [])
    for group in groups:
        rest = group[0] if group == missing else None
        values = [_term_values(r, loss, rest)[group[0]] for r, loss in zip(records, losses, strict=True)]
        scale = max(abs(float(v)) for v in values)
        if scale > 0 and all(abs(float(v) - float(values[0])) <= 1e-12 * scale for v in values[1:]):
            for t in group:
                weights[t] = [1] * len(values)


def _own_count(node: Node) -> int | None:
    """What a reduction divides by: a mean its elements, a sum nothing (``None``)."""
    return torch.Size(node._saved_self_sym_sizes).numel() if type(node).__name__ in _MEANS else None


class _GradientOnly(torch.autograd.Function):
    """0 in value, the identity in backward: carries gradients beside a value computed apart."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return torch.zeros_like(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def _on(values: Sequence[Any], root: torch.device, dtype: torch.dtype) -> Tensor:
    """Numbers and one-element tensors as one 1-D tensor on ``root`` in ``dtype``: one operation where they are
    numbers, or scalars on ``root`` already (a copy per other device met)."""
    if not any(map(_is_tensor, values)):
        return torch.tensor(values, dtype=dtype, device=root)
    try:  # one-element tensors on one device (the shards' losses on the root): one stack
        return torch.stack(values).reshape(-1).to(root, dtype)
    except (RuntimeError, TypeError):  # numbers among them, other shapes or devices: each moved first
        return torch.stack([torch.as_tensor(v).to(root).reshape(()) for v in values]).to(dtype)


def _weighted(values: Tensor, shares: Tensor) -> Tensor:
    """``sum(share * value)``; a shard of share 0 (a mean over nothing: NaN) takes no part."""
    return torch.where(shares > 0, values, 0).mul(shares).sum()


def _alike(records: Sequence[LossRecord | None]) -> bool:
    """Whether every shard's record explains its loss, term by term as the others'."""
    first = records[0]
    return first is not None and all(
        r is not None and not r.unknown and r.terms and r.signature() == first.signature() for r in records
    )


def _shares(
    weights: list[list[Any]],
    records: Sequence[LossRecord],
    sample_counts: Sequence[int],
    root: torch.device,
    dtype: torch.dtype,
    memory: dict[Any, str] | None = None,
) -> Tensor:
    """Each term's (rows) share of each shard (columns): its count over the term's total (1 in a sum), times the
    whole batch's multiplier over the shard's where the term is multiplied by a count (``criterion(...) * len(y)``:
    one device multiplies by the whole batch's)."""
    shares = _all_shares(weights, root, dtype)
    for t in range(len(weights)):
        coefficients = [record.terms[t].coefficient for record in records]
        if any(isinstance(c, Tensor) or c != 1 for c in coefficients):  # each shard's number: settled by value
            key = (records[0].signature(), t, "multiplier")
            summed = any(w is None for w in weights[t])
            shares[t] = _by_multiplier(shares[t], coefficients, sample_counts, memory, key, summed)
    return shares


def _all_shares(weights: list[list[Any]], root: torch.device, dtype: torch.dtype) -> Tensor:
    """Each term's (rows) share of each shard (columns), in a few operations where every term is a mean."""
    if len(weights) > 1 and not any(w is None for term in weights for w in term):
        counts = _on([w for term in weights for w in term], root, dtype).view(len(weights), -1)
        return torch.nan_to_num(counts / counts.sum(1, keepdim=True), nan=0.0)  # counts >= 0: NaN where all are 0
    rows = [_term_shares(term, root, dtype) for term in weights]
    return rows[0][None] if len(rows) == 1 else torch.stack(rows)


def _term_shares(weights: list[Any], root: torch.device, dtype: torch.dtype) -> Tensor:
    """One term's share of each shard: its count over the term's total (0 where it counts nothing), 1 in a sum."""
    if any(w is None for w in weights):
        return torch.ones(len(weights), dtype=dtype, device=root)
    if not any(map(_is_tensor, weights)):
        total = float(sum(weights))
        return torch.tensor([w / total if w > 0 else 0.0 for w in weights], dtype=dtype, device=root)
    counts = _on(weights, root, dtype)
    return torch.nan_to_num(counts / counts.sum(), nan=0.0)  # counts are >= 0: NaN only where all are 0


def _by_multiplier(
    shares: Tensor,
    coefficients: list[Any],
    sample_counts: Sequence[int],
    memory: dict[Any, str] | None,
    key: Any,
    summed: bool,
) -> Tensor:
    """A term's shares where the shards multiply it by a number: by the inverse of each shard's sample count
    (``sse * (1 / len(x))``, ``(bce + kld) / len(x)``: a mean over the batch), by a count (``loss * len(x)``: the
    whole batch's over the shard's), or a constant (see :func:`_settle`). A mean (not ``summed``) multiplied by the
    same number on every shard is not read as divided by a count (``(ce_a + ce_b) / 2`` on shards of 2 averages two
    means), unless the numbers differ between shards."""
    values = [float(c) for c in coefficients]
    counts = [float(n) for n in sample_counts]
    products = [v * n for v, n in zip(values, counts, strict=True)]
    inverse = all(abs(x - products[0]) <= 1e-9 * abs(products[0]) for x in products)
    differs = len(set(values)) > 1
    if inverse and (differs or products[0] == 1):
        reading = _settle(memory, key, differs, products[0] == 1 and summed, "inverse")
    else:
        reading = _settle(memory, key, differs, values == counts, "count")
    if reading == "inverse":
        return shares * torch.tensor(counts, device=shares.device, dtype=shares.dtype) / sum(counts)
    if reading == "constant":
        return shares
    factors = torch.tensor(values, device=shares.device, dtype=shares.dtype)
    return torch.where(factors != 0, shares * factors.sum() / factors, 0)


def _term_values(record: LossRecord, loss: Tensor, rest: int | None) -> list[Tensor]:
    """Each term's part of ``loss``, recomputed from saved tensors; term ``rest`` is the remainder (with every other
    term no saved tensor recomputes, which the caller has checked share its weights), those others 0."""
    values: list[Any] = [
        None if t == rest else torch.zeros(()) if term.value is None else term.contribution().detach()
        for t, term in enumerate(record.terms)
    ]
    if rest is None:
        return values
    known = sum((v.to(loss.device, loss.dtype) for v in values if v is not None), torch.zeros((), device=loss.device))
    values[rest] = loss.detach().reshape(()) - known
    return values


def _remainder(records: Sequence[LossRecord], shares: Tensor) -> tuple[bool, int | None]:
    """Whether the terms' values can be had, and the term whose value is the remainder: the one no saved tensor
    recomputes (several such terms must share their weights, as a regulariser's parts do), or ``None`` when every
    term is recomputed (a term over nothing, NaN on its shard, then stays out of the others)."""
    missing = [t for t, term in enumerate(records[0].terms) if any(r.terms[t].value is None for r in records)]
    if not missing:
        return True, None
    return all(torch.equal(shares[missing[0]], shares[t]) for t in missing[1:]), missing[0]


def _scaled_by(share: Tensor) -> Callable[[tuple[Tensor | None, ...]], tuple[Tensor | None, ...]]:
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        return tuple(None if g is None else g * share.to(g.device, g.dtype) for g in grad_outputs)

    return hook


#: Nodes whose result mixes rows of the batch when they run on it in training: per-shard batch statistics.
_BATCH_STATISTICS = frozenset({"NativeBatchNormBackward0", "CudnnBatchNormBackward0", "MiopenBatchNormBackward0"})
#: Reductions that mix the rows they reduce over: any of them over the batch dimension couples samples.
_ACROSS = frozenset(
    f"{name}Backward{n}"
    for name in ("Logsumexp", "Std", "Var", "Max", "Min", "Amax", "Amin", "Median", "Nanmedian", "Sort", "Topk")
    for n in (0, 1)
)
_TERMS_OVER_DIM = frozenset({"MeanBackward1", "SumBackward1"})  # at the loss's top they are its terms


def coupling(loss: Tensor, samples: int, limit: int = 200_000) -> str | None:
    """What in ``loss``'s graph mixes the rows of a shard of ``samples`` samples, or ``None``: BatchNorm's batch
    statistics, a batch-by-batch product (in-batch negatives), a reduction over the batch dimension before the
    loss. Reading only, about a microsecond a node; meant for the first steps and when the rule changes."""
    if loss.grad_fn is None or samples < 2:
        return None
    seen, stack = set(), [(loss.grad_fn, True)]
    while stack and len(seen) < limit:
        node, top = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found = _couples(node, samples, top)
        if found is not None:
            return found
        name = type(node).__name__
        below = top and name not in LOSS_NODES and name not in _MEANS and name not in _SUMS
        stack.extend((child, below) for child, _ in node.next_functions)
    return None


def _couples(node: Node, samples: int, top: bool) -> str | None:
    name = type(node).__name__
    if name in _BATCH_STATISTICS and getattr(node, "_saved_training", False):
        return "BatchNorm in training mode (each device normalises its shard with the shard's statistics)"
    if name == "MmBackward0":
        rows, cols = node._saved_self_sym_sizes[0], node._saved_mat2_sym_sizes[1]
        if rows == cols == samples and not _is_parameter(node.next_functions[1][0]):
            return "a product of the batch with itself (similarities between samples, as in contrastive losses)"
    if name in _ACROSS or (name in _TERMS_OVER_DIM and not top):
        sizes = node._saved_self_sym_sizes if hasattr(node, "_saved_self_sym_sizes") else node._saved_self.shape
        dim = getattr(node, "_saved_dim", None)  # none saved: a reduction over every element
        dims = [0] if dim is None else [_signed(d) % len(sizes) for d in (dim if isinstance(dim, tuple) else (dim,))]
        if sizes and sizes[0] == samples and 0 in dims and (len(sizes) > 1 or name in _ACROSS):
            return f"a reduction over the batch dimension ({name.removesuffix('Backward0').removesuffix('Backward1')})"
    return None


def _is_parameter(node: Node) -> bool:
    """Whether a node reaches a leaf (a parameter) through views only: ``linear``'s transposed weight."""
    while node is not None and type(node).__name__ in ("TBackward0", "PermuteBackward0", "ViewBackward0", *_PASS):
        node = node.next_functions[0][0]
    return node is not None and type(node).__name__ == "AccumulateGrad"
