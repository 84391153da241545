"""lightning-mgpu: single-process multi-GPU training for PyTorch Lightning 2.

``import lightning_mgpu`` registers ``strategy="parallel_criterion"`` and ``strategy="dp"`` (alias ``"data_parallel"``)
with ``lightning.pytorch`` and ``pytorch_lightning`` as each is imported, and imports no Lightning itself. The strategy
classes here are ``lightning.pytorch``'s; ``lightning_mgpu.strategies.pytorch_lightning`` has the others.
"""

import importlib
from typing import Any

from lightning_mgpu import integrations  # noqa: F401  (registers what replicas need of other libraries)
from lightning_mgpu.parallel import (
    BatchSplitError,
    DataParallelCriterion,
    DataParallelModel,
    NothingToSplitError,
    PeerFailedError,
    PerSample,
    RendezvousError,
    ReplicaSet,
    ReplicaValues,
    SyncBatchNorm,
    convert_sync_batchnorm,
    gather,
    merge_outputs,
    reduce_losses,
    replicate,
    revert_sync_batchnorm,
    run_replicas,
    scatter,
    split_batch,
    uses_sync_batchnorm,
)
from lightning_mgpu.parallel.collectives import local_rows
from lightning_mgpu.registration import register_on_import, register_strategies
from lightning_mgpu.strategies.step_outputs import LOSS_TERMS_KEY, LOSS_WEIGHT_KEY

__version__ = "0.2.0"


#: Names imported on first use: the strategy classes import ``lightning.pytorch``.
_LAZY = {
    "check_loss_reduction": "lightning_mgpu.loss_check",
    "ExactLoss": "lightning_mgpu.callbacks.exact_loss",
    "ParallelCriterionStrategy": "lightning_mgpu.strategies.lightning_pytorch",
    "DataParallelStrategy": "lightning_mgpu.strategies.lightning_pytorch",
}


def __getattr__(name: str) -> Any:
    """The strategy classes and the loss diagnostic, imported on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_mgpu' has no attribute {name!r}")


def __dir__() -> list[str]:
    """Every public name, the lazily imported ones included."""
    return sorted({*globals(), *__all__})


register_on_import()

__all__ = [
    "LOSS_TERMS_KEY",
    "LOSS_WEIGHT_KEY",
    "BatchSplitError",
    "DataParallelCriterion",
    "DataParallelModel",
    "DataParallelStrategy",
    "ExactLoss",
    "NothingToSplitError",
    "ParallelCriterionStrategy",
    "PeerFailedError",
    "PerSample",
    "RendezvousError",
    "ReplicaSet",
    "ReplicaValues",
    "SyncBatchNorm",
    "__version__",
    "check_loss_reduction",
    "convert_sync_batchnorm",
    "gather",
    "local_rows",
    "merge_outputs",
    "reduce_losses",
    "register_strategies",
    "replicate",
    "revert_sync_batchnorm",
    "run_replicas",
    "scatter",
    "split_batch",
    "uses_sync_batchnorm",
]
