"""Pure-PyTorch data-parallel core (never imports Lightning): distinct CUDA devices, one device repeated ("virtual
devices") or CPUs, which ``torch.nn.parallel`` refuses. ``scatter`` and ``gather`` keep torch's contracts;
``split_batch`` and ``merge_outputs`` are the batch-aware forms that the modules and strategies use.
"""

from lightning_mgpu.parallel.merge import ReplicaValues, merge_outputs
from lightning_mgpu.parallel.modules import DataParallelCriterion, DataParallelModel
from lightning_mgpu.parallel.reduce import reduce_losses
from lightning_mgpu.parallel.replica_group import PeerFailedError, RendezvousError
from lightning_mgpu.parallel.replicas import ReplicaSet, replicate
from lightning_mgpu.parallel.run_replicas import run_replicas
from lightning_mgpu.parallel.scatter_gather import (
    BatchSplitError,
    NothingToSplitError,
    PerSample,
    gather,
    scatter,
    split_batch,
)
from lightning_mgpu.parallel.sync_batchnorm import (
    SyncBatchNorm,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
    uses_sync_batchnorm,
)

__all__ = [
    "BatchSplitError",
    "DataParallelCriterion",
    "DataParallelModel",
    "NothingToSplitError",
    "PeerFailedError",
    "PerSample",
    "RendezvousError",
    "ReplicaSet",
    "ReplicaValues",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "gather",
    "merge_outputs",
    "reduce_losses",
    "replicate",
    "revert_sync_batchnorm",
    "run_replicas",
    "scatter",
    "split_batch",
    "uses_sync_batchnorm",
]
