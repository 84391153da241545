"""torchmetrics objects called in a step: what a call returns is its shard's value on each replica, and what the step
logs of it is one device's batch value; metrics held in dicts, lists and ``MetricCollection`` attributes merge as
attribute metrics do; a ``MeanMetric`` of the loss gives one device's value with uneven shards. Compared with one
device on the same seed and batches (float64, batches of 7 and a last one of 5: uneven shards on 2 and 3 devices),
every logged row and the final parameters; default callbacks and the progress bar on."""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torchmetrics
from strategy_models import N_CLASSES, N_FEATURES, NAMESPACES, flat_params, loader
from torch import nn
from torchmetrics.aggregation import MaxMetric, MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision, MulticlassRecall
from torchmetrics.text import BLEUScore, CharErrorRate
from torchmetrics.wrappers import ClasswiseWrapper, MultitaskWrapper

import lightning_mgpu

N_TRAIN, N_VAL, BATCH = 33, 19, 7  # batches of 7, 7, 7, 7, 5: shards 4+3 and 3+2 on 2 devices, 3+2+2, 2+2+1 on 3
F1 = functools.partial(MulticlassF1Score, N_CLASSES, average="macro")


def _float64(*metrics: Any) -> None:
    for metric in metrics:
        metric.set_dtype(torch.float64)


def _strings(classes: torch.Tensor, target: bool = False) -> list[Any]:
    """Text of uneven lengths per sample: a class's letter repeated by its index, and a two-word sentence."""
    letters = ["a" * (int(c) + 1) + "b" for c in classes]
    return [[f"{w} z"] for w in letters] if target else [f"{w} z" for w in letters]


@functools.cache
def _classes(namespace: str) -> SimpleNamespace:
    L = importlib.import_module(namespace)
    logger_base = importlib.import_module(f"{namespace}.loggers").Logger

    class Rows(logger_base):
        """Every row Lightning logs (step and epoch values), in order."""

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int | None, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "rows"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

    class Base(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(N_FEATURES, 16), nn.Tanh(), nn.Linear(16, N_CLASSES))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)

    class StepValues(Base):
        """(a) The tensors metric calls return, logged: F1, precision, text scores; objects for epoch values."""

        def __init__(self) -> None:
            super().__init__()
            self.train_f1, self.val_f1 = F1(), F1()
            self.acc = MulticlassAccuracy(N_CLASSES, average="macro")
            self.precision = MulticlassPrecision(N_CLASSES, average="weighted")
            self.cer, self.bleu = CharErrorRate(), BLEUScore(n_gram=2, smooth=True)
            _float64(self.cer, self.bleu)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self(x)
            f1 = self.train_f1(logits, y)
            self.log("train_f1", f1, prog_bar=True)  # on_step: one device's batch value
            self.log("train_f1_flipped", self.train_f1(logits.flip(1), y))  # a second call: its own value
            self.log("train_f1_obj", self.train_f1, on_step=False, on_epoch=True)  # its epoch value
            self.log("precision", self.precision(logits, y), on_step=True, on_epoch=True, reduce_fx="max")
            self.acc(logits, y)
            self.log("acc", self.acc, on_step=True, on_epoch=True)
            preds = _strings(logits.argmax(1))
            self.log("cer", self.cer(preds, [t[0] for t in _strings(y, target=True)]), on_epoch=True)
            self.log("bleu", self.bleu(preds, _strings(y, target=True)))
            return nn.functional.cross_entropy(logits, y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_f1", self.val_f1(self(x), y))  # on_epoch: the mean of one device's batch values

    class Wrappers(Base):
        """(a) Wrappers' and compositions' calls: their returned values, logged, are one device's too."""

        def __init__(self) -> None:
            super().__init__()
            self.classwise = ClasswiseWrapper(MulticlassF1Score(N_CLASSES, average=None), prefix="f1_")
            self.tasks = MultitaskWrapper({"cls": F1(), "reg": torchmetrics.MeanSquaredError()})
            self.composed = MulticlassRecall(N_CLASSES, average="macro") * 100 + F1()
            _float64(self.tasks)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self(x)
            self.log_dict(self.classwise(logits, y))
            self.log_dict(self.tasks({"cls": logits, "reg": logits[:, 0]}, {"cls": y, "reg": y.double()}))
            self.log("composed", self.composed(logits, y), on_epoch=True)
            return nn.functional.cross_entropy(logits, y)

    class Held(Base):
        """(b) Metrics in a plain dict, a plain list, a dict of a MetricCollection, and a MetricCollection."""

        def __init__(self) -> None:
            super().__init__()
            self.same = SumMetric()  # an attribute, held in the dict too: folded once
            _float64(self.same)
            self.metrics = {"f1": F1(), "acc": MulticlassAccuracy(N_CLASSES, average="macro"), "same": self.same}
            self.nested = {"train": (MulticlassAccuracy(N_CLASSES, average="weighted"),)}
            self.listed = [
                MulticlassPrecision(N_CLASSES, average="macro"),
                MulticlassRecall(N_CLASSES, average="macro"),
            ]
            self.stages = {"train": torchmetrics.MetricCollection([F1(), MulticlassAccuracy(N_CLASSES)], prefix="st_")}
            self.collection = torchmetrics.MetricCollection(
                [MulticlassPrecision(N_CLASSES, average="weighted"), MulticlassRecall(N_CLASSES, average="micro")],
                prefix="coll_",
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self(x)
            self.log("dict_f1", self.metrics["f1"](logits, y))
            self.log("same_step", self.metrics["same"]((logits.argmax(1) == y).sum()))  # correct ones, summed
            self.log("same_epoch", self.same, on_step=False, on_epoch=True)
            self.log("nested", self.nested["train"][0](logits, y))
            self.metrics["acc"].update(logits, y)
            # Outside the module's attributes Lightning itself needs the name, on one device too.
            self.log("dict_acc", self.metrics["acc"], metric_attribute="metrics.acc", on_step=False, on_epoch=True)
            for k, metric in enumerate(self.listed):
                self.log(f"list_{k}", metric(logits, y), on_epoch=True)
            self.log_dict(self.stages["train"](logits, y))
            self.log_dict(self.collection(logits, y), on_epoch=True)
            return nn.functional.cross_entropy(logits, y)

        def on_train_epoch_end(self) -> None:  # the held metrics' epoch states, computed on the root
            self.log("list_0_epoch_state", self.listed[0].compute())
            self.log("dict_f1_epoch_state", self.metrics["f1"].compute())
            for metric in (*self.listed, self.metrics["f1"]):
                metric.reset()

    class HeldUnnamed(Base):
        """A dict's metric logged as an object without ``metric_attribute``: Lightning refuses it on one device."""

        def __init__(self) -> None:
            super().__init__()
            self.metrics = {"f1": F1()}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self(x)
            self.metrics["f1"](logits, y)
            self.log("dict_f1", self.metrics["f1"])
            return nn.functional.cross_entropy(logits, y)

    class MeanLoss(Base):
        """(c) Aggregation metrics of the step's loss (a per-sample mean, or a mean over counted targets)."""

        def __init__(self, call: str = "forward", tokens: bool = False) -> None:
            super().__init__()
            self.call, self.tokens = call, tokens
            self.mean_loss, self.val_mean = MeanMetric(), MeanMetric()
            self.max_loss, self.sum_loss = MaxMetric(), SumMetric()
            _float64(self.mean_loss, self.val_mean, self.max_loss, self.sum_loss)

        def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = batch
            if self.tokens:  # some targets ignored: a mean over those counted
                y = y.masked_fill((x[:, 0] > 0.3) & (x[:, 1] < 0), -100)
            return nn.functional.cross_entropy(self(x), y), (y != -100).sum()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss, counted = self._loss(batch)
            if self.call == "forward":
                self.log("mean_loss_step", self.mean_loss(loss))
            elif self.call == "update":
                self.mean_loss.update(loss)
            elif self.call == "number":  # a Python number: merged by sample counts
                self.mean_loss.update(loss.item())
            elif self.call == "number_weighted":  # ... unless its weight says what it counts
                self.mean_loss.update(loss.item(), weight=counted)
            else:  # "weighted": the fix documented before
                self.mean_loss.update(loss, weight=len(batch[1]))
            self.log("mean_loss", self.mean_loss, on_step=self.call == "forward", on_epoch=True)
            self.log("max_loss", self.max_loss(loss.detach()), on_step=True)
            self.sum_loss.update(loss)
            self.log("sum_loss", self.sum_loss, on_step=False, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.val_mean(self._loss(batch)[0])
            self.log("val_mean_loss", self.val_mean)

    return SimpleNamespace(
        L=L, Rows=Rows, StepValues=StepValues, Wrappers=Wrappers, Held=Held, HeldUnnamed=HeldUnnamed, MeanLoss=MeanLoss
    )


def _fit(module_class: str | type, strategy: Any, devices: int, tmp_path: Any, namespace: str, **kwargs: Any) -> Any:
    """Fit a module (its class, or its name in ``_classes(namespace)``) from seed 0: what it logged, and its end."""
    classes = _classes(namespace)
    torch.manual_seed(0)
    make = getattr(classes, module_class) if isinstance(module_class, str) else module_class
    module = make(**kwargs).to(torch.float64)
    rows = classes.Rows()
    trainer = classes.L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=2,
        logger=rows,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, loader(BATCH, n=N_TRAIN), loader(BATCH, n=N_VAL, seed=1))
    return SimpleNamespace(
        rows=rows.rows,
        params=flat_params(module),
        callback={k: float(v) for k, v in trainer.callback_metrics.items()},
        logged={k: float(v) for k, v in trainer.logged_metrics.items()},
        module=module,
    )


_REFERENCES: dict[tuple[Any, ...], SimpleNamespace] = {}


def _reference(module_name: str, tmp_path: Any, namespace: str = "lightning.pytorch", **kwargs: Any) -> SimpleNamespace:
    key = (module_name, namespace, *sorted(kwargs.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = _fit(module_name, "auto", 1, tmp_path, namespace, **kwargs)
    return _REFERENCES[key]


def _assert_equal_runs(got: SimpleNamespace, ref: SimpleNamespace, tol: float = 1e-9) -> None:
    """Every logged row (steps and epochs), the trainer's last values and the final parameters."""
    assert [step for step, _ in got.rows] == [step for step, _ in ref.rows]
    for (step, got_row), (_, ref_row) in zip(got.rows, ref.rows, strict=True):
        assert got_row.keys() == ref_row.keys(), step
        for name, value in ref_row.items():
            assert got_row[name] == pytest.approx(value, rel=0, abs=tol), (step, name)
    assert got.callback == pytest.approx(ref.callback, rel=0, abs=tol)
    assert got.logged == pytest.approx(ref.logged, rel=0, abs=tol)
    torch.testing.assert_close(got.params, ref.params, rtol=0, atol=tol)


STRATEGIES = [("parallel_criterion", 2), ("parallel_criterion", 3), ("dp", 2), ("dp", 3)]


@pytest.mark.parametrize(("strategy", "devices"), STRATEGIES)
def test_values_metric_calls_return_log_one_devices_batch_values(tmp_path: Any, strategy: str, devices: int):
    ref = _reference("StepValues", tmp_path)
    got = _fit("StepValues", strategy, devices, tmp_path, "lightning.pytorch")
    _assert_equal_runs(got, ref)
    names = set().union(*(row for _, row in ref.rows))
    assert {"train_f1", "train_f1_flipped", "precision_step", "precision_epoch", "acc_step", "cer_step"} <= names
    assert {"bleu", "val_f1"} <= names
    assert {"train_f1_obj", "acc_epoch", "cer_epoch"} <= names
    assert len({row["train_f1"] for _, row in ref.rows if "train_f1" in row}) > 3  # values that differ by step


@pytest.mark.parametrize(("strategy", "devices"), STRATEGIES)
def test_values_wrapper_and_composition_calls_return_log_one_devices(tmp_path: Any, strategy: str, devices: int):
    ref = _reference("Wrappers", tmp_path)
    got = _fit("Wrappers", strategy, devices, tmp_path, "lightning.pytorch")
    _assert_equal_runs(got, ref)
    names = set().union(*(row for _, row in ref.rows))
    assert {"f1_0", "f1_2", "cls", "reg", "composed_step", "composed_epoch"} <= names


def test_a_replica_returns_its_shards_value_and_the_step_logs_one_devices(tmp_path: Any):
    """On each replica the call returns its shard's F1, and without the merge the logged value would be those values'
    sample-weighted mean, which differs from one device's (what the issue reported)."""
    seen: list[tuple[int, float, float]] = []
    classes = _classes("lightning.pytorch")

    class Spy(classes.StepValues):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            value = self.train_f1(self(x), y)
            alone = F1().to(x.device)(self(x), y)  # a fresh metric's value on this shard
            seen.append((len(y), float(value), float(alone)))
            self.log("train_f1", value)
            return nn.functional.cross_entropy(self(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            pass

    torch.manual_seed(0)
    module = Spy().to(torch.float64)
    trainer = classes.L.Trainer(
        strategy="parallel_criterion", accelerator="cpu", devices=2, max_steps=1, default_root_dir=tmp_path
    )
    trainer.fit(module, loader(BATCH, n=N_TRAIN))
    assert [n for n, _, _ in seen] == [4, 3] and all(value == alone for _, value, alone in seen)
    x, y = loader(BATCH, n=N_TRAIN).dataset.tensors
    torch.manual_seed(0)
    whole = F1()(classes.StepValues().to(torch.float64)(x[:BATCH]), y[:BATCH])
    by_rows = sum(n * value for n, value, _ in seen) / BATCH
    assert float(trainer.logged_metrics["train_f1"]) == pytest.approx(float(whole), abs=1e-12)
    assert abs(by_rows - float(whole)) > 1e-3  # the merge the issue reported would have been visibly wrong


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize(("strategy", "devices"), STRATEGIES)
def test_metrics_held_in_dicts_lists_and_collections_equal_one_device(
    tmp_path: Any, namespace: str, strategy: str, devices: int
):
    ref = _reference("Held", tmp_path, namespace)
    got = _fit("Held", strategy, devices, tmp_path, namespace)
    _assert_equal_runs(got, ref)
    names = set().union(*(row for _, row in ref.rows))
    assert {"dict_f1", "dict_acc", "same_step", "same_epoch", "nested", "list_0_step", "list_1_epoch"} <= names
    assert "st_MulticlassF1Score" in names
    assert {"coll_MulticlassPrecision_step", "list_0_epoch_state", "dict_f1_epoch_state"} <= names


def test_threads_and_a_metric_added_to_a_dict_between_steps(tmp_path: Any):
    """Replicas in threads each update their own clones; metrics put into the module's dict (rebound) and list
    (appended to) after the replicas were built, in a hook on the root, are found at the next step."""
    classes = _classes("lightning.pytorch")

    class Late(classes.Held):
        def on_train_epoch_start(self) -> None:
            if self.current_epoch == 1:
                self.metrics = {**self.metrics, "late": F1()}  # rebound
                self.listed.append(F1())  # grown in place

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if "late" in self.metrics:
                self.log("late_f1", self.metrics["late"](self(batch[0]), batch[1]))
            return super().training_step(batch, batch_idx)

    threads = lightning_mgpu.ParallelCriterionStrategy(execution_mode="threads")
    ref = _fit(Late, "auto", 1, tmp_path, "lightning.pytorch")
    got = _fit(Late, threads, 3, tmp_path, "lightning.pytorch")
    _assert_equal_runs(got, ref)
    assert {"late_f1", "list_2_step"} <= got.logged.keys()


@pytest.mark.parametrize(("strategy", "devices"), [("parallel_criterion", 2), ("auto", 1)])
def test_a_dict_metric_logged_without_metric_attribute_is_refused_as_on_one_device(
    tmp_path: Any, strategy: str, devices: int
):
    with pytest.raises(Exception, match=r"Could not find the `LightningModule` attribute") as raised:
        _fit("HeldUnnamed", strategy, devices, tmp_path, "pytorch_lightning")
    assert type(raised.value).__name__ == "MisconfigurationException"


@pytest.mark.parametrize("call", ["forward", "update", "weighted"])
@pytest.mark.parametrize(("strategy", "devices"), STRATEGIES)
def test_a_mean_metric_of_the_loss_equals_one_device_with_uneven_shards(
    tmp_path: Any, call: str, strategy: str, devices: int
):
    ref = _reference("MeanLoss", tmp_path, call=call)
    got = _fit("MeanLoss", strategy, devices, tmp_path, "lightning.pytorch", call=call)
    _assert_equal_runs(got, ref)
    names = set().union(*(row for _, row in ref.rows))
    assert {"mean_loss_epoch" if call == "forward" else "mean_loss", "max_loss", "sum_loss", "val_mean_loss"} <= names


@pytest.mark.parametrize("call", ["forward", "update", "number_weighted"])
def test_a_mean_metric_of_a_token_mean_loss_equals_one_device(tmp_path: Any, call: str):
    """The loss a mean over counted targets: a tensor merges by the loss's rule; a number with its count as weight."""
    ref = _reference("MeanLoss", tmp_path, call=call, tokens=True)
    got = _fit("MeanLoss", "parallel_criterion", 3, tmp_path, "lightning.pytorch", call=call, tokens=True)
    _assert_equal_runs(got, ref)


def test_a_mean_metric_of_a_number_counts_samples(tmp_path: Any):
    """What cannot be exact: ``update(loss.item())`` of a token mean holds no trace of its count, so the replicas'
    numbers merge by sample counts, which differs from one device; passing the tensor or ``weight=<count>`` is
    exact (previous test)."""
    ref = _reference("MeanLoss", tmp_path, call="number", tokens=True)
    got = _fit("MeanLoss", "parallel_criterion", 3, tmp_path, "lightning.pytorch", call="number", tokens=True)
    assert abs(got.callback["mean_loss"] - ref.callback["mean_loss"]) > 1e-6
    samples = _reference("MeanLoss", tmp_path, call="number")  # a per-sample mean: samples are what it counts
    _assert_equal_runs(_fit("MeanLoss", "parallel_criterion", 3, tmp_path, "lightning.pytorch", call="number"), samples)
