"""``strategy="parallel_criterion"``: every device runs the whole ``*_step`` (forward **and** loss) on its shard; one
scalar loss per device reaches the root, combined by the rule of :mod:`.loss_rules`."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_mgpu.parallel import collectives
from lightning_mgpu.parallel.loss_calls import LossCalls, can_read_calls, once_per_shard_alike
from lightning_mgpu.parallel.loss_combine import Combined, combine_losses_by_record, term_totals
from lightning_mgpu.parallel.loss_coupling import coupling
from lightning_mgpu.parallel.loss_graph import read_loss
from lightning_mgpu.parallel.merge import merge_outputs
from lightning_mgpu.parallel.run_replicas import ExecutionMode
from lightning_mgpu.parallel.scatter_gather import split_batch
from lightning_mgpu.strategies.checks import lightning_collectives
from lightning_mgpu.strategies.loader_batch import step_sample_counts
from lightning_mgpu.strategies.loss_rules import SAMPLES, coupling_message, describe, unread_message
from lightning_mgpu.strategies.replica_logging import LossCopy
from lightning_mgpu.strategies.single_process import SingleProcessParallel
from lightning_mgpu.strategies.step_outputs import (
    LOSS_TERMS_KEY,
    LOSS_WEIGHT_KEY,
    all_or_none,
    combine_losses,
    declared_copy,
    reduce_training_outputs,
    same_tensor,
)


class ParallelCriterionStrategyBase(SingleProcessParallel):
    """One process, N devices: forward and loss on every device, shard losses combined exactly on the root.

    Args:
        loss_reduction: how each device's loss is normalised, hence how the losses combine: ``"auto"`` (what the
            loss's autograd record says, else a per-sample mean, said once), ``"samples"``, ``"sum"``,
            ``"tokens:<key>"`` / ``"shifted_tokens:<key>"`` (a mean over the labels ``batch[<key>]`` that are not
            -100; append ``:<ignore_index>`` for another) or ``"replica_mean"``. A step's ``loss_weight`` /
            ``loss_terms`` win.
        collectives: whether the step calls ``self.all_gather``, ``strategy.reduce``, ``broadcast``, ``barrier`` or
            ``reduce_boolean_decision``; ``None``: read once from the module's classes' source code.
        dim: the batch dimension to split along.
        execution_mode: ``"auto"`` (threads on distinct GPUs, else sequential), ``"threads"`` or ``"sequential"``.
        sync_batchnorm: BatchNorm layers normalise with the whole batch's statistics, as on one device (their
            replicas meet at each layer, so they run in threads); ``False``: each shard's own statistics.

    In a step, ``self`` is the device's replica and sees its shard; the LightningModule stands for replica 0 (an
    attribute rebound there takes replica 0's value). Under manual optimization the replicas meet at each
    ``manual_backward`` (one backward pass of the combined loss) and ``opt.step()`` (one step, on the root).
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
        sync_batchnorm: bool = True,
    ) -> None:
        plugins = (accelerator, parallel_devices, checkpoint_io, precision_plugin)
        super().__init__(*plugins, dim, execution_mode, loss_reduction, sync_batchnorm)
        self.collectives = collectives
        self._read_weights: list[list[Any]] | None = None  # per term, each shard's weight in the last training step
        self._read_as: tuple[str, ...] | None = None  # the record's shape the rule was last said for
        self._counted: tuple[str, str] | None = None  # a read training rule other than a per-sample mean, its spec
        self._readable: dict[int, bool] = {}  # per module: whether evaluation reads its loss calls
        self._shards: tuple[list[int], list[Any] | None] = ([], None)  # the step's sample counts and declared weights
        self._number_copies: dict[tuple[str, str | None], bool] = {}  # (hook, name) logged as numbers: the loss's?

    @property
    def loss_counts(self) -> tuple[Tensor | None, ...] | None:
        """Per term of the last training step's loss, the whole batch's count (``None`` for a sum term); ``None`` when
        the rule did not come from the loss's autograd record. Counted when asked, not at every step."""
        return None if self._read_weights is None else term_totals(self._read_weights, self.root_device)

    @override
    def _run_step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One replicated step: split, run, combine the losses, merge the outputs."""
        module = self.lightning_module
        training = hook == "training_step" and module.automatic_optimization
        evaluating, calls = False, []
        with self._step_context(hook):
            chunks, sizes = self._split_batch(args)
            # Counted once per step (token counts: device tensors), for the loss and its logged copies.
            self._shards = (sizes, None if chunks is None else self._declared_weights(hook, chunks, sizes))
            weights, memo = self._shards[1], {}  # the training loss, combined once: for its logged copies and return
            combine = partial(self._combine, *self._shards, memo=memo)
            if chunks is None:
                outputs = [getattr(module, hook)(*args, **kwargs)]
            else:
                # Evaluation has no autograd record: its loss calls say their counts while they run.
                # (not with a layer whose fast path that would switch off: its outputs would differ from one device's)
                if id(module) not in self._readable:
                    self._readable[id(module)] = can_read_calls(module)
                evaluating = hook in ("validation_step", "test_step") and self._readable[id(module)]
                calls = [LossCalls() for _ in sizes] if evaluating else []

                def call(index: int, replica: nn.Module) -> Any:
                    with calls[index] if evaluating else contextlib.nullcontext():
                        return getattr(replica, hook)(chunks[index], *args[1:], **kwargs)

                # Manual optimization: the backward passes freed the losses' records: logged values merge per sample.
                manual = hook == "training_step" and not training
                copy = None if manual else partial(self._loss_copy, hook, calls, combine if training else None)
                outputs = self._run_replicated(module, sizes, call, copy)
                if evaluating and weights is None:  # a returned loss its calls recorded: merged by them
                    weights = self._by_record(hook, [_returned_loss(output) for output in outputs], sizes, calls)
        if evaluating and self.normalization is None and not any(c.records for c in calls):
            self._say_evaluation_rule(hook)  # no loss call said its count: values merge per sample
        if all_or_none(outputs, hook):
            return None
        if training:
            return reduce_training_outputs(outputs, sizes, self.root_device, combine, self.dim)
        if chunks is None:
            return outputs[0]
        # A returned loss merges by the declared rule or its record, as its logged copies do; others by sample counts.
        by_rule = "sum" if isinstance(weights, list) and weights[0] == "sum" else weights
        paths = None if by_rule is None else dict.fromkeys(("output", "output['loss']"), by_rule)
        return merge_outputs(outputs, self.root_device, self.dim, sizes=sizes, weights=paths, counts=True)

    @override
    def _combine_replica_losses(self, losses: list[Tensor]) -> Tensor:
        sizes, weights = self._shards
        return self._combine(sizes, weights, losses)

    def _declared_weights(self, hook: str, chunks: list[Any], sizes: list[int]) -> list[Any] | None:
        """Each replica's weight by the declared ``loss_reduction``; ``None`` when none is declared, for
        ``predict_step``, or for an evaluation batch without the rule's labels."""
        if self.normalization is None or hook == "predict_step":
            return None
        try:
            return self.normalization.weights(chunks, sizes)
        except ValueError:
            if hook == "training_step":
                raise
            return None

    def _combine(
        self, sizes: list[int], weights: list[Any] | None, losses: list[Tensor], memo: dict[str, Tensor] | None = None
    ) -> Tensor:
        """The training losses on the root: by the declared rule, else by their autograd record, else per sample;
        kept in ``memo`` (the step's) on the first call."""
        if memo:
            return memo["loss"]
        if weights is not None:
            self._read_weights = None
            if "rule" not in self._announced:
                self._announced.add("rule")
                self._log(
                    f"{self.strategy_name}: the training loss is {self.normalization.describe()}, as the declared "
                    f"loss_reduction={self.loss_reduction!r} says; the devices' losses are combined accordingly."
                )
            loss = combine_losses(losses, weights, self.root_device)
        else:
            records = [read_loss(value, size) for value, size in zip(losses, sizes, strict=True)]
            combined = combine_losses_by_record(
                losses, records, sizes, self.root_device, memory=self._settled, gathered=collectives.gathered_in_call()
            )
            self._say_read_rule(losses, records, sizes, combined)
            self._read_weights = None if combined is None else combined.weights  # numbers and counts, no graph
            loss = combined.loss if combined else combine_losses(losses, SAMPLES.weights([], sizes), self.root_device)
        if memo is not None:
            memo["loss"] = loss
        return loss

    def _say_read_rule(
        self, losses: list[Tensor], records: list[Any], sizes: list[int], combined: Combined | None
    ) -> None:
        """Once per shape of the record (the first step, and when the loss is built otherwise): the rule read, or why
        none was, and whether the graph couples samples across a shard (reading, never running)."""
        first = records[0]
        shape = (first.signature() if first is not None else None, combined is None)  # not the shard count
        if shape == self._read_as:
            return
        self._read_as = shape
        # A step that gathered with all_gather couples over the whole batch already (the fix the message names).
        found = None if collectives.gathered_in_call() else coupling(losses[0], sizes[0])
        if found is not None:  # no rule is claimed for it; a torch.distributed gather said at set-up is the cause
            if "torch.distributed" not in self._announced:
                self._warn_once(f"coupled:{found}", coupling_message(self.strategy_name, found))
        elif combined is None:
            alike = all(r is not None and r.signature() == first.signature() for r in records)
            why = (
                "the training loss carries no autograd record (computed without gradients, or detached)"
                if first is None
                else f"the training loss's autograd record does not say how it was normalised ({first.unknown})"
                if first.unknown
                else "the devices' training losses were built differently (in other branches)"
                if not alike
                else "the training loss adds parts of different weights that its record holds no value of"
            )
            self._warn_once(
                f"unread:{why}", unread_message(self.strategy_name, why, self._cli_options("loss_reduction=..."))
            )
        else:
            said = describe(records[0], combined.weights)
            per_sample = len(combined.weights) == 1 and all(
                w is not None and float(w) == n for w, n in zip(combined.weights[0], sizes, strict=True)
            )
            sums = all(any(w is None for w in term) for term in combined.weights)
            self._counted = None if per_sample else (said, "'sum'" if sums else "'tokens:<labels key>'")
            self._log(
                f"{self.strategy_name}: the training loss is {said}, as its autograd record says; the devices' losses "
                "are combined accordingly."
            )

    def _say_evaluation_rule(self, hook: str) -> None:
        """Said once: evaluation runs without autograd, so its losses carry no record; where the training loss is not a
        per-sample mean, a logged evaluation loss computed alike is merged per sample, unlike one device's."""
        if self._counted is None:
            return
        said, rule = self._counted
        count = " or log it with self.log(..., batch_size=<the count it averages over>)" if rule != "'sum'" else ""
        self._warn_once(
            "evaluation rule",
            f"{self.strategy_name}: `{hook}` runs without gradients and no call of torch's loss functions made what it "
            "logs or returns, so those values are merged by sample count, while the training loss is "
            f"{said}. For one device's value of such a loss, declare loss_reduction={rule} (it serves evaluation too; "
            f"CLI: {self._cli_options('loss_reduction=...')}){count}.",
        )

    def _loss_copy(
        self, hook: str, calls: list[Any], combine: Callable[[list[Tensor]], Tensor] | None, outputs: list[Any]
    ) -> LossCopy:
        """Merges logged values as the loss they copy: as the step declares, as the training loss (``combine``), by
        the declared rule (the returned loss), or by their own autograd record (training) or the loss call that made
        them (evaluation); ``None`` for other values (merged per sample)."""
        sizes, weights = self._shards

        def merge(values: list[Any], name: str | None) -> Tensor | None:
            declared = declared_copy(values, outputs, self.root_device)
            if declared is not None:
                return declared
            returned = [_returned_loss(output) for output in outputs]
            copies = all(map(same_tensor, values, returned)) or self._number_copy((hook, name), values, returned)
            # A logged number becomes a tensor of the default dtype in self.log, as on one device.
            dtype = torch.get_default_dtype() if isinstance(values[0], float) else None
            if copies and combine is not None:  # the training loss itself: combined once, for both
                return combine(returned).detach().to(dtype)
            if copies and weights is not None:
                return combine_losses([r.detach() for r in returned], weights, self.root_device).to(dtype)
            combined = self._by_record(hook, returned if copies else values, sizes, calls)  # a copy: as its loss
            return None if combined is None else combined.detach()

        return merge

    def _number_copy(self, key: tuple[str, str | None], values: list[Any], returned: list[Any]) -> bool:
        """Whether Python numbers logged under ``key`` are the returned losses' values (``loss.item()``): compared on
        the name's first step (the step read them already) and remembered, so no later step reads a value again."""
        if key[1] is None or not all(isinstance(v, float) for v in values):
            return False
        if key not in self._number_copies:
            self._number_copies[key] = all(  # a shard that counts nothing logs NaN, as its loss is
                isinstance(r, Tensor) and r.numel() == 1 and _same_number(v, r.item())
                for v, r in zip(values, returned, strict=True)
            )
        return self._number_copies[key]

    def _by_record(self, hook: str, values: list[Any], sizes: list[int], calls: list[LossCalls]) -> Tensor | None:
        """``values`` merged as the losses they are, by their autograd record (training) or their loss calls'
        (evaluation); ``None`` where they have none."""
        if not all(isinstance(v, Tensor) for v in values):
            return None
        if hook == "training_step":
            records = [read_loss(value, size) for value, size in zip(values, sizes, strict=True)]
        elif calls:
            records = [recorded.record_of(value) for value, recorded in zip(values, calls, strict=True)]
            if all(record is not None for record in records):
                once_per_shard_alike(records)
        else:  # evaluation without its loss calls recorded
            return None
        gathered = collectives.gathered_in_call()
        combined = combine_losses_by_record(values, records, sizes, self.root_device, False, self._settled, gathered)
        return None if combined is None else combined.loss

    def _split_batch(self, args: tuple[Any, ...]) -> tuple[list[Any] | None, list[int]]:
        """The batch's shards and sizes; ``(None, [1])`` when the step runs once, on the root. The DataLoader's sample
        counts (cached per loader) let a list of per-sample items be split by item, and refuse what disagrees."""
        if len(self.parallel_devices) == 1 or not args:
            return None, [1]
        samples = step_sample_counts(self.lightning_module, args)
        split = partial(split_batch, args[0], self.parallel_devices, self.dim, samples=samples)
        chunks = self._split(split, [("batch", args[0])], f"the batch ({type(args[0]).__name__})", "the step")
        return (None, [1]) if chunks is None else chunks

    @override
    def _collectives_reason(self, module: nn.Module) -> str | None:
        if self.collectives is None:
            return lightning_collectives(type(module))
        return "collectives=True" if self.collectives else None


def _same_number(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _returned_loss(output: Any) -> Any:
    """The loss a step returned, unless it weights it itself (``loss_weight``, ``loss_terms``)."""
    if not isinstance(output, Mapping):
        return output
    return None if LOSS_WEIGHT_KEY in output or LOSS_TERMS_KEY in output else output.get("loss")
