"""An exception raised in a replica's backward says that the step ran replicated, and anomaly mode names the replica."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from strategy_models import Classifier, loader, seeded, trainer


class FailsOnFourRows(torch.autograd.Function):
    """Identity forward; backward fails for a shard of 4 samples (replica 0 of 10 samples over 3 devices: 4/3/3)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if grad.shape[0] == 4:
            raise ValueError("bad gradient on a shard of 4")
        return grad


class FailingBackward(Classifier):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FailsOnFourRows.apply(self.net(x))


def _notes(err: BaseException) -> str:
    return "\n".join(getattr(err, "__notes__", []))


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp"])
def test_backward_error_says_the_step_was_replicated_and_anomaly_mode_names_the_replica(strategy):
    with pytest.raises(ValueError, match="bad gradient on a shard of 4") as caught:
        trainer(strategy, 3, max_steps=1).fit(seeded(FailingBackward), loader(10))
    assert "backward pass of a step that ran replicated on 3 devices (cpu, cpu, cpu)" in _notes(caught.value)
    if strategy == "dp" or sys.version_info < (3, 11):
        return  # dp runs the forward of every replica through the same frames; one check suffices
    with pytest.warns(UserWarning, match=r"(?s)Error detected.*replica_0"), pytest.raises(ValueError, match="bad"):
        trainer(strategy, 3, max_steps=1, detect_anomaly=True).fit(seeded(FailingBackward), loader(10))
