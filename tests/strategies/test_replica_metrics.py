"""torchmetrics metrics under parallel_criterion: wrappers whose states live in child metrics, collections, a step
value only when one device has one, and the cases the replicas cannot reproduce (refused with the fix)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchmetrics
import torchmetrics.segmentation
import torchmetrics.wrappers.bootstrapping
from strategy_models import N_CLASSES, Classifier, loader, seeded, trainer
from torch import nn
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassF1Score,
    MulticlassPrecision,
    MulticlassRecall,
    MulticlassStatScores,
)
from torchmetrics.wrappers import (
    BootStrapper,
    ClasswiseWrapper,
    MinMaxMetric,
    MultioutputWrapper,
    MultitaskWrapper,
    Running,
)

import lightning_mgpu

MODES = ("sequential", "threads")


def _strategy(mode: str) -> lightning_mgpu.ParallelCriterionStrategy:
    return lightning_mgpu.ParallelCriterionStrategy(execution_mode=mode)


def _flat(name: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flat(f"{name}.{key}", item, out)
    else:
        for i, item in enumerate(torch.as_tensor(value).flatten().tolist()):
            out[f"{name}[{i}]"] = item


class Wrapped(Classifier):
    """Wrappers and collections updated in the step (``update`` or ``forward``), computed at each epoch's end."""

    def __init__(self, call: str = "update") -> None:
        super().__init__()
        self.call = call
        self.mt = MultitaskWrapper(
            {
                "cls": MulticlassAccuracy(N_CLASSES, average="macro"),
                "reg": torchmetrics.MetricCollection(
                    [torchmetrics.MeanSquaredError(), torchmetrics.MeanAbsoluteError()]
                ),
            }
        )
        self.mo = MultioutputWrapper(torchmetrics.R2Score(), num_outputs=2)
        self.cw = ClasswiseWrapper(MulticlassStatScores(N_CLASSES, average=None))  # its states seen through it
        self.by_stage = nn.ModuleDict(
            {"fit": torchmetrics.MetricCollection([MulticlassAccuracy(N_CLASSES), MulticlassF1Score(N_CLASSES)])}
        )
        self.coll = torchmetrics.MetricCollection([MulticlassPrecision(N_CLASSES), MulticlassRecall(N_CLASSES)])
        self.acc = MulticlassAccuracy(N_CLASSES, average="macro")
        self.composed = MulticlassRecall(N_CLASSES, average="macro") * 100  # a CompositionalMetric
        self.mm = MinMaxMetric(MulticlassAccuracy(N_CLASSES, average="macro"))  # its forward: see test below
        self.bs = BootStrapper(torchmetrics.MeanSquaredError(), num_bootstraps=3)
        self.results: list[dict[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        update = (lambda m, *args: m.update(*args)) if self.call == "update" else (lambda m, *args: m(*args))
        update(self.mt, {"cls": logits, "reg": logits[:, 0]}, {"cls": y, "reg": y.double()})
        update(self.mo, logits[:, :2], torch.stack([y, 2 - y], 1).double())
        for metric in (self.cw, self.by_stage["fit"], self.coll, self.acc, self.composed):
            update(metric, logits, y)
        self.mm.update(logits, y)
        self.bs.update(logits[:, 0], y.double())
        return nn.functional.cross_entropy(logits, y)

    def on_train_epoch_end(self) -> None:
        out: dict[str, float] = {}
        for name in ("mt", "mo", "cw", "coll", "acc", "composed", "mm", "bs"):
            _flat(name, getattr(self, name).compute(), out)
            getattr(self, name).reset()
        _flat("by_stage", self.by_stage["fit"].compute(), out)
        self.by_stage["fit"].reset()
        self.results.append(out)


def _fit_results(module: Wrapped, strategy: Any, devices: int) -> list[dict[str, float]]:
    trainer(strategy, devices, max_epochs=2).fit(module, loader(8))
    return module.results


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("call", ["update", "forward"])
def test_wrapper_metrics_equal_one_device(monkeypatch: pytest.MonkeyPatch, mode: str, call: str):
    """BootStrapper draws its resamples per shard, so random draws cannot match one device: its sampler is made the
    identity here, which still checks that every bootstrap copy's state is folded."""
    monkeypatch.setattr(torchmetrics.wrappers.bootstrapping, "_bootstrap_sampler", lambda size, **_: torch.arange(size))
    ref = _fit_results(seeded(Wrapped, call=call), "auto", 1)
    got = _fit_results(seeded(Wrapped, call=call), _strategy(mode), 2)
    assert len(ref) == len(got) == 2
    for ref_epoch, got_epoch in zip(ref, got, strict=True):
        assert got_epoch.keys() == ref_epoch.keys()
        for key, value in ref_epoch.items():
            assert got_epoch[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert ref[1]["mm.min[0]"] < ref[1]["mm.max[0]"]  # the min and max over the epochs are really compared
    assert all(
        abs(ref[0][key]) > 0
        for key in ("mt.cls[0]", "mt.reg.MeanSquaredError[0]", "mo[0]", "bs.mean[0]", "composed[0]")
    )


class LoggedCollection(Classifier):
    """An ordinary MetricCollection (compute groups on), a plain and a composed metric, logged as objects after
    forward."""

    def __init__(self) -> None:
        super().__init__()
        self.coll = torchmetrics.MetricCollection(
            [MulticlassAccuracy(N_CLASSES), MulticlassPrecision(N_CLASSES), MulticlassF1Score(N_CLASSES)],
            prefix="train_",
        )
        self.composed = MulticlassRecall(N_CLASSES, average="macro") * 100

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        self.coll(logits, y)
        self.val_acc(logits, y)
        self.composed(logits, y)
        self.log_dict(self.coll, on_step=True, on_epoch=True)
        self.log("macro_acc", self.val_acc, on_step=True, on_epoch=True)
        self.log("recall_percent", self.composed, on_step=True, on_epoch=True)
        return nn.functional.cross_entropy(logits, y)


def _fit_both(module_class: type, mode: str, steps: int) -> tuple[Any, Any]:
    """Trainers that fit ``module_class`` on one device and on two replicas in ``mode``."""
    single, multi = trainer("auto", 1, max_steps=steps), trainer(_strategy(mode), 2, max_steps=steps)
    single.fit(seeded(module_class), loader(10))
    multi.fit(seeded(module_class), loader(10))
    return single, multi


@pytest.mark.parametrize("mode", MODES)
def test_metric_collection_and_plain_metric_logged_as_objects_equal_one_device(mode: str):
    single, multi = _fit_both(LoggedCollection, mode, 4)
    for ref, got in ((single.logged_metrics, multi.logged_metrics), (single.callback_metrics, multi.callback_metrics)):
        assert got.keys() == ref.keys()
        assert {k: float(v) for k, v in got.items()} == pytest.approx({k: float(v) for k, v in ref.items()}, abs=1e-7)
    assert {"train_MulticlassPrecision_step", "recall_percent_step"} <= set(single.logged_metrics)


class UpdatedOnly(Classifier):
    """Logs a metric with on_step=True that the step only updates: one device has no batch value to log."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("acc", self.val_acc, on_step=True, on_epoch=True)
        return nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("mode", MODES)
def test_a_metric_only_updated_logs_no_step_value_as_on_one_device(mode: str):
    single, multi = _fit_both(UpdatedOnly, mode, 3)
    assert set(single.logged_metrics) == set(multi.logged_metrics) == {"acc_epoch"}
    assert set(single.callback_metrics) == set(multi.callback_metrics) == {"acc", "acc_epoch"}
    assert float(multi.logged_metrics["acc_epoch"]) == pytest.approx(float(single.logged_metrics["acc_epoch"]))


class ComputesInStep(Classifier):
    """Calls compute() on its metric inside the step (``where="step"``) or after it (``where="batch_end"``)."""

    def __init__(self, where: str = "step") -> None:
        super().__init__()
        self.where = where
        self.seen: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        if self.where == "step":
            self.seen.append(float(self.val_acc.compute()))
        return nn.functional.cross_entropy(logits, y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.where == "batch_end":
            self.seen.append(float(self.val_acc.compute()))


@pytest.mark.parametrize("mode", MODES)
def test_compute_inside_a_replicated_step_is_refused_and_the_suggested_hook_equals_one_device(mode: str):
    with pytest.raises(
        RuntimeError, match=r"compute\(\) was called on self\.val_acc inside a step.*on_train_batch_end"
    ):
        trainer(_strategy(mode), 2, max_steps=2).fit(seeded(ComputesInStep), loader(10))
    reference, moved = seeded(ComputesInStep), seeded(ComputesInStep, where="batch_end")
    trainer("auto", 1, max_steps=4).fit(reference, loader(10))
    trainer(_strategy(mode), 2, max_steps=4).fit(moved, loader(10))
    assert moved.seen == pytest.approx(reference.seen, abs=1e-12)
    assert len(set(reference.seen)) > 1


class RunningSum(Classifier):
    """A Running wrapper (it counts its updates in a plain attribute), updated in the step or from its outputs."""

    def __init__(self, where: str = "step") -> None:
        super().__init__()
        self.where = where
        self.running = Running(torchmetrics.SumMetric(), window=2)
        self.seen: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        if self.where == "step":
            self.running.update(logits.max(-1).values)
        return {"loss": nn.functional.cross_entropy(logits, y), "top": logits.max(-1).values}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.where == "batch_end":
            self.running.update(outputs["top"])
        self.seen.append(float(self.running.compute()))


class ForwardedWrapper(Classifier):
    """Calls a wrapper whose torchmetrics forward resets the metric it wraps (on one device too)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        base = MulticlassAccuracy(N_CLASSES, average="macro")
        self.wrapper = MinMaxMetric(base) if kind == "minmax" else BootStrapper(base, num_bootstraps=2)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        self.wrapper(logits, y)
        return nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("mode", MODES)
def test_metrics_the_replicas_cannot_reproduce_are_refused_with_a_fix_that_works(mode: str):
    with pytest.raises(TypeError, match=r"self\.running \(Running\) changed '_num_vals_seen'.*on_train_batch_end"):
        trainer(_strategy(mode), 2, max_steps=2).fit(seeded(RunningSum), loader(10))
    for kind in ("minmax", "bootstrap"):
        with pytest.raises(TypeError, match=r"self\.wrapper\(\.\.\.\).*forward.*self\.wrapper\.update\(\.\.\.\)"):
            trainer(_strategy(mode), 2, max_steps=2).fit(seeded(ForwardedWrapper, kind=kind), loader(10))
    reference, moved = seeded(RunningSum), seeded(RunningSum, where="batch_end")
    trainer("auto", 1, max_steps=4).fit(reference, loader(10))
    trainer(_strategy(mode), 2, max_steps=4).fit(moved, loader(10))
    assert moved.seen == pytest.approx(reference.seen, rel=1e-6)


class InferredClasses(Classifier):
    """``MeanIoU(num_classes=None)`` infers ``num_classes`` on its first update, outside its metric states."""

    def __init__(self) -> None:
        super().__init__()
        self.iou = torchmetrics.segmentation.MeanIoU(num_classes=None, input_format="one-hot")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        one_hot = [nn.functional.one_hot(t, N_CLASSES)[..., None] for t in (logits.argmax(1), y)]
        self.iou.update(*one_hot)
        self.log("iou", self.iou, on_step=False, on_epoch=True)
        return nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("mode", MODES)
def test_a_setting_a_metric_infers_on_its_first_update_reaches_the_root_metric(mode: str):
    single, multi = _fit_both(InferredClasses, mode, 4)
    assert float(multi.callback_metrics["iou"]) == pytest.approx(float(single.callback_metrics["iou"]), abs=1e-12)
