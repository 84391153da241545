"""Combine what the replicas' ``*_step`` methods returned into what one device would have returned.

Training steps may return, besides ``"loss"``, two documented keys that say how to weight the replicas' losses:

* ``"loss_weight"``: the count this replica's mean loss averages over (default: its number of samples), e.g. the
  number of non-ignored tokens of a token-level loss.
* ``"loss_terms"``: ``{name: (term_loss, weight)}`` for a loss made of terms with different normalisers, e.g.
  ``{"mlm": (mlm_loss, n_masked_tokens), "nsp": (nsp_loss, batch_size)}``. Each term is reduced with its own weights
  and the loss is their sum, at every device count (the step's ``"loss"`` should be that sum: Lightning's own
  single-device strategy, which knows nothing of terms, trains on it).

Both keys are consumed here, on every device count, and do not appear in the step's outputs. Other outputs are
gathered on the root by the one rule set of :mod:`lightning_mgpu.parallel.merge`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_mgpu.parallel.merge import merge_outputs
from lightning_mgpu.parallel.reduce import as_float_weights, check_some_weight, reduce_losses, weighted_mean

LOSS_WEIGHT_KEY = "loss_weight"
LOSS_TERMS_KEY = "loss_terms"


def tensor_key(value: Any) -> tuple[int, int, tuple[int, ...]] | None:
    """What identifies a logged loss: its storage, offset and shape, so ``loss.detach()`` (a new tensor object on the
    same storage) is recognised as the loss."""
    if not isinstance(value, Tensor) or value.layout != torch.strided:
        return None
    return value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape)


@dataclass(frozen=True)
class LossTermsTotal:
    """A replica's logged total loss made of ``loss_terms``: ``(term loss, weight)`` pairs, merged term by term."""

    terms: tuple[tuple[Tensor, Any], ...]

    @staticmethod
    def merge(totals: Sequence[LossTermsTotal], device: torch.device, dtype: torch.dtype) -> Tensor:
        merged = torch.zeros((), device=device, dtype=dtype)
        for position in range(len(totals[0].terms)):
            values = torch.stack([t.terms[position][0].detach().to(device, dtype).reshape(()) for t in totals])
            w = torch.stack([torch.as_tensor(t.terms[position][1]).to(device, dtype).reshape(()) for t in totals])
            merged = merged + weighted_mean(values, w)
        return merged


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


def implied_loss_weights(outputs: Sequence[Any], rule: Any, rule_weights: Sequence[Any] | None) -> list[dict[Any, Any]]:
    """Per replica, ``{tensor_key(loss): weight}`` for the losses a training step returned.

    A value logged without ``batch_size=`` that *is* one of these losses (``self.log("train_loss", loss)``, or its
    ``.detach()``) is merged across replicas as the loss is, so the logged number is the optimized one: with the
    step's ``loss_weight``; for ``loss_terms``, each term with its weights and the total as the sum of the merged
    terms; else with ``rule`` (a :class:`LossNormalization`) and its per-replica ``rule_weights`` (``"sum"`` for a
    sum, equal weights for ``replica_mean``). ``rule`` is ``None`` outside training steps.
    """
    if rule is None or rule_weights is None:
        rule_weights = None
    elif rule.kind == "sum":
        rule_weights = ["sum"] * len(outputs)
    elif rule.kind == "replica_mean":
        rule_weights = [1] * len(outputs)
    implied: list[dict[Any, Any]] = []
    for index, output in enumerate(outputs):
        weights: dict[Any, Any] = {}
        mapping = output if isinstance(output, Mapping) else {"loss": output}
        loss = mapping.get("loss")
        terms = mapping.get(LOSS_TERMS_KEY)
        if isinstance(terms, Mapping):
            pairs = [t for t in terms.values() if isinstance(t, (tuple, list)) and len(t) == 2]
            for term, weight in pairs:
                weights[tensor_key(term)] = weight
            if isinstance(loss, Tensor):
                weights[tensor_key(loss)] = LossTermsTotal(tuple((t, w) for t, w in pairs))
        elif LOSS_WEIGHT_KEY in mapping:
            weights[tensor_key(loss)] = mapping[LOSS_WEIGHT_KEY]
        elif rule_weights is not None and isinstance(loss, Tensor):
            weights[tensor_key(loss)] = rule_weights[index]
        weights.pop(None, None)
        implied.append(weights)
    return implied


def reduce_training_outputs(
    outputs: Sequence[Any],
    sample_counts: Sequence[int],
    root: torch.device,
    rule: Any,
    rule_weights: Sequence[Any],
    dim: int = 0,
) -> Any:
    """The training step's result on the root: a combined loss tensor, or ``{"loss": ..., **gathered extras}``.

    ``rule`` (a :class:`~lightning_mgpu.strategies.loss_normalization.LossNormalization`) combines, with its
    per-replica ``rule_weights``, the losses the step did not weight itself. With one output (one device, or a batch
    that runs once) the loss is returned as it is, but ``loss_weight`` / ``loss_terms`` are checked and consumed all
    the same, so every device count follows one rule.
    """
    single = len(outputs) == 1
    first = outputs[0]
    if isinstance(first, Tensor):
        return first if single else rule.reduce(list(outputs), rule_weights, root)
    if not isinstance(first, Mapping):
        raise TypeError(
            f"`training_step` returned a {type(first).__name__}; return a loss tensor, a dict with 'loss', or None."
        )
    if LOSS_TERMS_KEY in first:
        # The terms define the loss at every device count (one device too), so the device count never changes it.
        loss = _reduce_terms(outputs, root)
    else:
        if "loss" not in first:
            raise ValueError("`training_step` returned a dict without a 'loss' key (or 'loss_terms').")
        losses = [o["loss"] for o in outputs]
        if LOSS_WEIGHT_KEY in first:
            weights = [o.get(LOSS_WEIGHT_KEY) for o in outputs]
            check_some_weight(as_float_weights(weights, "loss_weight"))
            loss = losses[0] if single else reduce_losses(losses, weights, root, "weighted")
        else:
            loss = losses[0] if single else rule.reduce(losses, rule_weights, root)
    extras = [{k: v for k, v in o.items() if k not in ("loss", LOSS_WEIGHT_KEY, LOSS_TERMS_KEY)} for o in outputs]
    return {"loss": loss, **(extras[0] if single else merge_outputs(extras, root, dim, sizes=sample_counts))}


def _reduce_terms(outputs: Sequence[Mapping[str, Any]], root: torch.device) -> Tensor:
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
        check_some_weight(as_float_weights(weights, f"{LOSS_TERMS_KEY}[{name!r}] weight"))
        reduced = losses[0] if len(losses) == 1 else reduce_losses(losses, weights, root, "weighted")
        total = reduced if total is None else total + reduced
    return total  # type: ignore[return-value]  # not None: loss_terms holds at least one term (checked above)
