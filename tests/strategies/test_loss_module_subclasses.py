"""A loss module that subclasses a torch loss with its own ``forward`` (labels shifted, or masked its own way) does not
count what its ``ignore_index`` / ``weight`` say: its mean has no known rule, so ``parallel_criterion`` says the
one-line notice, whose fixes (``loss_reduction``, ``loss_weight``) then train as one device; ``reduction="sum"``
stays a sum. Token-level losses with ``-100`` padding, float64, 7 samples over 2 devices (4 + 3)."""

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


def notices(run: Run) -> list[str]:
    return [w for w in run.warnings if "nothing says how the training loss is normalised" in w]


@pytest.mark.parametrize("criterion", [ShiftedCE, RareTokensCE])
def test_a_subclass_mean_gets_the_notice_not_its_options_rule(root, criterion):
    """Its ``ignore_index`` would say a mean over ``labels != -100``, which is not what it averages over: no rule is
    decided from it; the notice names ``shifted_tokens:labels`` and ``loss_weight``, once."""
    got = run(root, criterion())
    assert got.decisions() == []
    (notice,) = notices(got)
    assert "'shifted_tokens:labels'" in notice and "loss_weight" in notice


def test_the_notices_loss_reduction_fix_equals_one_device(root):
    """The declared rule weighs the training loss and the logged validation loss (a call of the subclass, which says
    nothing by itself) alike."""
    strategy = lightning_mgpu.ParallelCriterionStrategy(loss_reduction="shifted_tokens:labels")
    loader = token_loader("causal_lm", 7)
    got = fit(ValidatedTokenModel(ShiftedCE()), strategy, 2, loader, root)
    assert notices(got) == [] and "val_loss" in got.final
    assert_equal_runs(got, fit(ValidatedTokenModel(ShiftedCE()), "auto", 1, loader, root))


def test_the_notices_loss_weight_fix_equals_one_device(root):
    got = run(root, RareTokensCE(), count=rare_tokens)
    assert notices(got) == [] and got.decisions() == []
    assert_equal_runs(got, run(root, RareTokensCE(), "auto", devices=1, count=rare_tokens))


def test_a_subclass_sum_stays_a_sum_and_equals_one_device(root):
    got = run(root, ShiftedCE(reduction="sum"))
    assert notices(got) == []
    (decided,) = got.decisions()
    assert "loss_reduction='sum'" in decided and "ShiftedCE" in decided
    assert_equal_runs(got, run(root, ShiftedCE(reduction="sum"), "auto", devices=1))
