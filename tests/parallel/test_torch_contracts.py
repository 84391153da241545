"""``lightning_mgpu.gather`` and ``scatter`` keep ``torch.nn.parallel``'s contracts, on CPU and virtual devices.

Checked against torch's own functions where torch runs (torch's ``gather`` refuses CPU inputs, so the expected
values are written out as torch's tests write them).
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

import lightning_mgpu
from lightning_mgpu import gather, merge_outputs, scatter, split_batch

CPU2 = ["cpu", "cpu"]


def test_gather_of_scalars_is_a_vector_with_torchs_warning():
    # torch's test_gather_cpu: 0-dim tensors come back unsqueezed into one value per replica, with a warning.
    x = torch.tensor(1.5, requires_grad=True)
    y = torch.tensor(2.5, requires_grad=True)
    with pytest.warns(UserWarning, match="all input tensors were scalars; will instead unsqueeze"):
        out = gather([x, y], "cpu")
    assert torch.equal(out, torch.tensor([1.5, 2.5]))
    out.sum().backward()
    assert x.grad == 1.0 and y.grad == 1.0


def test_gathered_partial_sums_add_up_to_the_total():
    partial_sums = [torch.tensor(3.0), torch.tensor(4.0), torch.tensor(5.0)]
    with pytest.warns(UserWarning):
        assert gather(partial_sums, "cpu").sum().item() == 12.0


def test_gather_concatenates_and_recurses_like_torch():
    Pair = namedtuple("Pair", "a b")
    outputs = [
        {"x": torch.ones(2, 3), "pair": Pair(torch.zeros(2), None), "seq": [torch.ones(1, 2)]},
        {"x": torch.zeros(1, 3), "pair": Pair(torch.ones(1), None), "seq": [torch.zeros(1, 2)]},
    ]
    out = gather(outputs, "cpu")
    assert torch.equal(out["x"], torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]))
    assert isinstance(out["pair"], Pair) and out["pair"].b is None
    assert torch.equal(out["pair"].a, torch.tensor([0.0, 0.0, 1.0]))
    assert torch.equal(out["seq"][0], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert torch.equal(gather([torch.ones(2, 1), torch.zeros(2, 2)], "cpu", dim=1), torch.tensor([[1.0, 0, 0]] * 2))
    with pytest.raises(ValueError, match="All dicts must have the same number of keys"):
        gather([{"a": torch.ones(1)}, {"a": torch.ones(1), "b": torch.ones(1)}], "cpu")


def test_merge_outputs_keeps_the_one_device_rule_for_scalars():
    # The batch-aware merge averages a mean loss by sample count instead: 3 samples at 1.0, 1 at 5.0.
    assert merge_outputs([torch.tensor(1.0), torch.tensor(5.0)], "cpu", sizes=[3, 1]).item() == 2.0


def test_scatter_returns_chunks_like_torch():
    x = torch.arange(10.0).reshape(5, 2)
    chunks = scatter(x, CPU2)
    assert [c.shape[0] for c in chunks] == [3, 2]
    assert torch.equal(torch.cat(chunks), x)
    assert scatter(7, CPU2) == [7, 7]  # no tensor: one reference per device, as torch does
    chunks = scatter({"x": x, "flag": "on"}, CPU2)
    assert [c["flag"] for c in chunks] == ["on", "on"]
    tiny = scatter(torch.ones(1, 2), CPU2)  # a batch smaller than the device count: fewer chunks
    assert len(tiny) == 1 and torch.equal(tiny[0], torch.ones(1, 2))
    # torch recurses into a list and hands every device each plain item: a list as long as the batch stays whole
    # (split_batch, the batch-aware form, splits such a list by item)
    chunks = scatter((x, [0.5, 1.0, 2.0, 4.0, 8.0]), CPU2)
    assert [c[1] for c in chunks] == [[0.5, 1.0, 2.0, 4.0, 8.0]] * 2
    assert [c[1] for c in split_batch((x, [0.5, 1.0, 2.0, 4.0, 8.0]), CPU2)[0]] == [[0.5, 1.0, 2.0], [4.0, 8.0]]


def test_parallel_exports_only_the_public_surface():
    assert "ThreadState" not in lightning_mgpu.parallel.__all__
    assert set(lightning_mgpu.parallel.__all__) >= {"gather", "scatter", "merge_outputs", "split_batch"}
