"""A collective whose replicas pass tensors of shapes it cannot combine fails with an error that names the
collective, every replica's shape and the replica that differs, raised in that replica (the others fail as its peers).
Uneven shards (dim 0 differs) are what ``all_gather`` is for: they keep working."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_mgpu.parallel import collectives
from lightning_mgpu.parallel.collectives import CollectiveShapeError
from lightning_mgpu.parallel.replica_group import RendezvousError
from lightning_mgpu.parallel.run_replicas import run_replicas


def meet(call: Callable[[torch.Tensor], Any], tensors: list[torch.Tensor]) -> list[Any]:
    """``call(tensors[i])`` in replica ``i`` of ``len(tensors)`` replicas in threads on virtual CPU devices."""
    return run_replicas([lambda t=t: call(t) for t in tensors], ["cpu"] * len(tensors), "threads")


def shape_error(call: Callable[[torch.Tensor], Any], tensors: list[torch.Tensor]) -> CollectiveShapeError:
    with pytest.raises(CollectiveShapeError) as raised:
        meet(call, tensors)
    return raised.value


def test_all_gather_of_shards_whose_other_dims_differ_names_each_shape_and_the_replica_that_differs():
    error = shape_error(collectives.all_gather, [torch.zeros(4, 3), torch.zeros(3, 3), torch.zeros(2, 5)])
    message = str(error)
    assert message.startswith(
        "all_gather (collective 1 of this step): the replicas passed tensors whose shapes cannot be combined "
        "(replica 0: (4, 3), replica 1: (3, 3), replica 2: (2, 5)); replica 2 differs from the others."
    )
    assert "every dim but dim 0 must match" in message and "dim 0 may differ (uneven shards)" in message
    assert "pad to a size every replica shares" in message
    assert "Sizes of tensors must match" not in message
    assert isinstance(error, RendezvousError) and error.replica_index == 2  # raised in the replica at fault
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "Caught CollectiveShapeError in replica 2" in notes
    assert "replica 0: PeerFailedError: all_gather (collective 1 of this step): replica 2 passed a tensor" in notes


def test_a_0_dim_tensor_in_one_replica_only_says_how_squeeze_drops_the_batch_dim():
    error = shape_error(collectives.all_gather, [torch.zeros(2), torch.zeros(2), torch.zeros(())])
    assert "(replica 0: (2,), replica 1: (2,), replica 2: ()); replica 2 differs" in str(error)
    assert "`.squeeze()` of a shard of one sample" in str(error)


def test_two_replicas_that_differ_name_the_second():
    error = shape_error(collectives.all_gather, [torch.zeros(4, 4), torch.zeros(3, 3)])
    assert "(replica 0: (4, 4), replica 1: (3, 3)); replica 1 differs" in str(error)
    assert error.replica_index == 1


def test_reduce_of_different_shapes_names_reduce_and_its_rule():
    error = shape_error(lambda t: collectives.reduce(t, "sum"), [torch.ones(3), torch.ones(3), torch.ones(2)])
    assert str(error).startswith("reduce(sum) (collective 1 of this step): the replicas passed tensors whose shapes")
    assert "replica 2 differs" in str(error) and "elementwise" in str(error)


def test_uneven_shards_and_0_dim_values_still_gather():
    rows = [torch.full((n, 3), float(n)) for n in (4, 3, 2)]
    gathered = meet(collectives.all_gather, rows)
    assert all(torch.equal(g, torch.cat(rows)) for g in gathered)
    scalars = meet(collectives.all_gather, [torch.tensor(1.0), torch.tensor(2.0)])
    assert all(torch.equal(s, torch.tensor([1.0, 2.0])) for s in scalars)
    summed = meet(lambda t: collectives.reduce(t, "sum"), [torch.ones(2), 2 * torch.ones(2)])
    assert all(torch.equal(s, torch.full((2,), 3.0)) for s in summed)


def test_a_later_collective_still_meets_after_a_refused_one_in_another_call():
    shape_error(collectives.all_gather, [torch.zeros(1, 2), torch.zeros(1, 3)])
    assert [g.shape for g in meet(collectives.all_gather, [torch.zeros(1, 2), torch.zeros(1, 2)])] == [(2, 2)] * 2
