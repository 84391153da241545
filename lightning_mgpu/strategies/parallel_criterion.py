"""``strategy="parallel_criterion"``: every device runs the whole ``*_step`` (forward **and** loss) on its shard.

Only one scalar loss per device reaches the root, where the losses are averaged with weights that make the result
equal to one device on the whole batch (sample counts by default; a step can return its own weights, see
:mod:`lightning_mgpu.strategies.step_outputs`). Outputs never pile up on the root device, which is what makes
``nn.DataParallel`` run out of memory on GPU 0 first.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mgpu.parallel.parallel_apply import ExecutionMode
from lightning_mgpu.parallel.reduce import LOSS_REDUCTIONS, LossReduction
from lightning_mgpu.parallel.scatter_gather import scatter
from lightning_mgpu.strategies.single_process import SingleProcessParallelStrategy
from lightning_mgpu.strategies.step_outputs import all_or_none, gather_step_outputs, reduce_training_outputs


class ParallelCriterionStrategy(SingleProcessParallelStrategy):
    """Data parallelism in one process with the loss computed on every device.

    Args:
        loss_reduction: ``"weighted"`` (default): losses weighted by sample count or the step's own weights, equal to
            one device on the whole batch; ``"mean"``: plain mean over replicas (Lightning 1.x ``dp``); ``"sum"``.
        dim: the batch dimension to split along.
        execution_mode: ``"auto"`` (threads on distinct GPUs, else sequential), ``"threads"`` or ``"sequential"``.

    The ``*_step`` methods run on replicas, so they must not rebind attributes of the module (such changes are lost
    with the replica); ``self.log`` and torchmetrics attributes are handled and give single-device values. Manual
    optimization is refused: every replica would step the optimizer. Use ``strategy="dp"`` for it.
    """

    strategy_name = "parallel_criterion"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        loss_reduction: LossReduction = "weighted",
        dim: int = 0,
        execution_mode: ExecutionMode = "auto",
    ) -> None:
        super().__init__(accelerator, parallel_devices, checkpoint_io, precision_plugin, dim, execution_mode)
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}.")
        self.loss_reduction: LossReduction = loss_reduction

    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.lightning_module.automatic_optimization:
            raise MisconfigurationException(
                "strategy='parallel_criterion' does not support manual optimization: training_step runs on every "
                "device, so each replica would step the optimizer. Use strategy='dp' (the step runs once, on the root "
                "device) or strategy='ddp'."
            )
        super().setup(trainer)

    def _parallel_step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[int]]:
        module = self.lightning_module
        batch, rest = args[0], args[1:]
        chunks, sizes = scatter(batch, self.parallel_devices, self.dim)
        devices = self.parallel_devices[: len(sizes)]

        def call(index: int, replica: Any) -> Any:
            return getattr(replica, hook)(chunks[index], *rest, **kwargs)

        return self._run_replicas(module, devices, sizes, call), sizes

    def _single_device(self) -> bool:
        return len(self.parallel_devices) == 1

    def _run_step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self._step_context(hook):
            if len(self.parallel_devices) == 1:
                return getattr(self.lightning_module, hook)(*args, **kwargs)
            outputs, sizes = self._parallel_step(hook, args, kwargs)
        if all_or_none(outputs, hook):
            return None
        if hook == "training_step":
            return reduce_training_outputs(outputs, sizes, self.root_device, self.loss_reduction, self.dim)
        return gather_step_outputs(outputs, sizes, self.root_device, self.dim)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="One process, N devices: forward and loss on every device, weighted losses reduced on root",
            )
