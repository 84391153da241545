"""The strategy classes of one Lightning namespace: the shared implementation put before its ``ParallelStrategy``,
defined in that namespace's module so that they import and pickle as its own."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from lightning_mgpu.strategies.data_parallel import DataParallelStrategyBase
from lightning_mgpu.strategies.parallel_criterion import ParallelCriterionStrategyBase
from lightning_mgpu.strategies.single_process import LightningNamespace


def define(namespace: str, fabric: str, module: str) -> tuple[type, type, Callable[[], None]]:
    """``(ParallelCriterionStrategy, DataParallelStrategy, register)`` for the Lightning ``namespace`` (``fabric``: its
    Fabric package), as classes of ``module``; they are registered now, and again (idempotent) by ``register()``."""
    strategies = importlib.import_module(f"{namespace}.strategies")
    lightning = LightningNamespace(
        namespace,
        importlib.import_module(namespace).LightningModule,
        importlib.import_module(f"{fabric}.utilities.exceptions").MisconfigurationException,
        importlib.import_module(f"{fabric}.utilities.device_dtype_mixin")._DeviceDtypeModuleMixin,
    )
    classes = {
        implementation: type(
            name,
            (implementation, strategies.ParallelStrategy),
            {"__module__": module, "__qualname__": name, "__doc__": implementation.__doc__, "namespace": lightning},
        )
        for name, implementation in (
            ("ParallelCriterionStrategy", ParallelCriterionStrategyBase),
            ("DataParallelStrategy", DataParallelStrategyBase),
        )
    }

    def register() -> None:
        for implementation, strategy in classes.items():
            for name in (implementation.strategy_name, *implementation.aliases):
                if name not in strategies.StrategyRegistry:
                    description = (strategy.__doc__ or name).strip().splitlines()[0]
                    strategies.StrategyRegistry.register(name, strategy, description=description)

    register()
    return classes[ParallelCriterionStrategyBase], classes[DataParallelStrategyBase], register
