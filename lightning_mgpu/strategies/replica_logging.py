"""``self.log`` from replicas: record per replica, merge once on the root module.

Replicas share the trainer's result collection, so a replica calling the real ``LightningModule.log`` would race
with the others and log one shard's value as if it were the batch's. Each replica's ``log`` is replaced by a
recorder; after the replicas have run, values are merged per name according to ``reduce_fx`` and logged once, from
the main thread, on the root module:

* ``"mean"``: weighted by each replica's ``batch_size=`` argument when given (then logged with their sum as the
  batch size); else, for a value that is the loss the step returned with ``loss_weight`` (or a ``loss_terms`` term),
  by that weight; else by the replica's sample count (then logged with the step's sample count as the batch size).
  Each equals the single-device value of the mean. Replicas with weight 0 (e.g. no valid token in their shard, whose
  mean is NaN) are left out, as in the loss.
* ``"sum"``, ``"max"``, ``"min"``: sum, max, min over replicas.
* a torchmetrics ``Metric``: the root metric, whose state the metric merger has filled from every replica.

Replicas that skip a name do not take part in its merge; every replica that logs a name must use the same options.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_mgpu.parallel.reduce import weighted_mean
from lightning_mgpu.strategies.step_outputs import LossTermsTotal, tensor_key

_MEAN = ("mean", "avg", torch.mean)
_SUM = ("sum", torch.sum, sum)
_MAX = ("max", torch.max, max)
_MIN = ("min", torch.min, min)
_LOG_DEFAULTS: dict[str, Any] = {"reduce_fx": "mean", "batch_size": None, "enable_graph": False}


@dataclass
class LogCall:
    name: str
    value: Any
    options: dict[str, Any]


@dataclass
class LogRecorder:
    """Stands in for ``LightningModule.log`` on one replica (``log_dict`` calls ``log``, so it is recorded too)."""

    calls: list[LogCall] = field(default_factory=list)

    def log(self, name: str, value: Any, **options: Any) -> None:
        self.calls.append(LogCall(name, value, options))


def _reduce_kind(reduce_fx: str | Callable[..., Any]) -> str:
    for kind, aliases in (("mean", _MEAN), ("sum", _SUM), ("max", _MAX), ("min", _MIN)):
        if any(reduce_fx is a or (isinstance(reduce_fx, str) and reduce_fx.lower() == a) for a in aliases):
            return kind
    raise ValueError(
        f"self.log(reduce_fx={reduce_fx!r}) is not supported under a multi-device single-process strategy: "
        "use 'mean', 'sum', 'max' or 'min'."
    )


def _without(options: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k not in keys}


def merge_and_log(
    root: Any,
    recorders: Sequence[LogRecorder],
    sample_counts: Sequence[int],
    metric_owner: Callable[[Any], Metric | None],
    implied_weights: Sequence[dict[int, Any]] | None = None,
) -> None:
    """Merge the replicas' recorded ``log`` calls and log each name once on ``root`` (a LightningModule).

    ``metric_owner(value)`` maps a replica's metric clone to the root metric it stands for (``None`` if ``value`` is
    not one). ``implied_weights[i]`` maps :func:`tensor_key` of a loss tensor to the weight replica ``i`` returned for
    it (``"sum"`` for a sum loss, a :class:`LossTermsTotal` for the total of ``loss_terms``).
    """
    by_name: dict[str, list[tuple[int, LogCall]]] = {}
    for index, recorder in enumerate(recorders):
        for call in recorder.calls:
            by_name.setdefault(call.name, []).append((index, call))
        recorder.calls.clear()
    for name, entries in by_name.items():
        options = {**_LOG_DEFAULTS, **entries[0][1].options}
        for index, call in entries[1:]:
            other = {**_LOG_DEFAULTS, **call.options}
            if _without(other, "batch_size") != _without(options, "batch_size"):
                raise ValueError(
                    f"Replicas logged {name!r} with different options ({_without(options, 'batch_size')} on replica "
                    f"{entries[0][0]} vs {_without(other, 'batch_size')} on replica {index}); log it the same way."
                )
        first_value = entries[0][1].value
        if isinstance(first_value, Metric):
            owner = metric_owner(first_value)
            if owner is None:
                raise ValueError(
                    f"{name!r}: a replica logged a Metric that is not an attribute of the LightningModule."
                )
            root.log(name, owner, **options)
            continue
        value, merged_options = _merge_values(name, entries, sample_counts, options, implied_weights)
        root.log(name, value, **merged_options)


def _merge_values(
    name: str,
    entries: list[tuple[int, LogCall]],
    sample_counts: Sequence[int],
    options: dict[str, Any],
    implied_weights: Sequence[dict[int, Any]] | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    kind = _reduce_kind(options["reduce_fx"])
    values = [_as_tensor(name, call.value, options["enable_graph"]) for _, call in entries]
    device = values[0].device
    dtype = torch.promote_types(values[0].dtype, torch.float32) if values[0].is_floating_point() else torch.float32
    stacked = torch.stack([v.to(device=device, dtype=dtype) for v in values])
    merged_options = dict(options)
    if kind == "mean":
        explicit = [call.options.get("batch_size") for _, call in entries]
        implied = [
            (implied_weights[index] if implied_weights else {}).get(tensor_key(call.value)) for index, call in entries
        ]
        batch_size = int(sum(float(b) for b in explicit)) if all(b is not None for b in explicit) else None
        if all(isinstance(b, str) for b in implied):  # a sum loss: one device logs the whole batch's sum
            merged_options["batch_size"] = batch_size or sum(sample_counts[index] for index, _ in entries)
            return stacked.sum(), merged_options
        if all(isinstance(b, LossTermsTotal) for b in implied):  # the total of loss_terms: each term weighted
            merged_options["batch_size"] = batch_size or sum(sample_counts[index] for index, _ in entries)
            return LossTermsTotal.merge(implied, device, dtype), merged_options
        if all(b is not None and not isinstance(b, str) for b in implied):  # the loss's weights: no host sync
            # A logged copy of the optimized loss merges as the loss does, whatever batch_size= says (that only
            # weights the step in Lightning's epoch mean).
            w = torch.stack([torch.as_tensor(b).to(device=device, dtype=dtype).reshape(()) for b in implied])
            if batch_size is not None:
                merged_options["batch_size"] = batch_size
        elif batch_size is not None:
            w = torch.tensor([float(b) for b in explicit], dtype=dtype, device=device)
            merged_options["batch_size"] = batch_size
        else:
            counts = [sample_counts[index] for index, _ in entries]
            w = torch.tensor([float(n) for n in counts], dtype=dtype, device=device)
            # The step's weight in the epoch mean: its sample count, which Lightning would otherwise read from the
            # first tensor of the batch (the channel count of a PerSample list of images, say).
            merged_options["batch_size"] = sum(counts)
        merged = weighted_mean(stacked, w)
    elif kind == "sum":
        merged = stacked.sum()
    elif kind == "max":
        merged = stacked.max()
    else:
        merged = stacked.min()
    return merged, merged_options


def _as_tensor(name: str, value: Any, enable_graph: bool) -> Tensor:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}, ...) needs a single value, got a tensor of shape {tuple(value.shape)}."
            )
        value = value.reshape(())
        return value if enable_graph else value.detach()
    if isinstance(value, (int, float)):
        return torch.tensor(float(value), dtype=torch.float64)
    raise ValueError(f"self.log({name!r}, ...) got a {type(value).__name__}; log a number or a scalar tensor.")
