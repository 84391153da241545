"""Turn a benchmark strategy name and a device plan into ``Trainer`` arguments.

Names: ``single`` (one device, Lightning's default strategy), ``parallel_criterion``, ``dp`` / ``data_parallel``
(this package, one process driving every replica), ``ddp`` (Lightning's, one process per replica). Any other name is
handed to Lightning as ``strategy=<name>`` with ``devices=N``, so a name Lightning does not know fails in that
strategy's row of the report, not in the benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.compare.devices import DevicePlan

SINGLE_PROCESS = {
    "parallel_criterion": "ParallelCriterionStrategy",
    "dp": "DataParallelStrategy",
    "data_parallel": "DataParallelStrategy",
}


@dataclass
class StrategySetup:
    """``Trainer`` keyword arguments for one strategy, and what the benchmark must know about it."""

    trainer_kwargs: dict[str, Any]
    kind: str  # "single" | "single-process" | "multi-process" | "other"
    devices: list[str]  # the devices its replicas run on
    world_size: int


def _gpu_indices(devices: list[str]) -> list[int]:
    return sorted({torch.device(d).index for d in devices})


def strategy_setup(name: str, plan: DevicePlan) -> StrategySetup:
    """How to run strategy ``name`` on ``plan`` (see the module docstring)."""
    import lightning_mgpu

    devices = list(plan.devices)
    n, gpu = len(devices), plan.accelerator == "gpu"
    if name == "single":
        return StrategySetup(
            {"accelerator": plan.accelerator, "devices": _gpu_indices(devices[:1]) if gpu else 1, "strategy": "auto"},
            "single",
            devices[:1],
            1,
        )
    if name in SINGLE_PROCESS:
        cls = getattr(lightning_mgpu, SINGLE_PROCESS[name])
        strategy = cls(parallel_devices=[torch.device(d) for d in devices])
        return StrategySetup(
            {"accelerator": plan.accelerator, "devices": _gpu_indices(devices) if gpu else 1, "strategy": strategy},
            "single-process",
            devices,
            1,
        )
    if name == "ddp":
        if gpu and plan.virtual:
            # NCCL refuses two ranks on one GPU; gloo all-reduces CUDA tensors through the host and accepts it.
            from lightning.pytorch.strategies import DDPStrategy

            strategy = DDPStrategy(parallel_devices=[torch.device(d) for d in devices], process_group_backend="gloo")
            kwargs = {"accelerator": "gpu", "devices": _gpu_indices(devices), "strategy": strategy}
        else:
            kwargs = {
                "accelerator": plan.accelerator,
                "devices": _gpu_indices(devices) if gpu else n,
                "strategy": "ddp",
            }
        return StrategySetup(kwargs, "multi-process", devices, n)
    return StrategySetup({"accelerator": plan.accelerator, "devices": n, "strategy": name}, "other", devices, n)
