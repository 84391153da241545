"""How a scalar loss was normalised, read from its autograd record.

The top nodes' saved attributes (``_saved_*``: ``nll_loss``'s reduction, ignore index, weight and target, a mean's
element count, a divisor) say what each shard's loss divides by: :func:`read_loss` returns its terms, each with its
count and, where saved tensors recompute it, its value (:mod:`.loss_combine` combines the shards' losses by them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

Node = Any  # torch.autograd.graph.Node
#: Nodes that pass a scalar's gradient through unchanged (dtype casts under autocast, views of a scalar).
PASS = frozenset(
    [f"{name}Backward0" for name in ("ToCopy", "Clone", "View", "ReshapeAlias", "UnsafeView", "Alias", "Squeeze")]
    + ["SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0"]
)
MEANS = frozenset({"MeanBackward0", "MeanBackward1"})
SUMS = frozenset({"SumBackward0", "SumBackward1"})
_PRODUCTS = frozenset({"MulBackward0", "MulBackward1"})
QUOTIENTS = frozenset({"DivBackward0", "DivBackward1"})
NLL = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})
_REDUCTION = {1: "mean", 2: "sum"}  # torch's Reduction enum as saved (0: none, no scalar)
OF_PARAMETERS = " of the parameters"  # a reduction that may read the parameters alone


def signed(value: int) -> int:
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
        count = count_targets(node._saved_target, node._saved_weight, signed(node._saved_ignore_index))

    def value() -> Tensor:
        weight, ignore = node._saved_weight, signed(node._saved_ignore_index)
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
    **dict.fromkeys(NLL, _nll),
    **{name: partial(_elementwise, spec) for name, spec in _ELEMENTWISE.items()},
}
#: Each node a term enters the loss at, in words (the rule said once).
TERM_WORDS = {
    **dict.fromkeys(NLL, "cross_entropy / nll_loss over its counted targets"),
    **{name: f"{spec[0].__name__} over elements" for name, spec in _ELEMENTWISE.items()},
    **dict.fromkeys(MEANS, ".mean() over elements"),
    **dict.fromkeys(SUMS, ".sum()"),
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

    def contribution(self) -> Tensor | None:
        """The term's part of the loss, recomputed from saved tensors (through the graph where gradients are on)."""
        if self.value is None:
            return None
        value = self.value()
        unit = isinstance(self.coefficient, (int, float)) and self.coefficient == 1
        return value if unit else value * self.coefficient


@dataclass
class LossRecord:
    """What a loss's graph says: its terms, or the first node it cannot explain (``unknown``)."""

    terms: list[Term] = field(default_factory=list)
    unknown: str | None = None
    samples: int | None = None  # the shard's sample count, where known: what data looks like in saved tensors

    def signature(self) -> tuple[str, ...]:
        """The record's shape: each term's node and whether it is a mean."""
        return tuple(f"{t.name}{' scaled' * t.scaled}:{'sum' if t.count is None else 'mean'}" for t in self.terms)


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
    elif name in MEANS or name in SUMS:
        _reduction(node, name, children[0], coefficient, record)
    elif name in PASS or name == "NegBackward0":
        _walk(children[0], -coefficient if name == "NegBackward0" else coefficient, record)
    elif name in ("AddBackward0", "SubBackward0"):
        alpha = node._saved_alpha * (-1 if name == "SubBackward0" else 1)
        for child, scale in zip(children, (1, alpha), strict=True):
            if child is not None:
                _walk(child, coefficient * scale, record)
    elif (name in _PRODUCTS or name in QUOTIENTS) and _constant_other(node, children):
        _scaled(node, name in QUOTIENTS, children[0], coefficient, record)
    else:
        record.unknown = record.unknown or name


def _scaled(node: Node, divides: bool, child: Node, coefficient: Any, record: LossRecord) -> None:
    """A product or quotient by a constant: a coefficient, or ``sum / divisor`` where a sum (of a tensor or a loss
    function's) lies below casts, signs and constant products (``0.5 * sse / n``): see :func:`settle_weights`."""
    other, below, factor = _as_written(node._saved_other), child, 1
    while divides:
        name = type(below).__name__
        children = [child for child, _ in below.next_functions]
        if name in PASS or name == "NegBackward0":
            factor, below = -factor if name == "NegBackward0" else factor, children[0]
        elif name in _PRODUCTS and _constant_other(below, children):
            factor, below = factor * _as_written(below._saved_other), children[0]  # not through a division: its own
        else:
            break
    name = type(below).__name__
    if divides and name in SUMS:
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
    if len(sizes) == 0 or (sizes.numel() == 1 and type(child).__name__ in PASS):
        _walk(child, coefficient, record)
    elif len(sizes) == 1 and len(parts) == sizes[0] and getattr(child, "_saved_dim", None) in (0, 2**64 - 1):
        for part in parts:
            if part is not None:
                _walk(part, coefficient / len(parts) if name in MEANS else coefficient, record)
    elif of_parameters(node, record.samples):
        record.terms.append(Term(node, f"{name}{OF_PARAMETERS}", 1, coefficient))
    else:
        record.terms.append(Term(node, name, own_count(node), coefficient))


def of_parameters(node: Node, samples: int | None, limit: int = 256) -> bool:
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


def own_count(node: Node) -> int | None:
    """What a reduction divides by: a mean its elements, a sum nothing (``None``)."""
    return torch.Size(node._saved_self_sym_sizes).numel() if type(node).__name__ in MEANS else None
