"""Combine what the replicas' ``*_step`` methods returned into what one device would have returned.

A training step may return ``"loss_weight"`` (the count its mean loss averages over) or ``"loss_terms"`` (``{name:
(term_loss, weight)}``, each term reduced with its own weights); both are consumed here, at every device count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mgpu.parallel.merge import merge_outputs
from lightning_mgpu.parallel.reduce import as_float_weights, reduce_losses, stack_scalars, weighted_mean

LOSS_WEIGHT_KEY = "loss_weight"
LOSS_TERMS_KEY = "loss_terms"


def all_or_none(outputs: Sequence[Any], hook: str) -> bool:
    """True when every replica returned ``None``; raise when only some did (the step would be half-skipped)."""
    skipped = [i for i, output in enumerate(outputs) if output is None]
    if skipped and len(skipped) < len(outputs):
        raise RuntimeError(
            f"`{hook}` returned None on replica(s) {skipped} but not on the others. Skip a batch on every replica "
            "(e.g. based on `batch_idx`), or on none."
        )
    return bool(skipped)


def same_tensor(value: Any, loss: Any) -> bool:
    """Whether a logged ``value`` is the tensor ``loss``: itself, a view sharing its autograd node, or
    ``loss.detach()`` (its storage, offset and shape; the step's outputs keep ``loss`` alive)."""
    if value is loss:
        return True
    if not isinstance(value, Tensor) or not isinstance(loss, Tensor):
        return False
    if value.grad_fn is not None:
        return value.grad_fn is loss.grad_fn
    return (
        value.layout == loss.layout == torch.strided
        and value.untyped_storage().data_ptr() == loss.untyped_storage().data_ptr()
        and (value.storage_offset(), value.shape) == (loss.storage_offset(), loss.shape)
    )


def declared_copy(values: Sequence[Any], outputs: Sequence[Any], root: torch.device) -> Tensor | None:
    """The replicas' logged ``values`` merged as the loss they are, where the step declares its weights: the loss
    by ``loss_weight``, the total of ``loss_terms`` term by term, a term by its weight; ``None`` otherwise."""
    if not isinstance(outputs[0], Mapping):  # replica 0 declares nothing
        return None
    found = [_declared_pairs(value, output) for value, output in zip(values, outputs, strict=True)]
    if None in found or len({len(pairs) for pairs in found}) > 1:
        return None
    dtype = torch.promote_types(values[0].dtype, torch.float32)
    return sum(
        weighted_mean(
            stack_scalars([loss.detach() for loss, _ in term], root, dtype),
            stack_scalars([weight for _, weight in term], root, dtype),
        )
        for term in zip(*found, strict=True)
    )


def _declared_pairs(value: Any, output: Any) -> list[tuple[Any, Any]] | None:
    """The ``(loss, weight)`` pairs that a step returning ``output`` declares ``value`` is: its loss or a term (one
    pair), the terms' total (one per term); ``None`` otherwise."""
    mapping = output if isinstance(output, Mapping) else {}
    terms, loss = mapping.get(LOSS_TERMS_KEY), mapping.get("loss")
    if isinstance(terms, Mapping):
        pairs = [(t[0], t[1]) for t in terms.values() if isinstance(t, (tuple, list)) and len(t) == 2]
        total = pairs if same_tensor(value, loss) else None
    else:
        pairs, total = [(loss, mapping[LOSS_WEIGHT_KEY])] if LOSS_WEIGHT_KEY in mapping else [], None
    return next(([pair] for pair in pairs if same_tensor(value, pair[0])), total)


def combine_losses(losses: Sequence[Tensor], weights: Sequence[Any], root: torch.device) -> Tensor:
    """The replicas' losses on ``root``: summed for ``"sum"`` weights, else their mean weighted by the counts."""
    return reduce_losses(losses, weights, root, "sum" if isinstance(weights[0], str) else "weighted")


def reduce_training_outputs(
    outputs: Sequence[Any],
    sample_counts: Sequence[int],
    root: torch.device,
    combine: Callable[[list[Tensor]], Tensor],
    dim: int = 0,
) -> Any:
    """The training step's result on the root: a combined loss, or ``{"loss": ..., **gathered extras}``; ``combine``
    combines the losses the step did not weight itself."""
    single = len(outputs) == 1
    first = outputs[0]
    if isinstance(first, Tensor):
        return first if single else combine(list(outputs))
    if not isinstance(first, Mapping):
        raise TypeError(
            f"`training_step` returned a {type(first).__name__}; return a loss tensor, a dict with 'loss', or None."
        )
    if LOSS_TERMS_KEY not in first and "loss" not in first:
        raise ValueError("`training_step` returned a dict without a 'loss' key (or 'loss_terms').")
    if LOSS_TERMS_KEY in first or LOSS_WEIGHT_KEY in first:  # they define the loss at every device count
        loss = _declared_loss(outputs, root)
    else:
        loss = first["loss"] if single else combine([o["loss"] for o in outputs])
    extras = [{k: v for k, v in o.items() if k not in ("loss", LOSS_WEIGHT_KEY, LOSS_TERMS_KEY)} for o in outputs]
    return {
        "loss": loss,
        **(extras[0] if single else merge_outputs(extras, root, dim, sizes=sample_counts, counts=True)),
    }


def _declared_loss(outputs: Sequence[Mapping[str, Any]], root: torch.device) -> Tensor:
    """The loss of steps returning ``loss_terms`` (each term reduced by its weights, then summed) or ``loss_weight``."""
    if LOSS_TERMS_KEY not in outputs[0]:
        parts = {"loss_weight": [(o["loss"], o.get(LOSS_WEIGHT_KEY)) for o in outputs]}
    else:
        terms = [_checked_terms(output, index) for index, output in enumerate(outputs)]
        if not terms[0]:
            raise ValueError(f"`training_step` returned an empty {LOSS_TERMS_KEY!r} mapping.")
        for name in terms[0]:
            if missing := [index for index, replica in enumerate(terms) if name not in replica]:
                raise ValueError(f"Replica {missing[0]} returned {LOSS_TERMS_KEY!r} without the term {name!r}.")
        parts = {f"{LOSS_TERMS_KEY}[{name!r}] weight": [replica[name] for replica in terms] for name in terms[0]}
    reduced = []
    for what, pairs in parts.items():
        losses, weights = zip(*pairs, strict=True)
        floats = as_float_weights(weights, what)  # checked and read once
        reduced.append(losses[0] if len(losses) == 1 else reduce_losses(losses, floats, root, "weighted"))
    return sum(reduced[1:], reduced[0])


def _checked_terms(output: Mapping[str, Any], index: int) -> Mapping[str, Any]:
    """Replica ``index``'s ``loss_terms``: a mapping of ``(loss, weight)`` pairs that add up to the returned ``loss``
    (when one is returned): a term left out would silently leave the optimised and the logged loss."""
    terms = output[LOSS_TERMS_KEY]
    if not isinstance(terms, Mapping):
        raise TypeError(
            f"{LOSS_TERMS_KEY!r} must be a dict {{name: (term_loss, count)}}, got a {type(terms).__name__}: write "
            f"{{'loss': total, {LOSS_TERMS_KEY!r}: {{'mlm': (mlm_loss, n_tokens), 'nsp': (nsp_loss, n_samples)}}}}."
        )
    for name, term in terms.items():
        if not (isinstance(term, (tuple, list)) and len(term) == 2):
            raise TypeError(f"{LOSS_TERMS_KEY}[{name!r}] must be a (loss, weight) pair, got {type(term).__name__}.")
    loss = output.get("loss")
    if not isinstance(loss, Tensor):
        return terms
    total = sum(
        (torch.as_tensor(t[0]).detach().to(loss.device, loss.dtype) for t in terms.values()), torch.zeros_like(loss)
    )
    if not torch.allclose(total, loss.detach(), rtol=1e-5, atol=1e-7, equal_nan=True):
        raise ValueError(
            f"On replica {index}, the terms of {LOSS_TERMS_KEY!r} add up to {float(total):.8g}, but 'loss' is "
            f"{float(loss):.8g}: a part of the loss would be left out of what is optimised and logged. Give every "
            "part of the loss as a term (a regulariser of the weights, which every device computes alike: 'reg': (reg, "
            "1)), or return the terms' sum as 'loss'."
        )
    return terms
