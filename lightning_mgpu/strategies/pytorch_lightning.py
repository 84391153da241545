"""The strategies for ``pytorch_lightning`` (``import pytorch_lightning as pl``); see :mod:`.namespace_strategies`."""

from lightning_mgpu.strategies.namespace_strategies import define

ParallelCriterionStrategy, DataParallelStrategy, register = define("pytorch_lightning", "lightning_fabric", __name__)
