"""How each device's loss is normalised, which decides how the devices' losses combine into the whole batch's.

The rule comes from the step (``loss_weight`` / ``loss_terms``), else ``loss_reduction=``, else what the module's
objects say (:func:`known_rule`), else a per-sample mean, said once. Nothing here runs user code."""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from lightning_mgpu.parallel.library_hooks import outermost_transformers_models
from lightning_mgpu.parallel.modules import count_labels, has_torch_loss_forward
from lightning_mgpu.parallel.reduce import Weight

Kind = Literal["samples", "sum", "replica_mean", "tokens"]
IGNORE_INDEX = -100
Path = tuple[Any, ...]
#: Batch keys that name the labels, for a criterion module whose targets the batch must supply.
LABEL_KEYS = ("labels", "label", "targets", "target", "y")
#: The keyword with which a ``transformers`` loss is a sum over tokens divided by the count given: a part of one sum.
ITEM_COUNT = "num_items_in_batch"


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
        """A ``loss_reduction`` string; ``"auto"`` gives ``None``. ``<key>`` in ``"tokens:<key>[:<ignore_index>]"`` is a
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
        """The ``loss_reduction`` string that selects this rule."""
        if self.kind != "tokens":
            return self.kind
        ignore = "" if self.ignore_index == IGNORE_INDEX else f":{self.ignore_index}"
        return f"{'shifted_tokens' if self.shifted else 'tokens'}:{'.'.join(map(str, self.key))}{ignore}"

    def describe(self) -> str:
        """The rule in words."""
        if self.kind != "tokens":
            return _KIND_WORDS[self.kind]
        weighted = ", weighted by class" if self.class_weight is not None else ""
        shift = ", shifted by one position as causal LMs do" if self.shifted else ""
        return f"a mean over the labels in {show(self.key)} that are not {self.ignore_index}{weighted}{shift}"

    def weights(self, chunks: Sequence[Any], sample_counts: Sequence[int]) -> list[Weight | str]:
        """Each replica's weight (see :func:`.step_outputs.combine_losses`): its sample or label count, ``"sum"`` for a
        sum, 1 for ``replica_mean``."""
        if self.kind == "tokens":
            return [self.count(chunk) for chunk in chunks]
        if self.kind == "sum":
            return ["sum"] * len(sample_counts)
        return [1] * len(sample_counts) if self.kind == "replica_mean" else list(sample_counts)

    def count(self, batch: Any) -> Tensor:
        """The labels of ``batch`` this rule averages over."""
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
        weight = None if self.class_weight is None else torch.tensor(self.class_weight, dtype=torch.float64)
        return count_labels(labels, self.ignore_index, weight)


_KIND_WORDS = {
    "samples": "a mean over samples (weighted by each device's sample count)",
    "sum": "a sum (summed over devices)",
    "replica_mean": "an equal-weight mean over devices",
}
SAMPLES = LossNormalization("samples")
SUM = LossNormalization("sum")


def known_rule(module: nn.Module, batch: Any, method: str = "training_step") -> tuple[LossNormalization, str] | None:
    """The rule the objects in ``module`` say, with what said it, or ``None``: the one outermost ``transformers``
    model's by its task, else that of the loss modules ``method`` (or a method it calls) names, when they agree and run
    torch's own forward."""
    models = outermost_transformers_models(module)
    return (_model_rule(models[0], batch) if len(models) == 1 else None) or _criterion_rule(module, batch, method)


def uncombinable_loss(module: nn.Module) -> str | None:
    """What to return instead when the model's loss adds terms normalised differently (BERT pre-training), which no
    rule combines; else ``None``."""
    models = outermost_transformers_models(module)
    if len(models) != 1 or not type(models[0]).__name__.endswith("ForPreTraining"):
        return None
    return (
        f"{type(models[0]).__name__}'s loss adds a mean over masked tokens (MLM) and a mean over samples (NSP), "
        "which one weight per device cannot combine. Return the terms with their counts from training_step: "
        "{'loss': mlm_loss + nsp_loss, 'loss_terms': {'mlm': (mlm_loss, (labels != -100).sum()), "
        "'nsp': (nsp_loss, len(next_sentence_label))}}"
    )


def _model_rule(model: nn.Module, batch: Any) -> tuple[LossNormalization, str] | None:
    """The rule a ``transformers`` model's task says for its loss on ``batch``'s labels, or ``None``: a sum when
    ``batch`` (or a call's arguments) holds ``num_items_in_batch`` for a model that divides by it."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("labels"), Tensor):
        return None
    rule = _task_rule(model, batch["labels"])
    if rule is None:
        return None
    name = type(model).__name__
    passed = batch.get(ITEM_COUNT) is not None
    divides = _divides_by_item_count(type(model)) if passed and rule.kind == "tokens" else False
    if divides is None:
        return None  # its source is unreadable: a token mean or a part of a sum, nothing tells
    if not divides:
        return rule, f"{name}'s loss"
    return SUM, f"{name}'s loss with {ITEM_COUNT} (a sum over tokens divided by that count)"


def _task_rule(model: nn.Module, labels: Tensor) -> LossNormalization | None:
    """The rule of a ``transformers`` model's default loss for its task, or ``None`` for a task not known here."""
    name = type(model).__name__
    config = model.config
    tokens = LossNormalization("tokens", ("labels",))
    if getattr(config, "is_encoder_decoder", False) and "ForConditionalGeneration" in name:
        return tokens  # decoder targets, aligned with the decoder's outputs
    if name.endswith(("ForCausalLM", "LMHeadModel")) or getattr(model, "loss_type", None) == "ForCausalLM":
        return LossNormalization("tokens", ("labels",), shifted=True)
    if name.endswith(("ForMaskedLM", "ForTokenClassification")):
        return tokens
    if name.endswith(("ForSequenceClassification", "ForImageClassification", "ForAudioClassification")):
        # Cross-entropy ignores labels of -100; regression or multi-label is a mean over samples x outputs.
        single_label = config.num_labels > 1 and not labels.is_floating_point()
        cross_entropy = single_label and getattr(config, "problem_type", None) in (None, "single_label_classification")
        return tokens if cross_entropy else SAMPLES
    return None


@functools.cache
def _divides_by_item_count(model_class: type) -> bool | None:
    """Whether the model's ``forward`` hands its keyword arguments to ``self.loss_function`` (which divides by
    ``num_items_in_batch``; BERT's MLM head does not); ``None`` when its source is unreadable."""
    try:
        source = inspect.getsource(model_class.forward)
    except (OSError, TypeError):
        return None
    return re.search(r"self\.loss_function\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\*\*", source) is not None


def loss_producers(module: nn.Module, method: str) -> list[nn.Module]:
    """The modules whose outputs are losses: the loss modules ``method`` (or a method it calls) names, and the one
    outermost ``transformers`` model."""
    models = outermost_transformers_models(module)
    criteria = [m for m in _named_criteria(module, method) if m.reduction != "none"]
    return criteria + (models if len(models) == 1 else [])


def call_weight(producer: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], output: Any) -> Any:
    """What one call of a loss producer averages over: its non-ignored labels (class-weighted) for a cross-entropy,
    ``"sum"`` for a sum, its samples for another mean, a ``transformers`` model's count by its task; ``None`` when
    the call does not say (a loss module's own forward)."""
    if isinstance(producer, nn.modules.loss._Loss):
        if producer.reduction == "sum":
            return "sum"
        if not has_torch_loss_forward(producer):
            return None  # its own forward: what its mean counts is not in its options
        target = args[1] if len(args) > 1 else kwargs.get("target")
        class_indices = isinstance(target, Tensor) and not target.is_floating_point()
        if isinstance(producer, (nn.CrossEntropyLoss, nn.NLLLoss)) and class_indices:
            return count_labels(target, producer.ignore_index, producer.weight)
        first = args[0] if args else kwargs.get("input")
        return _mean_count(producer, first, target) if isinstance(first, Tensor) else None
    said = _model_rule(producer, kwargs)  # the producer is the outermost model: no walk of its modules per call
    labels = kwargs.get("labels")
    if said is None or not isinstance(labels, Tensor):
        return None
    if said[0].kind != "sum":
        return said[0].weights([kwargs], [len(labels)])[0]
    # Divided by the count given: this call's own count makes it a token mean, another (the batch's) a part of a sum.
    own = _task_rule(producer, labels)
    count = own.count(kwargs) if own is not None else None
    return count if count is not None and bool(torch.as_tensor(kwargs[ITEM_COUNT]).to(count) == count) else "sum"


#: torch losses with one value per sample (batch first): their mean is over samples, whatever the other dimensions.
_PER_SAMPLE_LOSSES = (
    nn.CosineEmbeddingLoss,
    nn.MultiLabelMarginLoss,
    nn.MultiLabelSoftMarginLoss,
    nn.MultiMarginLoss,
    nn.TripletMarginLoss,
    nn.TripletMarginWithDistanceLoss,
)


def _mean_count(criterion: nn.Module, first: Tensor, target: Any) -> int:
    """How many values a torch loss module's mean divides by (its unreduced output's elements), from its input's
    shape: CTC's batch is the second dimension of its (T, N, C) input; per-sample losses count samples (batch first);
    a cross-entropy on probabilities, samples and positions; the others, elements (sequence-first inputs too)."""
    if isinstance(criterion, nn.CTCLoss):
        return first.shape[1] if first.dim() == 3 else 1
    if isinstance(criterion, _PER_SAMPLE_LOSSES) or getattr(criterion, "reduction", None) == "batchmean":
        return first.shape[0] if first.dim() > 1 else 1
    if isinstance(criterion, nn.CrossEntropyLoss):
        return first.numel() // first.shape[1] if first.dim() > 1 else 1
    try:
        shape = torch.broadcast_shapes(first.shape, target.shape) if isinstance(target, Tensor) else first.shape
    except RuntimeError:
        shape = first.shape
    return shape.numel()


def _named_criteria(module: nn.Module, method: str) -> list[nn.Module]:
    """The loss modules ``method`` (or a method it calls) names; every one when its source is unreadable."""
    source = _method_source(module, method)
    return [
        m
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.loss._Loss)
        and (source is None or re.search(rf"\b\w+\.{re.escape(name.split('.')[0])}\b", source))
    ]


def _criterion_rule(module: nn.Module, batch: Any, method: str) -> tuple[LossNormalization, str] | None:
    criteria = _named_criteria(module, method)
    rules = {_rule_of(c, batch) for c in criteria}
    if len(rules) != 1 or None in rules:
        return None
    (rule,) = rules
    names = sorted({type(c).__name__ for c in criteria})
    return rule, " and ".join(names) + f" (reduction={criteria[0].reduction!r})"


def _method_source(module: nn.Module, method: str) -> str | None:
    """The source of ``method`` and of the methods it calls (one level); ``None`` when unreadable."""
    try:
        source = inspect.getsource(getattr(type(module), method))
    except (AttributeError, OSError, TypeError):
        return None
    called = set(re.findall(r"\b\w+\.(\w+)\(", source)) - {method}
    if re.search(r"\bself\(", source):  # self(...) runs forward
        called.add("forward")
    for name in called:
        with contextlib.suppress(AttributeError, OSError, TypeError):
            source += inspect.getsource(getattr(type(module), name))
    return source


def _rule_of(criterion: nn.Module, batch: Any) -> LossNormalization | None:
    reduction = criterion.reduction
    if reduction == "sum":
        return SUM
    if reduction not in ("mean", "batchmean"):
        return None  # "none": the step reduces the per-sample losses itself, in its own way
    if not has_torch_loss_forward(criterion):
        return None  # its own forward (shifted or masked labels): the options do not say what its mean counts
    if not isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return SAMPLES  # a mean over elements: every sample holds as many
    key = _labels_key(batch)
    if key is None:
        return None
    weight = None if criterion.weight is None else tuple(criterion.weight.detach().cpu().double().tolist())
    return LossNormalization("tokens", key, ignore_index=criterion.ignore_index, class_weight=weight)


def _labels_key(batch: Any) -> Path | None:
    """Where the labels are: a dict's label key, else the last item of a tuple or list batch, if an integer tensor."""
    if isinstance(batch, Mapping):
        keys = [k for k in LABEL_KEYS if isinstance(batch.get(k), Tensor)]
        return (keys[0],) if len(keys) == 1 and not batch[keys[0]].is_floating_point() else None
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        last = batch[-1]
        if isinstance(last, Tensor) and not last.is_floating_point() and last.dtype != torch.bool:
            return (len(batch) - 1,)
    return None


def labels_spec(batch: Any) -> str:
    """How ``loss_reduction`` names this batch's labels (``labels``, ``1``), or ``<labels key>`` when unclear."""
    key = _labels_key(batch)
    return ".".join(map(str, key)) if key is not None else "<labels key>"


def show(path: Path) -> str:
    return "batch" + "".join(f"[{p!r}]" for p in path)
