"""The strategies for ``pytorch_lightning`` (``import pytorch_lightning as pl``); see :mod:`.namespace_strategies`."""

from __future__ import annotations

from functools import partial

from lightning_fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning import LightningModule
from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry

from lightning_mgpu.strategies import namespace_strategies
from lightning_mgpu.strategies.single_process import LightningNamespace

NAMESPACE = LightningNamespace("pytorch_lightning", LightningModule, MisconfigurationException, _DeviceDtypeModuleMixin)
ParallelCriterionStrategy, DataParallelStrategy = namespace_strategies.define(NAMESPACE, ParallelStrategy, __name__)

register = partial(namespace_strategies.register, StrategyRegistry, ParallelCriterionStrategy, DataParallelStrategy)
register()  # on import, so the classes are usable by name as soon as they exist
