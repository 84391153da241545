"""BERT recipe model and LightningModule: masked-only MLM head, NSP loss, loss terms, schedules, learnability."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torchmetrics import Metric

from recipes.bert.masking import IGNORE_INDEX, PretrainingCollator
from recipes.bert.metrics import Perplexity, SumOfMeans
from recipes.bert.model import (
    BertPretrainingModel,
    masked_lm_loss,
    next_sentence_loss,
    pretraining_loss,
)
from recipes.bert.module import BertPretrainingModule, WarmupSchedule

VOCAB = 120
TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "max_position_embeddings": 32}


def _batch(batch: int = 6, width: int = 20, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(batch):
        la, lb = torch.randint(2, width // 2 - 1, (2,), generator=g).tolist()
        a = torch.randint(5, VOCAB, (la,), generator=g).tolist()
        b = torch.randint(5, VOCAB, (lb,), generator=g).tolist()
        examples.append(
            {
                "input_ids": [2, *a, 3, *b, 3],
                "token_type_ids": [0] * (la + 2) + [1] * (lb + 1),
                "next_sentence_label": int(torch.randint(2, (1,), generator=g)),
            }
        )
    collate = PretrainingCollator(
        VOCAB,
        pad_token_id=0,
        mask_token_id=4,
        special_ids=range(5),
        mlm_probability=0.3,
        generator=torch.Generator().manual_seed(seed + 1),
    )
    return collate(examples)


def _forward_loss(model: BertPretrainingModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], labels=batch["labels"])
    return pretraining_loss(out, batch["next_sentence_label"])["loss"]


@pytest.mark.parametrize("tie", [True, False])
def test_masked_only_head_matches_full_logits_in_float64(tie: bool) -> None:
    torch.manual_seed(0)
    model = BertPretrainingModel(VOCAB, dropout=0.0, attention_dropout=0.0, tie_word_embeddings=tie, **TINY).double()
    batch = _batch()
    assert (batch["labels"] != IGNORE_INDEX).sum() > 10

    results = {}
    for full in (False, True):
        model.full_logits = full
        model.zero_grad()
        out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], labels=batch["labels"])
        n_masked = int((batch["labels"] != IGNORE_INDEX).sum())
        expected_rows = n_masked if not full else batch["input_ids"].numel()
        assert out.mlm_logits.reshape(-1, VOCAB).shape[0] == expected_rows
        loss = pretraining_loss(out, batch["next_sentence_label"])["loss"]
        loss.backward()
        results[full] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})

    (loss_m, grads_m), (loss_f, grads_f) = results[False], results[True]
    torch.testing.assert_close(loss_m, loss_f, rtol=1e-12, atol=1e-12)
    assert grads_m.keys() == grads_f.keys()
    for name in grads_m:
        torch.testing.assert_close(grads_m[name], grads_f[name], rtol=1e-10, atol=1e-12, msg=name)
    # The reference: transformers-style CE over all positions with ignore_index.
    model.full_logits = True
    out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    reference = F.cross_entropy(out.mlm_logits.reshape(-1, VOCAB), batch["labels"].reshape(-1)) + F.cross_entropy(
        out.nsp_logits, batch["next_sentence_label"]
    )
    torch.testing.assert_close(loss_m, reference.detach(), rtol=1e-12, atol=1e-12)


def test_outputs_concatenate_like_a_data_parallel_gather() -> None:
    """Running the model on two halves and concatenating outputs along dim 0 equals running it on the whole batch."""
    torch.manual_seed(0)
    model = BertPretrainingModel(VOCAB, dropout=0.0, attention_dropout=0.0, **TINY).double().eval()
    batch = _batch(batch=7)
    args = ("input_ids", "attention_mask", "token_type_ids", "labels")
    whole = model(*(batch[k] for k in args))
    parts = [model(*(batch[k][sl] for k in args)) for sl in (slice(0, 4), slice(4, 7))]
    for field in ("mlm_logits", "mlm_labels", "nsp_logits"):
        torch.testing.assert_close(torch.cat([getattr(p, field) for p in parts]), getattr(whole, field))


def test_both_nsp_labels_contribute_to_the_loss() -> None:
    logits = torch.tensor([[2.0, -1.0], [0.5, 0.3], [-1.0, 1.0], [0.0, 0.0]], requires_grad=True)
    labels = torch.tensor([0, 0, 1, 1])
    next_sentence_loss(logits, labels).backward()
    expected = (logits.detach().softmax(-1) - F.one_hot(labels, 2)) / len(labels)
    torch.testing.assert_close(logits.grad, expected)
    assert (logits.grad.abs().sum(-1) > 0).all()  # every example, IsNext (0) included, has a gradient

    # Through the model: a batch of only IsNext (label 0) examples still trains the NSP head (the seed's
    # NLLLoss(ignore_index=0) gave it exactly zero gradient).
    torch.manual_seed(0)
    model = BertPretrainingModel(VOCAB, dropout=0.0, attention_dropout=0.0, **TINY)
    batch = _batch()
    for label in (0, 1):
        model.zero_grad()
        out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], labels=batch["labels"])
        next_sentence_loss(out.nsp_logits, torch.full_like(batch["next_sentence_label"], label)).backward()
        assert model.nsp_head.weight.grad.abs().sum() > 0
        assert model.bert.pooler.dense.weight.grad.abs().sum() > 0


def test_mlm_loss_without_masked_tokens_is_a_finite_zero() -> None:
    logits = torch.randn(0, VOCAB, requires_grad=True)
    loss, count = masked_lm_loss(logits, torch.zeros(0, dtype=torch.long))
    loss.backward()
    assert count == 0 and loss.item() == 0.0 and torch.isfinite(logits.grad).all()
    full = torch.randn(2, 5, VOCAB, requires_grad=True)
    loss, count = masked_lm_loss(full, torch.full((2, 5), IGNORE_INDEX))
    assert count == 0 and loss.item() == 0.0
    with pytest.raises(ValueError, match="do not align"):
        masked_lm_loss(torch.randn(3, VOCAB), torch.zeros(4, dtype=torch.long))


def test_step_returns_loss_terms_that_sum_to_the_loss() -> None:
    torch.manual_seed(0)
    module = BertPretrainingModule(VOCAB, dropout=0.0, attention_dropout=0.0, **TINY)
    batch = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer only warns
        out = module.training_step(batch, 0)
    terms = out["loss_terms"]
    assert set(terms) == {"mlm", "nsp"}
    (mlm, n_masked), (nsp, n_seq) = terms["mlm"], terms["nsp"]
    assert n_masked == int((batch["labels"] != IGNORE_INDEX).sum()) and n_seq == 6
    torch.testing.assert_close(out["loss"], mlm + nsp)
    assert out["loss"].requires_grad and mlm.requires_grad and nsp.requires_grad

    # Reducing each term over two shards with its own weights gives the whole-batch loss exactly.
    shards = [{k: v[sl] for k, v in batch.items()} for sl in (slice(0, 2), slice(2, 6))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = [module.training_step(s, 0) for s in shards]
    reduced = sum(
        sum(o["loss_terms"][t][0] * o["loss_terms"][t][1] for o in outs) / sum(o["loss_terms"][t][1] for o in outs)
        for t in ("mlm", "nsp")
    )
    torch.testing.assert_close(reduced, out["loss"], rtol=1e-5, atol=1e-6)


def test_optimizer_groups_and_schedules() -> None:
    module = BertPretrainingModule(VOCAB, total_steps=100, warmup_steps=10, learning_rate=1e-3, **TINY)
    config = module.configure_optimizers()
    decay, no_decay = config["optimizer"].param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))
    assert any(p is module.model.bert.embeddings.LayerNorm.weight for p in no_decay["params"])

    linear = WarmupSchedule("linear", warmup_steps=10, total_steps=100)
    assert linear(0) < linear(5) < linear(9) < linear(10) == 1.0
    assert linear(55) == pytest.approx(0.5) and linear(100) == 0.0
    noam = WarmupSchedule("noam", warmup_steps=10_000, hidden_size=256)
    peak = noam(9_999)  # step 10000 counting from 1
    assert peak == pytest.approx(6.25e-4)
    assert noam(99) < peak and noam(40_000) == pytest.approx(256**-0.5 * 40_001**-0.5)
    assert WarmupSchedule("constant", warmup_steps=0)(1000) == 1.0
    with pytest.raises(ValueError, match="total number of steps"):
        WarmupSchedule("linear", warmup_steps=10)


def test_synthetic_corpus_is_learnable(tmp_path, one_thread) -> None:
    """A tiny model gets far above chance on MLM and NSP after a few hundred steps (plain loop, no Lightning)."""
    from recipes.bert.data import BertPretrainingDataModule

    torch.manual_seed(0)
    dm = BertPretrainingDataModule(
        work_dir=str(tmp_path),
        tokenizer_vocab_size=1024,
        synthetic_documents=600,
        synthetic_topics=4,
        max_seq_length=40,
        batch_size=32,
        val_fraction=0.1,
    )
    dm.setup("fit")
    model = BertPretrainingModel(
        dm.vocab_size,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    steps = 0
    while steps < 200:
        for batch in dm.train_dataloader():
            loss = _forward_loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            if steps == 200:
                break
    model.eval()
    mlm_hits = mlm_total = nsp_hits = nsp_total = 0
    with torch.no_grad():
        for batch in dm.val_dataloader():
            out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], labels=batch["labels"])
            mlm_hits += int((out.mlm_logits.argmax(-1) == out.mlm_labels).sum())
            mlm_total += out.mlm_labels.numel()
            nsp_hits += int((out.nsp_logits.argmax(-1) == batch["next_sentence_label"]).sum())
            nsp_total += len(batch["next_sentence_label"])
    print(f"after {steps} steps: MLM accuracy {mlm_hits / mlm_total:.3f}, NSP accuracy {nsp_hits / nsp_total:.3f}")
    assert mlm_total > 300 and nsp_total > 200
    assert mlm_hits / mlm_total > 0.3  # chance: 1/vocab (measured ~0.45)
    assert nsp_hits / nsp_total > 0.7  # chance: 0.5 (measured ~0.8)
    assert math.isfinite(loss.item())


def test_epoch_metrics_are_exact_weighted_means() -> None:
    losses, weights = [2.0, 4.0, 1.0], [3, 1, 0]
    perplexity = Perplexity()
    total = SumOfMeans(num_terms=2)
    for loss, weight in zip(losses, weights, strict=True):
        perplexity.update(torch.tensor(loss), weight=weight)
        # The second term: a placeholder NaN where its weight is 0 (a shard without masked tokens) counts for nothing.
        total.update([torch.tensor(loss), torch.tensor(float("nan") if weight == 0 else 0.5)], [weight, weight])
    mean = (2.0 * 3 + 4.0 * 1) / 4
    torch.testing.assert_close(perplexity.compute(), torch.tensor(math.exp(mean)))
    torch.testing.assert_close(total.compute(), torch.tensor(mean + 0.5))
    # Two shards' states merged (as DDP's sync and the single-process strategies' replica merge do) give the same.
    shards = [SumOfMeans(num_terms=2), SumOfMeans(num_terms=2)]
    shards[0].update([2.0, 0.5], [3, 3])
    shards[1].update([4.0, 0.5], [1, 1])
    shards[0].merge_state(shards[1])
    torch.testing.assert_close(shards[0].compute(), torch.tensor(mean + 0.5))
    with pytest.raises(ValueError, match="expected 2 values and weights"):
        total.update([1.0], [1])


def test_epoch_values_are_logged_as_metrics_not_computed_in_hooks() -> None:
    # Under DDP, a metric computed in an epoch-end hook meets the progress bar's rank-0-only sync and deadlocks: the
    # module leaves computing (and syncing) every epoch value to Lightning, which does it in one order on all ranks.
    from lightning.pytorch import LightningModule

    for hook in ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end"):
        assert getattr(BertPretrainingModule, hook) is getattr(LightningModule, hook), hook
    module = BertPretrainingModule(VOCAB, **TINY)
    logged: dict[str, object] = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)  # type: ignore[method-assign]
    module.validation_step(_batch(), 0)
    for name in ("val/mlm_loss", "val/nsp_loss", "val/perplexity", "val/loss", "val/mlm_acc", "val/nsp_acc"):
        assert isinstance(logged[name], Metric), name
