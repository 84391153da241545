"""Shared base of the single-process multi-device strategies: one process drives every device.

Ranks are 0 and ``world_size`` is 1, so Lightning injects no ``DistributedSampler`` and ``sync_dist`` is a no-op; the
master weights and the optimizer state live on the root device (``parallel_devices[0]``). The LightningModule is
stored unwrapped, so checkpoints carry no ``module.`` prefix and move freely between strategies and device counts.

This class also owns the replica lifecycle the two strategies share: replicate the module for the devices a batch
uses, give each replica its device, a ``log`` recorder and per-device metric clones, run them, then merge logs and
metrics back on the root from the main thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_mgpu.parallel.parallel_apply import EXECUTION_MODES, ExecutionMode, parallel_apply
from lightning_mgpu.parallel.replicate import replicate
from lightning_mgpu.parallel.scatter_gather import iter_tensors
from lightning_mgpu.strategies.replica_logging import LogRecorder, merge_and_log
from lightning_mgpu.strategies.replica_metrics import MetricReplicas
from lightning_mgpu.strategies.step_outputs import loss_weights_by_tensor


@dataclass
class StepTransfer:
    """Bytes one step sends between the root and the other replicas, as on distinct devices.

    ``outputs``: what replicas other than the root send it (``dp``: the gathered outputs; ``parallel_criterion``:
    losses and step outputs). ``parameters``: parameters and buffers broadcast to those replicas. ``gradients``: their
    gradients reduced back onto the root (training only). With virtual devices nothing crosses a bus, but the figures
    are what distinct devices would move. Parameter and gradient bytes are computed when read, not on every step.
    """

    outputs: int = 0
    replicas: int = 1
    _replications: list[tuple[nn.Module, int, bool]] = field(default_factory=list, repr=False)

    def add(self, module: nn.Module, outputs: Sequence[Any]) -> None:
        """Record one replicated call of ``module`` that returned ``outputs`` (one per replica)."""
        self.outputs += sum(_nbytes(o) for o in outputs[1:])
        self._replications.append((module, len(outputs) - 1, torch.is_grad_enabled()))
        self.replicas = max(self.replicas, len(outputs))

    @property
    def parameters(self) -> int:
        return sum(
            others * sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
            for module, others, _ in self._replications
        )

    @property
    def gradients(self) -> int:
        return sum(
            others * sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
            for module, others, with_grad in self._replications
            if with_grad
        )

    @property
    def total(self) -> int:
        return self.outputs + self.parameters + self.gradients


def _public_list_lengths(module: nn.Module) -> dict[str, int]:
    return {name: len(value) for name, value in vars(module).items() if isinstance(value, list) and name[0] != "_"}


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(obj))


class SingleProcessParallelStrategy(ParallelStrategy):
    """Base for strategies that run replicas of the model on several devices from one process."""

    strategy_name: str = ""

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        dim: int = 0,
        execution_mode: ExecutionMode = "auto",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if execution_mode not in EXECUTION_MODES:
            raise ValueError(f"execution_mode must be one of {EXECUTION_MODES}, got {execution_mode!r}.")
        self.dim = dim
        self.execution_mode: ExecutionMode = execution_mode
        self._metric_replicas = MetricReplicas()
        self._warned_lists: set[str] = set()
        self.step_transfer = StepTransfer()

    # --- one process: constant ranks, collectives are identities -----------------------------------------------------
    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_distributed(self) -> bool:
        return False

    @property
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError(f"{type(self).__name__} has no devices yet; it gets them when the Trainer is built.")
        return self.parallel_devices[0]

    @property
    def distributed_sampler_kwargs(self) -> None:
        return None

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def barrier(self, name: str | None = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    # --- set-up checks -----------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer) -> None:
        if self._layer_sync is not None:
            raise MisconfigurationException(
                f"sync_batchnorm=True cannot work with strategy={self.strategy_name!r}: SyncBatchNorm needs one "
                "process per device. Remove it, or use strategy='ddp' to synchronise BatchNorm statistics."
            )
        super().setup(trainer)

    def teardown(self) -> None:
        self._metric_replicas.clear()
        super().teardown()

    # --- replica lifecycle -------------------------------------------------------------------------------------------
    def _make_replicas(self, module: nn.Module, devices: Sequence[torch.device]) -> tuple[list[nn.Module], list]:
        """Replicas of ``module`` with their device set, a log recorder each and per-device metric clones."""
        replicas = replicate(module, devices, detach=not torch.is_grad_enabled())
        recorders = []
        for replica, device in zip(replicas, devices, strict=True):
            replica.__dict__.pop("forward", None)  # a patched forward (dp) must not be copied into replicas
            recorder = LogRecorder()
            for sub in replica.modules():
                if isinstance(sub, LightningModule):
                    sub.log = recorder.log  # instance attribute: shadows LightningModule.log on this replica only
                if device != self.root_device and isinstance(sub, _DeviceDtypeModuleMixin):
                    sub._device = device
            recorders.append(recorder)
        self._metric_replicas.install(module, replicas, devices)
        return replicas, recorders

    def _run_replicas(
        self,
        module: nn.Module,
        devices: Sequence[torch.device],
        sample_counts: Sequence[int],
        call: Callable[[int, nn.Module], Any],
    ) -> list[Any]:
        """Run ``call(i, replica_i)`` for every device, then merge logs and metrics into ``self.lightning_module``."""
        replicas, recorders = self._make_replicas(module, devices)
        list_lengths = _public_list_lengths(module)
        try:
            outputs = parallel_apply(
                [lambda i=i, r=r: call(i, r) for i, r in enumerate(replicas)], devices, self.execution_mode
            )
        except BaseException:
            self._metric_replicas.discard()
            raise
        self._merge_replica_state(recorders, sample_counts, [loss_weights_by_tensor(o) for o in outputs])
        self.step_transfer.add(module, outputs)
        self._warn_on_grown_lists(module, list_lengths, len(replicas))
        return outputs

    def _warn_on_grown_lists(self, module: nn.Module, before: dict[str, int], n_replicas: int) -> None:
        """Warn (once per attribute) when a replicated step appended to a list attribute of the module."""
        for name, length in _public_list_lengths(module).items():
            if length > before.get(name, length) and name not in self._warned_lists:
                self._warned_lists.add(name)
                rank_zero_warn(
                    f"`{type(module).__name__}.{name}` grew during a step that ran on {n_replicas} replicas: each "
                    "appended its own shard's value, so the list holds one entry per device per step, in no fixed "
                    "order under threads. Collect step outputs in `on_train_batch_end` / `on_validation_batch_end` "
                    "(they receive the gathered outputs, once, on the root) or use a torchmetrics metric."
                )

    def _merge_replica_state(
        self, recorders: Sequence[LogRecorder], sample_counts: Sequence[int], implied_weights: Sequence[dict[int, Any]]
    ) -> None:
        in_training = self.lightning_module._current_fx_name == "training_step"
        step_metrics = {
            id(owner)
            for rec in recorders
            for call in rec.calls
            if (owner := self._metric_replicas.owner_of(call.value)) is not None
            and (in_training if call.options.get("on_step") is None else call.options["on_step"])
        }
        self._metric_replicas.merge(step_metrics)
        merge_and_log(self.lightning_module, recorders, sample_counts, self._metric_replicas.owner_of, implied_weights)

    # --- the four step hooks Lightning calls on the strategy ------------------------------------------------------
    def _run_step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``hook`` (e.g. ``"training_step"``) the way this strategy spreads it over devices."""
        raise NotImplementedError

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("training_step", args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("predict_step", args, kwargs)

    @contextmanager
    def _step_context(self, hook: str):
        ctx = {
            "training_step": self.precision_plugin.train_step_context,
            "validation_step": self.precision_plugin.val_step_context,
            "test_step": self.precision_plugin.test_step_context,
            "predict_step": self.precision_plugin.predict_step_context,
        }[hook]
        self.step_transfer = StepTransfer()
        with ctx():
            yield
