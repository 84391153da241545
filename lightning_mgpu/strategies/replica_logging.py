"""``self.log`` from replicas: record per replica (they share the trainer's results), log once on the root module.

One device logs one whole-batch value per step, so: a logged copy of the loss merges as the loss does, and a value a
metric's call returned is that call's value on the whole batch, whatever ``reduce_fx``; another ``"mean"`` is weighted
by ``batch_size=``, else by sample counts; another ``"sum"``, ``"max"`` or ``"min"`` acts over replicas."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Complex, Number, Real
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_mgpu.parallel.loss_calls import unfollowed
from lightning_mgpu.parallel.loss_graph import read_loss
from lightning_mgpu.parallel.reduce import stack_scalars, weighted_mean
from lightning_mgpu.parallel.scatter_gather import iter_tensors
from lightning_mgpu.strategies.loader_batch import step_sample_counts
from lightning_mgpu.strategies.step_outputs import same_tensor

_REDUCE_FX: dict[Any, str] = {  # what Lightning's reduce_fx= accepts, and the kinds merged here
    **dict.fromkeys(("mean", "avg", torch.mean), "mean"),
    **dict.fromkeys(("sum", torch.sum, sum), "sum"),
    **dict.fromkeys(("max", torch.max, max), "max"),
    **dict.fromkeys(("min", torch.min, min), "min"),
}
_LOG_DEFAULTS: dict[str, Any] = {"reduce_fx": "mean", "batch_size": None, "enable_graph": False}
#: Merges the replicas' logged values of one name (given where known) as a loss (by its rule), or says ``None``.
LossCopy = Callable[[list[Any], str | None], Tensor | None]


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


def merge_and_log(
    root: Any,
    recorders: Sequence[LogRecorder],
    sample_counts: Sequence[int],
    metric_owner: Callable[[Any], Metric | None],
    loss_copy: LossCopy | None = None,
    step_values: Mapping[int, tuple[Any, Any]] | None = None,
    outputs: Sequence[Any] = (),
) -> dict[str, int]:
    """Log on ``root`` the replicas' recorded calls, the k-th call of a name on every replica merged into one (one
    device logs a name once per call). ``metric_owner`` maps a metric clone to its root metric; ``loss_copy`` merges a
    loss's copies by its rule (else ``None``); ``step_values``: id of a metric call's return -> (its key, one device's
    value); ``outputs``: what each replica's call returned. Returns the names one replica alone logged (behind
    ``is_global_zero``) whose one-device value is unknown, each with that replica: its shard's value was logged."""
    calls: dict[tuple[str, int], list[tuple[int, LogCall]]] = {}  # (name, k) -> every replica's k-th call of it
    for index, recorder in enumerate(recorders):
        made: dict[str, int] = {}
        for call in recorder.calls:
            made[call.name] = k = made.get(call.name, 0) + 1
            calls.setdefault((call.name, k), []).append((index, call))
        recorder.calls.clear()
    loader_batch = functools.partial(step_sample_counts, root)  # the DataLoader's counts, read only where needed
    alone: dict[str, int] = {}
    for (name, _), entries in calls.items():
        _require_same_options(name, entries)
        options = {**_LOG_DEFAULTS, **entries[0][1].options}
        values = [call.value for _, call in entries]
        if isinstance(values[0], Metric):
            if (owner := metric_owner(values[0])) is None:
                raise ValueError(
                    f"{name!r}: a replica logged a Metric that the LightningModule does not hold (as an attribute, or "
                    "in a dict, list or tuple attribute): one made inside the step holds only its replica's shard."
                )
            root.log(name, owner, **options)  # Lightning itself refuses one outside its attributes, as on one device
            continue
        # One device's value where every replica logged what one metric call returned, or a copy of the loss.
        found = [step_values.get(id(value)) for value in values] if step_values else [None]
        if all(found) and len({f[0] for f in found}) == 1:  # type: ignore[index]
            copy = torch.as_tensor(found[0][1])  # type: ignore[index]
        else:
            if len(entries) == 1 < len(recorders):  # behind is_global_zero
                entries, values = _logged_alone(name, entries[0], outputs, alone)
            copy = loss_copy(values, name) if loss_copy is not None and len(entries) == len(recorders) else None
            if copy is None:
                _say_unexplained(root, name, values, options)
        sizes = [call.options.get("batch_size") for _, call in entries]
        counts = [sample_counts[index] for index, _ in entries]
        value, options = _merge_values(name, values, sizes, counts, options, copy, loader_batch=loader_batch)
        root.log(name, value, **options)
    return alone


def _say_unexplained(root: Any, name: str, values: list[Any], options: dict[str, Any]) -> None:
    """Said once per name: a value made from a loss call by an operation evaluation does not follow, or in training
    a mean whose autograd record the reader cannot explain (``torch.exp(loss)``, ``logits.std()``) where the devices'
    values differ (a norm of the weights is alike on every device), is merged as a per-sample mean."""
    op = next(filter(None, map(unfollowed, values)), None)
    graphs = all(isinstance(v, Tensor) and v.grad_fn is not None and v.numel() == 1 for v in values)
    if op is None and not (graphs and _REDUCE_FX.get(options["reduce_fx"]) == "mean"):
        return
    strategy, key = root.trainer.strategy, f"unfollowed:{name}"
    if key in strategy._announced:
        return
    made_by = op if op is not None else _unexplained(values)
    if made_by is None:
        strategy._announced.add(key)  # read, or alike on every device: said never, read no more
        return
    hook = root._current_fx_name
    strategy._warn_once(key, merged_per_sample_message(strategy.strategy_name, hook, name, made_by, graph=op is None))


def _unexplained(values: list[Tensor]) -> str | None:
    """The node a training value's autograd record stops at, where the devices' values of it differ."""
    try:
        record = read_loss(values[0])
    except RuntimeError:  # its graph was freed by a backward pass in the step (manual optimization)
        return None
    if record is None or record.unknown is None:
        return None
    first = values[0].detach()
    return None if all(torch.equal(first, v.detach().to(first.device)) for v in values[1:]) else record.unknown


def merged_per_sample_message(strategy: str, hook: str, name: str, made_by: str, *, graph: bool) -> str:
    """Said once per logged ``name`` that ``made_by`` made where no record follows it (its autograd record's node in
    training, ``graph``; an operation on a loss call's output in evaluation): merged per sample, and the fix."""
    if graph:
        how = (
            f"was made through `{made_by}`, which its autograd record does not explain as a mean, a sum or a loss "
            "function's mean (a function of the batch's mean, as torch.exp(loss) or a root of a mean square, is not "
            "one)"
        )
        fix = (
            "log a torchmetrics metric held by the module (its states merge exactly: e.g. "
            "MeanSquaredError(squared=False), text.Perplexity), or use strategy='dp'"
        )
    else:
        how = (
            f"was made from a loss call through `{made_by}`, which the strategy does not follow (it follows sums and "
            "differences of losses, their products and quotients by numbers and counts, `.sum()`, `.mean()`)"
        )
        fix = (
            f"log the loss itself and compute {name!r} from its merged value: update a torchmetrics MeanMetric held by "
            f"the module with the loss in `{hook}`, and log what you make of its compute() in "
            f"`on_{hook.removesuffix('_step')}_epoch_end`"
        )
    return (
        f"{strategy}: {name!r}, logged in `{hook}`, {how}, so the devices' values of it are merged as a per-sample "
        f"mean: one device's value only if it is a per-sample mean itself. For one device's value, {fix}."
    )


def _require_same_options(name: str, entries: list[tuple[int, LogCall]]) -> None:
    """Replicas log a name with the same options (``batch_size=`` may differ: each replica counts its shard)."""
    (first_index, first), *others = entries
    expected = {**_LOG_DEFAULTS, **first.options, "batch_size": None}
    for index, call in others:
        if call.options != first.options and (got := {**_LOG_DEFAULTS, **call.options, "batch_size": None}) != expected:
            raise ValueError(
                f"Replicas logged {name!r} with different options ({expected} on replica {first_index} vs {got} "
                f"on replica {index}); log it the same way."
            )


def _logged_alone(
    name: str, entry: tuple[int, LogCall], outputs: Sequence[Any], alone: dict[str, int]
) -> tuple[list[tuple[int, LogCall]], list[Any]]:
    """The entries and values of a name one replica alone logged: where its value is a tensor it also returned (its
    loss), every replica's tensor at that place of its output, as if each had logged its own; else its own entry,
    noted in ``alone`` (its shard's value)."""
    index, call = entry
    path = None
    if isinstance(call.value, Tensor) and index < len(outputs):
        path = next(
            (p for p, tensor in iter_tensors(outputs[index], "output") if same_tensor(call.value, tensor)), None
        )
    found = [None if path is None else dict(iter_tensors(output, "output")).get(path) for output in outputs]
    if path is None or any(tensor is None for tensor in found):
        alone[name] = index
        return [entry], [call.value]
    return [(i, call) for i in range(len(found))], found


def merge_scalars(
    entries: list[tuple[int, Any]],
    weights: list[Any] | None,
    kind: str,
    *,
    sample_counts: Sequence[int],
    replicas: int,
    loss_copy: LossCopy | None,
) -> Tensor | None:
    """The replicas' scalar inputs of one call of an aggregation metric (``MeanMetric``, ``SumMetric``...) merged as
    ``self.log(value, reduce_fx=kind, batch_size=weight)`` merges them, into one device's input. ``None`` where a value
    or weight is not one number, and for ``"cat"`` of what is not a loss (those fold as any metric's states)."""
    values = [value for _, value in entries]
    if not all(map(_is_scalar, values)) or (weights is not None and not all(map(_is_scalar, weights))):
        return None
    everyone = len(entries) == replicas and all(isinstance(v, Tensor) for v in values)
    copy = loss_copy(values, None) if loss_copy is not None and everyone else None
    if copy is None and kind == "cat":
        return None
    options = {**_LOG_DEFAULTS, "reduce_fx": "mean" if kind == "cat" else kind}
    counts = [sample_counts[index] for index, _ in entries]
    sizes = weights or [None] * len(values)
    return _merge_values(f"{kind} metric input", values, sizes, counts, options, copy, torch.float64)[0]


def _is_number(value: Any) -> bool:
    """What Lightning's log accepts as a number: numpy scalars, bools and Decimal included, complex ones excluded."""
    return isinstance(value, Real) or (isinstance(value, Number) and not isinstance(value, Complex))


def _is_scalar(value: Any) -> bool:
    return value.numel() == 1 if isinstance(value, Tensor) else _is_number(value)


def _merge_values(
    name: str,
    values: list[Any],
    sizes: list[Any],
    counts: list[int],
    options: dict[str, Any],
    loss: Tensor | None,
    numbers: torch.dtype | None = None,
    loader_batch: Callable[[], tuple[int, ...]] = tuple,
) -> tuple[Tensor, dict[str, Any]]:
    """One device's value of ``name`` from the replicas' ``values`` (of ``batch_size=`` ``sizes`` and ``counts``
    samples; ``loss``: a copy of the loss merged by its rule) and the options to log it with. Python numbers become
    tensors of ``numbers`` (default: the default dtype, as Lightning makes them). ``loader_batch()``: the DataLoader's
    sample counts, read only for a ``batch_size=`` equal on every replica."""
    key = options["reduce_fx"].lower() if isinstance(options["reduce_fx"], str) else options["reduce_fx"]
    kind = _REDUCE_FX.get(key) if isinstance(key, Hashable) else None
    if kind is None:
        raise ValueError(
            f"self.log(reduce_fx={options['reduce_fx']!r}) is not supported by a single-process multi-device "
            "strategy: use 'mean', 'sum', 'max' or 'min'."
        )
    # The step's weight in the epoch mean: the devices' batch_size= summed (each counts its shard: tokens equal on even
    # shards too), the loader's batch size passed by every device as it is (a constant, as one device passes it, also
    # on a smaller last batch), else what Lightning reads from the whole batch (its warning on an ambiguous batch too).
    explicit = None if None in sizes else [float(b) for b in sizes]
    alike = explicit is not None and len(set(explicit)) == 1
    constant = alike and sizes != counts and explicit[:1] == [float(b) for b in loader_batch()[:1]]  # type: ignore[index]
    given = None if explicit is None else int(explicit[0]) if constant else int(sum(explicit))
    logged = options if given is None or kind != "mean" else {**options, "batch_size": given}
    if loss is not None:  # one device's value, in its own dtype (a metric may make a float32 0 of a float64 state)
        device = values[0].device if isinstance(values[0], Tensor) else None
        return loss.detach().to(device=device, dtype=torch.promote_types(loss.dtype, torch.float32)), logged
    tensors = [
        _as_tensor(name, value, options["enable_graph"], numbers or torch.get_default_dtype()) for value in values
    ]
    device, dtype = tensors[0].device, tensors[0].dtype
    dtype = torch.promote_types(dtype, torch.float32) if tensors[0].is_floating_point() else torch.float32
    if kind != "mean":  # reduce_fx acts over steps: within one, over the replicas
        return getattr(stack_scalars(tensors, device, dtype), kind)(), options
    # Equal values on every replica (a constant such as hparams.batch_size) say nothing about the shards: samples do.
    weights = counts if explicit is None or alike else explicit
    # In float64, as an offset from a weighted value, rounded once: a value alike on every replica (a learning rate)
    # comes back exactly as it was logged.
    wide = torch.promote_types(dtype, torch.float64)
    values, weights = stack_scalars(tensors, device, wide), stack_scalars(weights, device, wide)
    base = values[(weights > 0).byte().argmax()]
    return (base + weighted_mean(values - base, weights)).to(dtype), logged


def _as_tensor(name: str, value: Any, enable_graph: bool, numbers: torch.dtype) -> Tensor:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"self.log({name!r}, ...) needs a single value, got a tensor of shape {tuple(value.shape)}."
            )
        value = value.reshape(())
        return value if enable_graph else value.detach()
    if _is_number(value):
        return torch.tensor(float(value), dtype=numbers)
    raise ValueError(f"self.log({name!r}, ...) got a {type(value).__name__}; log a real number or a scalar tensor.")
