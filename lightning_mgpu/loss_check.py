"""Opt-in diagnostic: which ``loss_reduction`` makes ``parallel_criterion`` reproduce one device for a module's step.

``print(lightning_mgpu.check_loss_reduction(module, batch))``, or on a config's first training batch:
``python -m lightning_mgpu.loss_check -c config.yaml [--devices 2] [--device cpu] [overrides]``."""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_mgpu.parallel.devices import DeviceLike, to_device
from lightning_mgpu.parallel.loss_combine import combine_losses_by_record
from lightning_mgpu.parallel.loss_graph import read_loss
from lightning_mgpu.parallel.scatter_gather import batch_size_of, move_to, split_batch
from lightning_mgpu.strategies import step_outputs
from lightning_mgpu.strategies.loss_rules import SAMPLES, SUM, LossNormalization, describe

AUTO = "auto"  # what parallel_criterion applies unasked: the step's own weights, else the rule its autograd record says
RELATIVE_TOLERANCE = 1e-5  # a rule that misses the whole batch's loss by this much reproduces it (float32 rounding)
#: Off in the copy: a mask drawn for the whole batch cannot match the masks drawn for its shards.
DROPOUT_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_DECLARED = (step_outputs.LOSS_WEIGHT_KEY, step_outputs.LOSS_TERMS_KEY)


@dataclass
class LossCheck:
    """The whole batch's loss, each candidate rule's combination of the shards' losses (of ``sizes`` samples), and how
    much the loss moves under another seed with the dropout layers off (0 for a deterministic step)."""

    whole: float
    predictions: dict[str, float]
    noise: float
    declared: str | None  # the key the step returns its own weights under: parallel_criterion's only rule then
    known: str | None  # the rule parallel_criterion applies unasked (the step's weights or its record's rule), in words
    sizes: list[int]
    dropout_off: int  # dropout layers switched off for the check
    batchnorm_off: int  # BatchNorm layers put on their running statistics for the check
    nan: list[int]  # the shards whose loss is NaN (e.g. a mean over an empty mask)

    def errors(self) -> dict[str, float]:
        """How far each candidate misses the whole batch's loss, closest first."""
        return dict(sorted(((spec, abs(v - self.whole)) for spec, v in self.predictions.items()), key=lambda i: i[1]))

    def fits(self) -> list[str]:
        """The candidates that reproduce the whole batch's loss, closest first; none for a random step."""
        return [] if self.noise else [s for s, e in self.errors().items() if e <= RELATIVE_TOLERANCE * abs(self.whole)]

    @property
    def rule(self) -> str | None:
        """The ``loss_reduction`` to declare, if one reproduces the whole batch's loss."""
        return next(iter(self.fits()), None)

    def _verdict(self, fits: list[str]) -> str:
        if self.noise:
            return (
                f"the step is random even with its {self.dropout_off} dropout layer(s) off (its loss moves by "
                f"{self.noise:.3g} under another seed), so no rule can be told from another. Make the step "
                "deterministic for the check (e.g. attention dropout 0, no sampling in the step) and run it again"
            )
        if self.known is not None and AUTO in fits:
            return f"parallel_criterion applies {self.known}: nothing to declare"
        if self.declared is not None:
            return (
                f"parallel_criterion applies {self.known}, and they do not reproduce one device: return what each "
                "device's loss divides by, and check that the loss does not couple samples across the batch"
            )
        if len(fits) == 1:
            return f"declare ParallelCriterionStrategy(loss_reduction={fits[0]!r})"
        if not fits:
            return "no rule reproduces one device: " + (
                f"the loss is NaN on shard(s) {', '.join(map(str, self.nan))} (counted from 0; the shards have "
                f"{', '.join(map(str, self.sizes))} samples), e.g. a mean over nothing (an empty mask: 0/0), which "
                "the rules above keep. Return {'loss': loss, 'loss_weight': <what it divides by, e.g. mask.sum()>}: "
                "parallel_criterion leaves out a shard of weight 0"
                if self.nan
                else "the step couples samples across the batch (a contrastive loss: self.all_gather(..., "
                "sync_grads=True) or strategy='dp'), or adds terms normalised differently (return 'loss_terms')"
            )
        why = "e.g. no ignored label"
        if len(self.sizes) < 2:
            why = f"a batch of {sum(self.sizes)} sample(s) is not split: use a larger one"
        elif len(set(self.sizes)) < 2:
            why = f"its shards are all of {self.sizes[0]} samples: use a batch of at least {len(self.sizes) + 1}"
        return (
            f"these rules coincide on this batch: {', '.join(map(repr, fits))} ({why}): declare the one your loss "
            "averages over, or check a batch that tells them apart"
        )

    def __str__(self) -> str:
        lines = [f"the whole batch's loss on one device: {self.whole:.8g}"]
        if self.dropout_off:
            lines.append(f"  ({self.dropout_off} dropout layer(s) switched off for the check)")
        if self.batchnorm_off:
            lines.append(
                f"  ({self.batchnorm_off} BatchNorm layer(s) on their running statistics for the check; in training "
                "parallel_criterion computes their statistics over the whole batch, as sync_batchnorm=True by default)"
            )
        for spec, error in self.errors().items():
            lines.append(
                f"  loss_reduction={spec!r}: shards combine to {self.predictions[spec]:.8g}, off by {error:.3g}"
            )
        return "\n".join([*lines, self._verdict(self.fits())])


def check_loss_reduction(
    module: nn.Module,
    batch: Any,
    *,
    devices: int = 2,
    device: DeviceLike = "cpu",
    batch_idx: int = 0,
    dim: int = 0,
    seed: int = 0,
) -> LossCheck:
    """Which rule combines the shards' losses into the whole batch's: ``training_step`` of a deep copy of ``module`` in
    train mode (dropout off, BatchNorm on running statistics) on ``batch`` whole and in ``devices`` unequal shards."""
    target = to_device(device)
    replica = copy.deepcopy(module).to(target).train()
    dropout = [m for m in replica.modules() if isinstance(m, DROPOUT_LAYERS)]
    batchnorm = [m for m in replica.modules() if isinstance(m, _BatchNorm) and m.running_mean is not None]
    for layer in (*dropout, *batchnorm):
        layer.eval()
    batch = move_to(batch, target)

    def step(part: Any, draw_seed: int = seed) -> dict[str, Any]:
        torch.manual_seed(draw_seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a Trainer
            output = replica.training_step(part, batch_idx)
        output = output if isinstance(output, Mapping) else {"loss": output}
        return {key: output[key] for key in ("loss", *_DECLARED) if key in output}  # no extras to merge

    def loss_of(outputs: list[dict[str, Any]], sizes: list[int]) -> Tensor:
        """The loss parallel_criterion makes of ``outputs``: one's own, or combined by the weights they declare."""
        loss = step_outputs.reduce_training_outputs(outputs, sizes, target, sum)["loss"]  # sum: never called here
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"training_step returned {type(loss).__name__}, not a scalar loss.")
        return loss

    size = batch_size_of(batch, dim)
    whole = float(loss_of([step(batch)], [size]).detach())
    noise = abs(float(loss_of([step(batch, seed + 1)], [size]).detach()) - whole)
    chunks, sizes = split_batch(batch, [target] * devices, dim, sizes=_uneven_sizes(size, devices))
    outputs = [step(chunk) for chunk in chunks]
    declared = next((key for key in _DECLARED if key in outputs[0]), None)
    check = LossCheck(whole, {}, noise, declared, None, sizes, len(dropout), len(batchnorm), [])
    if declared is not None:  # parallel_criterion's only rule for this step
        check.predictions[AUTO] = float(loss_of(outputs, sizes).detach())
        check.known = f"the step's own weights ({declared}) whatever loss_reduction says"
        return check
    losses = [loss_of([output], [n]) for output, n in zip(outputs, sizes, strict=True)]
    values = [loss.detach().double().cpu() for loss in losses]
    check.nan = [i for i, value in enumerate(values) if value.isnan()]
    for rule in _candidates(batch, dim):  # combined as the strategy combines them, in float64
        weights = rule.weights(chunks, sizes)
        check.predictions[rule.spec()] = float(step_outputs.combine_losses(values, weights, values[0].device))
    records = [read_loss(loss, n) for loss, n in zip(losses, sizes, strict=True)]
    read = combine_losses_by_record(losses, records, sizes, target, scale_gradients=False)
    if read is not None:
        check.predictions[AUTO] = float(read.loss.detach())
        check.known = f"the rule read from the autograd record ({describe(records[0], read.weights)})"
    return check


def _uneven_sizes(size: int, devices: int) -> list[int]:
    """Shards of unequal sizes, so that sample and equal weights tell apart."""
    devices = max(1, min(devices, size))
    small = max(1, size // (2 * devices))
    return [size - small * (devices - 1), *([small] * (devices - 1))]


def _candidates(batch: Any, dim: int) -> list[LossNormalization]:
    """The declarable rules: samples, sum, equal weights, and tokens of each integer tensor but the first input (for
    rows of tokens, a causal LM's shifted tokens too)."""
    rules = [SAMPLES, SUM, LossNormalization("replica_mean")]
    items = batch.items() if isinstance(batch, Mapping) else enumerate(batch) if isinstance(batch, list | tuple) else ()
    for key, value in items:
        integer = isinstance(value, Tensor) and not (value.is_floating_point() or value.dtype == torch.bool)
        if key != 0 and integer and value.dim() > dim:
            rules.append(LossNormalization("tokens", (key,)))
            if value.dim() > dim + 1:
                rules.append(LossNormalization("tokens", (key,), shifted=True))
    return rules


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_mgpu.loss_check",
        description="Run a LightningCLI config's training_step on its first training batch, whole and split, and say "
        "which loss_reduction makes parallel_criterion equal one device. Runs the step several times.",
    )
    parser.add_argument("-c", "--config", action="append", required=True, help="a LightningCLI YAML config")
    parser.add_argument("--devices", type=int, default=2, help="how many shards to split the batch into")
    parser.add_argument("--device", default="cpu", help="where to run the copies (e.g. cuda:0)")
    args, overrides = parser.parse_known_args(argv)
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_mgpu.cli import main as cli_main

    command_line, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when it sees both argv and its args
    try:
        cli = cli_main([*(arg for config in args.config for arg in ("-c", config)), *overrides], run=False)
    finally:
        sys.argv = command_line
    datamodule = cli.datamodule
    datamodule.prepare_data()
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    for hook in ("on_before_batch_transfer", "on_after_batch_transfer"):  # the step's batch, as Lightning makes it
        batch = getattr(datamodule if is_overridden(hook, datamodule) else cli.model, hook)(batch, 0)
    print(check_loss_reduction(cli.model, batch, devices=args.devices, device=args.device))


if __name__ == "__main__":
    main()
