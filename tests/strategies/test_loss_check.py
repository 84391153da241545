"""The opt-in diagnostic ``lightning_mgpu.check_loss_reduction``: runs the step on purpose, on a copy, and names the
rule that reproduces one device; the module it is given is left as it was."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from hf_models import make_mlp, mlp_loader

import lightning_mgpu
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
    # PyramidNet's BatchNorm couples the samples of a batch in train mode: no per-device weighting reproduces it
    assert "sync_batchnorm=True" in out
