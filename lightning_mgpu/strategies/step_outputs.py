"""Combine what the replicas' ``*_step`` methods returned into what one device would have returned.

Training steps may return, besides ``"loss"``, two documented keys that say how to weight the replicas' losses:

* ``"loss_weight"``: the count this replica's mean loss averages over (default: its number of samples), e.g. the
  number of non-ignored tokens of a token-level loss.
* ``"loss_terms"``: ``{name: (term_loss, weight)}`` for a loss made of terms with different normalisers, e.g.
  ``{"mlm": (mlm_loss, n_masked_tokens), "nsp": (nsp_loss, batch_size)}``. Each term is reduced with its own weights
  and the root loss is their sum (the replica's ``"loss"`` must equal the sum of its terms; one device uses it).

Both keys are consumed here and do not appear in the step's outputs. Other outputs are gathered on the root, in
batch order, as one device would have returned them for the whole batch:

* tensors and numpy arrays are concatenated along ``dim``, as ``nn.DataParallel`` gathers: per-sample values and
  flattened per-element ones (``preds[mask]``) come back whole; a statistic without a sample dimension (a ``(C, C)``
  confusion matrix) comes back stacked along ``dim``, to be summed; arrays whose other dimensions differ come back
  as ``ReplicaValues``;
* lists and tuples with one item per sample (ids, per-sample records, variable-size tensors; :class:`PerSample` lists
  always) are concatenated;
* scalars (0-dim tensors, numbers) are averaged weighted by sample count: exact for a per-sample mean, not for a sum
  or a count (return per-sample values, or log sums with ``reduce_fx="sum"``);
* mappings, dataclasses and fixed structures (``(preds, target)``) are gathered field by field;
* anything else that is not the same on every replica comes back as ``ReplicaValues``, the list of the replicas'
  values, so code expecting one device's value fails loudly instead of using a wrong number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_mgpu.parallel.reduce import LossReduction, reduce_losses
from lightning_mgpu.parallel.scatter_gather import PerSample, all_equal, is_namedtuple, iter_tensors, move_to, rebuild

LOSS_WEIGHT_KEY = "loss_weight"
LOSS_TERMS_KEY = "loss_terms"


class ReplicaValues(list):
    """A step output that cannot be merged into one device's value: one entry per replica, in batch order.

    Returned for values that differ between replicas and have no rule to combine them (arrays whose non-batch
    dimensions differ, objects). Using it as the value one device would have returned fails with an explanation.
    """

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"this step output differs between the {len(self)} replicas and has no rule to merge it into one "
            f"device's value, so it came back as the list of their values (ReplicaValues), which has no attribute "
            f"{name!r}. Combine them as your statistic needs, or return per-sample values, which are concatenated "
            "in batch order."
        )


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


def loss_weights_by_tensor(output: Any) -> dict[int, Any]:
    """``{id(tensor): weight}`` for the losses a training step returned with an explicit weight.

    A value logged without ``batch_size=`` that *is* one of these tensors (``self.log("train_loss", loss)`` then
    ``return {"loss": loss, "loss_weight": n}``) is merged across replicas with the same weights as the loss, so the
    logged number is the optimized one.
    """
    if not isinstance(output, Mapping):
        return {}
    weights: dict[int, Any] = {}
    if LOSS_WEIGHT_KEY in output and isinstance(output.get("loss"), Tensor):
        weights[id(output["loss"])] = output[LOSS_WEIGHT_KEY]
    terms = output.get(LOSS_TERMS_KEY)
    if isinstance(terms, Mapping):
        for term in terms.values():
            if isinstance(term, (tuple, list)) and len(term) == 2 and isinstance(term[0], Tensor):
                weights[id(term[0])] = term[1]
    return weights


def reduce_training_outputs(
    outputs: Sequence[Any], sample_counts: Sequence[int], root: torch.device, reduction: LossReduction, dim: int = 0
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
    return {"loss": loss, **gather_step_outputs(extras, sample_counts, root, dim)}


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


def gather_step_outputs(outputs: Sequence[Any], sample_counts: Sequence[int], root: torch.device, dim: int = 0) -> Any:
    """Gather arbitrary step outputs on ``root`` as one device would have produced them for the whole batch."""
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, (Tensor, np.ndarray)):
        if first.ndim == 0:
            return _weighted_mean(outputs, sample_counts, root)
        if _concatenable(outputs, dim):
            if isinstance(first, Tensor):
                return torch.cat([o.to(root) for o in outputs], dim=dim)
            return np.concatenate(outputs, axis=dim)
        return ReplicaValues(outputs)
    if isinstance(first, (int, float, np.number)) and not isinstance(first, bool):
        return _weighted_mean(outputs, sample_counts, root)
    if isinstance(first, Mapping):
        gathered = {k: gather_step_outputs([o[k] for o in outputs], sample_counts, root, dim) for k in first}
        return rebuild(first, gathered)
    if isinstance(first, (list, tuple)):
        if not is_namedtuple(first) and _per_sample_items(outputs, sample_counts, dim):
            return type(first)(move_to(x, root) for o in outputs for x in o)
        if all(type(o) is type(first) and len(o) == len(first) for o in outputs):
            items = [gather_step_outputs([o[i] for o in outputs], sample_counts, root, dim) for i in range(len(first))]
            return rebuild(first, items)
        return ReplicaValues(outputs)
    return first if all_equal(outputs) else ReplicaValues(outputs)


def _weighted_mean(values: Sequence[Any], sample_counts: Sequence[int], root: torch.device) -> Any:
    if isinstance(values[0], Tensor):
        return reduce_losses(list(values), sample_counts, root)
    as_tensors = [torch.tensor(float(v), dtype=torch.float64) for v in values]
    return float(reduce_losses(as_tensors, sample_counts, torch.device("cpu")))


def _concatenable(outputs: Sequence[Any], dim: int) -> bool:
    """Arrays of one type that agree on every dimension but ``dim``."""
    first = outputs[0]
    return all(
        type(o) is type(first)
        and o.ndim == first.ndim > dim
        and all(a == b for d, (a, b) in enumerate(zip(o.shape, first.shape, strict=True)) if d != dim)
        for o in outputs
    )


def _per_sample_items(outputs: Sequence[Sequence[Any]], sample_counts: Sequence[int], dim: int) -> bool:
    """A list or tuple with one item per sample on every replica, rather than a fixed structure such as ``(preds, y)``.

    :class:`PerSample` lists are, always. Otherwise the lengths must equal the replicas' sample counts; when those
    differ between replicas, that settles it. When they are equal, the items decide: strings, and in lists also
    numbers and 0-dim tensors, are per-sample (a tuple of numbers is a structure such as ``(loss, acc)``); dicts and
    dataclasses are per-sample records unless every tensor in them is batched (one dict per decoder layer, say);
    tensors are per-sample when ragged (not all of the replica's size along ``dim``).
    """
    if all(isinstance(o, PerSample) for o in outputs):
        return True
    if any(len(o) != n for o, n in zip(outputs, sample_counts, strict=True)):
        return False
    if len(set(sample_counts)) > 1:
        return True
    n = sample_counts[0]
    items = [item for o in outputs for item in o]
    if all(isinstance(x, str) for x in items):
        return True
    if isinstance(outputs[0], list) and all(_is_scalar(x) for x in items):
        return True
    if all(isinstance(x, Mapping) for x in items) or all(dataclasses.is_dataclass(x) for x in items):
        tensors = [t for x in items for _, t in iter_tensors(x)]
        return not tensors or not all(t.ndim > dim and t.shape[dim] == n for t in tensors)
    if all(isinstance(x, (Tensor, np.ndarray)) for x in items):
        return all(x.ndim > 0 for x in items) and not all(x.ndim > dim and x.shape[dim] == n for x in items)
    return False


def _is_scalar(value: Any) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, (Tensor, np.ndarray)) and value.ndim == 0)


_PLAIN = (str, bytes, int, float, bool, type(None), np.number)
