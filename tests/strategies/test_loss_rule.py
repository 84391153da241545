"""Unit tests of the declared loss rule (:mod:`lightning_mgpu.strategies.loss_rules`): what each rule counts, and how a
``loss_reduction`` string reads and prints."""

from __future__ import annotations

import pytest
import torch

from lightning_mgpu.strategies.loss_rules import LossNormalization

LABELS = torch.tensor([[5, 6, -100, -100], [7, -100, 8, 9]])


def test_a_token_count_skips_ignored_labels():
    assert LossNormalization.parse("tokens:labels").count({"labels": LABELS}).item() == 5


def test_a_shifted_count_leaves_out_the_first_position_of_each_row():
    # causal LMs predict token t+1 from t: row 0 counts 6 (1 valid after the first), row 1 counts 8, 9 (2)
    assert LossNormalization.parse("shifted_tokens:labels").count({"labels": LABELS}).item() == 3


def test_a_declared_ignore_index_is_the_one_counted():
    labels = {"mask": torch.tensor([[1, 255, 2], [-100, 255, 3]])}
    assert LossNormalization.parse("tokens:mask:255").count(labels).item() == 4  # -100 is a label here


def test_class_weights_weight_the_count_and_positions_name_tuple_items():
    rule = LossNormalization("tokens", (1,), ignore_index=-1, class_weight=(0.5, 2.0, 4.0))
    batch = (torch.zeros(4, 2), torch.tensor([0, 2, -1, 2]))
    assert rule.count(batch).item() == pytest.approx(0.5 + 4.0 + 4.0)


@pytest.mark.parametrize(
    "spec", ["samples", "sum", "replica_mean", "tokens:labels", "shifted_tokens:a.0", "tokens:mask:255", "tokens:1:-1"]
)
def test_parse_and_spec_round_trip(spec):
    assert LossNormalization.parse(spec).spec() == spec


def test_parse_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        LossNormalization.parse("tokens")
    with pytest.raises(ValueError, match="'tokens:labels:255' for an ignore index other than -100"):
        LossNormalization.parse("tokens:labels:none")
    assert LossNormalization.parse("auto") is None
