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
    single, multi, sample_weighted = clone(base), clone(base), clone(base)
    trainer("auto", 1, max_steps=4).fit(single, loader(10))
    trainer("parallel_criterion", 4, max_steps=4).fit(multi, loader(10))
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)

    class SampleWeighted(module_cls):  # the same loss without the weights: differs, so the weights matter
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch, batch_idx)["loss"]

    sample_weighted.__class__ = SampleWeighted
    trainer("parallel_criterion", 4, max_steps=4).fit(sample_weighted, loader(10))
    assert (flat_params(sample_weighted) - flat_params(single)).abs().max() > 1e-6
