"""What a step's loss is normalised by, and finding it out on the first step when the user did not say.

Each replica's loss covers its shard only. Combining shard losses into the whole batch's loss needs to know how each
was normalised: a per-sample mean is weighted by sample counts, a sum is summed, and a token mean (``transformers``'
``.loss``: a mean over ``labels != -100``, shifted by one position for causal LMs) is weighted by each shard's valid
tokens. A wrong guess trains silently differently from one device.

:class:`LossNormalization` is that rule. :func:`detect` establishes it from one experiment on a small sub-batch of
the first batch: the caller runs the step (or the forward) once on the sub-batch and once on two unequal shards of it,
without side effects, and each hypothesis predicts the sub-batch's loss from the shards' losses. The hypothesis that
reproduces it, clearly apart from the others, is adopted. When labels alone cannot tell samples from tokens (no
padding), the experiment masks part of the labels of one sample: both runs see the same batch, so the comparison
stays valid.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_mgpu.parallel.reduce import Weight, reduce_losses
from lightning_mgpu.parallel.scatter_gather import (
    BatchSplitError,
    batch_size_of,
    is_namedtuple,
    iter_tensors,
    rebuild,
    scatter,
)

Kind = Literal["samples", "sum", "replica_mean", "tokens"]
KINDS = ("samples", "sum", "replica_mean", "tokens", "shifted_tokens")
IGNORE_INDEX = -100
#: Relative difference under which a hypothesis reproduces the sub-batch loss (the experiment runs in float32 or
#: float64 with autocast off, where shard and whole-batch losses agree to ~1e-6).
TOLERANCE = 1e-4
#: Other hypotheses must miss by this many times the tolerance for the winner to count as clearly established.
SEPARATION = 10.0
SUB_BATCH = 8

Path = tuple[Any, ...]


@dataclass(frozen=True)
class LossNormalization:
    """How each replica's loss is normalised: ``samples`` (a per-sample mean), ``sum``, ``replica_mean`` (equal weights,
    Lightning 1.x ``dp``) or ``tokens`` (a mean over the entries of ``key`` that are not ``ignore_index``, the first
    position of each row left out when ``shifted``, as causal LMs shift labels)."""

    kind: Kind
    key: Path = ()
    shifted: bool = False
    ignore_index: int = IGNORE_INDEX

    @classmethod
    def parse(cls, spec: str) -> LossNormalization | None:
        """``"auto"`` (None: detect), ``"samples"``, ``"sum"``, ``"replica_mean"``, ``"tokens:<key>"`` or
        ``"shifted_tokens:<key>"``, where ``<key>`` names the labels in the batch: a dict key (``labels``), a
        position in a tuple batch (``1``), or a dotted path of them (``targets.labels``)."""
        if not isinstance(spec, str):
            raise TypeError(f"loss_reduction must be a string, got {type(spec).__name__}.")
        name, _, key = spec.partition(":")
        if spec == "auto":
            return None
        if name in ("samples", "sum", "replica_mean") and not key:
            return cls(name)  # type: ignore[arg-type]
        if name in ("tokens", "shifted_tokens") and key:
            path = tuple(int(part) if part.isdigit() else part for part in key.split("."))
            return cls("tokens", path, shifted=name == "shifted_tokens")
        raise ValueError(
            f"loss_reduction must be one of 'auto', 'samples', 'sum', 'replica_mean', 'tokens:<key>' or "
            f"'shifted_tokens:<key>' (e.g. 'tokens:labels'), got {spec!r}."
        )

    def spec(self) -> str:
        """The ``loss_reduction`` string that selects this rule."""
        if self.kind != "tokens":
            return self.kind
        return f"{'shifted_tokens' if self.shifted else 'tokens'}:{'.'.join(map(str, self.key))}"

    def describe(self) -> str:
        if self.kind == "samples":
            return "a mean over samples (weighted by each device's sample count)"
        if self.kind == "sum":
            return "a sum (summed over devices)"
        if self.kind == "replica_mean":
            return "an equal-weight mean over devices"
        shift = ", shifted by one position as causal LMs do" if self.shifted else ""
        return f"a mean over the tokens of {_show(self.key)} that are not {self.ignore_index}{shift}"

    def weights(self, chunks: Sequence[Any], sample_counts: Sequence[int]) -> list[Weight]:
        """Each replica's weight under this rule (``samples`` and ``tokens``; the others have none)."""
        if self.kind == "tokens":
            return [self.count(chunk) for chunk in chunks]
        return list(sample_counts)

    def count(self, batch: Any) -> Tensor:
        """The number of tokens this rule averages over in ``batch``."""
        labels = _lookup(batch, self.key)
        if self.shifted:
            labels = labels[..., 1:]
        return (labels != self.ignore_index).sum()

    def reduce(self, losses: Sequence[Tensor], weights: Sequence[Weight], root: torch.device) -> Tensor:
        if self.kind in ("sum", "replica_mean"):
            return reduce_losses(losses, None, root, self.kind)
        return reduce_losses(losses, weights, root, "weighted")


SAMPLES = LossNormalization("samples")


@dataclass
class Detection:
    """The outcome of :func:`detect`: the rule (``None`` when not established), the losses and what each rule
    predicted, for the message."""

    normalization: LossNormalization | None
    reference: float = math.nan
    predictions: dict[LossNormalization, float] = field(default_factory=dict)
    sub_batch: int = 0
    reason: str = ""

    def report(self) -> str:
        lines = [f"the loss of a {self.sub_batch}-sample sub-batch on one device is {self.reference:.6g}"]
        for rule, value in self.predictions.items():
            diff = abs(value - self.reference)
            lines.append(f"  {rule.spec()!r}: the shards' losses combine to {value:.6g} (difference {diff:.2g})")
        return "\n".join(lines)


def detect(batch: Any, dim: int, losses_of: Callable[[list[Any]], list[Tensor] | None]) -> Detection:
    """Find how ``losses_of``'s losses are normalised, from the first samples of ``batch``.

    ``losses_of(chunks)`` runs the step on each chunk (chunk ``i`` on replica ``i``) without side effects and returns
    one scalar loss per chunk, or ``None`` when the step does not return a plain loss (then nothing is decided).
    """
    try:
        size = batch_size_of(batch, dim)
    except BatchSplitError as err:
        return Detection(None, reason=f"the batch has no batch dimension to split ({err})")
    if size < 2:
        return Detection(None, reason="the batch has fewer than 2 samples")
    k = min(size, SUB_BATCH)
    sub = _head(batch, k, size, dim)
    labels = _label_candidates(sub, dim)
    rules = [SAMPLES, LossNormalization("sum"), LossNormalization("replica_mean")]
    for path, tensor in labels:
        rules.append(LossNormalization("tokens", path))
        if tensor.dim() > dim + 1:
            rules.append(LossNormalization("tokens", path, shifted=True))
    attempts = [_mask_first_sample(sub, labels, dim), sub] if any(t.dim() > dim + 1 for _, t in labels) else [sub]
    reference = shards = None
    for attempt, candidate in enumerate(attempts):
        try:
            reference = losses_of([candidate])
            if reference is None:
                return Detection(None, reason="the step does not return a plain loss")
            for split in _splits_by_preference(candidate, k, dim, rules):  # a shard may have nothing to average
                chunks = _split(candidate, split, dim)
                shards = losses_of(chunks)
                if shards is None or all(math.isfinite(float(s.detach())) for s in shards):
                    break
        except Exception as err:
            if attempt + 1 < len(attempts):
                continue  # the step may not accept masked labels (e.g. labels that index an embedding)
            return Detection(None, sub_batch=k, reason=f"the step failed on a sub-batch ({type(err).__name__}: {err})")
        break
    if reference is None or shards is None:
        return Detection(None, reason="the step does not return a plain loss")
    whole = float(reference[0].detach().double())
    values = [float(s.detach().double()) for s in shards]
    predictions = {rule: _predict(rule, values, chunks, split) for rule in rules}
    detection = Detection(None, whole, predictions, k)
    scale = max(abs(whole), 1e-12)
    errors = {rule: abs(value - whole) / scale for rule, value in predictions.items()}
    matching = [rule for rule in rules if errors[rule] <= TOLERANCE]
    if not matching:
        detection.reason = "no rule reproduces the sub-batch loss"
        return detection
    best = matching[0]  # rules are listed in order of preference
    others = [r for r in rules if r not in matching and not _same_weights(r, best, chunks, split)]
    if any(errors[r] <= SEPARATION * TOLERANCE for r in others):
        detection.reason = "the rules are not clearly apart on this batch"
        return detection
    detection.normalization = best
    return detection


def _predict(rule: LossNormalization, values: list[float], chunks: list[Any], sizes: list[int]) -> float:
    if rule.kind == "sum":
        return sum(values)
    if rule.kind == "replica_mean":
        return sum(values) / len(values)
    weights = [float(w) for w in rule.weights(chunks, sizes)]
    total = sum(weights)
    if total == 0:
        return math.nan
    return sum(v * w for v, w in zip(values, weights, strict=True) if w > 0) / total


def _normalized_weights(rule: LossNormalization, chunks: list[Any], sizes: list[int]) -> tuple[float, ...] | str:
    if rule.kind in ("sum", "replica_mean"):
        return rule.kind
    weights = [float(w) for w in rule.weights(chunks, sizes)]
    total = sum(weights) or 1.0
    return tuple(round(w / total, 9) for w in weights)


def _same_weights(a: LossNormalization, b: LossNormalization, chunks: list[Any], sizes: list[int]) -> bool:
    return _normalized_weights(a, chunks, sizes) == _normalized_weights(b, chunks, sizes)


def _splits_by_preference(sub: Any, k: int, dim: int, rules: list[LossNormalization]) -> list[list[int]]:
    """Splits of the sub-batch into two shards, those whose weights tell the rules apart best first."""
    scored = []
    for first in range(1, k):
        split = [first, k - first]
        chunks = _split(sub, split, dim)
        weights = [_normalized_weights(r, chunks, split) for r in rules]
        numeric = [w[0] for w in weights if isinstance(w, tuple)]
        gaps = [abs(a - b) for i, a in enumerate(numeric) for b in numeric[i + 1 :] if a != b]
        scored.append((len(set(weights)) + (min(gaps) if gaps else 0.0), -first, split))
    return [split for *_, split in sorted(scored, reverse=True)]


def _head(batch: Any, k: int, size: int, dim: int) -> Any:
    return _split(batch, [k, size - k], dim)[0] if k < size else batch


def _split(batch: Any, sizes: list[int], dim: int) -> list[Any]:
    device = next((t.device for _, t in iter_tensors(batch)), torch.device("cpu"))
    return scatter(batch, [device] * len(sizes), dim, sizes=sizes)[0]


def _label_candidates(batch: Any, dim: int) -> list[tuple[Path, Tensor]]:
    """Integer tensors that may hold labels: one row of tokens per sample (or ignored entries), not the first input."""
    candidates = []
    for path, tensor in _paths(batch):
        if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool or tensor.dim() <= dim:
            continue
        named = any(isinstance(p, str) and ("label" in p.lower() or "target" in p.lower()) for p in path)
        positional_target = bool(path) and all(isinstance(p, int) for p in path) and path[-1] != 0
        if named or positional_target or bool((tensor == IGNORE_INDEX).any()):
            candidates.append((path, tensor))
    return candidates


def _paths(obj: Any, prefix: Path = ()) -> list[tuple[Path, Tensor]]:
    if isinstance(obj, Tensor):
        return [(prefix, obj)]
    if isinstance(obj, Mapping):
        return [item for key in obj for item in _paths(obj[key], (*prefix, key))]
    if isinstance(obj, (list, tuple)) and not is_namedtuple(obj):
        return [item for i, value in enumerate(obj) for item in _paths(value, (*prefix, i))]
    return []


def _lookup(batch: Any, path: Path) -> Tensor:
    value = batch
    for part in path:
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError) as err:
            raise ValueError(
                f"loss_reduction names the labels {_show(path)}, but the batch has no such entry ({err!r}). Name a "
                "dict key (tokens:labels), a position in a tuple batch (tokens:1) or a dotted path (tokens:a.b)."
            ) from None
    if not isinstance(value, Tensor):
        raise ValueError(f"loss_reduction names {_show(path)}, which is a {type(value).__name__}, not a tensor.")
    return value


def _replace(batch: Any, path: Path, value: Tensor) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(batch, (list, tuple)):
        items = list(batch)
        items[head] = _replace(items[head], rest, value)
        return rebuild(batch, items)
    items = {k: (_replace(v, rest, value) if k == head else v) for k, v in batch.items()}
    return rebuild(batch, items)


def _mask_first_sample(batch: Any, labels: list[tuple[Path, Tensor]], dim: int) -> Any:
    """The sub-batch with the second half of the first sample's label rows ignored, so that token counts are not
    proportional to sample counts and shifted counts differ from unshifted ones (both runs of the experiment see
    this same batch)."""
    for path, tensor in labels:
        if tensor.dim() <= dim + 1:
            continue
        masked = tensor.clone()
        row = masked.select(dim, 0)
        length = row.shape[-1]
        row[..., length // 2 :] = IGNORE_INDEX
        batch = _replace(batch, path, masked)
    return batch


def _show(path: Path) -> str:
    return "batch" + "".join(f"[{p!r}]" for p in path)
