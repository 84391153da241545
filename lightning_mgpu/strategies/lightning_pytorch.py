"""The strategies for ``lightning.pytorch`` (``import lightning.pytorch as L``); see :mod:`.namespace_strategies`."""

from lightning_mgpu.strategies.namespace_strategies import define

ParallelCriterionStrategy, DataParallelStrategy, register = define("lightning.pytorch", "lightning.fabric", __name__)
