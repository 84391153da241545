"""lightning-mgpu: single-process multi-GPU training for PyTorch Lightning 2.

``import lightning_mgpu`` registers ``strategy="parallel_criterion"`` and ``strategy="dp"`` (alias
``"data_parallel"``) with Lightning, so ``Trainer(strategy="parallel_criterion", accelerator="gpu", devices=4)`` works.
The pure-PyTorch :class:`DataParallelModel` / :class:`DataParallelCriterion` are here too.
"""

from lightning_mgpu.parallel import (
    DataParallelCriterion,
    DataParallelModel,
    PerSample,
    gather,
    parallel_apply,
    reduce_losses,
    replicate,
    scatter,
)
from lightning_mgpu.strategies import (
    LOSS_TERMS_KEY,
    LOSS_WEIGHT_KEY,
    DataParallelStrategy,
    ParallelCriterionStrategy,
    register_strategies,
)

__version__ = "0.1.0"

register_strategies()

__all__ = [
    "LOSS_TERMS_KEY",
    "LOSS_WEIGHT_KEY",
    "DataParallelCriterion",
    "DataParallelModel",
    "DataParallelStrategy",
    "ParallelCriterionStrategy",
    "PerSample",
    "__version__",
    "gather",
    "parallel_apply",
    "reduce_losses",
    "register_strategies",
    "replicate",
    "scatter",
]
