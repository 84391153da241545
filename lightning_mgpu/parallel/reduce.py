"""Reduce per-replica scalar losses onto the root device so that the result equals one-device training: with mean
losses ``l_i`` over ``w_i`` items (samples, non-ignored tokens), the whole batch's is ``sum(w_i * l_i) / sum(w_i)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

from lightning_mgpu.parallel.devices import DeviceLike, to_device

Weight = int | float | Tensor
LossReduction = Literal["weighted", "replica_mean", "sum"]
LOSS_REDUCTIONS = get_args(LossReduction)


def as_float_weights(weights: Sequence[Weight], what: str = "loss weight") -> list[float]:
    """Weights as Python floats (a host sync for tensors), each a number or a one-element tensor, finite and >= 0, not
    all 0 (the weighted mean is undefined); else an error naming it."""
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not (isinstance(w, (int, float)) or (isinstance(w, Tensor) and w.numel() == 1)):
            shown = f"a tensor of shape {tuple(w.shape)}" if isinstance(w, Tensor) else repr(w)
            raise TypeError(
                f"The {what} of replica {i} is {shown}; it must be a number or a one-element tensor: the count "
                "(samples, valid tokens...) that replica's mean loss averages over."
            )
    floats = [float(w) for w in weights]
    if bad := [f"{w} on replica {i}" for i, w in enumerate(floats) if not math.isfinite(w) or w < 0]:
        raise ValueError(
            f"The {what}s must be finite and >= 0 (each is the count a replica's mean loss averages over), got "
            f"{', '.join(bad)}."
        )
    if not any(floats):
        raise ValueError(
            "Every replica has loss weight 0 (e.g. no valid target in the whole batch): the weighted mean is "
            "undefined. Skip such a batch (return None from training_step) or give it a weight."
        )
    return floats


def weighted_mean(values: Tensor, weights: Tensor) -> Tensor:
    """``sum(w_i * v_i) / sum(w_i)`` over 1-D tensors on one device, with no host sync; an entry of weight 0 takes no
    part (its NaN mean over no valid token cannot poison the result)."""
    return torch.where(weights > 0, values, torch.zeros_like(values)).mul(weights).sum() / weights.sum()


def stack_scalars(values: Sequence[Weight], device: torch.device, dtype: torch.dtype) -> Tensor:
    """Numbers or one-element tensors as one 1-D tensor on ``device`` (no host sync)."""
    return torch.stack([torch.as_tensor(value).to(device, dtype).reshape(()) for value in values])


def reduce_losses(
    losses: Sequence[Tensor],
    weights: Sequence[Weight] | None = None,
    device: DeviceLike | None = None,
    reduction: LossReduction = "weighted",
) -> Tensor:
    """Combine per-replica scalar losses on ``device`` (default: the first loss's), differentiably, in float32 at
    least: ``"weighted"`` = ``sum(w_i * l_i) / sum(w_i)`` (replicas of weight 0 left out, graph included),
    ``"replica_mean"`` = equal weights (Lightning 1.x ``dp``), ``"sum"`` = plain sum."""
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"Unknown loss reduction {reduction!r}: choose one of {LOSS_REDUCTIONS}.")
    if not losses:
        raise ValueError("reduce_losses() needs at least one loss.")
    root = to_device(device) if device is not None else getattr(losses[0], "device", torch.device("cpu"))
    for i, loss in enumerate(losses):
        if not isinstance(loss, Tensor):
            raise TypeError(f"The loss of replica {i} is a {type(loss).__name__}, expected a scalar tensor.")
        if loss.numel() != 1:
            raise ValueError(
                f"The loss of replica {i} has shape {tuple(loss.shape)}; only scalar losses can be reduced. Reduce it "
                "to a scalar (e.g. `.mean()`), or gather per-sample losses instead."
            )
    # never reduced in half precision or integers
    scalars = [s.to(root, torch.promote_types(s.dtype, torch.float32)).reshape(()) for s in losses]
    if reduction != "weighted" or weights is None:
        return torch.stack(scalars).sum() if reduction == "sum" else torch.stack(scalars).mean()
    if len(weights) != len(losses):
        raise ValueError(f"Got {len(weights)} weights for {len(losses)} losses.")
    # A replica of weight 0 is left out of the graph too: backward through a mean over nothing is NaN.
    kept = [(s, w) for s, w in zip(scalars, as_float_weights(weights), strict=True) if w > 0]
    stacked = torch.stack([s for s, _ in kept])
    return weighted_mean(stacked, torch.tensor([w for _, w in kept], dtype=stacked.dtype, device=root))
