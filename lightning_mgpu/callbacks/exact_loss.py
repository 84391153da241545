"""``ExactLoss``: the optimizer step equals one device's step on the whole global batch, across micro-batches and
processes, for a loss that is a mean over a count (tokens, class weights), where Lightning's and DDP's equal weights
are biased."""

from __future__ import annotations

import functools
import importlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor
from typing_extensions import override

from lightning_mgpu.parallel.loss_combine import settle_weights
from lightning_mgpu.parallel.loss_graph import read_loss
from lightning_mgpu.parallel.scatter_gather import iter_tensors
from lightning_mgpu.strategies.loss_rules import describe

__all__ = ["ExactLossHooks", "Rule", "exact_loss_class", "read_rule", "scale_gradients"]

KEEP, MEAN, SUM, TERMS = "keep", "mean", "sum", "terms"
_LIGHTNING = "micro-batches and processes keep Lightning's weighting (each loss / accumulate_grad_batches, DDP's mean)"
_EQUAL = (
    "the counts of an accumulation window are not known before its backward, so each micro-batch's loss is weighted "
    "equally (Lightning's weighting). Set accumulate_grad_batches=1 for one device's step."
)
_ABSENT = object()
_NAMES = {"lightning.pytorch": "ExactLoss", "pytorch_lightning": "PytorchLightningExactLoss"}


@dataclass
class Rule:
    """A micro-batch's loss rule: the nodes where its terms enter the loss, each term's count (``None``: a sum), and
    what it is in words; without nodes, why Lightning's weighting is kept."""

    nodes: list[Any] = field(default_factory=list)
    counts: list[Any] = field(default_factory=list)
    said: str = ""

    @property
    def kind(self) -> str:
        """``keep``, ``sum`` (every term), ``mean`` (every term over one count) or ``terms`` (anything else)."""
        keys = {c if c is None or isinstance(c, int | float) else id(c) for c in self.counts}
        return KEEP if not self.nodes else SUM if keys == {None} else MEAN if len(keys) == 1 else TERMS


def read_rule(loss: Tensor, samples: int | None, sum_divisor: str = "auto", divided_by: int | None = None) -> Rule:
    """The rule of a micro-batch's ``loss`` (of ``samples`` samples) from its autograd record: a ``sum / divisor`` as
    the strategies read it unless ``sum_divisor`` says; a top division by ``divided_by`` (Lightning's) leaves a sum."""
    record = read_loss(loss, samples)
    if record is None or record.unknown or not record.terms:
        why = "it has no autograd record" if record is None else f"its record ends in {record.unknown or 'nothing'}"
        return Rule(said=f"the reader cannot explain the training loss ({why}): {_LIGHTNING}")
    counts = [weights[0] for weights in settle_weights([record], [-1 if samples is None else samples])]
    said = ""
    for t, term in enumerate(record.terms):
        if term.node is loss.grad_fn and isinstance(term.count, int | float) and term.count == divided_by:
            counts[t] = None  # Lightning's division of a sum: equal to the sample count or not, a sum
        elif term.summed is not None:  # a sum / divisor
            if sum_divisor != "auto":
                counts[t] = term.count if sum_divisor == "count" else None
            reading, other = ("count", "constant") if counts[t] is not None else ("constant", "count")
            how = f"as sum_divisor={sum_divisor!r} says" if sum_divisor != "auto" else f"if not: sum_divisor={other!r}"
            said += f"; its sum / divisor is read as a {reading} ({how})"
    said = f"the training loss is {describe(record, [[c] for c in counts])}{said}"
    return Rule([term.node for term in record.terms], counts, said)


def strategy_rule(loss: Tensor, counts: tuple[Any, ...] | None) -> Rule:
    """The rule under ``parallel_criterion`` (its loss is exact across devices): ``counts`` is ``strategy.loss_counts``,
    per term the whole batch's count."""
    if counts is None:
        return Rule(said=f"the strategy's loss rule did not come from the loss's autograd record: {_LIGHTNING}")
    if len(counts) > 1:
        return Rule(
            said=f"the loss adds {len(counts)} differently normalised terms, exact across devices, but {_EQUAL}"
        )
    return Rule([loss.grad_fn], list(counts), f"the strategy's loss is a {'sum' if counts[0] is None else 'mean'}")


def _scaled_by(scale: Any) -> Callable[[tuple[Tensor | None, ...]], tuple[Tensor | None, ...]]:
    """A node pre-hook multiplying the gradient flowing into the node by ``scale`` (a number or a tensor)."""
    return lambda grads: tuple(
        None if g is None else g * (scale.to(g.device, g.dtype) if isinstance(scale, Tensor) else scale) for g in grads
    )


def scale_gradients(optimizer: Any, scale: Tensor) -> None:
    """Multiply every gradient of ``optimizer`` by ``scale`` (0-dim: no host sync), one call per device and dtype."""
    grads: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for p in (p for group in optimizer.param_groups for p in group["params"] if p.grad is not None):
        grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for (device, dtype), tensors in grads.items():
        torch._foreach_mul_(tensors, scale.to(device, dtype))


def _sum_over_processes(trainer: Any, tensor: Tensor) -> Tensor:
    """``tensor`` summed over the processes: one all-reduce, without the barrier ``strategy.reduce`` adds."""
    if trainer.world_size > 1 and not torch.distributed.is_initialized():
        return trainer.strategy.reduce(tensor, reduce_op="sum")
    if trainer.world_size > 1:
        torch.distributed.all_reduce(tensor)
    return tensor


class ExactLossHooks:
    """The optimizer step equals one device's step on the whole global batch (every process's micro-batches of the
    accumulation window): each micro-batch's loss rule, read from its autograd record before backward (under
    ``parallel_criterion``, from ``strategy.loss_counts``), is applied by node pre-hooks. A mean over one count is
    backpropagated as a sum, and the gradients divided once by the window's global count before the optimizer step
    (one scalar all-reduce per step); a sum has Lightning's and DDP's divisions undone; means over different counts are
    each normalised by their global count (one all-reduce per micro-batch), each micro-batch weighted equally under
    accumulation; a loss the reader cannot explain keeps Lightning's weighting. The rule is settled on the first
    micro-batch (agreed across processes) and said once. Logged values are untouched. Automatic optimization only.

    Args:
        sum_divisor: what a ``sum / divisor`` term divides by: ``"auto"`` (read as the strategies read it), ``"count"``
            (a mean, as ``(loss * mask).sum() / mask.sum()``) or ``"constant"`` (a sum, scaled).
    """

    namespace = "lightning.pytorch"

    def __init__(self, sum_divisor: Literal["auto", "count", "constant"] = "auto") -> None:
        super().__init__()
        if sum_divisor not in ("auto", "count", "constant"):
            raise ValueError(f"sum_divisor must be 'auto', 'count' or 'constant', got {sum_divisor!r}")
        self.sum_divisor = sum_divisor
        self._plan: str | None = None  # the first micro-batch's rule kind, for the whole fit
        self._terms = 0
        self._samples: int | None = None
        self._count: Tensor | None = None  # the window's count on this process (plan "mean")
        self._said: set[str] = set()

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._plan, self._count = None, None  # each fit settles its own plan

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """The micro-batch's sample count (a ``sum / divisor`` by it is a mean)."""
        self._samples = next((len(t) for _, t in iter_tensors(batch) if t.dim() > 0), None)

    @override
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Tensor) -> None:
        """Read the micro-batch's rule; settle the plan on the first; put the pre-hooks."""
        accumulate, world = trainer.accumulate_grad_batches, trainer.world_size
        if accumulate == 1 and world == 1:
            return
        if not pl_module.automatic_optimization:
            return self._say(trainer, "manual", "ExactLoss acts under automatic optimization only: it does nothing.")
        if (counts := getattr(trainer.strategy, "loss_counts", _ABSENT)) is _ABSENT:
            rule = read_rule(loss, self._samples, self.sum_divisor, accumulate)
        else:
            rule = strategy_rule(loss, counts)
        if self._plan is None:
            self._settle_plan(trainer, rule, accumulate)
        if self._plan != KEEP:
            self._apply(trainer, loss, rule, accumulate, world)

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Divide the window's summed gradients once by its global count (plan ``mean``)."""
        if self._plan == MEAN and self._count is not None:
            total = _sum_over_processes(trainer, self._count)
            scale_gradients(optimizer, torch.where(total > 0, trainer.world_size / total, 0.0))
        self._count = None

    def _settle_plan(self, trainer: Any, rule: Rule, accumulate: int) -> None:
        """The plan for the whole fit, the same on every process (so that they run the same collectives)."""
        kind, self._terms = rule.kind, len(rule.counts)
        if trainer.world_size > 1:  # every code is equal where (their sum)^2 == world * (the sum of their squares)
            code = float((KEEP, MEAN, SUM, TERMS).index(kind) * 1000 + self._terms)
            codes = torch.tensor([code, code**2], dtype=torch.float64, device=trainer.strategy.root_device)
            total, squares = _sum_over_processes(trainer, codes).tolist()
            if total**2 != trainer.world_size * squares:
                kind, rule = KEEP, Rule(said=f"the processes' first losses have different forms: {_LIGHTNING}")
        self._plan, equal = kind, kind == TERMS and accumulate > 1
        tail = f": across processes each term is exact, but {_EQUAL}" if equal else "."
        self._say(trainer, "plan", f"ExactLoss: {rule.said}{tail}", info=kind != KEEP and not equal)

    def _apply(self, trainer: Any, loss: Tensor, rule: Rule, accumulate: int, world: int) -> None:
        """The pre-hooks that make the micro-batch's gradient exact under the plan; a loss of another form than the
        first is said once and read as the plan's kind (a per-sample mean, a sum) or, under ``terms``, left as is."""
        fits = rule.kind != KEEP and len(rule.counts) == self._terms if self._plan == TERMS else rule.kind == self._plan
        if not fits:
            self._say(trainer, "misfit", f"ExactLoss: a training loss differs in form from the first ({rule.said}).")
        root = trainer.strategy.root_device
        if self._plan == MEAN:  # a sum now, divided by the window's global count before the optimizer step
            count = rule.counts[0] if fits else self._samples or 1
            loss.grad_fn.register_prehook(_scaled_by(count * accumulate))
            count = torch.as_tensor(count, device=root, dtype=torch.float32 if root.type == "mps" else torch.float64)
            self._count = count if self._count is None else self._count + count
        elif self._plan == SUM:
            loss.grad_fn.register_prehook(_scaled_by(float(accumulate * world)))
        else:  # each sum term as a sum; each mean across processes times its share of the term's global count
            counts = [0 if c is None else c for c in rule.counts] if fits else [0] * self._terms
            if world > 1:  # every process runs this all-reduce, fitting or not
                local = torch.stack([torch.as_tensor(c).to(root, torch.float64) for c in counts])
                totals = _sum_over_processes(trainer, local.clone())
                shares = torch.where(totals > 0, local * world / totals, 0.0)
            for t, node in enumerate(rule.nodes if fits else []):
                if rule.counts[t] is None:
                    node.register_prehook(_scaled_by(float(accumulate * world)))
                elif world > 1:
                    node.register_prehook(_scaled_by(shares[t]))

    def _say(self, trainer: Any, key: str, message: str, info: bool = False) -> None:
        """Say ``message`` once per key, on global rank zero: a warning, or an info line of the namespace's logger."""
        if key not in self._said and trainer.is_global_zero:
            self._said.add(key)
            logging.getLogger(self.namespace).info(message) if info else warnings.warn(message, stacklevel=2)


@functools.cache
def exact_loss_class(namespace: str = "lightning.pytorch") -> type:
    """``ExactLoss`` for a Lightning ``namespace``, importable and picklable (``ddp_spawn``) from this module."""
    if namespace not in _NAMES:
        raise ValueError(f"Unknown Lightning namespace {namespace!r}: use one of {sorted(_NAMES)}.")
    body = {"__module__": __name__, "__qualname__": _NAMES[namespace], "__doc__": ExactLossHooks.__doc__}
    callback = importlib.import_module(namespace).Callback
    return type(_NAMES[namespace], (ExactLossHooks, callback), {**body, "namespace": namespace})


def __getattr__(name: str) -> Any:
    """``ExactLoss`` and ``PytorchLightningExactLoss``, built on first use: this module imports no Lightning."""
    namespace = next((space for space, class_name in _NAMES.items() if class_name == name), None)
    if namespace is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return exact_loss_class(namespace)
