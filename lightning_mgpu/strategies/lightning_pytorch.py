"""The strategies for ``lightning.pytorch`` (``import lightning.pytorch as L``); see :func:`..registration.define`."""

from lightning_mgpu.registration import define

ParallelCriterionStrategy, DataParallelStrategy = define("lightning.pytorch")
