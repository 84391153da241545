"""The loss rule comes from contracts and static knowledge, never from running the step: exact where it is known,
one notice where it is assumed, and the user's step runs exactly as often as the strategy's semantics need.

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
from hf_models import N_IN, N_OUT, STEPS, Run, assert_equal_runs, fit, make_mlp, mlp_loader
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
    return [w for w in run.warnings if "nothing says how the training loss is normalised" in w]


def assert_decided(run: Run, spec: str) -> None:
    """The rule was printed once (INFO on the namespace's logger), named ``spec``, and nothing warned."""
    assert notices(run) == []
    decisions = run.decisions()
    assert len(decisions) == 1, decisions
    assert f"loss_reduction={spec!r}" in decisions[0], decisions[0]
    assert run.trainer.strategy.normalization.spec() == spec


def assert_declared(run: Run, spec: str) -> None:
    """The declared rule was said once, as declared, and nothing warned."""
    assert_decided(run, spec)
    assert "as the declared loss_reduction says" in run.decisions()[0]


def strategy(reduction: str) -> Any:
    return lightning_mgpu.ParallelCriterionStrategy(loss_reduction=reduction)


# --- 1. declared: loss_reduction --------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["handwritten_sum", "mse_sum", "ce_sum"])
@pytest.mark.parametrize(("devices", "batch"), SPLITS)
def test_sum_losses_declared_equal_one_device(root, loss, devices, batch):
    """``((net(x) - y) ** 2).sum()``, ``MSELoss(reduction="sum")``, ``cross_entropy(reduction="sum")`` with
    ``loss_reduction="sum"``: summed over devices; the optimized loss, ``self.log("loss", loss)`` (step and epoch)
    and the parameters equal one device's; one line says the declared rule, no notice."""
    expected = one_device(("mlp", loss, batch), lambda: make_mlp(L, loss), lambda: mlp_loader(loss, batch), root)
    got = fit(make_mlp(L, loss), strategy("sum"), devices, mlp_loader(loss, batch), root)
    assert_declared(got, "sum")
    assert_equal_runs(got, expected)
    assert {"loss_step", "loss_epoch"} <= got.final.keys()


def test_a_handwritten_sum_gets_the_one_line_notice_once(root):
    """Nothing declares the sum: per-sample weighting, said once in one line (5 steps) with the fixes that work."""
    got = fit(make_mlp(L, "handwritten_sum"), "parallel_criterion", 3, mlp_loader("handwritten_sum", 10), root)
    (notice,) = notices(got)
    assert "\n" not in notice
    assert "loss_reduction='sum'" in notice and "ParallelCriterionStrategy(" in notice and "loss_weight" in notice
    assert got.trainer.strategy.normalization.spec() == "samples"


def test_the_notices_command_line_fix_works_on_a_config_that_names_the_strategy(tmp_path):
    """The notice's CLI options, taken from its text, set ``loss_reduction`` on a config whose strategy is the string
    ``parallel_criterion`` (the README's form, where ``--trainer.strategy.init_args...`` alone is refused)."""
    from lightning_mgpu.cli import main as cli_main

    strategy = lightning_mgpu.ParallelCriterionStrategy()
    with pytest.warns(UserWarning, match="nothing says how") as caught:
        strategy._say_assumed_samples("the training loss", "labels", "return loss_weight")
    options = re.search(r"\(CLI: (.+?)\)", str(caught[0].message)).group(1).replace("...", "sum").split()
    config = tmp_path / "config.yaml"
    config.write_text(
        "model:\n  class_path: lightning.pytorch.demos.boring_classes.BoringModel\n"
        "trainer:\n  strategy: parallel_criterion\n  accelerator: cpu\n  devices: 2\n"
        f"  default_root_dir: {tmp_path}\n"
    )
    cli = cli_main(["-c", str(config), *options], run=False)
    assert type(cli.trainer.strategy).__name__ == "ParallelCriterionStrategy"
    assert cli.trainer.strategy.normalization.spec() == "sum"


# --- 2. a per-sample mean written by hand: exact, with at most the notice ------------------------------------------
@pytest.mark.parametrize(("devices", "batch"), SPLITS)
def test_handwritten_per_sample_mean_equals_one_device(root, devices, batch):
    make, data = lambda: make_mlp(L, "ce_mean"), lambda: mlp_loader("ce_mean", batch)
    expected = one_device(("mlp", "ce_mean", batch), make, data, root)
    got = fit(make_mlp(L, "ce_mean"), "parallel_criterion", devices, mlp_loader("ce_mean", batch), root)
    assert len(notices(got)) == 1
    assert_equal_runs(got, expected)


def test_a_step_that_weights_its_own_loss_gets_no_notice(root):
    """``{"loss": loss, "loss_weight": n}``: the step declares it; nothing is printed."""
    got = fit(make_mlp(L, "ce_mean", output="loss_weight"), "parallel_criterion", 3, mlp_loader("ce_mean", 10), root)
    assert notices(got) == [] and got.decisions() == []


# --- 3. static knowledge: loss modules the LightningModule holds ----------------------------------------------------
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


CRITERIA = {
    # name: (criterion, data, expected rule)
    "ce_ignore_index": (lambda: nn.CrossEntropyLoss(), dict(loss="ce_mean", ignored=slice(1, None, 3)), "tokens:1"),
    "ce_class_weight": (
        lambda: nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64)),
        dict(loss="ce_mean", ignored=slice(2, None, 4)),
        "tokens:1",
    ),
    "nll_ignore_minus_one": (lambda: nn.NLLLoss(ignore_index=-1), dict(loss="ce_mean"), "tokens:1:-1"),
    "mse_sum": (lambda: nn.MSELoss(reduction="sum"), dict(loss="mse_sum"), "sum"),
    "mse_mean": (lambda: nn.MSELoss(), dict(loss="mse_sum"), "samples"),
}


@pytest.mark.parametrize("name", list(CRITERIA))
def test_loss_modules_say_the_rule_and_training_equals_one_device(root, name):
    """``CrossEntropyLoss`` with ignored labels and class weights, ``NLLLoss(ignore_index=-1)``, ``MSELoss`` as
    sum and mean: known from the module's ``reduction`` / ``ignore_index`` / ``weight``, said once, exact."""
    make_criterion, data_args, rule = CRITERIA[name]
    make = lambda: seeded(WithCriterion, criterion=make_criterion())  # noqa: E731
    data = lambda: mlp_loader(batch_size=10, **data_args)  # noqa: E731
    expected = one_device(("criterion", name), make, data, root)
    got = fit(make(), "parallel_criterion", 3, data(), root)
    assert_decided(got, rule)
    assert_equal_runs(got, expected)


@pytest.mark.parametrize(("declared", "clash"), [("sum", True), ("replica_mean", True), ("samples", False)])
def test_a_declared_rule_the_loss_module_contradicts_is_used_with_one_warning_whose_fix_works(root, declared, clash):
    """``loss_reduction='sum'`` (or ``replica_mean`` on shards 4/3/3) declared for a mean ``CrossEntropyLoss``: the
    declared rule is used, and one warning says what the module's loss says and the fix; following it (``auto``)
    equals one device. ``samples`` weighs these devices as the module's rule does (no ignored labels): said only."""
    make = lambda: seeded(WithCriterion, criterion=nn.CrossEntropyLoss())  # noqa: E731
    data = lambda: mlp_loader(batch_size=10, loss="ce_mean")  # noqa: E731
    got = fit(make(), strategy(declared), 3, data(), root)
    said = [w for w in got.warnings if f"loss_reduction={declared!r} is declared, but" in w]
    if not clash:
        assert said == [] and notices(got) == []
        assert_declared(got, declared)
        return
    assert len(said) == 1 and got.decisions() == [], got.warnings
    returns = "the step returns the output of CrossEntropyLoss (reduction='mean'), a training loss that is a mean"
    assert returns in said[0]
    assert got.trainer.strategy.normalization.spec() == declared
    assert "Leave loss_reduction at 'auto'" in said[0]
    assert_equal_runs(
        fit(make(), "parallel_criterion", 3, data(), root), one_device(("declared", declared), make, data, root)
    )


class SumOfMeans(WithCriterion):
    """Returns a mean criterion's output times the sample count: a true sum, declared as such."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.criterion(self.net(x), y) * len(y)


def test_a_declared_rule_for_a_loss_built_from_the_criterions_output_is_not_contradicted(root):
    """``criterion(...) * n`` declared ``'sum'``: exact, said as declared, and no warning (the returned loss is not the
    criterion's output, whose rule would be wrong for it)."""
    make = lambda: seeded(SumOfMeans, criterion=nn.CrossEntropyLoss())  # noqa: E731
    data = lambda: mlp_loader(batch_size=10, loss="ce_mean")  # noqa: E731
    got = fit(make(), strategy("sum"), 3, data(), root)
    assert not [w for w in got.warnings if "is declared, but" in w]
    assert_declared(got, "sum")
    assert_equal_runs(got, one_device(("sum_of_means",), make, data, root))


class AddsATerm(WithCriterion):
    """Returns the criterion's output plus another term: the criterion's rule does not describe that sum."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        return self.criterion(logits, y) + 0.5 * logits.pow(2).mean()


def test_a_loss_that_adds_terms_to_a_criterions_output_is_not_given_the_criterions_rule(root):
    """The step names a CrossEntropyLoss (a token mean over non-ignored labels) but returns more than its output: the
    returned loss is weighted per sample, said once with the exact fix (``loss_terms``), not given the token rule."""
    data = lambda: mlp_loader(batch_size=10, loss="ce_mean", ignored=slice(1, None, 3))  # noqa: E731
    got = fit(seeded(AddsATerm, criterion=nn.CrossEntropyLoss()), "parallel_criterion", 3, data(), root)
    said = [w for w in got.warnings if "not the output of CrossEntropyLoss (reduction='mean') alone" in w]
    assert len(said) == 1 and "'loss_terms'" in said[0], got.warnings
    assert got.decisions() == [] and got.trainer.strategy.normalization.spec() == "samples"


class LabelsThenLengths(WithCriterion):
    """Batches ``(x, labels, lengths)``: the tuple's last integer item is not what the loss counts."""

    def __init__(self, scale: float) -> None:
        super().__init__(nn.CrossEntropyLoss())
        self.scale = scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = self.criterion(self.net(x), y)
        return loss if self.scale == 1 else self.scale * loss


@pytest.mark.parametrize("scale", [1.0, 2.0], ids=["criterion-output", "scaled"])
def test_messages_name_only_the_labels_the_loss_counted(root, scale):
    """The batch's last integer item (lengths) is not the labels: the rule is said without naming it (its own
    calls' counts are exact), and the notice for a scaled loss does not suggest ``tokens:2``, which would be wrong."""
    x, y = next(iter(mlp_loader("ce_mean", 10 * STEPS, ignored=slice(1, None, 3))))
    lengths = torch.arange(len(y)) % 3 + 1
    loader = DataLoader(TensorDataset(x, y, lengths), batch_size=10)
    got = fit(seeded(LabelsThenLengths, scale=scale), "parallel_criterion", 3, loader, root)
    said = " ".join([*got.warnings, *got.info])
    assert "tokens:2" not in said and "batch[2]" not in said, said
    if scale == 1:
        assert got.decisions() == [
            "parallel_criterion: the training loss is a mean over each call's own tokens; the devices' values are "
            "combined accordingly."
        ]
    else:
        assert "loss_reduction='sum' | 'tokens:<labels key>'" in said


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
    device; the hand-written sum undeclared gets the notice."""
    pl = pytest.importorskip("pytorch_lightning")
    from lightning_mgpu.strategies.pytorch_lightning import ParallelCriterionStrategy

    data = lambda: mlp_loader("handwritten_sum", 10)  # noqa: E731
    expected = fit(make_mlp(pl, "handwritten_sum"), "auto", 1, data(), root, ns=pl)
    got = fit(make_mlp(pl, "handwritten_sum"), ParallelCriterionStrategy(loss_reduction="sum"), 3, data(), root, ns=pl)
    assert_equal_runs(got, expected)
    undeclared = fit(make_mlp(pl, "handwritten_sum"), "parallel_criterion", 3, data(), root, ns=pl)
    assert len(notices(undeclared)) == 1


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
def test_an_ignore_index_other_than_minus_100_is_found_or_declared(reduction):
    from strategy_models import flat_params, metrics, trainer

    single, multi = IgnoresMinusOne().double(), IgnoresMinusOne().double()
    trainer("auto", 1, max_epochs=1).fit(single, _ignoring_batches())
    run = trainer(strategy(reduction), 3, max_epochs=1, enable_progress_bar=True)
    run.fit(multi, _ignoring_batches())
    assert run.strategy.normalization.spec() == "tokens:1:-1"
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)
    assert metrics(run)["loss"] == pytest.approx(float(single.trainer.callback_metrics["loss"]), abs=1e-10, rel=0)
