"""Unit tests of the merge of replicas' ``self.log`` calls: each rule pinned on its own component."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import numpy as np
import pytest
import torch

from lightning_mgpu.parallel.reduce import stack_scalars, weighted_mean
from lightning_mgpu.strategies.replica_logging import LogRecorder, merge_and_log


class Root:
    """Stands in for the root LightningModule: keeps what would reach Lightning's ``log``."""

    def __init__(self) -> None:
        self.logged: dict[str, tuple[Any, dict[str, Any]]] = {}

    def log(self, name: str, value: Any, **options: Any) -> None:
        self.logged[name] = (value, options)


def _merge(values: list[float], counts: list[int], **options: Any) -> tuple[float, dict[str, Any]]:
    recorders = [LogRecorder() for _ in values]
    for recorder, value in zip(recorders, values, strict=True):
        recorder.log("x", torch.tensor(value, dtype=torch.float64), **options)
    root = Root()
    merge_and_log(root, recorders, counts, lambda _: None)
    value, merged = root.logged["x"]
    return value.item(), merged


def test_a_logged_mean_is_weighted_by_each_replicas_sample_count():
    value, options = _merge([1.0, 4.0], counts=[3, 1])
    assert value == pytest.approx((3 * 1.0 + 1 * 4.0) / 4, rel=0, abs=1e-15)
    assert options["batch_size"] is None  # Lightning reads the step's weight from the whole batch, as on one device


def test_batch_size_given_to_log_weights_the_mean_instead_of_sample_counts():
    recorders = [LogRecorder(), LogRecorder()]
    recorders[0].log("x", torch.tensor(1.0, dtype=torch.float64), batch_size=1)
    recorders[1].log("x", torch.tensor(4.0, dtype=torch.float64), batch_size=3)
    root = Root()
    merge_and_log(root, recorders, [3, 1], lambda _: None)
    value, options = root.logged["x"]
    assert value.item() == pytest.approx((1 * 1.0 + 3 * 4.0) / 4, rel=0, abs=1e-15)
    assert options["batch_size"] == 4


def test_the_same_batch_size_on_every_replica_is_a_constant_and_sample_counts_weight_the_mean():
    """``batch_size=self.hparams.batch_size``: every replica passes the whole batch's size, which says nothing about
    the shards (4 and 3 samples here): the step's value is one device's, weighted by sample counts."""
    recorders = [LogRecorder(), LogRecorder()]
    recorders[0].log("x", torch.tensor(1.0, dtype=torch.float64), batch_size=7)
    recorders[1].log("x", torch.tensor(4.0, dtype=torch.float64), batch_size=7)
    root = Root()
    merge_and_log(root, recorders, [4, 3], lambda _: None)
    assert root.logged["x"][0].item() == pytest.approx((4 * 1.0 + 3 * 4.0) / 7, rel=0, abs=1e-15)


def test_equal_batch_sizes_are_summed_for_the_steps_epoch_weight():
    """``batch_size=n_tokens`` equal on even shards counts each shard: the step's is their sum (a constant is summed
    too, which scales every step alike)."""
    value, options = _merge([1.0, 4.0], counts=[4, 4], batch_size=16)
    assert value == pytest.approx(2.5, rel=0, abs=1e-15)
    assert options["batch_size"] == 32


def test_a_name_logged_twice_in_a_step_is_logged_twice_each_call_merged_over_replicas():
    """One device logs each call (Lightning keeps the last as the step's value and takes every one into the epoch's):
    the k-th calls of the replicas merge into the root's k-th call, in order."""
    recorders = [LogRecorder(), LogRecorder()]
    for recorder, (first, second) in zip(recorders, [(1.0, 10.0), (3.0, 30.0)], strict=True):
        recorder.log("x", torch.tensor(first, dtype=torch.float64))
        recorder.log("y", torch.tensor(0.0, dtype=torch.float64))
        recorder.log("x", torch.tensor(second, dtype=torch.float64))
    calls: list[tuple[str, float]] = []

    class InOrder(Root):
        def log(self, name: str, value: Any, **options: Any) -> None:
            calls.append((name, value.item()))

    merge_and_log(InOrder(), recorders, [1, 3], lambda _: None)
    assert calls == [("x", 2.5), ("y", 0.0), ("x", 25.0)]


def test_a_replica_with_weight_zero_takes_no_part_in_the_mean():
    recorders = [LogRecorder(), LogRecorder()]
    recorders[0].log("x", torch.tensor(2.0), batch_size=5)
    recorders[1].log("x", torch.tensor(float("nan")), batch_size=0)
    root = Root()
    merge_and_log(root, recorders, [3, 2], lambda _: None)
    assert root.logged["x"][0].item() == 2.0


@pytest.mark.parametrize(("reduce_fx", "expected"), [("sum", 5.0), ("max", 4.0), ("min", 1.0)])
def test_sum_max_min_reduce_over_replicas(reduce_fx: str, expected: float):
    value, _ = _merge([1.0, 4.0], counts=[3, 1], reduce_fx=reduce_fx)
    assert value == expected


def test_replicas_that_log_a_name_differently_are_refused():
    recorders = [LogRecorder(), LogRecorder()]
    recorders[0].log("x", torch.tensor(1.0), prog_bar=True)
    recorders[1].log("x", torch.tensor(1.0), prog_bar=False)
    with pytest.raises(ValueError, match="Replicas logged 'x' with different options"):
        merge_and_log(Root(), recorders, [1, 1], lambda _: None)


@pytest.mark.parametrize("reduce_fx", ["mean", "sum", "max", "min", max])
def test_a_logged_copy_of_the_loss_merges_as_the_loss_whatever_reduce_fx(reduce_fx: Any):
    """One device logs the whole-batch loss once per step; reduce_fx acts over steps, not over the replicas."""
    losses = [torch.tensor(1.0, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64)]
    recorders = [LogRecorder(), LogRecorder()]
    for recorder, loss in zip(recorders, losses, strict=True):
        recorder.log("loss", loss.detach(), reduce_fx=reduce_fx)
    root = Root()

    def as_the_loss(values: list[torch.Tensor], name: str | None) -> torch.Tensor:  # the strategy's: the loss's rule
        return weighted_mean(stack_scalars(values, values[0].device, torch.float64), torch.tensor([3.0, 1.0]))

    merge_and_log(root, recorders, [2, 2], lambda _: None, as_the_loss)
    value, options = root.logged["loss"]
    assert value.item() == pytest.approx((3 * 1.0 + 1 * 4.0) / 4, rel=0, abs=1e-15)  # by the loss's weights
    assert options["reduce_fx"] is reduce_fx  # Lightning applies it over the steps


@pytest.mark.parametrize("value", [np.float32(0.5), np.float64(0.5), np.int64(3), True, Decimal("0.5")])
def test_numbers_lightning_logs_are_accepted(value: Any):
    recorders = [LogRecorder(), LogRecorder()]
    for recorder in recorders:
        recorder.log("x", value, reduce_fx="max")
    root = Root()
    merge_and_log(root, recorders, [1, 1], lambda _: None)
    assert root.logged["x"][0].item() == float(value)


@pytest.mark.parametrize("value", [np.array(0.5), np.bool_(True), 1j])
def test_what_lightning_refuses_to_log_is_refused(value: Any):
    recorder = LogRecorder()
    recorder.log("x", value)
    with pytest.raises(ValueError, match=r"self.log\('x', ...\) got a .*; log a real number or a scalar tensor"):
        merge_and_log(Root(), [recorder], [1], lambda _: None)


def test_a_name_one_replica_alone_logged_is_said_unless_every_replica_returned_it():
    """``if self.trainer.is_global_zero: self.log(...)``: replica 0's shard value, named in the result; where replica 0
    logged what it returned, every replica's return at that place stands in for the calls the others did not make."""
    returned = [torch.tensor(1.0, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64)]
    recorders = [LogRecorder(), LogRecorder()]
    recorders[0].log("returned", returned[0].detach())
    recorders[0].log("other", torch.tensor(2.0, dtype=torch.float64))
    root = Root()
    assert merge_and_log(root, recorders, [3, 1], lambda _: None, outputs=returned) == {"other": 0}
    assert root.logged["returned"][0].item() == pytest.approx((3 * 1.0 + 1 * 4.0) / 4, rel=0, abs=1e-15)
    assert root.logged["other"][0].item() == 2.0  # replica 0's, as under DDP: said by the strategy
