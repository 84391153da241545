"""The thin strategy classes of one Lightning namespace: the shared implementation put before its ``ParallelStrategy``,
defined in that namespace's module so that they import and pickle as its own."""

from __future__ import annotations

from typing import Any

from lightning_mgpu.strategies.data_parallel import DataParallelStrategyBase
from lightning_mgpu.strategies.parallel_criterion import ParallelCriterionStrategyBase
from lightning_mgpu.strategies.single_process import LightningNamespace, SingleProcessParallel


def define(namespace: LightningNamespace, parallel_strategy: type, module: str) -> tuple[type, type]:
    """``(ParallelCriterionStrategy, DataParallelStrategy)`` for ``namespace``, as classes of ``module``."""
    classes = []
    for name, implementation in (
        ("ParallelCriterionStrategy", ParallelCriterionStrategyBase),
        ("DataParallelStrategy", DataParallelStrategyBase),
    ):
        body = {"__module__": module, "__qualname__": name, "__doc__": implementation.__doc__, "namespace": namespace}
        classes.append(type(name, (implementation, parallel_strategy), body))
    return classes[0], classes[1]


def register(registry: Any, *strategies: type[SingleProcessParallel]) -> None:
    """Add each strategy to ``registry`` under its names (idempotent)."""
    for strategy in strategies:
        for name in (strategy.strategy_name, *strategy.aliases):
            if name not in registry:
                registry.register(name, strategy, description=(strategy.__doc__ or name).strip().splitlines()[0])
