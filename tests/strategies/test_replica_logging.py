"""Replica logging and metrics edge cases: zero-weight shards, loss_weight-implied weights, builtin reduce_fx,
logged copies of the loss with every reduce_fx, numpy scalars, metrics with unreduced states, a failed step
leaving no state behind, and the warnings for step outputs kept in attributes and attributes rebound in a step."""

from __future__ import annotations

import collections
import importlib
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torchmetrics
from strategy_models import NAMESPACES, Classifier, clone, loader, make_data, metrics, models, seeded, trainer
from torch import nn

import lightning_mgpu


class TokenLossLogged(Classifier):
    """A token loss with ignored targets: one shard of the first batch has none valid (its mean is NaN)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y, index = batch
        labels = torch.where(index % 8 < 4, -100, y)  # batches of 8 over 2 shards: shard 0 has no valid target
        loss = nn.functional.cross_entropy(self(x), labels, ignore_index=-100)
        valid = (labels != -100).sum()
        self.log("tok_loss_by_batch_size", loss, batch_size=int(valid), on_step=True)
        self.log("tok_loss_implied", loss, on_step=True)  # no batch_size: weighted like the returned loss
        self.log("max_seen", float(len(y)), reduce_fx=max, on_step=True)  # builtins, as Lightning accepts
        self.log("min_seen", float(len(y)), reduce_fx=min, on_step=True)
        self.log("n_seen", float(len(y)), reduce_fx=sum, on_step=True)
        return {"loss": loss, lightning_mgpu.LOSS_WEIGHT_KEY: valid}


def test_logged_means_skip_zero_weight_shards_and_follow_loss_weight():
    x, y = loader(8).dataset.tensors
    indexed = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, torch.arange(len(y))), batch_size=8)
    base = seeded(TokenLossLogged)
    single, multi = trainer("auto", 1, max_steps=1), trainer("parallel_criterion", 2, max_steps=1)
    single.fit(clone(base), indexed)
    multi.fit(clone(base), indexed)
    ref, got = metrics(single), metrics(multi)
    for name in ("tok_loss_by_batch_size", "tok_loss_implied"):
        assert got[name] == pytest.approx(ref[name], abs=1e-12), name  # not NaN, not sample-weighted
    assert (got["max_seen"], got["min_seen"], got["n_seen"]) == (4.0, 4.0, 8.0)  # per-replica max/min, summed total
    assert (ref["max_seen"], ref["min_seen"], ref["n_seen"]) == (8.0, 8.0, 8.0)


class EpochMeans(Classifier):
    """Validation logs a mean without ``batch_size=`` from batches whose first entry is not per-sample (Lightning
    weighs each step by what it reads there, warning that the batch is ambiguous), and one with ``batch_size=`` the
    shard's sample count; 11 samples in batches of 5, 5 and 1 (the last one runs on one replica)."""

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        x = batch["x"]
        self.log("val_inferred_weight", self(x).mean())
        self.log("val_given_weight", self(x).mean(), batch_size=len(x))


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("first", ["scalar", "images"])
def test_epoch_means_of_logged_values_weigh_each_step_as_one_device_does(first: str, devices: int):
    x = make_data(11).tensors[0]

    def collate(rows: list[torch.Tensor]) -> dict[str, Any]:
        head = torch.tensor(1.0) if first == "scalar" else lightning_mgpu.PerSample([r.view(2, -1) for r in rows])
        return {"head": head, "x": torch.stack(rows)}

    data = torch.utils.data.DataLoader(list(x), batch_size=5, collate_fn=collate)
    base = seeded(EpochMeans)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Trying to infer the `batch_size`")
        ref = trainer("auto", 1, enable_progress_bar=True).validate(clone(base), data, verbose=False)[0]
        got = trainer("parallel_criterion", devices, enable_progress_bar=True).validate(
            clone(base), data, verbose=False
        )
    for name in ("val_inferred_weight", "val_given_weight"):
        assert got[0][name] == pytest.approx(ref[name], rel=0, abs=1e-12), name


class Correlation(Classifier):
    """PearsonCorrCoef keeps unreduced (dist_reduce_fx=None) states that DDP stacks per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.pearson = torchmetrics.PearsonCorrCoef()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.pearson.update(self(x)[:, 0], y.double())
        self.log("val_pearson", self.pearson)


class MeanState(torchmetrics.Metric):
    """A state reduced with "mean" across processes: the mean of per-batch maxima."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("value", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="mean")
        self.add_state("batches", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="mean")

    def update(self, x: torch.Tensor) -> None:
        self.value += x.max()
        self.batches += 1

    def compute(self) -> torch.Tensor:
        return self.value / self.batches


class MeanReduced(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.mean_state = MeanState()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.mean_state.update(batch[0][:, 0])
        self.log("mean_of_maxima", self.mean_state)


class Retrieval(Classifier):
    """RetrievalMRR keeps list states with no reduction (each rank's list is kept, DDP concatenates them)."""

    def __init__(self) -> None:
        super().__init__()
        self.mrr = torchmetrics.retrieval.RetrievalMRR()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.mrr.update(self(x)[:, 0], y == 0, indexes=(x[:, 1] > 0).long())  # query id from the sample itself
        self.log("val_mrr", self.mrr)


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("module_cls", [Correlation, Retrieval])
def test_metric_with_unreduced_states_equals_one_device(devices: int, module_cls: type):
    base = seeded(module_cls)
    single, multi = trainer("auto", 1, limit_val_batches=4), trainer("parallel_criterion", devices, limit_val_batches=4)
    single.validate(clone(base), loader(10), verbose=False)
    multi.validate(clone(base), loader(10), verbose=False)
    name = "val_pearson" if module_cls is Correlation else "val_mrr"
    assert metrics(multi)[name] == pytest.approx(metrics(single)[name], abs=1e-10)
    assert 0 < abs(metrics(single)[name]) < 1
    assert not multi.strategy._replicas  # replicas and metric clones released at teardown (they live on other devices)


def test_mean_reduced_state_is_the_equal_weight_mean_over_every_replica_batch():
    """As DDP would with one rank per (batch, replica): equal weights, not a running mean of running means."""
    multi = trainer("parallel_criterion", 2, limit_val_batches=3)
    multi.validate(seeded(MeanReduced), loader(10), verbose=False)
    x = loader(10).dataset.tensors[0][:30, 0]
    shard_maxima = [chunk.max() for batch in x.split(10) for chunk in batch.tensor_split(2)]
    expected = torch.stack(shard_maxima).mean()  # value and batches both averaged: the ratio of the means
    assert metrics(multi)["mean_of_maxima"] == pytest.approx(float(expected), abs=1e-12)


class FailsOnce(Classifier):
    """Replica 1 raises after updating the metric in its first validation step (a caught OOM, say)."""

    fail = True

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_acc.update(self(x), y)
        if FailsOnce.fail and x.shape[0] < 5:  # 9 over 2 devices: 5 and 4
            raise RuntimeError("replica failure")
        self.log("val_acc", self.val_acc)


def test_a_failed_step_leaves_no_metric_state_behind():
    base = seeded(FailsOnce)
    module = clone(base)
    strategy_trainer = trainer("parallel_criterion", 2, limit_val_batches=3)
    with pytest.raises(RuntimeError, match="replica failure"):
        strategy_trainer.validate(module, loader(9), verbose=False)
    FailsOnce.fail = False
    try:
        module.val_acc.reset()
        strategy_trainer.validate(module, loader(9), verbose=False)
        reference = trainer("auto", 1, limit_val_batches=3)
        reference.validate(clone(base), loader(9), verbose=False)
    finally:
        FailsOnce.fail = True
    assert metrics(strategy_trainer)["val_acc"] == pytest.approx(metrics(reference)["val_acc"], abs=1e-12)


def test_dp_output_device_int_is_a_cuda_index_as_everywhere_else():
    """One meaning for output_device=1: cuda:1, as in nn.DataParallel, DataParallelModel and Lightning's devices."""
    if torch.cuda.is_available():
        assert lightning_mgpu.DataParallelStrategy(output_device=0).output_device == torch.device("cuda", 0)
    else:
        with pytest.raises(ValueError, match="Device cuda:1 was requested but CUDA is not available"):
            lightning_mgpu.DataParallelStrategy(output_device=1)
    assert lightning_mgpu.DataParallelStrategy(output_device="cpu").output_device == torch.device("cpu")


class AppendsOutputs(Classifier):
    """Lightning 2's epoch-output pattern: append in the step, reduce at epoch end. Wrong on replicas."""

    def on_validation_epoch_start(self) -> None:
        self.losses: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.losses.append(nn.functional.cross_entropy(self(x), y))


def test_appending_to_a_list_attribute_inside_a_replicated_step_warns_once():
    module = seeded(AppendsOutputs)
    with pytest.warns(UserWarning, match=r"`AppendsOutputs.losses` grew during a step that ran on 2 replicas") as seen:
        trainer("parallel_criterion", 2, limit_val_batches=3).validate(module, loader(8), verbose=False)
    assert len(module.losses) == 6  # one entry per device per step: the reason for the warning
    assert sum("grew during a step" in str(w.message) for w in seen) == 1


class LoggedLossCopies(Classifier):
    """Logs its loss with every reduce_fx. One device logs the whole-batch loss each step (reduce_fx acts over the
    steps), so the replicas' copies must merge as the loss: a mean, by loss_weight, term by term, or summed."""

    def __init__(self, loss: str = "mean") -> None:
        super().__init__()
        self.loss = loss

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        labels = torch.where(x[:, 0] > 0, y, -100)  # about half the rows ignored
        output: Any
        if self.loss == "sum":  # under loss_reduction="sum"
            loss = output = nn.functional.cross_entropy(logits, y, reduction="sum")
        elif self.loss == "loss_weight":
            loss = nn.functional.cross_entropy(logits, labels)
            output = {"loss": loss, lightning_mgpu.LOSS_WEIGHT_KEY: (labels != -100).sum()}
        elif self.loss == "loss_terms":
            token, sample = nn.functional.cross_entropy(logits, labels), (logits**2).mean()
            loss = token + sample
            terms = {"token": (token, (labels != -100).sum()), "sample": (sample, len(y))}
            output = {"loss": loss, lightning_mgpu.LOSS_TERMS_KEY: terms}
        else:
            loss = output = nn.functional.cross_entropy(logits, y)
        for reduce_fx in ("mean", "max", "min", "sum"):
            self.log(f"loss_{reduce_fx}", loss, reduce_fx=reduce_fx, on_step=True, on_epoch=True)
        return output


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("loss", ["mean", "loss_weight", "loss_terms", "sum"])
def test_logged_copies_of_the_loss_equal_one_device_with_every_reduce_fx(loss: str, devices: int):
    base = seeded(LoggedLossCopies, loss=loss)
    strategy = lightning_mgpu.ParallelCriterionStrategy(loss_reduction="sum" if loss == "sum" else "auto")
    single, multi = trainer("auto", 1, max_epochs=1), trainer(strategy, devices, max_epochs=1)
    single.fit(clone(base), loader(7))  # 40 samples: the last batch holds 5
    multi.fit(clone(base), loader(7))
    ref, got = metrics(single), metrics(multi)
    names = [f"loss_{fx}_{when}" for fx in ("mean", "max", "min", "sum") for when in ("step", "epoch")]
    assert {n: got[n] for n in names} == pytest.approx({n: ref[n] for n in names}, rel=1e-12, abs=0)
    assert ref["loss_max_epoch"] > ref["loss_min_epoch"]


class LogsNumpyScalars(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.log("count", np.int64(len(y)), reduce_fx="sum", on_step=True, on_epoch=True)
        self.log("max_x", np.float32(x.max().item()), reduce_fx="max", on_step=True, on_epoch=True)
        self.log("quarter", np.float64(0.25), on_step=True, on_epoch=True)
        self.log("half", np.float16(0.5))
        self.log("flag", True, reduce_fx="min")
        return super().training_step(batch, batch_idx)


def test_numpy_scalars_and_bools_are_logged_as_on_one_device():
    """Lightning's ``self.log`` takes any ``numbers.Number`` (numpy's scalars are registered as such)."""
    base = seeded(LogsNumpyScalars)
    single, multi = trainer("auto", 1, max_epochs=1), trainer("parallel_criterion", 3, max_epochs=1)
    single.fit(clone(base), loader(7))
    multi.fit(clone(base), loader(7))
    ref, got = metrics(single), metrics(multi)
    names = ["count_step", "count_epoch", "max_x_step", "max_x_epoch", "quarter_step", "quarter_epoch", "half", "flag"]
    assert {n: got[n] for n in names} == {n: ref[n] for n in names}
    assert (ref["count_epoch"], ref["flag"]) == (40.0, 1.0)


class KeepsOutputs(Classifier):
    """Step outputs kept in a private list, a deque or a dict of lists: grown once per device per step."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def on_validation_epoch_start(self) -> None:
        if self.kind == "private_list":
            self._losses: list[torch.Tensor] = []
        elif self.kind == "deque":
            self.recent: collections.deque[torch.Tensor] = collections.deque(maxlen=100)
        else:
            self.outputs: dict[str, list[torch.Tensor]] = collections.defaultdict(list)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self.kind == "private_list":
            self._losses.append(loss)
        elif self.kind == "deque":
            self.recent.append(loss)
        else:
            self.outputs["loss"].append(loss)
            self.outputs["size"].append(torch.tensor(len(y)))


@pytest.mark.parametrize(
    ("kind", "path"), [("private_list", "_losses"), ("deque", "recent"), ("dict_of_lists", "outputs['loss']")]
)
def test_a_private_list_deque_or_dict_of_lists_grown_in_a_replicated_step_warns_once(kind: str, path: str):
    module = seeded(KeepsOutputs, kind=kind)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer("parallel_criterion", 2, limit_val_batches=3).validate(module, loader(8), verbose=False)
    said = [str(w.message) for w in seen if "grew during a step" in str(w.message)]
    assert len(said) == 1  # one per attribute, a dict's two lists included
    assert said[0].startswith(f"`KeepsOutputs.{path}` grew during a step that ran on 2 replicas")


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_an_attribute_rebound_in_the_step_warns_once_and_the_suggested_hook_equals_one_device(namespace: str):
    base_cls = models(namespace).Classifier

    class CountsInStep(base_cls):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.seen = 0

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.seen += len(batch[1])  # each replica rebinds its own `seen`
            return super().training_step(batch, batch_idx)

    class CountsOnRoot(CountsInStep):  # the fix the warning suggests
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return base_cls.training_step(self, batch, batch_idx)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.seen += len(batch[1])

    def fit(module: Any, strategy: str, devices: int) -> list[str]:
        run = trainer(strategy, devices, namespace, max_epochs=1, limit_train_batches=3, limit_val_batches=2)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            run.fit(module, loader(9), loader(9))  # shards of 5 and 4: the replicas' counts differ
        return [str(w.message) for w in seen if "was rebound" in str(w.message) or "grew during" in str(w.message)]

    rebinding = seeded(CountsInStep)
    said = fit(rebinding, "parallel_criterion", 2)
    assert rebinding.seen == 15  # replica 0's, as DDP's rank 0 keeps its own: what the warning is about
    assert len(said) == 1 and said[0].startswith("`CountsInStep.seen` was rebound during a step that ran on 2 replicas")
    assert "differ between the replicas" in said[0] and "keeps replica 0's" in said[0]
    assert "on_train_batch_end" in said[0]
    reference, fixed = seeded(CountsOnRoot), seeded(CountsOnRoot)
    fit(reference, "auto", 1)
    assert fit(fixed, "parallel_criterion", 2) == []  # nothing the strategy sets per replica is taken for a rebind
    assert fixed.seen == reference.seen == 27


class HookedFeatures(Classifier):
    """A perceptual or distillation loss on a hidden layer's output: caught by a forward hook in a dict on the module
    (``how="dict"``, which every replica shares), or as the warning's fixes say: on the hooked layer itself
    (``"layer"``), or returned from ``forward`` (``"return"``)."""

    def __init__(self, how: str = "dict") -> None:
        super().__init__()
        self.how = how
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
        self.features: dict[str, Any] = {}
        self.net.features = collections.OrderedDict()  # a feature extractor's own
        if how in ("dict", "tuple", "submodule"):
            store = self.net.features if how == "submodule" else self.features
            wrap = (lambda output: (output,)) if how == "tuple" else (lambda output: output)  # an LSTM's (out, state)
            self.net[0].register_forward_hook(lambda module, args, output: store.__setitem__("hidden", wrap(output)))
        elif how == "layer":
            self.net[0].register_forward_hook(lambda module, args, output: setattr(module, "features", output))

    def forward(self, x: torch.Tensor) -> Any:
        if self.how != "return":
            return self.net(x)
        hidden = self.net[0](x)
        return self.net[1:](hidden), hidden

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.how == "return":
            logits, hidden = self(x)
        else:
            logits = self(x)
            hidden = {
                "dict": lambda: self.features["hidden"],
                "tuple": lambda: self.features["hidden"][0],
                "submodule": lambda: self.net.features["hidden"],
                "layer": lambda: self.net[0].features,
            }[self.how]()
        loss = nn.functional.cross_entropy(logits, y) + hidden.pow(2).mean()
        self.log("loss", loss)
        return loss


@pytest.mark.parametrize(
    ("strategy", "sync", "says"),
    [
        ("parallel_criterion", True, r"a replica may have read another's entry.*setattr\(module"),  # BN hands over
        ("parallel_criterion", False, r"after the step it holds the last replica's entries.*setattr\(module"),
        ("dp", False, r"the step reads the last replica's entries.*Return them from `forward`"),
    ],
)
@pytest.mark.parametrize(("how", "path"), [("dict", "features"), ("tuple", "features"), ("submodule", "net.features")])
def test_a_dict_that_replicas_share_and_write_tensors_into_is_said_once_with_the_fix(strategy, sync, says, how, path):
    module = seeded(HookedFeatures, how=how)
    with pytest.warns(UserWarning, match=rf"`HookedFeatures.{path}` got tensors.*{says}") as seen:
        named = {
            "parallel_criterion": lightning_mgpu.ParallelCriterionStrategy,
            "dp": lightning_mgpu.DataParallelStrategy,
        }
        chosen = named[strategy](sync_batchnorm=sync)  # synchronised by default: the option opts out
        trainer(chosen, 3, max_steps=2, enable_progress_bar=True).fit(module, loader(7, n=14))
    assert sum(f"`HookedFeatures.{path}` got tensors" in str(w.message) for w in seen) == 1


@pytest.mark.parametrize(("strategy", "how"), [("parallel_criterion", "layer"), ("dp", "return")])
def test_the_fix_the_warning_names_equals_one_device(strategy, how):
    """Under SyncBatchNorm (parallel_criterion's replicas hand over inside their step), on uneven shards."""
    base = seeded(HookedFeatures, how=how)
    single, multi = clone(base), clone(base)
    trainer("auto", 1, max_steps=3, enable_progress_bar=True).fit(single, loader(7, n=21))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*got tensors during a call")  # nothing to say: no shared dict was written
        trainer(strategy, 3, max_steps=3, sync_batchnorm=True, enable_progress_bar=True).fit(multi, loader(7, n=21))
    for (name, a), b in zip(multi.state_dict().items(), single.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)


class PrintsOnGlobalZero(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.print(f"PRINTED {len(x)}")  # rank-zero only: once per step on one device
        return nn.functional.cross_entropy(self(x), y)


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("mode", ["sequential", "threads"])
def test_self_print_and_global_zero_guards_run_once_per_step(namespace, mode, capsys):
    """As on one device (and on DDP's rank 0): replica 0 alone is global zero inside the step."""
    prints = type("Prints", (models(namespace).Classifier,), {"training_step": PrintsOnGlobalZero.training_step})
    module = seeded(prints)
    strategy = importlib.import_module(f"lightning_mgpu.strategies.{namespace.replace('.', '_')}")
    fit = trainer(strategy.ParallelCriterionStrategy(execution_mode=mode), 3, namespace=namespace, max_steps=2)
    fit.fit(module, loader(7, n=14))
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("PRINTED")]
    assert printed == ["PRINTED 3", "PRINTED 3"]  # replica 0's shard of each step of 7 samples (3 + 2 + 2)
    assert fit.is_global_zero  # outside the step, the one process is
