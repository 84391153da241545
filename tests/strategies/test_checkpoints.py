"""Checkpoints carry no wrapper prefix and move between strategies and device counts; resuming is exact."""

from __future__ import annotations

import pytest
import torch
from strategy_models import NAMESPACES, clone, flat_params, loader, models, seeded, trainer

import lightning_mgpu  # noqa: F401


def _fit(module, strategy, devices, max_epochs, ckpt_path=None, namespace="lightning.pytorch", **kwargs):
    t = trainer(strategy, devices, namespace, max_epochs=max_epochs, limit_val_batches=0, **kwargs)
    t.fit(module, loader(10), ckpt_path=ckpt_path)
    return t


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize(
    ("first", "second"),
    [
        (("parallel_criterion", 4), ("dp", 2)),
        (("dp", 3), ("auto", 1)),
        (("auto", 1), ("parallel_criterion", 3)),
    ],
)
def test_resume_under_another_strategy_equals_uninterrupted(tmp_path, first, second, namespace):
    Classifier = models(namespace).Classifier
    base = seeded(Classifier)
    uninterrupted = clone(base)
    _fit(uninterrupted, "auto", 1, max_epochs=2, namespace=namespace)

    interrupted = clone(base)
    t = _fit(interrupted, *first, max_epochs=1, namespace=namespace)
    path = tmp_path / "half.ckpt"
    t.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert not any(k.startswith("module.") for k in state), list(state)
    assert "net.0.weight" in state

    resumed = seeded(Classifier, seed=123)  # different initial weights: everything must come from the checkpoint
    t2 = _fit(resumed, *second, max_epochs=2, ckpt_path=str(path), namespace=namespace)
    assert t2.global_step == 8  # 4 batches per epoch
    torch.testing.assert_close(flat_params(resumed), flat_params(uninterrupted), rtol=0, atol=1e-10)


def test_load_from_checkpoint_into_plain_module(tmp_path):
    Classifier = models().Classifier
    module = seeded(Classifier)
    t = _fit(module, "parallel_criterion", 3, max_epochs=1)
    t.save_checkpoint(tmp_path / "m.ckpt")
    loaded = Classifier.load_from_checkpoint(tmp_path / "m.ckpt").double()
    torch.testing.assert_close(flat_params(loaded), flat_params(module))
    plain = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    state = torch.load(tmp_path / "m.ckpt", weights_only=False)["state_dict"]
    plain.load_state_dict({k.removeprefix("net."): v for k, v in state.items() if k.startswith("net.")})
    torch.testing.assert_close(flat_params(plain), flat_params(module.net))


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_model_checkpoint_and_early_stopping(tmp_path, strategy, namespace):
    L, Classifier = models(namespace).L, models(namespace).Classifier
    ModelCheckpoint, EarlyStopping = L.callbacks.ModelCheckpoint, L.callbacks.EarlyStopping
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, filename="{epoch}-{val_loss:.4f}")
    stopping = EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)  # no improvement is ever big enough
    t = trainer(strategy, 3, namespace, max_epochs=10, enable_checkpointing=True, callbacks=[checkpoint, stopping])
    t.fit(seeded(Classifier), loader(10), loader(10, seed=1))
    assert t.current_epoch == 2  # stopped by EarlyStopping after patience ran out, not by max_epochs
    assert checkpoint.best_model_path and len(list(tmp_path.glob("*.ckpt"))) == 2
    best = Classifier.load_from_checkpoint(checkpoint.best_model_path)
    assert isinstance(best, Classifier)
    assert float(checkpoint.best_model_score) == pytest.approx(min(float(s) for s in checkpoint.best_k_models.values()))
