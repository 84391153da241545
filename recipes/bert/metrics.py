"""Epoch-level loss metrics of the BERT recipe, as ``torchmetrics`` metrics that Lightning computes and resets.

Both are logged from the steps with ``self.log(name, metric, on_epoch=True)``, so that Lightning, not an epoch-end
hook, calls their ``compute`` (and with it the ``all_gather`` of their states under DDP). An epoch-end hook that
computes a metric itself deadlocks DDP under Lightning's default progress bar: on global rank 0 only, the progress
bar's ``on_train_epoch_end`` computes (and syncs) every epoch-level value *before* the LightningModule's
``on_train_epoch_end`` runs, so rank 0's collectives come in another order than the other ranks' (Lightning issues
#21264 and #19604). Metrics logged as objects are computed in Lightning's own pass over the logged values, in the
same order on every rank.

- :class:`Perplexity`: ``exp`` of a weighted mean loss (the MLM loss weighted by masked tokens).
- :class:`SumOfMeans`: the sum of several weighted means (MLM mean over masked tokens + NSP mean over sequences: the
  epoch loss, which one sample-weighted mean of the per-step totals would not equal).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import MeanMetric, Metric
from typing_extensions import override

__all__ = ["Perplexity", "SumOfMeans"]


class Perplexity(MeanMetric):
    """``exp`` of the weighted mean of the values given to ``update(value, weight)`` since the last reset.

    With the per-batch MLM loss (a mean over masked tokens) weighted by the batch's masked-token count, this is the
    perplexity of every masked token of the epoch, exactly as on one device whatever the batches' split.
    """

    @override
    def compute(self) -> Tensor:
        return torch.exp(super().compute())


class SumOfMeans(Metric):
    """``Σ_k mean_k``, where ``mean_k`` is the weighted mean of the ``k``-th values given to ``update``.

    Args:
        num_terms: how many means are summed (values and weights per ``update`` call).

    A term whose weights sum to 0 makes the result NaN: its mean is undefined.
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    def __init__(self, num_terms: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        if num_terms < 1:
            raise ValueError(f"num_terms must be >= 1, got {num_terms}")
        self.num_terms = num_terms
        self.add_state("weighted_sums", default=torch.zeros(num_terms), dist_reduce_fx="sum")
        self.add_state("weights", default=torch.zeros(num_terms), dist_reduce_fx="sum")

    @override
    def update(self, values: Sequence[Tensor | float], weights: Sequence[Tensor | float]) -> None:
        """Add one batch: ``values[k]`` (a mean over ``weights[k]`` items) to term ``k``."""
        if len(values) != self.num_terms or len(weights) != self.num_terms:
            raise ValueError(
                f"expected {self.num_terms} values and weights, got {len(values)} values and {len(weights)} weights"
            )
        value, weight = self._vector(values), self._vector(weights)
        # A term with weight 0 contributes nothing (its value may be a placeholder, e.g. the loss of no masked token).
        self.weighted_sums += torch.where(weight > 0, value * weight, torch.zeros_like(value))
        self.weights += weight

    def _vector(self, items: Sequence[Tensor | float]) -> Tensor:
        """``items`` as one detached vector in the states' dtype and device."""
        dtype, device = self.weighted_sums.dtype, self.weighted_sums.device
        return torch.stack([torch.as_tensor(x, dtype=dtype, device=device).detach().reshape(()) for x in items])

    @override
    def compute(self) -> Tensor:
        return (self.weighted_sums / self.weights).sum()
