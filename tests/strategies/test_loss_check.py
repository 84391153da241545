"""The opt-in diagnostic ``lightning_mgpu.check_loss_reduction``: runs the step on purpose, on a copy, and names the
rule that reproduces one device; the module it is given is left as it was."""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from hf_models import STEPS, assert_equal_runs, fit, make_mlp, mlp_loader
from torch.utils.data import DataLoader, TensorDataset

import lightning_mgpu
from benchmarks.compare.process_group import run_in_process_group
from lightning_mgpu import loss_check


def _batch(loss: str, ignored: slice | None = None) -> Any:
    return next(iter(mlp_loader(loss, 10, ignored=ignored)))


@pytest.mark.parametrize(
    ("loss", "ignored", "expected"),
    [
        ("handwritten_sum", None, {"sum"}),
        ("ce_sum", None, {"sum"}),
        ("ce_ignore_index", slice(1, None, 3), {"tokens:1"}),
        ("ce_mean", None, {"samples", "tokens:1"}),  # no ignored label: the two rules coincide on this batch
    ],
)
def test_names_the_rule_that_reproduces_one_device(loss, ignored, expected):
    check = lightning_mgpu.check_loss_reduction(make_mlp(L, loss), _batch(loss, ignored), devices=3)
    assert check.rule in expected, str(check)
    assert f"loss_reduction={check.rule!r}" in str(check)


def test_a_median_has_no_rule_and_the_report_says_what_can_work():
    check = lightning_mgpu.check_loss_reduction(make_mlp(L, "median"), _batch("median"), devices=2)
    assert check.rule is None
    assert "no rule reproduces one device" in str(check) and "loss_terms" in str(check)


def test_the_module_given_is_left_as_it_was():
    module = make_mlp(L, "handwritten_sum").eval()
    before = [p.detach().clone() for p in module.parameters()]
    lightning_mgpu.check_loss_reduction(module, _batch("handwritten_sum"), devices=2)
    assert not module.training  # the copy ran in train mode; the original keeps its mode
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def test_command_line_form_on_a_recipe_config(capsys):
    loss_check.main(
        [
            "-c",
            "configs/pyramidnet/quickstart.yaml",
            "--data.init_args.synthetic_train_size=16",
            "--data.init_args.synthetic_test_size=8",
            "--data.init_args.batch_size=8",
            "--trainer.callbacks=[]",
        ]
    )
    out = capsys.readouterr().out
    assert "the whole batch's loss on one device" in out
    # PyramidNet's BatchNorm couples a batch's samples in train mode, which no loss rule undoes: the check puts it on
    # running statistics, finds the loss's own rule, and says that training needs sync_batchnorm=True for BatchNorm.
    assert "BatchNorm layer(s) on their running statistics for the check" in out and "sync_batchnorm=True" in out
    # The rule parallel_criterion reads from the loss's autograd record reproduces one device: nothing to declare.
    verdict = out.strip().splitlines()[-1]
    assert "autograd record" in verdict and "cross_entropy" in verdict and "nothing to declare" in verdict, out
    assert "loss_reduction='auto': shards combine to" in out


class _Opaque(torch.autograd.Function):
    """The identity, as a custom autograd Function: a node whose record says nothing of the loss's normalisation."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _NoisyMean(L.LightningModule):
    """A per-sample mean behind dropout, optionally noise drawn in the step itself, or behind an ``_Opaque`` node."""

    def __init__(self, noise_in_step: bool = False, opaque: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)).double()
        self.noise_in_step = noise_in_step
        self.opaque = opaque

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.noise_in_step:
            x = x + 0.1 * torch.randn_like(x)
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        return _Opaque.apply(loss) if self.opaque else loss


def _classes(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, dtype=torch.float64, generator=generator), torch.arange(n) % 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dropout_layers_are_off_for_the_check_so_a_per_sample_mean_is_named(seed):
    """Dropout masks drawn for the whole batch cannot match its shards'; with the layers off the rule is exact."""
    check = lightning_mgpu.check_loss_reduction(_NoisyMean(), _classes(10), devices=3, seed=seed)
    assert check.rule == "samples", str(check)
    assert "1 dropout layer(s) switched off" in str(check)


def test_a_step_random_beyond_dropout_gets_no_rule_and_says_why():
    check = lightning_mgpu.check_loss_reduction(_NoisyMean(noise_in_step=True), _classes(10), devices=3)
    assert check.rule is None and check.noise > 0
    report = str(check)
    assert "the step is random even with its 1 dropout layer(s) off" in report and "declare" not in report


@pytest.mark.parametrize(("size", "why"), [(1, "is not split"), (2, "shards are all of 1 samples")])
def test_a_batch_too_small_to_tell_rules_apart_says_so(size, why):
    """A loss whose record says nothing (a custom autograd Function): the candidates coincide on a batch of 1 or of
    1 + 1 samples, and the report says why and to check a larger batch, instead of naming one rule."""
    check = lightning_mgpu.check_loss_reduction(_NoisyMean(opaque=True), _classes(size), devices=2)
    assert check.known is None and "auto" not in check.predictions, str(check)
    assert why in str(check) and "coincide" in str(check), str(check)


@pytest.mark.parametrize("size", [1, 2])
def test_a_loss_read_from_its_record_needs_nothing_declared_even_on_a_tiny_batch(size):
    """A plain ``cross_entropy``: what ``parallel_criterion`` reads from its record reproduces one device, whatever
    the batch, so the report says there is nothing to declare."""
    check = lightning_mgpu.check_loss_reduction(_NoisyMean(), _classes(size), devices=2)
    assert check.known is not None and "cross_entropy" in check.known, str(check)
    assert "nothing to declare" in str(check) and "coincide" not in str(check), str(check)


def test_the_command_starts_without_python_warnings(tmp_path):
    """``python -m lightning_mgpu.loss_check`` runs a module the package has not imported (no runpy warning)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-W", "error::RuntimeWarning", "-m", "lightning_mgpu.loss_check", "--help"]
    run = run_in_process_group(command, 120, env=env, log=tmp_path / "log")
    assert run.returncode == 0, run.describe()
    assert "usage: python -m lightning_mgpu.loss_check" in run.output and "Warning" not in run.output


def _masked_module(ns: Any, style: str) -> Any:
    """A mean over the positive rows (``y == 1``), which lie in each batch's first 4 rows: the later shards have none.

    ``clamped`` divides by ``m.sum().clamp(min=1)`` (its record reads a count of 1 on an empty shard: hazards.md), with
    ``loss_weight`` or as a ``loss_terms`` term; ``opaque`` hides ``(l * m).sum() / m.sum()`` behind a custom autograd
    Function (no rule read; NaN on an empty shard); ``read`` is that mean bare; ``infonce`` is a contrastive loss over
    the shard's similarity matrix (each row's positive is itself), which couples the shard's rows."""

    class Masked(ns.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            logits = self.net(x)
            if style == "infonce":
                z = F.normalize(logits, dim=1)
                return F.cross_entropy(z @ z.T / 0.5, torch.arange(len(x)))
            per_row, m = F.cross_entropy(logits, y, reduction="none"), (y == 1).double()
            if style in ("opaque", "read"):
                loss = (per_row * m).sum() / m.sum()
                return _Opaque.apply(loss) if style == "opaque" else loss
            loss = (per_row * m).sum() / m.sum().clamp(min=1)
            self.log("train_loss", loss)
            if style == "clamped_terms":
                mean = per_row.mean()
                return {"loss": loss + mean, "loss_terms": {"pos": (loss, m.sum()), "all": (mean, len(y))}}
            return {"loss": loss, "loss_weight": m.sum()}

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Masked()


def _positives_first(batches: int = STEPS, size: int = 12) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batches * size, 5, dtype=torch.float64, generator=generator)
    y = torch.full((batches, size), 2)
    y[:, :4] = torch.tensor([1, 0, 1, 1])  # shards of 12 over 3: 8 + 2 + 2 here, 4 + 4 + 4 in training
    return DataLoader(TensorDataset(x, y.flatten()), batch_size=size)


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
@pytest.mark.parametrize("style", ["clamped_weight", "clamped_terms"])
def test_a_step_that_declares_its_weights_is_the_auto_row(style, namespace, tmp_path):
    """The step's ``loss_weight`` / ``loss_terms`` are parallel_criterion's only rule for it: the check's ``auto`` row
    combines the shards by them (not by the record, which reads the clamped divisor as a count of 1 on an empty
    shard: 0.358 off before), and training on 3 devices equals one device, as the check says."""
    ns = pytest.importorskip(namespace)
    check = lightning_mgpu.check_loss_reduction(_masked_module(ns, style), next(iter(_positives_first())), devices=3)
    assert list(check.predictions) == ["auto"] and check.rule == "auto", str(check)
    assert abs(check.predictions["auto"] - check.whole) <= 1e-12, str(check)
    verdict = str(check).splitlines()[-1]
    assert "step's own weights" in verdict and "nothing to declare" in verdict, str(check)
    one = fit(_masked_module(ns, style), "auto", 1, _positives_first(), tmp_path / "one", ns)
    three = fit(_masked_module(ns, style), "parallel_criterion", 3, _positives_first(), tmp_path / "three", ns)
    assert_equal_runs(three, one, atol=1e-12)


@pytest.mark.parametrize("read", [False, True])
def test_an_empty_mask_on_a_shard_is_not_called_coupling(read, tmp_path):
    """A masked mean over a shard with an empty mask is 0/0 = NaN there. Unread (behind a custom Function), every rule
    keeps that NaN, as training does: the report says so and how to leave the shard out (the coupling message was
    wrong). Read from its record, the empty shard is left out and the report says there is nothing to declare."""
    module = _masked_module(L, "read" if read else "opaque")
    check = lightning_mgpu.check_loss_reduction(module, next(iter(_positives_first())), devices=3)
    verdict = str(check).splitlines()[-1]
    assert "couples" not in verdict, str(check)
    if read:
        assert check.rule == "auto" and "nothing to declare" in verdict, str(check)
        return
    assert check.nan == [1, 2] and check.rule is None, str(check)
    assert "NaN on shard(s) 1, 2" in verdict and "'loss_weight': <what it divides by, e.g. mask.sum()>" in verdict
    three = fit(module, "parallel_criterion", 3, _positives_first(), tmp_path)  # unread: each device's sample count
    assert all(torch.tensor(three.losses).isnan()), three.losses


def test_a_contrastive_loss_over_the_shard_is_still_called_coupling():
    check = lightning_mgpu.check_loss_reduction(_masked_module(L, "infonce"), next(iter(_positives_first())), devices=3)
    assert check.rule is None and not check.nan, str(check)
    assert "couples samples across the batch" in str(check).splitlines()[-1], str(check)
