"""Pure-PyTorch data-parallel core (never imports Lightning).

Works on distinct CUDA devices, on one device repeated ("virtual devices") and on CPUs, which torch's own
``torch.nn.parallel`` helpers refuse.
"""

from lightning_mgpu.parallel.devices import resolve_devices
from lightning_mgpu.parallel.modules import DataParallelCriterion, DataParallelModel
from lightning_mgpu.parallel.parallel_apply import ReplicaError, ThreadState, parallel_apply
from lightning_mgpu.parallel.reduce import reduce_losses
from lightning_mgpu.parallel.replicate import replicate
from lightning_mgpu.parallel.scatter_gather import (
    BatchSplitError,
    NothingToSplitError,
    PerSample,
    batch_size_of,
    gather,
    move_to,
    scatter,
    scatter_args,
    split_sizes,
)

__all__ = [
    "BatchSplitError",
    "DataParallelCriterion",
    "DataParallelModel",
    "NothingToSplitError",
    "PerSample",
    "ReplicaError",
    "ThreadState",
    "batch_size_of",
    "gather",
    "move_to",
    "parallel_apply",
    "reduce_losses",
    "replicate",
    "resolve_devices",
    "scatter",
    "scatter_args",
    "split_sizes",
]
