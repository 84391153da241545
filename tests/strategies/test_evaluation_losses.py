"""Losses logged in ``validation_step`` and ``test_step`` under ``parallel_criterion`` equal one device's, by the same
rule as the training loss: a mean over non-ignored labels, a sum, or a ``transformers`` model's token mean, whether the
step returns the loss or only logs it (``self.log("val_loss", self.criterion(...))``). Values that are no loss (an
accuracy) still merge by sample counts. Float64, 2 and 3 devices, against one device on the same batches.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from hf_models import build_model, token_loader
from strategy_models import NAMESPACES, metrics, trainer
from torch import nn
from torch.utils.data import DataLoader

from lightning_mgpu import ParallelCriterionStrategy

VOCAB, SEQ = 7, 6


def token_batches(seed: int, batches: int = 3, size: int = 5) -> DataLoader:
    """Dict batches whose rows hold very different numbers of labels (a token mean is no per-sample mean)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        ids = torch.randint(0, VOCAB, (size, SEQ), generator=g)
        labels = ids.clone()
        labels[0, 1:] = -100
        labels[1, 3:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return DataLoader(out, batch_size=None)


def make_module(namespace: str, reduction: str, returns: bool, log_accuracy: bool = False) -> Any:
    L = importlib.import_module(namespace)

    class TokenModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, 8)
            self.head = nn.Linear(8, VOCAB)
            # "inline": the loss is written in the step, where no object says its rule
            self.criterion = (
                nn.functional.cross_entropy
                if reduction in ("inline", "two_terms", "times_count", "stacked", "alpha", "reads")
                else nn.CrossEntropyLoss(reduction=reduction)
            )
            self.reduction = reduction

        def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            logits = self.head(torch.tanh(self.embed(batch["input_ids"])))
            if log_accuracy:
                self.log("val_acc", (logits.argmax(-1)[:, 0] == batch["input_ids"][:, 0]).double().mean())
            loss = self.criterion(logits.flatten(0, 1), batch["labels"].flatten())
            if self.reduction == "two_terms":  # a token mean plus a mean over samples (BERT's MLM + NSP)
                loss = 0.5 * loss + nn.functional.mse_loss(logits[:, 0, 0], batch["input_ids"][:, 0].double())
            if self.reduction == "times_count":  # a sum written as a mean times the sample count
                loss = loss * len(batch["input_ids"])
            first = nn.functional.mse_loss(logits[:, 0, 0], batch["input_ids"][:, 0].double())
            if self.reduction == "stacked":  # nn.DataParallel's habit: a mean of the losses, stacked
                loss = torch.stack([loss, first]).mean()
            if self.reduction == "alpha":
                loss = torch.add(loss, first, alpha=0.5)
            if self.reduction == "reads":  # reading the loss (.shape, .dtype, int()) leaves it what it was
                assert loss.shape == () and loss.dtype == torch.float64 and int(loss.detach().mul(0)) == 0
            return loss

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.loss(batch)
            self.log("train_loss", loss)
            self.log("train_loss_detached", loss.detach())  # a copy of the loss: merged as the loss
            return loss

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            loss = self.loss(batch)
            self.log("val_loss", loss)
            return loss if returns else None

        def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            self.log("test_loss", self.loss(batch))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return TokenModel().double()


def run(module: Any, strategy: Any, devices: int, namespace: str, **kwargs: Any) -> dict[str, float]:
    t = trainer(strategy, devices, namespace, max_epochs=1, enable_progress_bar=True, **kwargs)
    t.fit(module, token_batches(0), token_batches(1))
    logged = metrics(t)
    logged.update({k: float(v) for k, v in t.test(module, token_batches(2), verbose=False)[0].items()})
    return logged


def assert_same(got: dict[str, float], expected: dict[str, float]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=1e-10, rel=0), name


def test_reading_a_token_mean_loss_in_evaluation_keeps_its_count():
    """``loss.shape`` goes through torch's ``__get__``, whose name ends in ``_`` as in-place ops' do: it was taken for
    an in-place change, the count was dropped and the logged ``val_loss`` came out NaN on 3 devices."""
    expected = run(make_module(NAMESPACES[0], "reads", True), "auto", 1, NAMESPACES[0])
    got = run(make_module(NAMESPACES[0], "reads", True), "parallel_criterion", 3, NAMESPACES[0])
    assert_same(got, expected)


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "two_terms", "times_count", "stacked", "alpha"])
@pytest.mark.parametrize("returns", [False, True], ids=["logged-only", "returned"])
def test_logged_evaluation_losses_equal_one_device(namespace, reduction, returns):
    pytest.importorskip(namespace)
    expected = run(make_module(namespace, reduction, returns), "auto", 1, namespace)
    got = run(make_module(namespace, reduction, returns), "parallel_criterion", 2, namespace)
    assert_same(got, expected)


def test_a_declared_rule_serves_evaluation_and_an_accuracy_still_merges_by_samples():
    namespace = NAMESPACES[0]
    expected = run(make_module(namespace, "mean", False, log_accuracy=True), "auto", 1, namespace)
    strategy = ParallelCriterionStrategy(loss_reduction="tokens:labels")
    got = run(make_module(namespace, "mean", False, log_accuracy=True), strategy, 3, namespace)
    assert_same(got, expected)


def test_an_evaluation_loss_written_in_the_step_follows_a_declared_rule_when_returned():
    namespace = NAMESPACES[0]
    expected = run(make_module(namespace, "inline", True), "auto", 1, namespace)
    strategy = ParallelCriterionStrategy(loss_reduction="tokens:labels")
    got = run(make_module(namespace, "inline", True), strategy, 2, namespace)
    assert got["val_loss"] == pytest.approx(expected["val_loss"], abs=1e-10, rel=0)


def test_the_returned_validation_loss_reaches_callbacks_as_one_devices():
    namespace = NAMESPACES[0]
    L = importlib.import_module(namespace)
    seen: dict[str, list[float]] = {}

    class Outputs(L.Callback):
        def __init__(self, key: str) -> None:
            self.key = key

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
            seen.setdefault(self.key, []).append(float(outputs))

    for key, strategy, devices in (("one", "auto", 1), ("three", "parallel_criterion", 3)):
        module = make_module(namespace, "mean", True)
        trainer(strategy, devices, namespace, max_epochs=1, callbacks=[Outputs(key)]).fit(
            module, token_batches(0), token_batches(1)
        )
    assert seen["three"] == pytest.approx(seen["one"], abs=1e-10, rel=0)


def test_a_transformers_models_logged_validation_loss_equals_one_device():
    namespace = NAMESPACES[0]
    L = importlib.import_module(namespace)

    class Tagger(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model("token_classification")

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            self.log("val_loss", self.model(**batch).loss)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    logged = {}
    for devices, strategy in ((1, "auto"), (2, "parallel_criterion")):
        t = trainer(strategy, devices, namespace, max_epochs=1, enable_progress_bar=True)
        t.fit(Tagger(), token_loader("token_classification", 4, steps=2), token_loader("token_classification", 4, 3, 1))
        logged[devices] = metrics(t)["val_loss"]
    assert logged[2] == pytest.approx(logged[1], abs=1e-10, rel=0)


def test_the_loss_hooks_leave_with_the_run():
    module = make_module(NAMESPACES[0], "mean", False)
    run(module, "parallel_criterion", 2, NAMESPACES[0])
    assert not module.criterion._forward_hooks


def test_each_loss_module_call_merges_by_what_it_averaged_over():
    """One validation step with two loss modules (a token mean and a sum) and the token mean called again on other
    labels, with a shard whose labels are all ignored (its token mean is NaN and must weigh nothing): every logged
    value equals one device's, each merged by the count its own call averaged over."""
    L = importlib.import_module(NAMESPACES[0])

    class TwoCriteria(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)
            self.criterion = nn.CrossEntropyLoss()
            self.summed = nn.CrossEntropyLoss(reduction="sum")

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.criterion(self.logits(batch), batch["labels"].flatten())

        def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.head(torch.tanh(self.embed(batch["input_ids"]))).flatten(0, 1)

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            logits, labels = self.logits(batch), batch["labels"].flatten()
            self.log("val_mean", self.criterion(logits, labels))
            self.log("val_sum", self.summed(logits, labels))
            self.log("val_other_labels", self.criterion(logits, torch.where(labels % 2 == 0, labels, -100)))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def batches() -> DataLoader:
        loader = token_batches(1)
        for batch in loader.dataset:
            batch["labels"][:2] = -100  # the first shard of 2 devices holds no label at all
        return loader

    logged = {}
    for devices, strategy in ((1, "auto"), (2, "parallel_criterion")):
        t = trainer(strategy, devices, NAMESPACES[0], enable_progress_bar=True)
        t.validate(TwoCriteria().double(), batches(), verbose=False)
        logged[devices] = metrics(t)
    assert_same(logged[2], logged[1])


def test_layers_with_a_fast_inference_path_compute_as_on_one_device():
    """``nn.TransformerEncoderLayer`` takes a fast path in evaluation only while no torch function mode is active;
    reading loss calls would switch it off and change padded positions' outputs: evaluation does not read there."""
    L = importlib.import_module(NAMESPACES[0])

    class Encoder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, 8)
            layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.layer = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            padded = batch["labels"] == -100
            hidden = self.layer(self.embed(batch["input_ids"]), src_key_padding_mask=padded)
            self.log("pooled", hidden[..., 0].abs().mean())  # padded positions included

    results = {}
    for strategy, devices in (("auto", 1), ("parallel_criterion", 2)):
        t = trainer(strategy, devices, NAMESPACES[0], enable_progress_bar=True)
        results[devices] = t.validate(Encoder(), token_batches(1), verbose=False)[0]["pooled"]  # float32: fast path
    assert results[2] == pytest.approx(results[1], abs=1e-6, rel=0)  # float32
