"""The strategies for ``pytorch_lightning`` (``import pytorch_lightning as pl``): thin classes over the shared
implementation in :mod:`.parallel_criterion` and :mod:`.data_parallel`."""

from __future__ import annotations

from lightning_fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning import LightningModule
from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry

from lightning_mgpu.strategies.data_parallel import DataParallel
from lightning_mgpu.strategies.namespace import LightningNamespace
from lightning_mgpu.strategies.parallel_criterion import ParallelCriterion

NAMESPACE = LightningNamespace("pytorch_lightning", LightningModule, MisconfigurationException, _DeviceDtypeModuleMixin)


class ParallelCriterionStrategy(ParallelCriterion, ParallelStrategy):
    __doc__ = ParallelCriterion.__doc__
    namespace = NAMESPACE


class DataParallelStrategy(DataParallel, ParallelStrategy):
    __doc__ = DataParallel.__doc__
    namespace = NAMESPACE


def register() -> None:
    """Add ``parallel_criterion``, ``dp`` and ``data_parallel`` to ``pytorch_lightning``'s registry (idempotent)."""
    for strategy in (ParallelCriterionStrategy, DataParallelStrategy):
        strategy.register_strategies(StrategyRegistry)


register()  # on import, so the classes are usable by name as soon as they exist
