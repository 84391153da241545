"""What evaluation's loss calls divide by, read from their own arguments while they run.

Evaluation runs without autograd, so its losses carry no graph for :mod:`.loss_graph`: :class:`LossCalls` (a
``TorchFunctionMode``) notes each output of torch's functional losses with what its mean divides by, as a
:class:`.loss_graph.LossRecord`. Every call runs once, as written: the mode only reads.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_mgpu.parallel.loss_combine import combine_losses_by_record
from lightning_mgpu.parallel.loss_graph import LossRecord, Term, count_targets, read_loss


def _class_loss_count(bound: dict[str, Any]) -> Any:
    inputs, target = bound["input"], bound["target"]
    if target.is_floating_point():  # probabilities: a mean over samples (and positions)
        return inputs.numel() // inputs.shape[1] if inputs.dim() > 1 else 1
    return count_targets(target, bound.get("weight"), bound.get("ignore_index", -100))


def _elements(bound: dict[str, Any]) -> int:
    return torch.broadcast_shapes(bound["input"].shape, bound["target"].shape).numel()


_ELEMENTWISE = (F.mse_loss, F.l1_loss, F.huber_loss, F.smooth_l1_loss, F.binary_cross_entropy, F.kl_div)
#: The functional losses whose calls evaluation records, and what their mean divides by, from their arguments.
_CALL_COUNTS: dict[Any, Callable[[dict[str, Any]], Any]] = {
    **dict.fromkeys((F.cross_entropy, F.nll_loss), _class_loss_count),
    **dict.fromkeys((*_ELEMENTWISE, F.binary_cross_entropy_with_logits), _elements),
    # ctc_loss: a mean over samples of each one's loss over its target length
    F.ctc_loss: lambda bound: bound["log_probs"].shape[1] if bound["log_probs"].dim() == 3 else 1,
}
_SIGNS = {"add": 1, "__add__": 1, "__radd__": 1, "sub": -1, "__sub__": -1}
_SCALES = {"mul": 1, "__mul__": 1, "__rmul__": 1, "div": -1, "__truediv__": -1}
#: Operations that leave a scalar loss what it was (casts, copies, views), and a sign change.
_SAME = frozenset({"detach", "clone", "contiguous", "to", "float", "double", "half", "bfloat16", "squeeze", "view"})
_NEGATE = frozenset({"neg", "__neg__", "negative"})
_CALL_NAMES = frozenset(function.__name__ for function in _CALL_COUNTS)
_UNFOLLOWED = "_lightning_mgpu_unfollowed"  # set on a scalar made from a loss call by an operation not followed


_signature = functools.cache(inspect.signature)  # read once per loss function, not at every call


_IN_PLACE_OPERATORS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor")
) | {"__setitem__"}


def _in_place(name: str) -> bool:
    """Whether torch's function ``name`` changes its first argument in place (``add_``, ``__iadd__``)."""
    return name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))


class LossCalls(TorchFunctionMode):
    """Records, while active, the outputs of torch's functional losses with what their mean divides by, and sums and
    scalings of them (``mlm + nsp``, ``0.5 * loss``), as :class:`LossRecord` s."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[int, tuple[Tensor, LossRecord]] = {}
        self.stacks: dict[int, tuple[Tensor, list[LossRecord]]] = {}  # torch.stack of recorded losses

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        changed = self.record_of(args[0]) if args and _in_place(name) else None
        if changed is not None:
            del self.records[id(args[0])]  # changed in place (loss += reg): no longer what was recorded
        output = func(*args, **kwargs)
        if name == "stack" and args and isinstance(args[0], (list, tuple)) and not kwargs.get("dim"):
            records = [self.record_of(part) for part in args[0]]
            if records and None not in records:
                self.stacks[id(output)] = (output, records)
        if isinstance(output, Tensor) and output.dim() == 0 and not kwargs.get("out"):
            record = None if changed else self._record(func, name, args, kwargs, output)
            if record is not None:
                self.records[id(output)] = (output, record)
            elif args:
                self._note_unfollowed(name, args[:2], changed, output)
        return output

    def _note_unfollowed(self, name: str, args: tuple[Any, ...], changed: LossRecord | None, output: Tensor) -> None:
        """Marks a scalar made from a loss call by an operation not followed (``loss.sqrt()``, ``loss *= 2``): its
        logged value merges per sample, said once (:func:`unfollowed`)."""
        earlier = next(filter(None, map(unfollowed, args)), None)
        inputs = (changed, *map(self.record_of, args))
        if earlier or any(r is not None and any(map(_of_call, r.terms)) for r in inputs):
            setattr(output, _UNFOLLOWED, earlier or name)

    def _record(self, func: Any, name: str, args: tuple[Any, ...], kwargs: Any, output: Tensor) -> LossRecord | None:
        if func in _CALL_COUNTS:
            return self._loss_call(func, args, kwargs, output)
        if name in _SAME or name in _NEGATE:  # loss.detach(), -loss
            record = self.record_of(args[0]) if len(args) == 1 or name in ("to", "view") else None
            sign = -1 if name in _NEGATE else 1
            return record and LossRecord([replace(t, coefficient=t.coefficient * sign) for t in record.terms])
        return self._reduction(name, args, kwargs, output) or self._combined(func, args, kwargs, output)

    def _loss_call(self, func: Any, args: tuple[Any, ...], kwargs: Any, output: Tensor) -> LossRecord | None:
        bound = _signature(func).bind(*args, **kwargs).arguments
        reduction = bound.get("reduction", "mean")
        if reduction not in ("mean", "sum", "batchmean"):
            return None
        if reduction == "batchmean":  # kl_div's mean over samples
            count = bound["input"].shape[0] if bound["input"].dim() > 0 else 1
        else:
            count = _CALL_COUNTS[func](bound)
        sums = reduction == "sum"  # a sum, or a part of one over a count it is divided by (num_items_in_batch)
        term = Term(None, func.__name__, None if sums else count, 1.0, lambda: output, count if sums else None, sums)
        return LossRecord([term])

    def _reduction(self, name: str, args: tuple[Any, ...], kwargs: Any, output: Tensor) -> LossRecord | None:
        """``x.sum()`` / ``x.mean()`` over every element: a sum (its size kept, for a division) or a mean."""
        if name not in ("sum", "mean") or len(args) != 1 or kwargs or not isinstance(args[0], Tensor):
            return None
        if not args[0].is_floating_point() or unfollowed(args[0]):  # a count (mask.sum()), or what is not followed
            return None
        if self.record_of(args[0]) is not None:  # loss.mean() of a scalar
            return self.record_of(args[0])
        stacked = self.stacks.get(id(args[0]))
        if stacked is not None and stacked[0] is args[0]:  # torch.stack(losses).sum() / .mean()
            share = 1 / len(stacked[1]) if name == "mean" else 1
            return LossRecord([replace(t, coefficient=t.coefficient * share) for r in stacked[1] for t in r.terms])
        sums, size = name == "sum", args[0].numel()
        return LossRecord([Term(None, name, None if sums else size, 1.0, lambda: output, size if sums else None)])

    def _combined(self, func: Any, args: tuple[Any, ...], kwargs: Any, output: Tensor) -> LossRecord | None:
        """A sum, difference, product or quotient of recorded losses and numbers; a sum divided by a count is a mean
        over it (``(l * mask).sum() / mask.sum()``)."""
        name = getattr(func, "__name__", "")
        if len(args) != 2 or (name not in _SIGNS and name not in _SCALES):
            return None
        records = [self.record_of(arg) for arg in args]
        if name in _SIGNS and any(isinstance(arg, (int, float)) and arg == 0 for arg in args):
            return records[0] or records[1]  # sum(losses) starts from 0
        if name in _SIGNS and None not in records:  # two losses: their terms
            sign = (_SIGNS[name] if name != "__radd__" else 1) * kwargs.get("alpha", 1)  # torch.add(a, b, alpha=)
            second = [replace(t, coefficient=t.coefficient * sign) for t in records[1].terms]
            return LossRecord([*records[0].terms, *second])
        scale = args[1] if records[0] is not None else args[0]
        record = records[0] if records[0] is not None else records[1]
        if record is None or name not in _SCALES or (_SCALES[name] < 0 and records[0] is None):
            return None
        if isinstance(scale, Tensor) and (
            scale.dim() != 0 or (_SCALES[name] > 0 and self.record_of(scale)) or unfollowed(scale)
        ):
            return None  # a divisor may be recorded itself: mask.sum()
        (first, *others) = record.terms
        if _SCALES[name] < 0 and not others and first.count is None and first.summed is not None:
            return LossRecord([replace(first, name="sum / divisor", count=scale, value=lambda: output)])
        if _SCALES[name] < 0:
            return LossRecord([replace(t, coefficient=t.coefficient / scale) for t in record.terms])
        # A product's terms get their own name: what steps show of its number is not taken for the loss alone's.
        return LossRecord([replace(t, name=_scaled(t.name), coefficient=_product(t, scale)) for t in record.terms])

    def record_of(self, value: Any) -> LossRecord | None:
        """The record of ``value`` if it is a recorded loss (the same object), else ``None``."""
        found = self.records.get(id(value))
        return found[1] if found is not None and found[0] is value else None


def _scaled(name: str) -> str:
    return name if name.endswith(" * n") else f"{name} * n"


def _product(term: Term, scale: Any) -> Any:
    """A term's coefficient times ``scale``; a product of 1 (``ce * len(x)`` on shards of one sample) as a tensor, read
    as a number the shards multiply by, as other products are (a number 1 is a term's own)."""
    product = term.coefficient * scale
    return torch.ones((), dtype=torch.float64) if not isinstance(product, Tensor) and product == 1 else product


def _of_call(term: Term) -> bool:
    """Whether ``term`` comes from a functional loss call (not a ``.sum()`` or ``.mean()`` of other values)."""
    return term.of_loss or term.name.partition(" ")[0] in _CALL_NAMES


def unfollowed(value: Any) -> str | None:
    """The operation that made ``value`` from a loss call where :class:`LossCalls` does not follow it, else ``None``."""
    return getattr(value, _UNFOLLOWED, None) if isinstance(value, Tensor) else None


def once_per_shard_alike(records: list[LossRecord]) -> None:
    """In evaluation, a sum every shard computes alike (a regulariser of the weights) counts once, as on one device
    (a data sum equal on every shard to the last bit is a coincidence this accepts)."""
    for t, term in enumerate(records[0].terms):
        if term.count is None and len(records) > 1:
            values = [record.terms[t].contribution() for record in records]
            if all(torch.equal(values[0], value) for value in values[1:]):
                for record in records:
                    record.terms[t] = replace(record.terms[t], count=1, summed=None)


#: Layers with a fast path only while no torch function mode is active: reading loss calls would change their outputs.
FAST_PATH_LAYERS = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerEncoder)


def can_read_calls(module: torch.nn.Module) -> bool:
    """Whether evaluation may read ``module``'s loss calls without changing what its layers compute."""
    return not any(isinstance(layer, FAST_PATH_LAYERS) for layer in module.modules())


def combine_by_record(
    losses: list[Any], calls: Sequence[LossCalls | None], sizes: list[int], root: torch.device, memory: Any = None
) -> Tensor | None:
    """The whole batch's loss on ``root`` from the replicas' ``losses`` by their autograd records or, without one,
    their loss calls; ``None`` where they do not say (:func:`.loss_combine.combine_losses_by_record`)."""
    graphs = [getattr(loss, "grad_fn", None) is not None for loss in losses]
    records = [
        read_loss(loss, n) if graph else c and c.record_of(loss)
        for loss, graph, c, n in zip(losses, graphs, calls, sizes, strict=True)
    ]
    if not any(graphs) and all(record is not None for record in records):
        once_per_shard_alike(records)  # a regulariser every replica computes alike counts once
    combined = combine_losses_by_record(losses, records, sizes, root, all(graphs), memory)
    return None if combined is None else combined.loss
