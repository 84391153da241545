"""Lightning strategies: ``parallel_criterion`` and ``dp`` (alias ``data_parallel``)."""

from typing import Any

from lightning_mgpu.strategies.data_parallel import DataParallelStrategy
from lightning_mgpu.strategies.parallel_criterion import ParallelCriterionStrategy
from lightning_mgpu.strategies.single_process import SingleProcessParallelStrategy
from lightning_mgpu.strategies.step_outputs import LOSS_TERMS_KEY, LOSS_WEIGHT_KEY

STRATEGIES = (ParallelCriterionStrategy, DataParallelStrategy)


def register_strategies(registry: Any = None) -> None:
    """Add this package's strategies to Lightning's ``StrategyRegistry`` (idempotent: safe to call many times)."""
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry as registry
    for strategy in STRATEGIES:
        strategy.register_strategies(registry)


__all__ = [
    "LOSS_TERMS_KEY",
    "LOSS_WEIGHT_KEY",
    "DataParallelStrategy",
    "ParallelCriterionStrategy",
    "SingleProcessParallelStrategy",
    "register_strategies",
]
