"""``ExactLoss``: with accumulation, under Lightning's DDP and under ``parallel_criterion``, the optimizer step equals
one device's step on the whole global batch (float64, to 1e-9); what it cannot make exact it says once."""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from exact_loss_cases import GLOBAL_BATCH, LOSSES, SEQUENCES, TokenNet, dataset, fit, flat, module_class, reference

from benchmarks.compare.process_group import run_in_process_group
from lightning_mgpu.callbacks.exact_loss import MEAN, SUM, TERMS, exact_loss_class, read_rule

REPO = Path(__file__).resolve().parents[2]
EXACT = 1e-9
#: The mean-over-a-count losses of the issue.
MEANS = ("token_mean", "weighted", "sample_mean")


def said(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "ExactLoss" in str(w.message)]


def fit_recording(*args: Any, **kwargs: Any) -> tuple[Any, Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, module = fit(*args, **kwargs)
    return trainer, module, said(caught)


def distance(module: Any, loss: str) -> float:
    return float((flat(module) - reference(loss)).abs().max())


def logged_per_micro_batch(loss: str, micro: int) -> list[float]:
    """What one device logs for each micro-batch of ``micro`` sequences when every optimizer step is the reference's
    step on the whole global batch."""
    net, data, values = TokenNet(), dataset(), []
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    for step in range(SEQUENCES // GLOBAL_BATCH):
        start = step * GLOBAL_BATCH
        with torch.no_grad():
            values += [float(LOSSES[loss](net, data[i : i + micro])) for i in range(start, start + GLOBAL_BATCH, micro)]
        optimizer.zero_grad()
        LOSSES[loss](net, data[start : start + GLOBAL_BATCH]).backward()
        optimizer.step()
    return values


class LoggedLosses:
    """The ``train_loss_step`` value logged for each training batch (read at the next batch's start)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def read(self, trainer: Any, *args: Any) -> None:
        if "train_loss_step" in trainer.callback_metrics and trainer.global_step + trainer.fit_loop.batch_idx > 0:
            self.values.append(float(trainer.callback_metrics["train_loss_step"]))


@pytest.mark.parametrize("loss", MEANS)
def test_one_device_with_accumulation_equals_the_global_batch(tmp_path, loss):
    """Batches of 4, accumulate_grad_batches=3: the three steps equal one device's on batches of 12, and each
    micro-batch logs what one device computes for it (the callback changes gradients only)."""
    import lightning.pytorch as L

    recorder = LoggedLosses()
    reading = type("Reading", (L.Callback,), {"on_train_batch_start": recorder.read, "on_train_end": recorder.read})
    exact_loss = exact_loss_class()()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        accumulate_grad_batches=3,
        callbacks=[exact_loss, reading()],
        default_root_dir=tmp_path,
    )
    module = module_class()(loss)
    module.batch_size = 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    assert said(caught) == []
    assert distance(module, loss) < EXACT
    assert recorder.values == pytest.approx(logged_per_micro_batch(loss, 4), abs=EXACT)


@pytest.mark.parametrize("loss", ["token_mean", "weighted"])
def test_without_the_callback_accumulation_is_biased(tmp_path, loss):
    """The control: Lightning's equal weights of micro-batches with different token counts are off (the check above
    can fail)."""
    _, module, _ = fit_recording(loss, 4, 3, exact=False, root=tmp_path)
    assert distance(module, loss) > 1e-3


@pytest.mark.parametrize("loss", MEANS)
def test_parallel_criterion_with_accumulation(tmp_path, loss):
    """parallel_criterion x2 (virtual CPU devices) combines the devices' losses; the callback adds the micro-batches
    through the strategy's ``loss_counts``."""
    trainer, module, words = fit_recording(loss, 4, 3, strategy="parallel_criterion", devices=2, root=tmp_path)
    assert hasattr(trainer.strategy, "loss_counts") and words == []
    assert distance(module, loss) < EXACT


@pytest.mark.parametrize(("batch_size", "accumulate"), [(4, 3), (3, 3)])
def test_a_sum_stays_a_sum_whatever_the_micro_batch_size(tmp_path, batch_size, accumulate):
    """Lightning divides the loss by accumulate_grad_batches: read as ``sum / divisor``, that division is no count,
    even where it equals the micro-batch's sample count (3 and 3: it was read as a mean over samples, 6e-2 off)."""
    _, module, words = fit_recording("token_sum", batch_size, accumulate, root=tmp_path)
    assert words == []
    torch.testing.assert_close(flat(module), reference("token_sum", batch_size * accumulate), rtol=0, atol=EXACT)


def test_dp_with_accumulation(tmp_path):
    """Under dp the step (and the loss) runs once, on the root: the callback reads that loss as on one device."""
    _, module, words = fit_recording("token_mean", 4, 3, strategy="dp", devices=2, root=tmp_path)
    assert words == [] and distance(module, "token_mean") < EXACT


@pytest.mark.parametrize("strategy", ["auto", "parallel_criterion"])
def test_two_terms_under_accumulation_are_said_once_and_weighted_as_lightning_does(tmp_path, strategy):
    """Two means over different counts (tokens, sequences): an accumulation window's counts are not known before its
    backward, so the micro-batches keep Lightning's equal weights, said once."""
    devices = 2 if strategy != "auto" else 1
    _, expected, _ = fit_recording("two_terms", 4, 3, strategy=strategy, devices=devices, exact=False, root=tmp_path)
    _, module, words = fit_recording("two_terms", 4, 3, strategy=strategy, devices=devices, root=tmp_path)
    assert len(words) == 1 and "weighted equally" in words[0] and "accumulate_grad_batches=1" in words[0]
    torch.testing.assert_close(flat(module), flat(expected), rtol=0, atol=1e-12)


def test_an_unknown_loss_keeps_lightnings_weighting_said_once(tmp_path):
    _, expected, _ = fit_recording("unknown", 4, 3, exact=False, root=tmp_path)
    _, module, words = fit_recording("unknown", 4, 3, root=tmp_path)
    assert len(words) == 1 and "PowBackward0" in words[0] and "keep Lightning's weighting" in words[0]
    torch.testing.assert_close(flat(module), flat(expected), rtol=0, atol=1e-12)


def test_a_loss_that_changes_form_is_said_once(tmp_path):
    """A micro-batch whose loss differs in form from the first (here: one the reader cannot explain) is said once and
    read as the first's kind over the whole loss (a per-sample mean): training goes on."""
    import lightning.pytorch as L

    class Changing(module_class()):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return LOSSES["token_mean" if batch_idx == 0 else "unknown"](self.net, batch)

    module = Changing("token_mean")
    module.batch_size = 4
    callbacks = [exact_loss_class()()]
    trainer = L.Trainer(max_epochs=1, accumulate_grad_batches=3, callbacks=callbacks, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    words = said(caught)
    assert len(words) == 1 and "differs in form" in words[0] and "PowBackward0" in words[0], words
    assert torch.isfinite(flat(module)).all()


def test_a_sum_over_a_divisor_is_said_once_with_what_was_assumed(tmp_path, caplog):
    """``(loss * mask).sum() / mask.sum()``: a tensor divisor dividing a plain sum is a count (said once), so the
    steps are one device's; ``sum_divisor="constant"`` says otherwise, and then they are not."""
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        _, counted = fit("masked_by_hand", 4, 3, root=tmp_path)
        _, module = fit("masked_by_hand", 4, 3, root=tmp_path, sum_divisor="constant")
    lines = [r.getMessage() for r in caplog.records if "ExactLoss" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "sum / divisor is read as a count" in lines[0] and "sum_divisor='constant'" in lines[0]  # the other reading
    assert "sum / divisor is read as a constant" in lines[1] and "sum_divisor='constant'" in lines[1]
    assert distance(counted, "masked_by_hand") < EXACT
    assert distance(module, "masked_by_hand") > 1e-3


def test_read_rule_settles_a_sum_over_a_divisor():
    """``sum / d``: a mean where d is a tensor (a count computed from the data), or a number equal to the batch's
    sample count or the summed size; a sum scaled by a constant otherwise; ``sum_divisor`` overrides. ``x`` is made
    from data, as a model's outputs are (a leaf that requires gradients is a parameter: its reductions count once)."""
    x = torch.randn(4, 2, dtype=torch.float64) @ torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    assert read_rule((x.sum(1) * mask).sum() / mask.sum(), 4).kind == MEAN
    assert read_rule((x.sum(1) * mask).sum() / mask.sum(), 4, "constant").kind == SUM
    assert read_rule(x.sum() / len(x), 4).kind == MEAN
    assert read_rule(x.sum() / x.numel(), 4).kind == MEAN
    constant = read_rule(x.sum() / 2.0, 4)
    assert constant.kind == SUM and "a constant" in constant.said
    assert read_rule(x.sum() / 2.0, 4, "count").kind == MEAN
    assert read_rule(x.pow(2).mean() + x.sum(1).mean(), 4).kind == TERMS  # counts 12 and 4


def test_pytorch_lightning_namespace(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    import lightning.pytorch as L

    flavour = exact_loss_class("pytorch_lightning")
    assert issubclass(flavour, pl.Callback) and not issubclass(flavour, L.Callback)
    _, module, words = fit_recording("weighted", 4, 3, namespace="pytorch_lightning", root=tmp_path)
    assert words == [] and distance(module, "weighted") < EXACT
    # The hooks read only what both Trainers have: the other namespace's class works too (only type checks differ).
    module = module_class("pytorch_lightning")("weighted")
    module.batch_size = 4
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        accumulate_grad_batches=3,
        logger=False,
        callbacks=[exact_loss_class()()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    assert distance(module, "weighted") < EXACT


def test_ddp_two_processes(tmp_path):
    """Lightning's ``ddp`` (2 CPU processes, gloo), launched as Lightning launches it: every case of
    ``exact_loss_cases.DDP_CASES`` in one run (batches of 6; of 3 with accumulate_grad_batches=2)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    script = Path(__file__).with_name("exact_loss_cases.py")
    run = run_in_process_group(
        [sys.executable, str(script), str(tmp_path)], 240, cwd=tmp_path, env=env, log=tmp_path / "ddp.log"
    )
    assert not run.timed_out and run.returncode == 0, run.describe()
    cases = {c["name"]: c for c in (json.loads(line[5:]) for line in run.output.splitlines() if line[:5] == "CASE ")}
    assert len(cases) == 10, run.describe()
    # The cost across processes: one all-reduce to agree on the rule (first micro-batch), then one per optimizer step.
    steps = SEQUENCES // GLOBAL_BATCH
    added = cases["token_mean/ddp+acc"]["all_reduces"] - cases["token_mean/ddp+acc/without"]["all_reduces"]
    assert added == 1 + steps, cases
    for name, case in cases.items():
        if name == "two_terms/ddp+acc":  # weighted per micro-batch, said once (rank zero)
            assert len(case["said"]) == 1 and "weighted equally" in case["said"][0], case
        elif name.endswith("/without"):  # Lightning's own DDP with accumulation: biased
            assert case["error"] > 1e-3, case
        else:
            assert case["error"] < EXACT and case["said"] == [], case
