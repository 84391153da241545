"""lightning-mgpu: single-process multi-GPU training for PyTorch Lightning 2.

``import lightning_mgpu`` registers ``strategy="parallel_criterion"`` and ``strategy="dp"`` (alias ``"data_parallel"``)
with ``lightning.pytorch`` and ``pytorch_lightning`` as each is imported, and imports no Lightning itself. The strategy
classes here are ``lightning.pytorch``'s; ``lightning_mgpu.strategies.pytorch_lightning`` has the others.
"""

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


def __getattr__(name: str) -> Any:
    """The strategy classes (they import ``lightning.pytorch``) and the loss diagnostic, imported on first use."""
    if name == "check_loss_reduction":
        from lightning_mgpu.loss_check import check_loss_reduction

        return check_loss_reduction
    if name == "ExactLoss":
        from lightning_mgpu.callbacks.exact_loss import ExactLoss

        return ExactLoss
    if name in ("ParallelCriterionStrategy", "DataParallelStrategy"):
        from lightning_mgpu.strategies import lightning_pytorch

        return getattr(lightning_pytorch, name)
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
