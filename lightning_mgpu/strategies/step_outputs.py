"""Combine what the replicas' ``*_step`` methods returned into what one device would have returned.

A training step may return ``"loss_weight"`` (the count its mean loss averages over) or ``"loss_terms"`` (``{name:
(term_loss, weight)}``, each term reduced with its own weights); both are consumed here, at every device count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mgpu.parallel.merge import merge_outputs
from lightning_mgpu.parallel.reduce import as_float_weights, reduce_losses, stack_scalars, weighted_mean
from lightning_mgpu.parallel.replica_group import current_replica

LOSS_WEIGHT_KEY = "loss_weight"
LOSS_TERMS_KEY = "loss_terms"


def tensor_key(value: Any) -> tuple[int, int, tuple[int, ...]] | None:
    """What identifies a logged loss: its storage, offset and shape, so ``loss.detach()`` is recognised as the loss."""
    if not isinstance(value, Tensor) or value.layout != torch.strided:
        return None
    return value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape)


class LossCapture:
    """Forward hooks on the modules whose outputs are losses: per replica, each loss they returned with what that call
    averaged over, so that a logged copy merges as one device's value (``self.log("val_loss", criterion(...))``)."""

    def __init__(self, producers: Sequence[nn.Module], weigh: Any) -> None:
        # The losses themselves until take(): a freed one's storage could come back as another logged value's.
        self._losses: dict[int, list[tuple[Tensor, Any]]] = {}
        self._weigh = weigh
        self._handles = [producer.register_forward_hook(self._record, with_kwargs=True) for producer in producers]

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        replica = current_replica()
        loss = output.get("loss") if isinstance(output, Mapping) else output  # a transformers ModelOutput is a Mapping
        if replica is None or tensor_key(loss) is None:
            return
        # None: the call does not say; the step's rule then weighs it.
        self._losses.setdefault(replica.index, []).append((loss, self._weigh(module, args, kwargs, output)))

    def take(self) -> dict[int, dict[Any, Any]]:
        """Per replica index, ``{tensor_key(loss): weight or None}`` for the losses recorded since the last call."""
        losses, self._losses = self._losses, {}
        return {index: {tensor_key(loss): weight for loss, weight in recorded} for index, recorded in losses.items()}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass(frozen=True)
class LossTermsTotal:
    """A replica's logged total of ``loss_terms``: ``(term loss, weight)`` pairs, merged term by term."""

    terms: tuple[tuple[Tensor, Any], ...]

    @staticmethod
    def merge(totals: Sequence[LossTermsTotal], device: torch.device, dtype: torch.dtype) -> Tensor:
        merged = torch.zeros((), device=device, dtype=dtype)
        for pairs in zip(*(total.terms for total in totals), strict=True):  # one term, every replica's pair
            values = stack_scalars([loss.detach() for loss, _ in pairs], device, dtype)
            merged = merged + weighted_mean(values, stack_scalars([weight for _, weight in pairs], device, dtype))
        return merged


def all_or_none(outputs: Sequence[Any], hook: str) -> bool:
    """True when every replica returned ``None``; raise when only some did (the step would be half-skipped)."""
    skipped = [i for i, output in enumerate(outputs) if output is None]
    if skipped and len(skipped) < len(outputs):
        raise RuntimeError(
            f"`{hook}` returned None on replica(s) {skipped} but not on the others. Skip a batch on every replica "
            "(e.g. based on `batch_idx`), or on none."
        )
    return bool(skipped)


def implied_loss_weights(outputs: Sequence[Any], rule_weights: Sequence[Any] | None) -> list[dict[Any, Any]]:
    """Per replica, ``{tensor_key(loss): weight}`` for the losses a step returned, so that a logged copy merges as the
    loss does: by ``loss_weight``, term by term for ``loss_terms``, else by ``rule_weights``."""
    implied: list[dict[Any, Any]] = []
    for index, output in enumerate(outputs):
        mapping = output if isinstance(output, Mapping) else {"loss": output}
        loss = mapping.get("loss")
        terms = mapping.get(LOSS_TERMS_KEY)
        weights: dict[Any, Any] = {}
        if isinstance(terms, Mapping):
            pairs = tuple((t[0], t[1]) for t in terms.values() if isinstance(t, (tuple, list)) and len(t) == 2)
            weights = {tensor_key(term): weight for term, weight in pairs}
            weights[tensor_key(loss)] = LossTermsTotal(pairs)
        elif LOSS_WEIGHT_KEY in mapping:
            weights[tensor_key(loss)] = mapping[LOSS_WEIGHT_KEY]
        elif rule_weights is not None:
            weights[tensor_key(loss)] = rule_weights[index]
        weights.pop(None, None)
        implied.append(weights)
    return implied


def combine_losses(losses: Sequence[Tensor], weights: Sequence[Any], root: torch.device) -> Tensor:
    """The replicas' losses on ``root``: summed for ``"sum"`` weights, else their mean weighted by the counts."""
    return reduce_losses(losses, weights, root, "sum" if isinstance(weights[0], str) else "weighted")


def reduce_training_outputs(
    outputs: Sequence[Any], sample_counts: Sequence[int], root: torch.device, weights: Sequence[Any], dim: int = 0
) -> Any:
    """The training step's result on the root: a combined loss, or ``{"loss": ..., **gathered extras}``; ``weights``
    combine the losses the step did not weight itself."""
    single = len(outputs) == 1
    first = outputs[0]
    if isinstance(first, Tensor):
        return first if single else combine_losses(outputs, weights, root)
    if not isinstance(first, Mapping):
        raise TypeError(
            f"`training_step` returned a {type(first).__name__}; return a loss tensor, a dict with 'loss', or None."
        )
    if LOSS_TERMS_KEY in first:  # the terms define the loss at every device count, one device too
        loss = _reduce_terms(outputs, root)
    elif "loss" not in first:
        raise ValueError("`training_step` returned a dict without a 'loss' key (or 'loss_terms').")
    elif LOSS_WEIGHT_KEY in first:
        weights = [o.get(LOSS_WEIGHT_KEY) for o in outputs]
        loss = _reduce_weighted([o["loss"] for o in outputs], weights, "loss_weight", root)
    else:
        loss = first["loss"] if single else combine_losses([o["loss"] for o in outputs], weights, root)
    extras = [{k: v for k, v in o.items() if k not in ("loss", LOSS_WEIGHT_KEY, LOSS_TERMS_KEY)} for o in outputs]
    return {"loss": loss, **(extras[0] if single else merge_outputs(extras, root, dim, sizes=sample_counts))}


def _reduce_weighted(losses: Sequence[Any], weights: Sequence[Any], what: str, root: torch.device) -> Any:
    floats = as_float_weights(weights, what)  # checked and read once
    return losses[0] if len(losses) == 1 else reduce_losses(losses, floats, root, "weighted")


def _reduce_terms(outputs: Sequence[Mapping[str, Any]], root: torch.device) -> Tensor:
    names = list(outputs[0][LOSS_TERMS_KEY])
    if not names:
        raise ValueError(f"`training_step` returned an empty {LOSS_TERMS_KEY!r} mapping.")
    reduced = []
    for name in names:
        pairs = []
        for index, output in enumerate(outputs):
            terms = output[LOSS_TERMS_KEY]
            if name not in terms:
                raise ValueError(f"Replica {index} returned {LOSS_TERMS_KEY!r} without the term {name!r}.")
            if not (isinstance(terms[name], (tuple, list)) and len(terms[name]) == 2):
                raise TypeError(
                    f"{LOSS_TERMS_KEY}[{name!r}] must be a (loss, weight) pair, got {type(terms[name]).__name__}."
                )
            pairs.append(terms[name])
        losses, weights = zip(*pairs, strict=True)
        reduced.append(_reduce_weighted(losses, weights, f"{LOSS_TERMS_KEY}[{name!r}] weight", root))
    return sum(reduced[1:], reduced[0])
