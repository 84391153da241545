"""Lasting replicas of a module run inside a LightningModule's step, with what Lightning needs per replica.

Each replica gets a ``log`` recorder on every LightningModule in it (a real ``self.log`` would race the others on the
trainer's results), its own device on Lightning's device mixin (``self.device`` in a step) and its own clone of every
torchmetrics metric; :meth:`LightningReplicas.merge_into` merges them back on the root, from the main thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from lightning_mgpu.parallel.replicas import ReplicaSet
from lightning_mgpu.parallel.run_replicas import ExecutionMode, run_replicas
from lightning_mgpu.strategies.namespace import LightningNamespace
from lightning_mgpu.strategies.replica_logging import LogRecorder, merge_and_log
from lightning_mgpu.strategies.replica_metrics import MetricReplicas

_PER_REPLICA = ("log", "_device", "forward")


class LightningReplicas:
    """Replicas of ``module`` on ``devices`` for steps of a LightningModule of ``namespace``."""

    def __init__(self, module: nn.Module, devices: Sequence[torch.device], namespace: LightningNamespace) -> None:
        self.module = module
        self.devices = list(devices)
        self._namespace = namespace
        self.recorders = [LogRecorder() for _ in self.devices]
        self.metrics = MetricReplicas()
        self.replica_set = ReplicaSet(
            module, self.devices, on_build=self._install, overrides=_PER_REPLICA, shared=lambda m: isinstance(m, Metric)
        )

    def _install(self, replicas: list[nn.Module]) -> None:
        root_device = self.devices[0]
        for replica, device, recorder in zip(replicas, self.devices, self.recorders, strict=True):
            replica.__dict__.pop("forward", None)  # dp's parallel forward belongs to the original only
            for sub in replica.modules():
                if isinstance(sub, self._namespace.lightning_module):
                    sub.log = recorder.log  # shadows LightningModule.log on this replica only
                if device != root_device and isinstance(sub, self._namespace.device_dtype_mixin):
                    sub._device = device
        self.metrics.install(self.module, replicas, self.devices)

    def run(self, count: int, call: Callable[[int, nn.Module], Any], mode: ExecutionMode) -> list[Any]:
        """``call(i, replica_i)`` for the first ``count`` replicas; a failed step leaves no recorded state behind."""
        replicas = self.replica_set.prepare(count, mode)
        try:
            outputs = run_replicas(
                [lambda i=i, r=r: call(i, r) for i, r in enumerate(replicas)], self.devices[:count], mode
            )
        except BaseException:
            self.discard()
            raise
        self.replica_set.watch(outputs)  # the backward pass through them reduces the replicas' gradients
        return outputs

    def discard(self) -> None:
        """Forget what the step in progress recorded (it failed)."""
        self.metrics.discard()
        for recorder in self.recorders:
            recorder.calls.clear()

    def merge_into(self, root: Any, sample_counts: Sequence[int], implied: Sequence[dict[int, Any]]) -> None:
        """Log every recorded name once on ``root`` and fold the metric clones into the root metrics (``implied``: per
        replica, the weights of logged losses, see ``SingleProcessParallel._run_replicated``)."""
        recorders = self.recorders[: len(sample_counts)]
        in_training = root._current_fx_name == "training_step"
        step_metrics = {
            id(owner)
            for recorder in recorders
            for logged in recorder.calls
            if (owner := self.metrics.owner_of(logged.value)) is not None
            and (in_training if logged.options.get("on_step") is None else logged.options["on_step"])
        }
        self.metrics.merge(step_metrics)
        merge_and_log(root, recorders, sample_counts, self.metrics.owner_of, implied)

    def release(self) -> None:
        self.metrics.clear()
        self.replica_set.release()
