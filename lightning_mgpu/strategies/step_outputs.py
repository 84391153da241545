"""Combine what the replicas' ``*_step`` methods returned into what one device would have returned.

Training steps may return, besides ``"loss"``, two documented keys that say how to weight the replicas' losses:

* ``"loss_weight"``: the count this replica's mean loss averages over (default: its number of samples), e.g. the
  number of non-ignored tokens of a token-level loss.
* ``"loss_terms"``: ``{name: (term_loss, weight)}`` for a loss made of terms with different normalisers, e.g.
  ``{"mlm": (mlm_loss, n_masked_tokens), "nsp": (nsp_loss, batch_size)}``. Each term is reduced with its own weights
  and the root loss is their sum (the replica's ``"loss"`` must equal the sum of its terms; one device uses it).

Both keys are consumed here and do not appear in the step's outputs. Other outputs are gathered on the root: tensors
with a batch dimension concatenated in batch order, scalars (0-dim tensors, numbers) averaged weighted by sample
count, which is what one device computes for a per-sample mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mgpu.parallel.reduce import LossReduction, reduce_losses
from lightning_mgpu.parallel.scatter_gather import rebuild

LOSS_WEIGHT_KEY = "loss_weight"
LOSS_TERMS_KEY = "loss_terms"


def all_or_none(outputs: Sequence[Any], hook: str) -> bool:
    """True when every replica returned ``None``; raise when only some did (the step would be half-skipped)."""
    nones = [o is None for o in outputs]
    if all(nones):
        return True
    if any(nones):
        skipped = [i for i, n in enumerate(nones) if n]
        raise RuntimeError(
            f"`{hook}` returned None on replica(s) {skipped} but not on the others. Skipping a batch must be decided "
            "for the whole batch: return None from every replica (e.g. based on `batch_idx`), or from none."
        )
    return False


def reduce_training_outputs(
    outputs: Sequence[Any], sample_counts: Sequence[int], root: torch.device, reduction: LossReduction
) -> Any:
    """The training step's result on the root: a reduced loss tensor, or ``{"loss": ..., **gathered extras}``."""
    first = outputs[0]
    if isinstance(first, Tensor):
        return reduce_losses(list(outputs), sample_counts, root, reduction)
    if not isinstance(first, Mapping):
        raise TypeError(
            f"`training_step` returned a {type(first).__name__}; return a loss tensor, a dict with 'loss', or None."
        )
    if LOSS_TERMS_KEY in first:
        loss = _reduce_terms(outputs, root, reduction)
    else:
        if "loss" not in first:
            raise ValueError("`training_step` returned a dict without a 'loss' key (or 'loss_terms').")
        weights = [o.get(LOSS_WEIGHT_KEY, n) for o, n in zip(outputs, sample_counts, strict=True)]
        loss = reduce_losses([o["loss"] for o in outputs], weights, root, reduction)
    extras = [{k: v for k, v in o.items() if k not in ("loss", LOSS_WEIGHT_KEY, LOSS_TERMS_KEY)} for o in outputs]
    return {"loss": loss, **gather_step_outputs(extras, sample_counts, root)}


def _reduce_terms(outputs: Sequence[Mapping[str, Any]], root: torch.device, reduction: LossReduction) -> Tensor:
    names = list(outputs[0][LOSS_TERMS_KEY])
    if not names:
        raise ValueError(f"`training_step` returned an empty {LOSS_TERMS_KEY!r} mapping.")
    total = None
    for name in names:
        losses, weights = [], []
        for index, output in enumerate(outputs):
            terms = output[LOSS_TERMS_KEY]
            if name not in terms:
                raise ValueError(f"Replica {index} returned {LOSS_TERMS_KEY!r} without the term {name!r}.")
            term = terms[name]
            if not (isinstance(term, (tuple, list)) and len(term) == 2):
                raise TypeError(f"{LOSS_TERMS_KEY}[{name!r}] must be a (loss, weight) pair, got {type(term).__name__}.")
            losses.append(term[0])
            weights.append(term[1])
        reduced = reduce_losses(losses, weights, root, reduction)
        total = reduced if total is None else total + reduced
    return total  # type: ignore[return-value]


def gather_step_outputs(outputs: Sequence[Any], sample_counts: Sequence[int], root: torch.device) -> Any:
    """Gather arbitrary step outputs on ``root`` as one device would have produced them for the whole batch."""
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        if first.dim() == 0:
            return reduce_losses(list(outputs), sample_counts, root)
        return torch.cat([o.to(root) for o in outputs], dim=0)
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        values = [torch.tensor(float(o), dtype=torch.float64) for o in outputs]
        return float(reduce_losses(values, sample_counts, torch.device("cpu")))
    if isinstance(first, Mapping):
        return rebuild(first, {k: gather_step_outputs([o[k] for o in outputs], sample_counts, root) for k in first})
    if isinstance(first, list) and not any(isinstance(x, (Tensor, Mapping, list, tuple)) for x in first):
        return [x for o in outputs for x in o]
    if isinstance(first, (list, tuple)):
        items = [gather_step_outputs([o[i] for o in outputs], sample_counts, root) for i in range(len(first))]
        return rebuild(first, items)
    if all(o == first for o in outputs[1:]):
        return first
    return list(outputs)

