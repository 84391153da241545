"""How ``parallel_criterion`` combines the devices' losses: the step's own weights, a declared ``loss_reduction``, the
returned loss's autograd record, else per-sample weights said in one warning; the user's step runs exactly as often
as the strategy's semantics need.

Every equivalence check: float64, ``STEPS`` SGD steps, uneven shards (7 over 2 = 4+3, 10 over 3 = 4+3+3), Lightning's
default callbacks; final parameters, the loss each step optimized and every logged value equal one device's to 1e-10.
The ``transformers`` models are in ``test_transformers_models.py``; the opt-in diagnostic in ``test_loss_check.py``.
"""

from __future__ import annotations

import importlib
import re
import warnings
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from hf_models import IGNORE, N_IN, N_OUT, STEPS, Run, assert_equal_runs, fit, make_mlp, mlp_loader
from strategy_models import seeded
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu

SPLITS = [pytest.param(2, 7, id="2dev-batch7"), pytest.param(3, 10, id="3dev-batch10")]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tmp_path_factory.mktemp("runs")


_references: dict[Any, Run] = {}


def one_device(key: Any, make: Any, data: Any, root: Any) -> Run:
    """The single-device run for ``key`` (cached for the module: the reference of several device counts)."""
    if key not in _references:
        _references[key] = fit(make(), "auto", 1, data(), root)
    return _references[key]


def notices(run: Run) -> list[str]:
    """The one warning for a loss whose rule nothing says: per-sample weights, with the fixes."""
    return [w for w in run.warnings if "loss is weighted by its sample count" in w]


def strategy_warnings(run: Run) -> list[str]:
    return [w for w in run.warnings if w.startswith("parallel_criterion:")]


def assert_declared(run: Run, spec: str) -> None:
    """The declared rule is the strategy's, said once (INFO, naming it and that it was declared), and nothing warned."""
    assert strategy_warnings(run) == [], run.warnings
    decisions = run.decisions()
    assert len(decisions) == 1, decisions
    assert f"loss_reduction={spec!r}" in decisions[0] and "declared" in decisions[0], decisions[0]
    assert "autograd record" not in decisions[0]
    assert run.trainer.strategy.normalization.spec() == spec
    assert run.trainer.strategy.loss_counts is None


def assert_read(run: Run, words: list[str], counts: tuple[float | None, ...]) -> None:
    """The rule was read from the loss's autograd record: said once (INFO, with ``words``), nothing warned, no
    declared rule, and ``counts`` (per term, the last batch's whole count; ``None``: a sum) is what was read."""
    assert strategy_warnings(run) == [], run.warnings
    decisions = run.decisions()
    assert len(decisions) == 1, decisions
    assert "as its autograd record says" in decisions[0], decisions[0]
    assert all(word in decisions[0] for word in words), (words, decisions[0])
    strategy = run.trainer.strategy
    assert strategy.normalization is None
    read = strategy.loss_counts
    assert read is not None and len(read) == len(counts), read
    for got, expected in zip(read, counts, strict=True):
        assert (got is None) == (expected is None), (read, counts)
        assert got is None or float(got) == pytest.approx(expected, abs=1e-9, rel=0), (read, counts)


def last_batch(loader: DataLoader) -> Any:
    return list(loader)[-1]


def strategy(reduction: str) -> Any:
    return lightning_mgpu.ParallelCriterionStrategy(loss_reduction=reduction)


# --- 1. declared: loss_reduction --------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["handwritten_sum", "mse_sum", "ce_sum"])
@pytest.mark.parametrize(("devices", "batch"), SPLITS)
def test_sum_losses_declared_equal_one_device(root, loss, devices, batch):
    """``((net(x) - y) ** 2).sum()``, ``MSELoss(reduction="sum")``, ``cross_entropy(reduction="sum")`` with
    ``loss_reduction="sum"``: summed over devices; the optimized loss, ``self.log("loss", loss)`` (step and epoch)
    and the parameters equal one device's; one line says the declared rule, no warning."""
    expected = one_device(("mlp", loss, batch), lambda: make_mlp(L, loss), lambda: mlp_loader(loss, batch), root)
    got = fit(make_mlp(L, loss), strategy("sum"), devices, mlp_loader(loss, batch), root)
    assert_declared(got, "sum")
    assert_equal_runs(got, expected)
    assert {"loss_step", "loss_epoch"} <= got.final.keys()


# --- 2. read from the loss's autograd record --------------------------------------------------------------------------
@pytest.mark.parametrize(("devices", "batch"), SPLITS)
def test_an_undeclared_handwritten_sum_is_read_as_a_sum_and_equals_one_device(root, devices, batch):
    """``((net(x) - y) ** 2).sum()`` with nothing declared: its record (a ``.sum()``) says a sum, said once in one
    line (5 steps), no warning, exact."""
    make, data = lambda: make_mlp(L, "handwritten_sum"), lambda: mlp_loader("handwritten_sum", batch)
    expected = one_device(("mlp", "handwritten_sum", batch), make, data, root)
    got = fit(make(), "parallel_criterion", devices, data(), root)
    assert_read(got, [".sum()", "a sum"], (None,))
    assert "\n" not in got.decisions()[0]
    assert_equal_runs(got, expected)


@pytest.mark.parametrize(("devices", "batch"), SPLITS)
def test_handwritten_per_sample_mean_equals_one_device(root, devices, batch):
    """``F.cross_entropy(out, y)``: read as a mean over its counted targets (here every sample), exact, no warning."""
    make, data = lambda: make_mlp(L, "ce_mean"), lambda: mlp_loader("ce_mean", batch)
    expected = one_device(("mlp", "ce_mean", batch), make, data, root)
    got = fit(make(), "parallel_criterion", devices, data(), root)
    assert_read(got, ["cross_entropy", "a mean"], (batch,))
    assert_equal_runs(got, expected)


def test_a_loss_its_record_does_not_explain_gets_the_one_line_notice_once(root):
    """A clamped mean (a node the reader does not know): per-sample weighting, said once in one line (5 steps),
    naming the node it could not read and the fixes that work (``loss_reduction``, ``loss_weight``)."""
    got = fit(make_mlp(L, "clamped"), "parallel_criterion", 3, mlp_loader("clamped", 10), root)
    (notice,) = notices(got)
    assert strategy_warnings(got) == [notice]
    assert "\n" not in notice and "ClampBackward1" in notice
    assert "loss_reduction='sum'" in notice and "'tokens:<labels key>'" in notice
    assert "ParallelCriterionStrategy" in notice and "loss_weight" in notice
    assert got.decisions() == []
    assert got.trainer.strategy.normalization is None and got.trainer.strategy.loss_counts is None


def test_the_notices_command_line_fix_works_on_a_config_that_names_the_strategy(tmp_path):
    """The notice's CLI options, taken from the text a run printed, set ``loss_reduction`` on a config whose strategy
    is the string ``parallel_criterion`` (the README's form, where ``--trainer.strategy.init_args...`` alone is
    refused)."""
    from lightning_mgpu.cli import main as cli_main

    (notice,) = notices(fit(make_mlp(L, "clamped"), "parallel_criterion", 2, mlp_loader("clamped", 7), tmp_path))
    options = re.search(r"\(CLI: (.+?)\)", notice).group(1).replace("...", "sum").split()
    config = tmp_path / "config.yaml"
    config.write_text(
        "model:\n  class_path: lightning.pytorch.demos.boring_classes.BoringModel\n"
        "trainer:\n  strategy: parallel_criterion\n  accelerator: cpu\n  devices: 2\n"
        f"  default_root_dir: {tmp_path}\n"
    )
    cli = cli_main(["-c", str(config), *options], run=False)
    assert type(cli.trainer.strategy).__name__ == "ParallelCriterionStrategy"
    assert cli.trainer.strategy.normalization.spec() == "sum"


def test_a_squared_mean_is_named_as_coupling_samples_not_as_a_rule_to_declare(root):
    """``ce ** 2``: no weighting of the shards' values gives the square of the batch's mean (no ``loss_reduction``
    to declare): one warning names it and the fixes that work (dp, all_gather)."""
    got = fit(make_mlp(L, "squared"), "parallel_criterion", 2, mlp_loader("squared", 7), root)
    (warned,) = strategy_warnings(got)
    assert "couples samples" in warned and "(Pow)" in warned and "strategy='dp'" in warned, warned
    assert "loss_reduction" not in warned


def test_a_median_of_per_sample_losses_is_named_as_coupling_samples(root):
    """A median over the shard's samples mixes its rows: one warning names it and the fixes (dp, all_gather), and
    claims no rule."""
    got = fit(make_mlp(L, "median"), "parallel_criterion", 3, mlp_loader("median", 10), root)
    (warned,) = strategy_warnings(got)
    assert "couples samples" in warned and "Median" in warned and "strategy='dp'" in warned, warned
    assert "all_gather" in warned and got.decisions() == []


def test_a_step_that_weights_its_own_loss_gets_no_notice(root):
    """``{"loss": loss, "loss_weight": n}``: the step declares it; nothing is printed."""
    got = fit(make_mlp(L, "ce_mean", output="loss_weight"), "parallel_criterion", 3, mlp_loader("ce_mean", 10), root)
    assert strategy_warnings(got) == [] and got.decisions() == []
    assert got.trainer.strategy.loss_counts is None


# --- 3. loss modules the LightningModule holds: read from the loss they return -------------------------------------
class WithCriterion(L.LightningModule):
    """An MLP whose loss is a module attribute, as many projects write it."""

    def __init__(self, criterion: nn.Module, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(N_IN, 8), nn.Tanh(), nn.Linear(8, N_OUT))
        self.criterion = criterion
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.criterion(self.net(x), y)
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


CLASS_WEIGHT = torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64)


def counted(y: torch.Tensor) -> float:
    return float((y != IGNORE).sum())


CRITERIA = {
    # name: (criterion, data, words the decision says, the last batch's count per term from its labels y)
    "ce_ignore_index": (
        lambda: nn.CrossEntropyLoss(),
        dict(loss="ce_mean", ignored=slice(1, None, 3)),
        ["cross_entropy", "a mean"],
        lambda y: (counted(y),),
    ),
    "ce_class_weight": (
        lambda: nn.CrossEntropyLoss(weight=CLASS_WEIGHT),
        dict(loss="ce_mean", ignored=slice(2, None, 4)),
        ["cross_entropy", "a mean"],
        lambda y: (float(CLASS_WEIGHT[y[y != IGNORE]].sum()),),
    ),
    "nll_ignore_minus_one": (
        lambda: nn.NLLLoss(ignore_index=-1),
        dict(loss="ce_mean"),
        ["nll_loss", "a mean"],
        lambda y: (float((y != -1).sum()),),
    ),
    "mse_sum": (lambda: nn.MSELoss(reduction="sum"), dict(loss="mse_sum"), ["mse_loss", "a sum"], lambda y: (None,)),
    "mse_mean": (lambda: nn.MSELoss(), dict(loss="mse_sum"), ["mse_loss", "a mean"], lambda y: (float(y.numel()),)),
}


@pytest.mark.parametrize("name", list(CRITERIA))
def test_loss_modules_say_the_rule_and_training_equals_one_device(root, name):
    """``CrossEntropyLoss`` with ignored labels and class weights, ``NLLLoss(ignore_index=-1)``, ``MSELoss`` as
    sum and mean: read from the loss's record (what it counted, class-weighted), said once, exact."""
    make_criterion, data_args, words, counts = CRITERIA[name]
    make = lambda: seeded(WithCriterion, criterion=make_criterion())  # noqa: E731
    data = lambda: mlp_loader(batch_size=10, **data_args)  # noqa: E731
    expected = one_device(("criterion", name), make, data, root)
    got = fit(make(), "parallel_criterion", 3, data(), root)
    assert_read(got, words, counts(last_batch(data())[1]))
    assert_equal_runs(got, expected)


def _first_step_by_shards(make: Any, data: Any, combine: Any) -> float:
    """The first step's loss from the initial model's losses on the shards 4/3/3 of the first batch, combined."""
    module = make()
    x, y = next(iter(data()))
    with torch.no_grad():
        losses = [module.criterion(module.net(x[a:b]), y[a:b]) for a, b in ((0, 4), (4, 7), (7, 10))]
    return float(combine(torch.stack(losses)))


@pytest.mark.parametrize(("declared", "combine"), [("sum", torch.sum), ("replica_mean", torch.mean), ("samples", None)])
def test_a_declared_rule_is_used_as_declared_even_where_the_loss_says_otherwise(root, declared, combine):
    """``loss_reduction='sum'`` (or ``replica_mean`` on shards 4/3/3) declared for a mean ``CrossEntropyLoss``: the
    declared rule wins over the loss's record (the first step optimizes the sum / mean of the shards' losses), said
    once, no warning; leaving it at ``auto`` equals one device, as does ``samples`` (no ignored labels here)."""
    make = lambda: seeded(WithCriterion, criterion=nn.CrossEntropyLoss())  # noqa: E731
    data = lambda: mlp_loader(batch_size=10, loss="ce_mean")  # noqa: E731
    expected = one_device(("declared",), make, data, root)
    got = fit(make(), strategy(declared), 3, data(), root)
    assert_declared(got, declared)
    if combine is None:
        assert_equal_runs(got, expected)
        return
    assert got.losses[0] == pytest.approx(_first_step_by_shards(make, data, combine), abs=1e-10, rel=0)
    assert abs(got.losses[0] - expected.losses[0]) > 1e-3
    assert_equal_runs(fit(make(), "parallel_criterion", 3, data(), root), expected)


class SumOfMeans(WithCriterion):
    """Returns a mean criterion's output times the sample count: a true sum, declared as such."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.criterion(self.net(x), y) * len(y)


def test_a_declared_rule_for_a_loss_built_from_the_criterions_output_equals_one_device(root):
    """``criterion(...) * n`` declared ``'sum'``: exact, said as declared, and no warning."""
    make = lambda: seeded(SumOfMeans, criterion=nn.CrossEntropyLoss())  # noqa: E731
    data = lambda: mlp_loader(batch_size=10, loss="ce_mean")  # noqa: E731
    got = fit(make(), strategy("sum"), 3, data(), root)
    assert_declared(got, "sum")
    assert_equal_runs(got, one_device(("sum_of_means",), make, data, root))


class AddsATerm(WithCriterion):
    """Returns the criterion's output plus another term normalised otherwise (a mean over every logit)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = self.criterion(logits, y) + 0.5 * logits.pow(2).mean()
        self.log("loss", loss)
        return loss


def test_a_loss_that_adds_terms_to_a_criterions_output_weighs_each_term_by_its_own_count(root):
    """A ``CrossEntropyLoss`` with ignored labels (a mean over its counted targets) plus a mean over every logit: the
    record says two terms, each combined by its own count (counted targets; elements), said once, exact."""
    make = lambda: seeded(AddsATerm, criterion=nn.CrossEntropyLoss())  # noqa: E731
    data = lambda: mlp_loader(batch_size=10, loss="ce_mean", ignored=slice(1, None, 3))  # noqa: E731
    got = fit(make(), "parallel_criterion", 3, data(), root)
    y = last_batch(data())[1]
    assert_read(got, ["2 terms", "cross_entropy", ".mean()"], (counted(y), float(len(y) * N_OUT)))
    assert_equal_runs(got, one_device(("adds_a_term",), make, data, root))


class LabelsThenLengths(WithCriterion):
    """Batches ``(x, labels, lengths)``: the tuple's last integer item is not what the loss counts."""

    def __init__(self, scale: float) -> None:
        super().__init__(nn.CrossEntropyLoss())
        self.scale = scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = self.criterion(self.net(x), y)
        self.log("loss", loss)
        return loss if self.scale == 1 else self.scale * loss


@pytest.mark.parametrize("scale", [1.0, 2.0], ids=["criterion-output", "scaled"])
def test_a_batch_with_other_integer_items_is_combined_by_what_the_loss_counted(root, scale):
    """The batch's last integer item (lengths) is not the labels: the rule read (the loss's own counted targets,
    scaled or not) is exact and said without naming the batch's items (no ``tokens:2`` / ``batch[2]``)."""
    x, y = next(iter(mlp_loader("ce_mean", 10 * STEPS, ignored=slice(1, None, 3))))
    lengths = torch.arange(len(y)) % 3 + 1
    loader = lambda: DataLoader(TensorDataset(x, y, lengths), batch_size=10)  # noqa: E731
    make = lambda: seeded(LabelsThenLengths, scale=scale)  # noqa: E731
    got = fit(make(), "parallel_criterion", 3, loader(), root)
    said = " ".join([*got.warnings, *got.info])
    assert "tokens:2" not in said and "batch[2]" not in said, said
    assert_read(got, ["cross_entropy", "a mean"], (counted(last_batch(loader())[1]),))
    assert_equal_runs(got, one_device(("labels_then_lengths", scale), make, loader, root))


# --- 4. no extra calls of user code, no leaked effects ---------------------------------------------------------------
def make_probe(ns: Any, log_file: str) -> Any:
    """A step with effects everywhere: a dict counter, a set of the labels it saw, a forward hook count, a user
    ``torch.Generator``, a file it appends to, and a label embedding (``ignore_index=-1`` loss: a rewritten -100
    label would raise). Under ``dp`` the forward is replicated, so ``forward`` counts replicas."""

    class Probe(ns.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(N_IN, N_OUT)
            self.label_embedding = nn.Embedding(N_OUT, N_IN)
            self.counts = {"steps": 0, "forwards": 0}
            self.labels_seen: set[int] = set()
            self.hook_calls = [0]
            self.generator = torch.Generator().manual_seed(7)
            self.net.register_forward_hook(lambda *_: self.hook_calls.__setitem__(0, self.hook_calls[0] + 1))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            self.counts["forwards"] += 1
            noise = torch.rand(x.shape, generator=self.generator, dtype=x.dtype)
            return self.net(x + 0.1 * self.label_embedding(y) + 0.01 * noise.to(x.device))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.counts["steps"] += 1
            self.labels_seen.update(y.tolist())
            with open(log_file, "a") as f:
                f.write(f"{batch_idx}:{len(y)}\n")
            return F.nll_loss(F.log_softmax(self(x, y), -1), y, ignore_index=-1)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    return Probe().to(torch.float64)


def _probe_run(root: Any, tmp_path: Any, ns: Any, strategy_name: str, declared: bool) -> tuple[Any, str]:
    log_file = tmp_path / f"{strategy_name}-{declared}.log"
    module = make_probe(ns, str(log_file))
    chosen: Any = strategy_name
    if declared:
        namespace = "lightning_pytorch" if ns is L else "pytorch_lightning"
        classes = importlib.import_module(f"lightning_mgpu.strategies.{namespace}")
        name = "ParallelCriterionStrategy" if strategy_name == "parallel_criterion" else "DataParallelStrategy"
        chosen = getattr(classes, name)(loss_reduction="samples")
    trainer = ns.Trainer(
        accelerator="cpu", devices=2, strategy=chosen, max_epochs=1, logger=False, default_root_dir=str(root)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, mlp_loader("ce_mean", 7, steps=4))
    return module, log_file.read_text()


@pytest.mark.parametrize("strategy_name", ["parallel_criterion", "dp"])
@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_no_extra_calls_and_no_leaked_effects(root, tmp_path, strategy_name, namespace):
    """One epoch of 4 batches of 7 over 2 devices: the step runs once per replica per batch under
    ``parallel_criterion`` (8) and once per batch under ``dp`` (4, its forward once per replica: 8); counters, the set
    of labels (never a -100), hook calls, the generator's draws and the file are those of the declared run."""
    ns = pytest.importorskip(namespace)
    auto, auto_log = _probe_run(root, tmp_path, ns, strategy_name, declared=False)
    declared, declared_log = _probe_run(root, tmp_path, ns, strategy_name, declared=True)
    steps = 8 if strategy_name == "parallel_criterion" else 4
    assert auto.counts == declared.counts == {"steps": steps, "forwards": 8}
    assert auto.labels_seen == declared.labels_seen and min(auto.labels_seen) >= 0
    assert auto.hook_calls == declared.hook_calls == [8]
    assert torch.equal(auto.generator.get_state(), declared.generator.get_state())
    assert auto_log == declared_log and len(auto_log.splitlines()) == steps
    for a, b in zip(auto.parameters(), declared.parameters(), strict=True):
        assert torch.equal(a, b)


# --- 5. the pytorch_lightning namespace ------------------------------------------------------------------------------
def test_sum_loss_under_pytorch_lightning(root):
    """``import pytorch_lightning as pl``: a ``pl`` strategy with ``loss_reduction="sum"`` equals ``pl``'s one
    device; so does the hand-written sum undeclared, read from its record and said once on ``pl``'s logger."""
    pl = pytest.importorskip("pytorch_lightning")
    from lightning_mgpu.strategies.pytorch_lightning import ParallelCriterionStrategy

    data = lambda: mlp_loader("handwritten_sum", 10)  # noqa: E731
    expected = fit(make_mlp(pl, "handwritten_sum"), "auto", 1, data(), root, ns=pl)
    got = fit(make_mlp(pl, "handwritten_sum"), ParallelCriterionStrategy(loss_reduction="sum"), 3, data(), root, ns=pl)
    assert_declared(got, "sum")
    assert_equal_runs(got, expected)
    undeclared = fit(make_mlp(pl, "handwritten_sum"), "parallel_criterion", 3, data(), root, ns=pl)
    assert_read(undeclared, [".sum()", "a sum"], (None,))
    assert_equal_runs(undeclared, expected)


class IgnoresMinusOne(L.LightningModule):
    """Calls ``self(x, y)``; ``forward`` computes a cross-entropy that ignores label -1 (legacy datasets; 255 in
    segmentation), with uneven numbers of ignored labels per shard."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(N_IN, N_OUT)
        self.criterion = nn.CrossEntropyLoss(ignore_index=-1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.criterion(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self(*batch)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _ignoring_batches() -> Any:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(30, N_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, N_OUT, (30,), generator=g)
    y[torch.tensor([0, 1, 2, 3, 11, 12])] = -1  # the first shard of each batch loses most of its labels
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10)


@pytest.mark.parametrize("reduction", ["auto", "tokens:1:-1"])
def test_an_ignore_index_other_than_minus_100_is_read_or_declared(reduction):
    from strategy_models import flat_params, metrics, trainer

    single, multi = IgnoresMinusOne().double(), IgnoresMinusOne().double()
    trainer("auto", 1, max_epochs=1).fit(single, _ignoring_batches())
    run = trainer(strategy(reduction), 3, max_epochs=1, enable_progress_bar=True)
    run.fit(multi, _ignoring_batches())
    if reduction == "auto":  # read from the record: the loss's own ignore index, no declared rule
        assert run.strategy.normalization is None
        (count,) = run.strategy.loss_counts
        assert float(count) == float((last_batch(_ignoring_batches())[1] != -1).sum())
    else:
        assert run.strategy.normalization.spec() == "tokens:1:-1" and run.strategy.loss_counts is None
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)
    assert metrics(run)["loss"] == pytest.approx(float(single.trainer.callback_metrics["loss"]), abs=1e-10, rel=0)


def test_a_loss_over_gathered_embeddings_gets_no_coupling_warning():
    """Barlow Twins over ``self.all_gather(..., sync_grads=True)``: the loss couples samples over the whole batch, as
    the coupling message would ask; no warning, and one device's result. Its ``z.T @ z`` is features by features, 4
    like the first shard's rows (11 over 3 devices: 4, 4, 3), which a scan of the graph alone took for similarities."""

    class Barlow(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.encoder = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            z1, z2 = (self.all_gather(self.encoder(v), sync_grads=True) for v in (x, x * 0.9 + 0.1))
            z1, z2 = ((z - z.mean(0)) / (z.std(0) + 1e-5) for z in (z1, z2))
            c = z1.T @ z2 / len(z1)
            on_diagonal = (torch.diagonal(c) - 1).pow(2).sum()
            loss = on_diagonal + 0.005 * (c - torch.diag(torch.diagonal(c))).pow(2).sum()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    x = torch.randn(33, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    loader = DataLoader(TensorDataset(x), batch_size=11)
    modules = {}
    for strategy, devices in (("auto", 1), ("parallel_criterion", 3)):
        modules[strategy] = module = Barlow().double()
        trainer = L.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, logger=False,
            enable_checkpointing=False, enable_model_summary=False,
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, loader)
        assert not [w for w in caught if "couples samples" in str(w.message)]
    for a, b in zip(modules["parallel_criterion"].parameters(), modules["auto"].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
