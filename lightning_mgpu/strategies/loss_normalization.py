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
    split_batch,
)

Kind = Literal["samples", "sum", "replica_mean", "tokens"]
KINDS = ("samples", "sum", "replica_mean", "tokens", "shifted_tokens")
IGNORE_INDEX = -100
#: A rule reproduces the sub-batch loss when it misses by at most this many machine epsilons of the loss's dtype
#: (relative; the experiment runs without autocast, where shard and whole-batch losses agree to rounding).
PRECISION_ULPS = 64
#: Every rule that weights the shards differently must miss by this many times more than the adopted one.
SEPARATION = 100.0
#: For a random step: the tolerance is this many times the change of its loss under another seed.
NOISE_MARGIN = 4.0
NOISE_SEED = 1_000_003
SUB_BATCH = 8

Path = tuple[Any, ...]
LossesOf = Callable[[list[Any], "int | None"], "list[Tensor] | None"]


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

    def describe(self, labels: Tensor | None = None) -> str:
        """In words; ``labels`` (the tensor at ``key``) tells one label per sample from rows of tokens."""
        if self.kind == "samples":
            return "a mean over samples (weighted by each device's sample count)"
        if self.kind == "sum":
            return "a sum (summed over devices)"
        if self.kind == "replica_mean":
            return "an equal-weight mean over devices"
        if labels is not None and labels.dim() <= 1:
            return f"a mean over the samples whose label {_show(self.key)} is not {self.ignore_index} (ignored labels)"
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
    labels: Tensor | None = None
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


def detect(batch: Any, dim: int, losses_of: LossesOf) -> Detection:
    """Find how ``losses_of``'s losses are normalised, from the first samples of ``batch``.

    ``losses_of(chunks, seed)`` runs the step on each chunk (chunk ``i`` on replica ``i``) without side effects and
    returns one scalar loss per chunk, or ``None`` when the step does not return a plain loss (then nothing is
    decided); with a ``seed`` its random draws are reseeded (to measure how random the step is).

    The closest rule is adopted when it reproduces the sub-batch's loss to the precision of the loss's dtype (or of the
    step's own randomness) and every rule that weights the shards differently misses by a hundred times more. Masking
    part of the labels first (:func:`_mask_first_shard`) makes the rules weight the shards very differently; rules
    that still tie are the same rule on this batch, and the first in order of preference is taken.
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
    rules = [SAMPLES, LossNormalization("sum")]
    for path, tensor in labels:
        rules.append(LossNormalization("tokens", path))
        if tensor.dim() > dim + 1:
            rules.append(LossNormalization("tokens", path, shifted=True))
    first = max(1, k // 2 - (1 if k % 2 == 0 and k >= 4 else 0))  # unequal shards: samples and sums differ
    attempts = (
        [(_mask_first_shard(sub, labels, dim, first), [first, k - first]), (sub, None)] if labels else [(sub, None)]
    )
    run: tuple[Any, list[int], list[Any], Tensor, list[Tensor]] | None = None
    for attempt, (candidate, split) in enumerate(attempts):
        try:
            run = _experiment(candidate, k, dim, rules, losses_of, split)
        except Exception as err:
            if attempt + 1 < len(attempts):
                continue  # the step may not accept masked labels (labels that index an embedding, a metric...)
            return Detection(None, sub_batch=k, reason=f"the step failed on a sub-batch ({type(err).__name__}: {err})")
        break
    if run is None:
        return Detection(None, reason="the step does not return a plain loss")
    candidate, split, chunks, reference, shards = run
    whole = float(reference.detach().double())
    values = [float(s.detach().double()) for s in shards]
    predictions = {rule: _predict(rule, values, chunks, split) for rule in rules}
    detection = Detection(None, None, whole, predictions, k)
    scale = max(abs(whole), 1e-30)
    errors = {r: abs(v - whole) / scale if math.isfinite(v) else math.inf for r, v in predictions.items()}
    eps = torch.finfo(reference.dtype if reference.is_floating_point() else torch.float32).eps
    best = min(rules, key=lambda rule: errors[rule])  # ties: the first in order of preference
    floor = PRECISION_ULPS * eps
    noise = 0.0
    if errors[best] > floor:  # a step that draws random numbers: allow for how much its loss moves with the seed
        again = losses_of([candidate], NOISE_SEED)
        if again is not None:
            noise = abs(float(again[0].detach().double()) - whole) / scale
            floor = max(floor, NOISE_MARGIN * noise)
    if errors[best] > floor:
        detection.reason = "no rule reproduces the sub-batch loss"
        if noise > 0:
            detection.reason += f"; the step is random: its loss moves by {noise:.2g} (relative) with the seed"
        return detection
    rivals = [r for r in rules if not _same_weights(r, best, chunks, split)]
    # Rivals must miss by far more than the winner; for a random step, by far more than its randomness.
    apart = SEPARATION * max(errors[best], eps) if noise == 0 else NOISE_MARGIN * floor
    if any(errors[r] < apart for r in rivals):
        detection.reason = "the rules are not clearly apart on this batch"
        return detection
    detection.normalization = best
    detection.labels = _lookup(candidate, best.key) if best.kind == "tokens" else None
    return detection


def _experiment(
    candidate: Any,
    k: int,
    dim: int,
    rules: list[LossNormalization],
    losses_of: LossesOf,
    preferred: list[int] | None = None,
) -> tuple[Any, list[int], list[Any], Tensor, list[Tensor]] | None:
    """The sub-batch's loss on one replica, then on two shards of it: ``preferred`` first, then the splits that tell the
    rules apart best, up to the first whose shard losses are all finite."""
    reference = losses_of([candidate], None)
    if reference is None:
        return None
    shards: list[Tensor] | None = None
    splits = _splits_by_preference(candidate, k, dim, rules)
    for split in [preferred, *splits] if preferred else splits:  # a shard may have nothing to average (NaN)
        chunks = _split(candidate, split, dim)
        shards = losses_of(chunks, None)
        if shards is None:
            return None
        if all(math.isfinite(float(s.detach())) for s in shards):
            break
    assert shards is not None
    return candidate, split, chunks, reference[0], shards


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
        # A shard that some rule gives no weight makes rules coincide (its loss may be 0 or NaN): avoid it.
        empty = any(0.0 in w for w in weights if isinstance(w, tuple))
        scored.append((not empty, len(set(weights)) + (min(gaps) if gaps else 0.0), -first, split))
    return [split for *_, split in sorted(scored, reverse=True)]


def _head(batch: Any, k: int, size: int, dim: int) -> Any:
    return _split(batch, [k, size - k], dim)[0] if k < size else batch


def _split(batch: Any, sizes: list[int], dim: int) -> list[Any]:
    device = next((t.device for _, t in iter_tensors(batch)), torch.device("cpu"))
    return split_batch(batch, [device] * len(sizes), dim, sizes=sizes)[0]


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


def _mask_first_shard(batch: Any, labels: list[tuple[Path, Tensor]], dim: int, first: int) -> Any:
    """The sub-batch with labels ignored so that the rules weight the shards very differently: in each of the first
    ``first`` samples (the first shard) only the first two labels that count are kept, so token counts are far from
    proportional to sample counts and a shifted count (1 per row) is half the unshifted one (2); with one label per
    sample, one sample's label is ignored. Both runs of the experiment see this same batch, so the comparison stays
    valid; shard losses that differ by chance only then become far apart under the wrong rules."""
    for path, tensor in labels:
        masked = tensor.clone()
        rows = masked.narrow(dim, 0, first)
        if rows.dim() == dim + 1:  # one label per sample
            target = 0 if first >= 2 else masked.shape[dim] - 1
            masked.select(dim, target).fill_(IGNORE_INDEX)
        else:
            valid = rows != IGNORE_INDEX
            rows.masked_fill_(valid & (valid.cumsum(-1) > 2), IGNORE_INDEX)
        batch = _replace(batch, path, masked)
    return batch


def _show(path: Path) -> str:
    return "batch" + "".join(f"[{p!r}]" for p in path)
