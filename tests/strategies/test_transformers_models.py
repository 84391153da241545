"""Code we did not write: tiny ``transformers`` models built from configs (no downloads), padded labels with ``-100``,
``return self.model(**batch).loss`` as users write it.

* ``parallel_criterion`` (auto) knows each head's normalisation from the model's class and the batch's ``labels``,
  never by running anything — masked LM, token classification and seq2seq (T5, BART): a mean over
  ``labels != -100``; causal LM: the same over the labels shifted by one; sequence classification: a mean over the
  samples whose label is not -100 — prints it once, warns about nothing, and trains as one device does (float64, 1e-10);
* ``dp`` with ``self(**batch).loss`` combines the replicas' ``ModelOutput.loss`` the same way; with
  ``self.model(**batch)`` it warns once that the step ran on one device;
* ``bf16-mixed`` stays within bf16's tolerance of one device;
* ``num_items_in_batch`` (the whole batch's count) makes GPT-2's loss a part of one sum: the shards are summed, under
  both strategies; BERT's MLM head ignores it (its token mean stays);
* ``dp`` runs a forward whose arguments hold a ``DynamicCache`` once, on the root (every replica would append to it);
* with dropout on, the auto run equals the declared run bit for bit: no extra forward drew random numbers.

GPT-2's loss is computed by transformers on ``logits.float()`` (``ForCausalLMLoss``), i.e. in float32 even for a
float64 model, so the causal LM is compared to 1e-6 instead of 1e-10.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from hf_models import (
    EXPECTED_RULE,
    MORE_HEADS,
    TASKS,
    Run,
    assert_equal_runs,
    build_model,
    fit,
    make_hf_module,
    token_loader,
)

import lightning_mgpu

pytest.importorskip("transformers")

TOLERANCE = {"causal_lm": 1e-6}  # float32 loss inside transformers (see the module docstring)
BF16_TOLERANCE = 5e-3  # bf16 vs bf16 on one device; the wrong weighting is off by 3e-2 here
DESCRIBED = {  # what the decision line says the loss's autograd record holds, for each rule one device follows
    "samples": "a mean",
    "tokens:labels": "cross_entropy / nll_loss over its counted targets",
    "shifted_tokens:labels": "cross_entropy / nll_loss over its counted targets",  # the record holds the shifted labels
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tmp_path_factory.mktemp("hf_runs")


_references: dict[Any, Run] = {}


def one_device(task: str, batch: int, root: Any, dtype: torch.dtype = torch.float64, **trainer: Any) -> Run:
    key = (task, batch, dtype, tuple(sorted(trainer.items())))
    if key not in _references:
        _references[key] = fit(
            make_hf_module(L, task, dtype=dtype), "auto", 1, token_loader(task, batch), root, **trainer
        )
    return _references[key]


def assert_declared(run: Run, rule: str) -> None:
    """No warning about the normalisation; one line saying the declared rule."""
    assert run.normalisation_warnings() == [], run.normalisation_warnings()
    (line,) = run.decisions()
    assert f"as the declared loss_reduction={rule!r} says" in line, line
    assert run.trainer.strategy.normalization.spec() == rule


def assert_decided(run: Run, rule: str, strategy: str = "parallel_criterion") -> None:
    """No warning about the normalisation; under parallel_criterion one line saying what the loss's autograd record
    holds (``rule`` is what one device's loss follows), and the counts it read; dp merges silently."""
    assert run.normalisation_warnings() == [], run.normalisation_warnings()
    decisions = run.decisions()
    if strategy == "dp":
        assert decisions == [], decisions
        return
    assert len(decisions) == 1, decisions
    line = decisions[0]
    assert line.startswith(f"{strategy}:") and "autograd record" in line, line
    assert DESCRIBED[rule] in line, line
    assert run.trainer.strategy.loss_counts is not None


# --- parallel_criterion ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("task", "devices", "batch"),
    [pytest.param(task, d, b, id=f"{task}-{d}dev-batch{b}") for task in TASKS for d, b in ((2, 7), (3, 10))],
)
def test_parallel_criterion_finds_the_normalisation_and_equals_one_device(root, task, devices, batch):
    expected = one_device(task, batch, root)
    got = fit(make_hf_module(L, task), "parallel_criterion", devices, token_loader(task, batch), root)
    assert_decided(got, EXPECTED_RULE[task])
    assert_equal_runs(got, expected, atol=TOLERANCE.get(task, 1e-10))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("task", ["causal_lm", "masked_lm"])
def test_natural_padding_is_found_and_equals_one_device(root, task, seed):
    """Padding as drawn, nothing arranged: the shifted token mean of a causal LM (whose loss
    transformers computes in float32 even for a float64 model) and the MLM token mean are found on 7-sample batches
    over 3 devices, and training equals one device."""
    data = lambda: token_loader(task, 7, seed=seed, natural=True)  # noqa: E731
    expected = fit(make_hf_module(L, task), "auto", 1, data(), root)
    got = fit(make_hf_module(L, task), "parallel_criterion", 3, data(), root)
    assert_decided(got, EXPECTED_RULE[task])
    assert_equal_runs(got, expected, atol=TOLERANCE.get(task, 1e-10))


@pytest.mark.parametrize(("task", "seed"), [("masked_lm", 3), ("causal_lm", 1), ("token_classification", 3)])
def test_token_means_equal_one_device_on_other_data(root, task, seed):
    """Other data (seeds where token and sample weights are close, which an experiment could not tell apart): the
    rule comes from the model, so training equals one device."""
    data = lambda: token_loader(task, 10, seed=seed)  # noqa: E731
    expected = fit(make_hf_module(L, task), "auto", 1, data(), root)
    got = fit(make_hf_module(L, task), "parallel_criterion", 3, data(), root)
    assert_decided(got, EXPECTED_RULE[task])
    assert_equal_runs(got, expected, atol=TOLERANCE.get(task, 1e-10))


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
@pytest.mark.parametrize("task", list(MORE_HEADS))
def test_more_heads_equal_one_device_without_a_declaration(root, task, strategy):
    """T5 and BART (decoder labels padded with -100), RoBERTa masked LM, DistilBERT sequence classification with
    unlabelled (-100) samples: uneven shards (10 over 3), no declaration, equal to one device in float64."""
    style = "forward" if strategy == "dp" else "model"
    expected = one_device(task, 10, root)
    got = fit(make_hf_module(L, task, style=style), strategy, 3, token_loader(task, 10), root)
    assert_decided(got, MORE_HEADS[task], strategy=strategy)
    assert_equal_runs(got, expected)


@pytest.mark.parametrize("task", TASKS)
def test_explicit_loss_reduction_equals_one_device(root, task):
    """``loss_reduction`` set to each head's rule trains as one device; one line says the declared rule, no warning
    (the model's own rule agrees)."""
    strategy = lightning_mgpu.ParallelCriterionStrategy(loss_reduction=EXPECTED_RULE[task])
    got = fit(make_hf_module(L, task), strategy, 3, token_loader(task, 10), root)
    assert_declared(got, EXPECTED_RULE[task])
    assert_equal_runs(got, one_device(task, 10, root), atol=TOLERANCE.get(task, 1e-10))


def test_bf16_mixed_within_bf16_tolerance_and_still_decides(root):
    """``precision="bf16-mixed"`` with a float32 BERT MLM: the rule is the same, and training stays within bf16's
    tolerance of one device under bf16."""
    expected = one_device("masked_lm", 10, root, dtype=torch.float32, precision="bf16-mixed")
    module = make_hf_module(L, "masked_lm", dtype=torch.float32)
    got = fit(module, "parallel_criterion", 3, token_loader("masked_lm", 10), root, precision="bf16-mixed")
    assert_decided(got, "tokens:labels")
    assert_equal_runs(got, expected, atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)


def _dropout_run(root: Any, reduction: str) -> Run:
    module = make_hf_module(L, "masked_lm", dropout=True)
    dropouts = [m for m in module.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p > 0 for m in dropouts)  # the config's default dropout is on
    torch.manual_seed(1234)  # the same dropout masks for both runs, unless something drew extra random numbers
    strategy = lightning_mgpu.ParallelCriterionStrategy(loss_reduction=reduction)
    return fit(module, strategy, 3, token_loader("masked_lm", 10), root)


def test_auto_with_dropout_equals_the_declared_run_bit_for_bit(root):
    """Dropout on (config defaults): the auto run equals the run with ``loss_reduction`` declared to rounding (the two
    combine in another order) — same dropout masks (no extra forward drew from the RNG: another mask moves the loss
    by 1e-2), same losses, logs, parameters — in train mode."""
    auto = _dropout_run(root, "auto")
    explicit = _dropout_run(root, EXPECTED_RULE["masked_lm"])
    assert_equal_runs(auto, explicit, atol=1e-13)
    assert auto.module.training and all(m.training for m in auto.module.modules())


def test_dropout_does_not_hide_the_token_mean(root):
    """The rule comes from the model, so dropout noise cannot hide the token mean."""
    assert_decided(_dropout_run(root, "auto"), "tokens:labels")


def _pretraining_module(terms: bool) -> Any:
    class Pretraining(L.LightningModule):
        """BERT's MLM + NSP: a token mean plus a sample mean, which no single weighting reproduces."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build_model("pretraining")

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            if not terms:
                return self.model(**batch).loss
            labels, nsp = batch["labels"], batch["next_sentence_label"]
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            mlm = F.cross_entropy(out.prediction_logits.flatten(0, 1), labels.flatten())
            nsp_loss = F.cross_entropy(out.seq_relationship_logits, nsp)
            loss = mlm + nsp_loss
            self.log("loss", loss, on_step=True, on_epoch=True)
            return {"loss": loss, "loss_terms": {"mlm": (mlm, (labels != -100).sum()), "nsp": (nsp_loss, len(nsp))}}

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Pretraining()


_pretraining_runs: dict[Any, Run] = {}


def _pretraining(root: Any, terms: bool, strategy: str, devices: int) -> Run:
    key = (terms, strategy, devices)
    if key not in _pretraining_runs:
        module = _pretraining_module(terms)
        _pretraining_runs[key] = fit(module, strategy, devices, token_loader("pretraining", 10), root)
    return _pretraining_runs[key]


def test_two_differently_normalised_terms_are_read_apart_and_loss_terms_agree(root):
    """``BertForPreTraining(...).loss`` (MLM token mean + NSP sample mean), undeclared: its autograd record holds both
    terms, each weighted apart, and training equals one device with no warning; returning the two terms with their
    counts does too, silently."""
    expected = _pretraining(root, True, "auto", 1)
    undeclared = _pretraining(root, False, "parallel_criterion", 3)
    assert undeclared.normalisation_warnings() == []
    (line,) = undeclared.decisions()
    assert "a sum of 2 terms" in line and "autograd record" in line, line
    torch.testing.assert_close(undeclared.params, expected.params, rtol=0, atol=1e-10)
    torch.testing.assert_close(torch.tensor(undeclared.losses), torch.tensor(expected.losses), rtol=0, atol=1e-10)
    got = _pretraining(root, True, "parallel_criterion", 3)
    assert got.normalisation_warnings() == [] and got.decisions() == []
    torch.testing.assert_close(got.params, expected.params, rtol=0, atol=1e-10)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(expected.losses), rtol=0, atol=1e-10)


def test_logged_total_of_loss_terms_equals_one_device(root):
    """``loss = mlm + nsp; self.log("loss", loss); return {"loss": loss, "loss_terms": ...}``: the logged number
    must be the optimized one, as for a plain loss."""
    assert_equal_runs(_pretraining(root, True, "parallel_criterion", 3), _pretraining(root, True, "auto", 1))


# --- dp --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", TASKS)
def test_dp_combines_the_model_output_loss_and_equals_one_device(root, task):
    """``out = self(**batch); return out.loss`` with ``forward`` calling the model: the replicas' scalar ``.loss``
    is combined with the head's weights (decided once, INFO), not stacked; no warning; equal to one device."""
    got = fit(make_hf_module(L, task, style="forward"), "dp", 3, token_loader(task, 10), root)
    assert got.unreplicated_warnings() == []
    assert_decided(got, EXPECTED_RULE[task], strategy="dp")
    assert_equal_runs(got, one_device(task, 10, root), atol=TOLERANCE.get(task, 1e-10))


def test_dp_warns_once_when_the_step_bypasses_the_replicated_forward(root):
    """``self.model(**batch).loss`` never calls ``self(...)``: the step runs on one device, said once (5 steps)."""
    got = fit(make_hf_module(L, "masked_lm", style="model"), "dp", 2, token_loader("masked_lm", 7), root)
    warned = got.unreplicated_warnings()
    assert len(warned) == 1, warned
    assert "training_step" in warned[0] and "self(...)" in warned[0] and "parallel_modules" in warned[0]
    assert_equal_runs(got, one_device("masked_lm", 7, root))


# --- the pytorch_lightning namespace ---------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["tokens:labels", "auto"])
def test_masked_lm_under_pytorch_lightning(root, reduction):
    """``import pytorch_lightning as pl``: ``pl.Trainer`` with the ``pl`` strategy class (``auto``: the name) trains
    BERT MLM as ``pl``'s one device does; the decision goes to the ``pytorch_lightning`` logger."""
    pl = pytest.importorskip("pytorch_lightning")
    from lightning_mgpu.strategies.pytorch_lightning import ParallelCriterionStrategy

    strategy = "parallel_criterion" if reduction == "auto" else ParallelCriterionStrategy(loss_reduction=reduction)
    expected = fit(make_hf_module(pl, "masked_lm"), "auto", 1, token_loader("masked_lm", 10), root, ns=pl)
    got = fit(make_hf_module(pl, "masked_lm"), strategy, 3, token_loader("masked_lm", 10), root, ns=pl)
    assert isinstance(got.trainer.strategy, ParallelCriterionStrategy)
    if reduction == "auto":
        assert_decided(got, "tokens:labels")
    else:
        assert_declared(got, reduction)
    assert_equal_runs(got, expected)


# --- num_items_in_batch: a sum over tokens divided by the whole batch's count ----------------------------------------
def _item_count(task: str, labels: torch.Tensor) -> torch.Tensor:
    """What a causal LM's or masked LM's loss counts: the labels that are not -100 (after the shift, for causal LMs)."""
    return ((labels[:, 1:] if task == "causal_lm" else labels) != -100).sum()


def _counted_module(task: str, passed: str, style: str) -> Any:
    """Trains with ``num_items_in_batch`` = the whole batch's count: ``passed="batch"``, a key the collate function
    adds (``self.model(**batch)``); ``passed="step"``, counted in ``on_train_batch_start`` and passed in the step.
    Validation calls the model without it (the model's own mean)."""

    class Counted(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(task)
            self.items: torch.Tensor | None = None

        def forward(self, **batch: torch.Tensor) -> Any:
            return self.model(**batch)

        def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            self.items = _item_count(task, batch["labels"])  # the whole batch, on the root, before the step

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            call = self if style == "forward" else self.model
            if passed == "batch":
                out = call(**batch)
            elif passed == "unused":  # the collate function adds it, the step does not pass it
                out = call(**{k: v for k, v in batch.items() if k != "num_items_in_batch"})
            else:  # "step": the whole batch's, counted before the step; "own": this step's (a shard's, replicated)
                count = self.items if passed == "step" else _item_count(task, batch["labels"])
                out = call(**batch, num_items_in_batch=count)
            self.log("loss", out.loss, on_step=True, on_epoch=True)
            return out.loss

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            call = self if style == "forward" else self.model
            self.log("val_loss", call(**{k: v for k, v in batch.items() if k != "num_items_in_batch"}).loss)

        def val_dataloader(self) -> Any:
            return token_loader(task, 7, steps=2, seed=5)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Counted()


def _counted_loader(task: str, passed: str) -> Any:
    loader = token_loader(task, 7)
    if passed not in ("batch", "unused"):
        return loader

    def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = torch.utils.data.default_collate(samples)
        return {**batch, "num_items_in_batch": _item_count(task, batch["labels"])}

    return torch.utils.data.DataLoader(loader.dataset, batch_size=7, collate_fn=collate)


@pytest.mark.parametrize("passed", ["batch", "step", "own", "unused"])
@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
@pytest.mark.parametrize("task", ["causal_lm", "masked_lm"])
def test_num_items_in_batch_equals_one_device(root, task, strategy, passed):
    """GPT-2's loss with ``num_items_in_batch`` (the whole batch's count) is a sum over tokens divided by it: each
    shard's loss is a part of that sum, so the shards are summed (said once); a count of the call's own tokens
    (``"own"``: a replicated step counts its shard) keeps a token mean, as does a count the batch holds but the step
    does not pass. Training, logged losses and the validation loss (called without it) equal one device. BERT's MLM
    head ignores the count: its token mean stays. 7 samples over 2 devices (4 + 3)."""
    style = "forward" if strategy == "dp" else "model"
    expected = fit(_counted_module(task, passed, style), "auto", 1, _counted_loader(task, passed), root)
    got = fit(_counted_module(task, passed, style), strategy, 2, _counted_loader(task, passed), root)
    assert "val_loss" in got.final
    assert got.unreplicated_warnings() == []
    assert got.normalisation_warnings() == []
    assert_equal_runs(got, expected, atol=TOLERANCE.get(task, 1e-10))


# --- dp: a transformers cache in a replicated forward's arguments ---------------------------------------------------
def _cached_module() -> Any:
    from transformers.cache_utils import DynamicCache

    class Cached(L.LightningModule):
        """Two forward calls that share one ``DynamicCache`` (a prefix, then the rest of each sequence)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build_model("causal_lm")

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            ids, mask = batch["input_ids"], batch["attention_mask"]
            cache = DynamicCache()
            first = self.model(input_ids=ids[:, :5], attention_mask=mask[:, :5], past_key_values=cache)
            rest = self.model(input_ids=ids[:, 5:], attention_mask=mask, past_key_values=cache)
            logits = torch.cat([first.logits, rest.logits], dim=1)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
            self.log("loss", loss, on_step=True, on_epoch=True)
            return loss

        def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model.generate(input_ids=batch["input_ids"], max_new_tokens=3, do_sample=False)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Cached()


def test_dp_runs_a_forward_holding_a_cache_once_and_equals_one_device(root):
    """``past_key_values=DynamicCache(...)`` passed whole to every replica would collect every shard's keys and values
    (a shape error, or wrong logits): a forward whose arguments hold a cache runs once, on the root, said once; training
    equals one device, and so does ``generate()`` (whose forward calls all hold its cache)."""
    from lightning_mgpu import DataParallelStrategy

    expected = fit(_cached_module(), "auto", 1, token_loader("causal_lm", 7), root)
    got = fit(_cached_module(), DataParallelStrategy(parallel_modules=["model"]), 2, token_loader("causal_lm", 7), root)
    said = [w for w in got.warnings if w.startswith("dp:")]
    assert len(said) == 1 and "kwargs['past_key_values'] (DynamicCache)" in said[0] and "runs once" in said[0], said
    assert_equal_runs(got, expected, atol=1e-6)

    ids = token_loader("causal_lm", 7, steps=1).dataset.items["input_ids"][:, :3]  # every row holds 3 tokens or more
    data = torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=7)
    predictions = [
        L.Trainer(accelerator="cpu", devices=n, strategy=s, logger=False).predict(got.module, data)[0]
        for n, s in ((1, "auto"), (2, DataParallelStrategy(parallel_modules=["model"])))
    ]
    assert predictions[0].shape == (7, 6) and torch.equal(predictions[0], predictions[1])
