"""How each device's loss is normalised, hence how the devices' losses combine into the whole batch's.

The rule comes from, in order: the step's ``loss_weight`` / ``loss_terms`` (:mod:`.step_outputs`); a declared
``loss_reduction`` (:class:`LossNormalization`); the loss's autograd record (:mod:`..parallel.loss_graph`); else a
per-sample mean, said once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor

from lightning_mgpu.parallel.loss_graph import TERM_WORDS, LossRecord, count_targets
from lightning_mgpu.parallel.reduce import Weight

Kind = Literal["samples", "sum", "replica_mean", "tokens"]
IGNORE_INDEX = -100
Path = tuple[Any, ...]


@dataclass(frozen=True)
class LossNormalization:
    """How each replica's loss is normalised: ``samples``, ``sum``, ``replica_mean`` (equal weights) or ``tokens``
    (a mean over the labels at ``key`` that are not ``ignore_index``, class-weighted when given, the first position
    left out when ``shifted``, as causal LMs shift labels)."""

    kind: Kind
    key: Path = ()
    shifted: bool = False
    ignore_index: int = IGNORE_INDEX
    class_weight: tuple[float, ...] | None = None

    @classmethod
    def parse(cls, spec: str) -> LossNormalization | None:
        """A ``loss_reduction`` string (``"auto"``: ``None``); ``<key>`` in ``"tokens:<key>[:<ignore_index>]"`` is a
        dict key, a position in a tuple batch or a dotted path of them (``targets.labels``)."""
        if not isinstance(spec, str):
            raise TypeError(f"loss_reduction must be a string, got {type(spec).__name__}.")
        name, _, key = spec.partition(":")
        if spec == "auto":
            return None
        if name in ("samples", "sum", "replica_mean") and not key:
            return cls(cast(Kind, name))
        key, _, ignore = key.partition(":")
        if name in ("tokens", "shifted_tokens") and key and (not ignore or ignore.lstrip("-").isdigit()):
            path = tuple(int(part) if part.isdigit() else part for part in key.split("."))
            ignore_index = int(ignore) if ignore else IGNORE_INDEX
            return cls("tokens", path, shifted=name == "shifted_tokens", ignore_index=ignore_index)
        raise ValueError(
            f"loss_reduction must be one of 'auto', 'samples', 'sum', 'replica_mean', 'tokens:<key>' or "
            f"'shifted_tokens:<key>' (e.g. 'tokens:labels'; 'tokens:labels:255' for an ignore index other than -100), "
            f"got {spec!r}."
        )

    def spec(self) -> str:
        if self.kind != "tokens":
            return self.kind
        ignore = "" if self.ignore_index == IGNORE_INDEX else f":{self.ignore_index}"
        return f"{'shifted_tokens' if self.shifted else 'tokens'}:{'.'.join(map(str, self.key))}{ignore}"

    def describe(self) -> str:
        if self.kind != "tokens":
            return _KIND_WORDS[self.kind]
        weighted = ", weighted by class" if self.class_weight is not None else ""
        shift = ", shifted by one position as causal LMs do" if self.shifted else ""
        return f"a mean over the labels in {show(self.key)} that are not {self.ignore_index}{weighted}{shift}"

    def weights(self, chunks: Sequence[Any], sample_counts: Sequence[int]) -> list[Weight | str]:
        """Each replica's weight (:func:`.step_outputs.combine_losses`): its sample or label count, ``"sum"``, or 1."""
        if self.kind == "tokens":
            return [self.count(chunk) for chunk in chunks]
        if self.kind == "sum":
            return ["sum"] * len(sample_counts)
        return [1] * len(sample_counts) if self.kind == "replica_mean" else list(sample_counts)

    def count(self, batch: Any) -> Tensor:
        labels = batch
        for part in self.key:
            try:
                labels = labels[part]
            except (KeyError, IndexError, TypeError) as err:
                raise ValueError(
                    f"loss_reduction names the labels {show(self.key)}, but the batch has no such entry ({err!r}). "
                    "Name a dict key (tokens:labels), a position in a tuple (tokens:1) or a dotted path (tokens:a.b)."
                ) from None
        if not isinstance(labels, Tensor):
            raise ValueError(
                f"loss_reduction names {show(self.key)}, which is a {type(labels).__name__}, not a tensor."
            )
        if self.shifted:
            labels = labels[..., 1:]
        weight = None if self.class_weight is None else torch.tensor(self.class_weight, device=labels.device)
        return count_targets(labels, weight, self.ignore_index)


_KIND_WORDS = {
    "samples": "a mean over samples (weighted by each device's sample count)",
    "sum": "a sum (summed over devices)",
    "replica_mean": "an equal-weight mean over devices",
}
SAMPLES = LossNormalization("samples")
SUM = LossNormalization("sum")


def describe(record: LossRecord, weights: Sequence[Sequence[Any]]) -> str:
    """A read rule in words: each term's normalisation, by the node that says it."""
    parts = [
        "a regulariser of the weights: counted once"
        if term.name.endswith(" of the parameters")
        else f"{TERM_WORDS.get(term.name, term.name)}: "
        + ("a sum" if any(w is None for w in term_weights) else "a mean")
        for term, term_weights in zip(record.terms, weights, strict=True)
    ]
    return parts[0] if len(parts) == 1 else f"a sum of {len(parts)} terms ({'; '.join(parts)}), each weighted apart"


def unread_message(strategy: str, why: str, options: str) -> str:
    return (
        f"{strategy}: {why}, so each device's loss is weighted by its sample count, which equals one device for a "
        "per-sample mean. For a sum or a mean over tokens, declare it: loss_reduction='sum' | 'tokens:<labels key>' "
        f"(CLI: {options}), or return {{'loss': loss, 'loss_weight': <count it averages over>}} from training_step."
    )


def coupling_message(strategy: str, what: str) -> str:
    fix = (
        "the strategy's default sync_batchnorm=True, or Trainer(sync_batchnorm=True) (statistics over the whole batch)"
        if what.startswith("BatchNorm")
        else "strategy='dp' (the loss runs on the whole batch), or self.all_gather(..., sync_grads=True) in the step "
        "to compute it over the whole batch"
    )
    return (
        f"{strategy}: the training loss couples samples across the batch through {what}: each device computes it on "
        f"its shard, which differs from one device. For one device's result use {fix}."
    )


def show(path: Path) -> str:
    return "batch" + "".join(f"[{p!r}]" for p in path)
