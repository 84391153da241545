"""The strategies for ``pytorch_lightning`` (``import pytorch_lightning as pl``); see :func:`..registration.define`."""

from lightning_mgpu.registration import define

ParallelCriterionStrategy, DataParallelStrategy = define("pytorch_lightning")
