"""A loss module that subclasses a torch loss with its own ``forward`` (labels shifted, or masked its own way) does not
count what its ``ignore_index`` / ``weight`` say of the batch's labels: ``parallel_criterion`` reads what it counted
from the loss's autograd record (the targets torch's ``nll_loss`` saved), so its mean trains as one device with
nothing declared, as do the declared fixes (``loss_reduction``, ``loss_weight``); ``reduction="sum"`` stays a sum.
Token-level losses with ``-100`` padding, float64, 7 samples over 2 devices (4 + 3)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from hf_models import IGNORE, VOCAB, Run, assert_equal_runs, fit, token_loader
from torch import nn

import lightning_mgpu


class ShiftedCE(nn.CrossEntropyLoss):
    """Next-token cross-entropy: position t predicts the label at t + 1."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return super().forward(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class RareTokensCE(nn.CrossEntropyLoss):
    """Leaves out the frequent tokens (ids below 20) as well as the padding: a mask of its own."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return super().forward(logits.flatten(0, 1), labels.masked_fill(labels < 20, IGNORE).flatten())


def rare_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels >= 20).sum()


class TokenModel(L.LightningModule):
    def __init__(self, criterion: nn.Module, count: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)
        self.criterion = criterion
        self.count = count
        self.double()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        loss = self.criterion(self.head(self.embed(batch["input_ids"])), batch["labels"])
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss if self.count is None else {"loss": loss, "loss_weight": self.count(batch["labels"])}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class ValidatedTokenModel(TokenModel):
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.criterion(self.head(self.embed(batch["input_ids"])), batch["labels"]))

    def val_dataloader(self) -> Any:
        return token_loader("causal_lm", 7, steps=2, seed=5)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tmp_path_factory.mktemp("subclass_runs")


def run(root: Any, criterion: nn.Module, strategy: Any = "parallel_criterion", devices: int = 2, **kw: Any) -> Run:
    return fit(TokenModel(criterion, **kw), strategy, devices, token_loader("causal_lm", 7), root)


def strategy_warnings(run: Run) -> list[str]:
    return [w for w in run.warnings if w.startswith("parallel_criterion:")]


def shifted_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != IGNORE).sum()


def last_labels() -> torch.Tensor:
    return list(token_loader("causal_lm", 7))[-1]["labels"]


@pytest.mark.parametrize(("criterion", "count"), [(ShiftedCE, shifted_tokens), (RareTokensCE, rare_tokens)])
def test_a_subclass_mean_is_read_from_what_it_counted_and_equals_one_device(root, criterion, count):
    """Its ``ignore_index`` alone would say a mean over ``labels != -100``, which is not what it averages over; the
    record holds the targets it counted (shifted, or masked its own way): said once, no warning, exact."""
    got = run(root, criterion())
    assert strategy_warnings(got) == [], got.warnings
    (decided,) = got.decisions()
    assert "as its autograd record says" in decided and "cross_entropy" in decided and "a mean" in decided
    assert got.trainer.strategy.normalization is None
    (read,) = got.trainer.strategy.loss_counts
    assert float(read) == float(count(last_labels()))
    assert_equal_runs(got, run(root, criterion(), "auto", devices=1))


def test_a_declared_shifted_tokens_rule_equals_one_device_in_training_and_validation(root):
    """The declared rule weighs the training loss and the logged validation loss (a call of the subclass; evaluation
    runs without autograd, so only the declared rule can say how it is normalised) alike."""
    strategy = lightning_mgpu.ParallelCriterionStrategy(loss_reduction="shifted_tokens:labels")
    loader = token_loader("causal_lm", 7)
    got = fit(ValidatedTokenModel(ShiftedCE()), strategy, 2, loader, root)
    assert strategy_warnings(got) == [] and "val_loss" in got.final, got.warnings
    (decided,) = got.decisions()
    assert "loss_reduction='shifted_tokens:labels'" in decided and "declared" in decided
    assert_equal_runs(got, fit(ValidatedTokenModel(ShiftedCE()), "auto", 1, loader, root))


def test_the_steps_own_loss_weight_equals_one_device(root):
    got = run(root, RareTokensCE(), count=rare_tokens)
    assert strategy_warnings(got) == [] and got.decisions() == []
    assert_equal_runs(got, run(root, RareTokensCE(), "auto", devices=1, count=rare_tokens))


def test_a_subclass_sum_stays_a_sum_and_equals_one_device(root):
    got = run(root, ShiftedCE(reduction="sum"))
    assert strategy_warnings(got) == [], got.warnings
    (decided,) = got.decisions()
    assert "as its autograd record says" in decided and "a sum" in decided
    assert got.trainer.strategy.loss_counts == (None,)
    assert_equal_runs(got, run(root, ShiftedCE(reduction="sum"), "auto", devices=1))
