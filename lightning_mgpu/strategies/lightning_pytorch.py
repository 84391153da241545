"""The strategies for ``lightning.pytorch`` (``import lightning.pytorch as L``); see :mod:`.namespace_strategies`."""

from __future__ import annotations

from functools import partial

from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry

from lightning_mgpu.strategies import namespace_strategies
from lightning_mgpu.strategies.single_process import LightningNamespace

NAMESPACE = LightningNamespace("lightning.pytorch", LightningModule, MisconfigurationException, _DeviceDtypeModuleMixin)
ParallelCriterionStrategy, DataParallelStrategy = namespace_strategies.define(NAMESPACE, ParallelStrategy, __name__)

register = partial(namespace_strategies.register, StrategyRegistry, ParallelCriterionStrategy, DataParallelStrategy)
register()  # on import, so the classes are usable by name as soon as they exist
