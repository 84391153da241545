"""``strategy="parallel_criterion"``: every device runs the whole ``*_step`` (forward **and** loss) on its shard; one
scalar loss per device reaches the root, combined by the rule of :mod:`.loss_normalization`."""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_mgpu.parallel.merge import merge_outputs
from lightning_mgpu.parallel.run_replicas import ExecutionMode
from lightning_mgpu.parallel.scatter_gather import split_batch
from lightning_mgpu.strategies.loss_normalization import (
    SAMPLES,
    SUM,
    LossNormalization,
    call_weight,
    known_rule,
    labels_spec,
    loss_producers,
    uncombinable_loss,
)
from lightning_mgpu.strategies.single_process import SingleProcessParallel
from lightning_mgpu.strategies.step_outputs import (
    LOSS_TERMS_KEY,
    LOSS_WEIGHT_KEY,
    LossCapture,
    all_or_none,
    implied_loss_weights,
    reduce_training_outputs,
    tensor_key,
)

# Lightning's collectives (self.all_gather, strategy.reduce...), not torch.distributed's: those see one process here.
_COLLECTIVE_CALL = re.compile(
    r"(?<!distributed)(?<!dist)\.(all_gather|reduce_boolean_decision|barrier|broadcast)\s*\(|strategy\.(reduce)\s*\("
)
_LIBRARIES = ("lightning.", "pytorch_lightning.", "torch.", "torchmetrics.", "builtins")


class ParallelCriterionStrategyBase(SingleProcessParallel):
    """One process, N devices: forward and loss on every device, shard losses combined exactly on the root.

    Args:
        loss_reduction: how each device's loss is normalised, hence how the losses combine: ``"auto"`` (what the
            module's objects say, else a per-sample mean, said once), ``"samples"``, ``"sum"``, ``"tokens:<key>"`` /
            ``"shifted_tokens:<key>"`` (a mean over the labels ``batch[<key>]`` that are not -100; append
            ``:<ignore_index>`` for another) or ``"replica_mean"``. A step's ``loss_weight`` / ``loss_terms`` win.
        collectives: whether the step calls ``self.all_gather``, ``strategy.reduce``, ``broadcast``, ``barrier`` or
            ``reduce_boolean_decision``; ``None``: read from the module's source code.
        dim: the batch dimension to split along.
        execution_mode: ``"auto"`` (threads on distinct GPUs, else sequential), ``"threads"`` or ``"sequential"``.

    In a step, ``self`` is the device's replica (an attribute rebound there stays on it) and sees its shard. Manual
    optimization is refused (every replica would step the optimizer): use ``strategy="dp"``.
    """

    strategy_name = "parallel_criterion"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        loss_reduction: str = "auto",
        collectives: bool | None = None,
        dim: int = 0,
        execution_mode: ExecutionMode = "auto",
    ) -> None:
        super().__init__(
            accelerator, parallel_devices, checkpoint_io, precision_plugin, dim, execution_mode, loss_reduction
        )
        self.collectives = collectives
        self._eval_rules: dict[str, LossNormalization] = {}
        self._captures: dict[str, LossCapture] = {}
        self._called: list[Any] | None = None  # this step's returned losses: what each producer's call averaged over
        self._rule_source: str | None = None  # the objects that said the training loss's rule, while it holds
        self._overruled: str | None = None  # those objects, when a step returned another loss than their output
        self._labels_checked = True  # the labels the rule names are those the objects' calls counted
        self._returned_produced = False  # the last training step returned its loss objects' output as it is

    @override
    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == "fit" and not trainer.lightning_module.automatic_optimization:
            raise self.namespace.misconfiguration(
                "strategy='parallel_criterion' does not support manual optimization, whatever the device count: each "
                "replica would step the optimizer. Use strategy='dp' (the step runs once, on the root device) or 'ddp'."
            )
        super().setup(trainer)

    # --- the step ----------------------------------------------------------------------------------------------------
    @override
    def _run_step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        module = self.lightning_module
        training = hook == "training_step"
        weights: list[Any] | None = [1]
        with self._step_context(hook):
            chunks, sizes = self._split_batch(args)
            if chunks is None:
                outputs = [getattr(module, hook)(*args, **kwargs)]
            else:
                if training and self.normalization is None:
                    known = known_rule(module, args[0])
                    self.normalization, self._rule_source = known if known is not None else (SAMPLES, None)
                # Computed once per step (token counts: device tensors), for the loss and its logged copies.
                weights = self._rule_weights(hook, args[0], chunks, sizes)

                def call(index: int, replica: nn.Module) -> Any:
                    return getattr(replica, hook)(chunks[index], *args[1:], **kwargs)

                implied = partial(self._implied_weights, hook, weights, sizes)
                outputs = self._run_replicated(module, sizes, call, implied)
                if training:  # said once the step ran: a step that fails says so by itself
                    self._say_rule(outputs, self._rule_source, args[0], weights, (chunks, sizes))
        if all_or_none(outputs, hook):
            return None
        if training:  # what each call of the loss's producer averaged over decides, when known
            called, self._called = self._called, None
            return reduce_training_outputs(outputs, sizes, self.root_device, called or weights, self.dim)
        if chunks is None:
            return outputs[0]
        # A returned loss merges by the rule, as its logged copies do; other values by sample counts.
        by_rule = "sum" if weights is not None and weights[0] == "sum" else weights
        paths = None if by_rule is None else dict.fromkeys(("output", "output['loss']"), by_rule)
        return merge_outputs(outputs, self.root_device, self.dim, sizes=sizes, weights=paths)

    def _rule_weights(self, hook: str, batch: Any, chunks: list[Any], sizes: list[int]) -> list[Any] | None:
        """Each replica's weight by the rule of ``hook``'s losses; ``None`` (merge by sample counts) for
        ``predict_step`` or an evaluation batch without the rule's labels."""
        for capture in self._captures.values():  # every step starts empty: producers also fire in other hooks' steps
            capture.take()
        if hook == "predict_step":
            return None
        rule = self._rule_for(hook, batch)
        if hook not in self._captures:
            self._captures[hook] = LossCapture(loss_producers(self.lightning_module, hook), call_weight)
        try:
            return rule.weights(chunks, sizes)
        except ValueError:
            if hook == "training_step":
                raise
            return None

    def _rule_for(self, hook: str, batch: Any) -> LossNormalization:
        """The training loss's rule; for evaluation, ``loss_reduction``, else what the objects say for ``hook``, else
        a per-sample mean."""
        if hook == "training_step":
            return self.normalization or SAMPLES
        if hook not in self._eval_rules:
            rule = LossNormalization.parse(self.loss_reduction)
            known = known_rule(self.lightning_module, batch, hook) if rule is None else None
            if known is not None:
                self._say_known_rule(f"the {hook} loss", *known)
            self._eval_rules[hook] = rule or (known[0] if known is not None else SAMPLES)
        return self._eval_rules[hook]

    def _implied_weights(
        self, hook: str, weights: list[Any] | None, sizes: list[int], outputs: list[Any]
    ) -> list[dict[Any, Any]]:
        """Per replica, the weights of the logged copies of the losses it returned and its loss producers returned.
        A training loss that is not the output of the objects that said its rule (``criterion(...) + aux``) is
        weighted per sample from then on, this step included (``weights`` is the list the step reduces with)."""
        capture = self._captures.get(hook)
        produced = capture.take() if capture is not None else {}
        keys = [tensor_key(_returned_loss(output)) for output in outputs]
        not_produced = None not in keys and any(key not in produced.get(i, {}) for i, key in enumerate(keys))
        if hook == "training_step":  # the returned loss is the loss objects' output as it is
            self._returned_produced = None not in keys and not not_produced
        if hook == "training_step" and self._rule_source is not None and weights is not None and not_produced:
            recorded = [list(produced.get(i, {}).values()) for i in range(len(outputs))]
            self._labels_checked = self.normalization != SAMPLES and _counts_agree(recorded, weights)
            self._overruled, self._rule_source, self.normalization = self._rule_source, None, SAMPLES
            weights[:] = sizes
        implied = implied_loss_weights(outputs, weights)
        for index, recorded in produced.items():
            for key, weight in recorded.items():
                weight = weights[index] if weight is None and weights is not None else weight  # the rule's
                if weight is not None:
                    implied[index].setdefault(key, weight)  # what the step returned keeps its own weight
        if hook == "training_step" and self.loss_reduction == "auto":
            # What the call that produced each returned loss averaged over (tokens, or "sum" for a part of a sum over
            # num_items_in_batch) decides, when every replica's is known and of one kind.
            found = [produced.get(index, {}).get(key) for index, key in enumerate(keys)]
            known = all(w is not None for w in found) and len({w == "sum" for w in found}) == 1
            self._called = found if known else None
            for index, weight in enumerate(self._called or ()):
                implied[index][keys[index]] = weight
        return implied

    @override
    def teardown(self) -> None:
        self._called = self._rule_source = self._overruled = None
        for capture in self._captures.values():
            capture.remove()
        self._captures.clear()
        self._eval_rules.clear()
        super().teardown()

    def _split_batch(self, args: tuple[Any, ...]) -> tuple[list[Any] | None, list[int]]:
        """The batch's shards and sizes; ``(None, [1])`` when the step runs once, on the root."""
        if len(self.parallel_devices) == 1 or not args:
            return None, [1]
        what = f"the batch ({type(args[0]).__name__})"
        split = self._split(
            lambda: split_batch(args[0], self.parallel_devices, self.dim), [("batch", args[0])], what, "the step"
        )
        return (None, [1]) if split is None else split

    @override
    def _collectives_reason(self, module: nn.Module) -> str | None:
        if self.collectives is False:
            return None
        if self.collectives:
            return "collectives=True"
        # Read, never run (that would run the step twice). Only the module's own classes count.
        for cls in type(module).__mro__:
            if cls.__module__.startswith(_LIBRARIES) or cls is object:
                continue
            try:
                match = _COLLECTIVE_CALL.search(inspect.getsource(cls))
            except (OSError, TypeError):  # no source to read (a class defined in an interactive session)
                continue
            if match is not None:
                return f"{cls.__name__} calls {match.group(1) or match.group(2)} in the module's code"
        return None

    # --- the loss rule -----------------------------------------------------------------------------------------------
    def _say_rule(
        self,
        outputs: list[Any],
        source: str | None,
        batch: Any,
        weights: list[Any] | None,
        shards: tuple[list[Any], list[int]],
    ) -> None:
        """Once per run: the rule found and where from, the declared one, or the assumption with its fixes; nothing
        when the step declares it. Labels are named only where the loss's own calls counted them (the batch's
        ``labels`` may not be what the loss was computed on)."""
        if self._overruled is not None:  # said whenever it happens, also after the rule was said
            what, self._overruled = f"the training loss (not the output of {self._overruled} alone)", None
            self._announced.add("rule")
            terms = "return {'loss': loss, 'loss_terms': {<name>: (<term's loss>, <count it averages over>), ...}}"
            labels = labels_spec(batch) if self._labels_checked else "<labels key>"
            self._say_assumed_samples(what, labels, terms + " from training_step (each term weighted apart)")
            return
        if "rule" in self._announced:
            return
        self._announced.add("rule")
        first = outputs[0]
        if isinstance(first, Mapping) and (LOSS_WEIGHT_KEY in first or LOSS_TERMS_KEY in first):
            return
        if self.loss_reduction != "auto":
            self._say_declared_rule(batch, weights, *shards)
            return
        other_labels = (  # a token rule whose labels are not what the loss's calls counted: name none
            self.normalization.kind == "tokens"
            and self._called is not None
            and not _counts_agree([[w] for w in self._called], weights)
        )
        if self._called is not None and (
            source is None or other_labels or (self._called[0] == "sum") != (self.normalization == SUM)
        ):
            if self._called[0] == "sum":
                self._say_known_rule("the training loss", SUM, "each call with num_items_in_batch (not its own count)")
            else:
                self._log(
                    "parallel_criterion: the training loss is a mean over each call's own tokens; the devices' values "
                    "are combined accordingly."
                )
        elif source is not None:
            self._say_known_rule("the training loss", self.normalization, source)
        elif (uncombinable := uncombinable_loss(self.lightning_module)) is not None:
            warnings.warn(f"parallel_criterion: {uncombinable}.", UserWarning, stacklevel=2)
        else:
            coupled = (
                " (with all_gather: exact for a mean over this device's rows of the gathered batch, or a whole-batch "
                "loss every device computes alike)"
                if self._collectives_reason(self.lightning_module) is not None
                else ". A loss that couples samples across the batch (contrastive) needs self.all_gather(..., "
                "sync_grads=True) in the step, or strategy='dp'"
            )
            alternative = "return {'loss': loss, 'loss_weight': <count it averages over>} from training_step"
            self._say_assumed_samples("the training loss", labels_spec(batch), alternative + coupled)

    def _say_declared_rule(self, batch: Any, weights: list[Any] | None, chunks: list[Any], sizes: list[int]) -> None:
        """The declared rule, said once; a warning instead where the step returns its loss objects' output as it is
        and they say another rule that weighs this batch's devices differently (``'sum'`` declared for a mean
        ``CrossEntropyLoss`` multiplies the loss by the device count): the declared rule is still used."""
        declared = self.normalization or SAMPLES
        known = known_rule(self.lightning_module, batch) if self._returned_produced else None
        if known is not None and weights is not None:
            rule, source = known
            try:
                theirs = rule.weights(chunks, sizes)
            except ValueError:  # the rule's labels are not in this batch: nothing to compare
                theirs = weights
            if not _weigh_alike(weights, theirs):
                spec = "" if rule.class_weight is not None else f" (loss_reduction={rule.spec()!r})"
                warnings.warn(
                    f"{self.strategy_name}: loss_reduction={declared.spec()!r} is declared, but the step returns the "
                    f"output of {source}, a training loss that is {rule.describe()}{spec}, which weighs this batch's "
                    "devices otherwise; the declared rule is used. Leave loss_reduction at 'auto' for one device's "
                    "result.",
                    UserWarning,
                    stacklevel=2,
                )
                return
        self._say_known_rule("the training loss", declared, "the declared loss_reduction")


def _weigh_alike(first: list[Any], second: list[Any]) -> bool:
    """Whether two lists of per-device weights combine the devices' losses alike (proportional counts, or both sums);
    devices without a count to compare count as alike."""
    if "sum" in first or "sum" in second:
        return ("sum" in first) == ("sum" in second)
    a, b = [float(w) for w in first], [float(w) for w in second]
    if not sum(a) or not sum(b):
        return True
    return all(abs(x / sum(a) - y / sum(b)) <= 1e-9 for x, y in zip(a, b, strict=True))


def _counts_agree(recorded: list[list[Any]], weights: list[Any] | None) -> bool:
    """Whether, on every replica, one of the counts its loss calls ``recorded`` is the rule's count ``weights[i]``."""
    if weights is None or any(isinstance(w, str) for w in weights):
        return False
    return all(
        any(not isinstance(c, str) and c is not None and float(c) == float(w) for c in counts)
        for counts, w in zip(recorded, weights, strict=True)
    )


def _returned_loss(output: Any) -> Any:
    """The loss a training step returned, unless it weights it itself (``loss_weight``, ``loss_terms``)."""
    if not isinstance(output, Mapping):
        return output
    return None if LOSS_WEIGHT_KEY in output or LOSS_TERMS_KEY in output else output.get("loss")
