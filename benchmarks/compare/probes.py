"""What the benchmark worker attaches to the Trainer to measure one strategy.

Throughput (samples/s, tokens/s, FLOP/s) comes from Lightning's ``ThroughputMonitor``, fed by the functions here and
read back through :class:`MetricsRecorder`; peak memory from :class:`~lightning_mgpu.callbacks.DeviceMemoryMonitor`.
The probes below add what neither measures: per-batch wall time synchronised on every device, the bytes a step moves
to and from the root device, and FLOPs per batch for modules that do not declare ``flops_per_batch``.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as L
import torch
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.loggers import Logger
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_mgpu.callbacks.device_memory import distinct_devices, strategy_devices
from lightning_mgpu.parallel.scatter_gather import batch_size_of, split_batch

TOKEN_KEYS = ("attention_mask", "input_ids")


def batch_size_fn(batch: Any) -> int:
    """Samples in a batch: the shared size of its tensors' first dimension (any nesting of tuples/dicts)."""
    return batch_size_of(batch, 0)


def token_count_fn(batch: Any) -> int:
    """Tokens in a batch: non-padding positions (``attention_mask`` sum), else ``input_ids`` elements, else 0.

    ``ThroughputMonitor`` needs at least one item per sample when it is given a ``length_fn``, so a batch without
    tokens counts one per sample; :func:`has_tokens` tells the worker whether the figure means anything.
    """
    if isinstance(batch, Mapping):
        if isinstance(batch.get("attention_mask"), torch.Tensor):
            return int(batch["attention_mask"].sum())
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return int(batch["input_ids"].numel())
    return batch_size_fn(batch)


def has_tokens(batch: Any) -> bool:
    """Whether :func:`token_count_fn` counts tokens (not samples) for this batch."""
    return isinstance(batch, Mapping) and any(isinstance(batch.get(k), torch.Tensor) for k in TOKEN_KEYS)


def _synchronize(devices: Sequence[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class StepTimer(L.Callback):
    """Wall time of every training batch, from ``on_train_batch_start`` to ``on_train_batch_end``.

    Every CUDA device the strategy uses is synchronised at both ends (a replica's work on another GPU is part of the
    step). The times include forward, loss, backward and the optimizer step; the gap between batches (data loading)
    is not included: throughput (from ``ThroughputMonitor``) includes it.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.devices: list[torch.device] = []
        self._start = 0.0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.devices = distinct_devices(strategy_devices(trainer))

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        _synchronize(self.devices)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        _synchronize(self.devices)
        self.times.append(time.perf_counter() - self._start)


def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in ``obj`` (any nesting of lists, tuples, dicts, dataclasses)."""
    sizes: list[int] = []
    apply_to_collection(obj, torch.Tensor, lambda t: sizes.append(t.numel() * t.element_size()))
    return sum(sizes)


def _sent_by_other_replicas(merged: Any, others: int, share: float) -> int:
    """Bytes the other replicas sent for a merged output: each its own copy of a 0-dim value (a loss), and ``share``
    of every tensor with a batch dimension."""
    sizes: list[float] = []
    apply_to_collection(
        merged, torch.Tensor, lambda t: sizes.append(t.element_size() * (others if t.dim() == 0 else t.numel() * share))
    )
    return round(sum(sizes))


class TransferProbe(L.Callback):
    """Bytes each training step would move between the root device and the others under the single-process
    strategies (figures for distinct devices, whether or not the replicas share one), from public hooks only.

    With N replicas of which the root holds the first shard: ``parameters``, the module's parameters and buffers the
    root sends each other replica; ``gradients``, what they send back; ``outputs``, what the other replicas send the
    root: under ``dp`` the share of the replicated forward's (gathered) outputs that the other shards make up, under
    ``parallel_criterion`` that share of the step's merged outputs (losses and extras). ``last`` holds the last
    training step's figures; it stays ``None`` for one device and for multi-process strategies.
    """

    def __init__(self) -> None:
        self.last: dict[str, int] | None = None
        self._forward_bytes = 0
        self._hook: Any = None
        self._root: torch.nn.Module | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The root module's own calls only (replicas share its hooks): a dp step's self(...) returns the outputs
        # gathered from every replica.
        self._root = pl_module
        self._hook = pl_module.register_forward_hook(self._count_forward)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _count_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if module is self._root:
            self._forward_bytes += _sent_by_other_replicas(output, 0, 1.0)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._forward_bytes = 0

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        devices = getattr(trainer.strategy, "parallel_devices", None) or []
        if trainer.world_size > 1 or len(devices) < 2:
            return
        samples = batch_size_fn(batch)
        replicas = min(len(devices), samples)
        if replicas < 2:
            return
        others = replicas - 1
        share = 1 - -(-samples // replicas) / samples  # what the shards after the root's first one make up
        if trainer.strategy.strategy_name == "dp":
            sent = round(self._forward_bytes * share)
        else:
            sent = _sent_by_other_replicas(outputs, others, share)
        state = sum(t.numel() * t.element_size() for t in (*pl_module.parameters(), *pl_module.buffers()))
        grads = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
        step = {"outputs": sent, "parameters": others * state, "gradients": others * grads}
        self.last = {**step, "replicas": replicas, "total": sum(step.values())}


class BatchProbe(L.Callback):
    """Samples and tokens in the last training batch (as this process saw it)."""

    def __init__(self) -> None:
        self.samples = 0
        self.tokens: int | None = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples = batch_size_fn(batch)
        self.tokens = token_count_fn(batch) if has_tokens(batch) else None


def measure_step_flops(module: L.LightningModule, batch: Any, samples: int = 2) -> int:
    """FLOPs of one training step (forward, loss, backward) on ``batch``, estimated from its first ``samples``.

    The step runs once on a deep copy of the module (its metrics and state are not touched) with
    ``torch.utils.flop_counter`` via Lightning's ``measure_flops``, and the count is scaled by batch size / ``samples``:
    exact for models whose work is linear in the batch (convolutions, dense layers, attention over fixed-length
    sequences), an estimate otherwise (e.g. a loss over a random number of masked tokens).
    """
    size = batch_size_fn(batch)
    take = max(1, min(samples, size))
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    head = batch if take == size else split_batch(batch, [device, device], sizes=[take, size - take])[0][0]
    clone = copy.deepcopy(module)  # ``_trainer`` is dropped by LightningModule.__getstate__

    def step() -> Any:
        return clone.training_step(head, 0)

    def loss_of(output: Any) -> torch.Tensor:
        loss = output["loss"] if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"training_step returned {type(output).__name__}, not a loss to differentiate")
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ``self.log`` without a Trainer warns on every call
        flops = measure_flops(clone, step, loss_of)
    return round(flops * size / take)


class FlopsProbe(L.Callback):
    """Set ``pl_module.flops_per_batch`` (read by ``ThroughputMonitor``) before the first training batch.

    A module that already defines ``flops_per_batch`` keeps its own figure. Otherwise :func:`measure_step_flops` runs
    on the first batch; if that fails (a step that needs the Trainer, say) FLOP/s are left out and ``error`` says why.
    Runs before anything is timed; call ``after`` (e.g. resetting memory peaks) once it is done.
    """

    def __init__(self, enabled: bool = True, after: Any = None) -> None:
        self.enabled = enabled
        self.after = after
        self.flops: int | None = None
        self.source: str | None = None
        self.error: str | None = None
        self._done = False

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._done:
            return
        self._done = True
        if hasattr(pl_module, "flops_per_batch"):
            self.flops, self.source = pl_module.flops_per_batch, "module.flops_per_batch"
        elif self.enabled:
            try:
                self.flops = measure_step_flops(pl_module, batch)
                self.source = "measure_flops on 2 samples, scaled to the batch"
                pl_module.flops_per_batch = self.flops
            except Exception as err:  # FLOPs are a nice-to-have: never fail the run for them
                self.error = f"{type(err).__name__}: {err}"
        if self.after is not None:
            self.after()


class MetricsRecorder(Logger):
    """A logger that keeps every logged metric in memory (what ``ThroughputMonitor`` computes ends up here)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "bench"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.history.append((step, {k: float(v) for k, v in metrics.items()}))

    def latest(self, key: str) -> float | None:
        """The last value logged under ``key``."""
        for _, metrics in reversed(self.history):
            if key in metrics:
                return metrics[key]
        return None
