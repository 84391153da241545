"""What training_step may return under parallel_criterion: tensor, dict with extras, None, custom loss weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from strategy_models import Classifier, clone, flat_params, loader, seeded, trainer
from torch import nn

import lightning_mgpu


class DictOutputs(Classifier):
    """Returns extras and records what on_train_batch_end receives."""

    def __init__(self) -> None:
        super().__init__(output="dict")
        self.seen: list[dict[str, Any]] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append({k: v.detach().clone() for k, v in outputs.items()})


def test_dict_extras_are_gathered_like_single_device():
    base = seeded(DictOutputs)
    single, multi = clone(base), clone(base)
    trainer("auto", 1, max_steps=2).fit(single, loader(10))
    trainer("parallel_criterion", 4, max_steps=2).fit(multi, loader(10))
    assert len(multi.seen) == 2
    for got, ref in zip(multi.seen, single.seen, strict=True):
        assert got.keys() == ref.keys() == {"loss", "preds", "mean_logit"}
        torch.testing.assert_close(got["preds"], ref["preds"])  # concatenated in batch order
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=0, atol=1e-12)
        torch.testing.assert_close(got["mean_logit"], ref["mean_logit"], rtol=0, atol=1e-12)


class SkipsOddBatches(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


def test_every_replica_returning_none_skips_the_batch():
    base = seeded(SkipsOddBatches)
    single, multi = clone(base), clone(base)
    trainer("auto", 1, max_epochs=1).fit(single, loader(10))
    trainer("parallel_criterion", 3, max_epochs=1).fit(multi, loader(10))
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)
    assert not torch.equal(flat_params(multi), flat_params(base))


class SkipsOnOneReplica(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, _ = batch
        return None if x.shape[0] < 3 else super().training_step(batch, batch_idx)  # 10 over 4 = 3, 3, 2, 2


def test_some_replicas_returning_none_is_an_error():
    with pytest.raises(RuntimeError, match=r"returned None on replica\(s\) \[2, 3\]"):
        trainer("parallel_criterion", 4, max_steps=1).fit(seeded(SkipsOnOneReplica), loader(10))


class TokenLoss(Classifier):
    """A per-token loss whose normaliser is the number of valid (non-ignored) targets, given as loss_weight."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        labels = torch.where(x[:, 0] > 0, y, torch.full_like(y, -100))  # about half the rows are ignored
        loss = nn.functional.cross_entropy(self(x), labels, ignore_index=-100)
        return {"loss": loss, lightning_mgpu.LOSS_WEIGHT_KEY: (labels != -100).sum()}


class TwoTermLoss(Classifier):
    """Token-normalised term + sample-normalised term, like BERT's MLM + NSP."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        labels = torch.where(x[:, 0] > 0, y, torch.full_like(y, -100))
        token = nn.functional.cross_entropy(logits, labels, ignore_index=-100)
        sample = (logits**2).mean(dim=1).mean()
        return {
            "loss": token + sample,
            lightning_mgpu.LOSS_TERMS_KEY: {"token": (token, (labels != -100).sum()), "sample": (sample, len(y))},
        }


@pytest.mark.parametrize("module_cls", [TokenLoss, TwoTermLoss])
def test_custom_loss_weights_give_single_device_training(module_cls):
    base = seeded(module_cls)
    single, multi, undeclared, sample_weighted = clone(base), clone(base), clone(base), clone(base)
    trainer("auto", 1, max_steps=4).fit(single, loader(10))
    trainer("parallel_criterion", 4, max_steps=4).fit(multi, loader(10))
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)

    class Undeclared(module_cls):  # the same loss without the weights: its autograd record says them
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch, batch_idx)["loss"]

    undeclared.__class__ = sample_weighted.__class__ = Undeclared
    trainer("parallel_criterion", 4, max_steps=4).fit(undeclared, loader(10))
    torch.testing.assert_close(flat_params(undeclared), flat_params(single), rtol=0, atol=1e-10)
    # Weighted per sample instead, the run differs: the weights matter.
    strategy = lightning_mgpu.ParallelCriterionStrategy(loss_reduction="samples")
    trainer(strategy, 4, max_steps=4).fit(sample_weighted, loader(10))
    assert (flat_params(sample_weighted) - flat_params(single)).abs().max() > 1e-6


class Records(Classifier):
    """Predicts from ``(x, ids)`` batches whose ids are a tuple (``zip(*samples)`` collate), in several output forms."""

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        x, ids = batch
        scores = self(x)[:, 0]
        return {
            "records": [{"id": i, "score": float(s)} for i, s in zip(ids, scores, strict=True)],
            "ids": ids,
            "numpy": scores.detach().numpy(),
            "ragged": [torch.arange(int(i[2:]) % 3) for i in ids],  # variable-size per-sample tensors
            "pair": (scores, x[:, 0]),  # a fixed structure of per-sample tensors, not a per-sample list
        }


def _id_loader(batch_size: int) -> torch.utils.data.DataLoader:
    data = [(x, f"id{i}") for i, (x, _) in enumerate(loader(1).dataset)]
    return torch.utils.data.DataLoader(
        data,
        batch_size=batch_size,
        collate_fn=lambda samples: (torch.stack([s[0] for s in samples]), tuple(s[1] for s in samples)),
    )


@pytest.mark.parametrize(("devices", "batch_size"), [(3, 10), (2, 4)])  # uneven (4, 3, 3) and even (2, 2) shards
def test_per_sample_predictions_come_back_in_order(devices: int, batch_size: int):
    base = seeded(Records)
    single = trainer("auto", 1).predict(clone(base), _id_loader(batch_size))
    multi = trainer("parallel_criterion", devices).predict(clone(base), _id_loader(batch_size))
    assert len(multi) == len(single)
    for got, ref in zip(multi, single, strict=True):
        assert got["ids"] == ref["ids"] and isinstance(got["ids"], tuple)  # split with x, not copied to every shard
        assert [r["id"] for r in got["records"]] == [r["id"] for r in ref["records"]]
        assert [r["score"] for r in got["records"]] == pytest.approx([r["score"] for r in ref["records"]], abs=1e-12)
        assert got["numpy"].shape == ref["numpy"].shape and got["numpy"] == pytest.approx(ref["numpy"], abs=1e-12)
        assert [t.tolist() for t in got["ragged"]] == [t.tolist() for t in ref["ragged"]]
        assert isinstance(got["pair"], tuple) and len(got["pair"]) == 2
        for g, r in zip(got["pair"], ref["pair"], strict=True):
            torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


class BatchStatistics(Classifier):
    """Batches with the batch on dim 1 (``x.T``, ``y[None]``); outputs without a per-sample dimension, or on dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[Any] = []

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x_t, y_row = batch
        logits = self(x_t.T)
        y = y_row[0]
        confusion = torch.zeros(3, 3, dtype=torch.long).index_put_(
            (y, logits.argmax(-1)), torch.tensor(1), accumulate=True
        )
        selected = logits[logits[:, 0] > 0]  # (k, C): k varies on dim 0, but the batch dimension here is dim 1
        return {"confusion": confusion, "by_class": logits.T, "selected": selected}

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.outputs.append(outputs)


def _batch_on_dim_1(batch_size: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        loader(1).dataset,
        batch_size=batch_size,
        collate_fn=lambda samples: (
            torch.stack([s[0] for s in samples], dim=1),
            torch.stack([s[1] for s in samples])[None],
        ),
    )


def test_outputs_are_concatenated_along_dim_and_unmergeable_ones_come_back_per_replica():
    base = seeded(BatchStatistics)
    single, multi = clone(base), clone(base)
    trainer("auto", 1, limit_val_batches=1).validate(single, _batch_on_dim_1(10), verbose=False)
    strategy = lightning_mgpu.ParallelCriterionStrategy(dim=1)
    trainer(strategy, 2, limit_val_batches=1).validate(multi, _batch_on_dim_1(10), verbose=False)
    got, ref = multi.outputs[0], single.outputs[0]
    assert got["by_class"].shape == (3, 10)
    torch.testing.assert_close(got["by_class"], ref["by_class"], rtol=0, atol=1e-12)
    # A statistic without a sample dimension is stacked along dim, as nn.DataParallel gathers: sum the blocks.
    assert got["confusion"].shape == (3, 6)
    torch.testing.assert_close(got["confusion"][:, :3] + got["confusion"][:, 3:], ref["confusion"])
    torch.testing.assert_close(torch.cat(list(got["selected"])), ref["selected"])  # not mergeable on dim 1
    assert isinstance(got["selected"], lightning_mgpu.ReplicaValues)
    with pytest.raises(AttributeError, match=r"differs between the 2 replicas .* has no attribute 'shape'"):
        _ = got["selected"].shape


def test_fixed_structures_and_per_sample_sequences_are_told_apart_with_even_shards():
    """Two samples per replica: a 2-tuple (preds, loss) is a structure, a 2-list of scores or records is per-sample."""
    cpu, counts = torch.device("cpu"), [2, 2]
    preds = [torch.arange(6.0).view(2, 3), torch.arange(6.0, 12.0).view(2, 3)]
    losses = [torch.tensor(1.0), torch.tensor(3.0)]
    merged = _gather([(preds[0], losses[0]), (preds[1], losses[1])], counts, cpu)
    assert isinstance(merged, tuple) and len(merged) == 2
    assert torch.equal(merged[0], torch.cat(preds)) and float(merged[1]) == 2.0
    assert _gather([(1.0, 0.5), (3.0, 1.0)], counts, cpu) == (2.0, 0.75)  # (loss, acc): averaged
    assert _gather([[0.1, 0.2], [0.3, 0.4]], counts, cpu) == [0.1, 0.2, 0.3, 0.4]  # per-sample scores
    records = _gather([[{"id": 0}, {"id": 1}], [{"id": 2}, {"id": 3}]], counts, cpu)
    assert [r["id"] for r in records] == [0, 1, 2, 3]
    tokens = [torch.tensor([5, 6, 7]), torch.tensor([8])]  # preds[mask]: per token, not per sample
    assert _gather(tokens, counts, cpu).tolist() == [5, 6, 7, 8]


def test_lists_of_scalars_are_per_sample_and_dicts_of_batched_tensors_are_structures():
    cpu, counts = torch.device("cpu"), [2, 2]
    scores = _gather([[torch.tensor(1.0), torch.tensor(2.0)], [torch.tensor(3.0), torch.tensor(4.0)]], counts, cpu)
    assert [float(x) for x in scores] == [1.0, 2.0, 3.0, 4.0]  # list(scores) from predict_step
    layers = [[{"logits": torch.zeros(2, 5)}, {"logits": torch.ones(2, 5)}] for _ in range(2)]  # one dict per layer
    merged = _gather(layers, counts, cpu)
    assert len(merged) == 2 and merged[0]["logits"].shape == (4, 5) and float(merged[1]["logits"].sum()) == 20.0
    marked = _gather([lightning_mgpu.PerSample([1]), lightning_mgpu.PerSample([2, 3])], [2, 2], cpu)
    assert marked == [1, 2, 3] and isinstance(marked, lightning_mgpu.PerSample)  # marked: concatenated as given


def _gather(outputs: list, counts: list[int], device: torch.device) -> Any:
    return lightning_mgpu.merge_outputs(outputs, device, sizes=counts)
