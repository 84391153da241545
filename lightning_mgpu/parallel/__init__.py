"""Pure-PyTorch data-parallel core (never imports Lightning).

Works on distinct CUDA devices, on one device repeated ("virtual devices") and on CPUs, which torch's own
``torch.nn.parallel`` helpers refuse.
"""

from lightning_mgpu.parallel.devices import resolve_devices
from lightning_mgpu.parallel.gather import ReplicaValues, gather
from lightning_mgpu.parallel.modules import DataParallelCriterion, DataParallelModel
from lightning_mgpu.parallel.parallel_apply import parallel_apply
from lightning_mgpu.parallel.reduce import reduce_losses
from lightning_mgpu.parallel.replica_group import PeerFailedError, RendezvousError
from lightning_mgpu.parallel.replicas import ReplicaSet, replicate
from lightning_mgpu.parallel.scatter_gather import (
    BatchSplitError,
    NothingToSplitError,
    PerSample,
    batch_size_of,
    move_to,
    scatter,
    scatter_args,
    split_sizes,
)
from lightning_mgpu.parallel.sync_batchnorm import (
    SyncBatchNorm,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
    uses_sync_batchnorm,
)
from lightning_mgpu.parallel.thread_state import ThreadState

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
    "ThreadState",
    "batch_size_of",
    "convert_sync_batchnorm",
    "gather",
    "move_to",
    "parallel_apply",
    "reduce_losses",
    "replicate",
    "resolve_devices",
    "revert_sync_batchnorm",
    "scatter",
    "scatter_args",
    "split_sizes",
    "uses_sync_batchnorm",
]
