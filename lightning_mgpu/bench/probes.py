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


class TransferProbe(L.Callback):
    """Bytes each training step would move between the root device and the others, under the single-process
    strategies (figures for distinct devices, whether or not the replicas share one).

    Counted from the strategy's ``replicated_call_observer``, which it calls after every replicated call with the
    module and the replicas' outputs: ``outputs``, what the other replicas send the root (``dp``: the gathered outputs;
    ``parallel_criterion``: losses and step outputs); ``parameters``, the parameters and buffers the root sends each
    of them; ``gradients``, what they send back (when the call ran with autograd). ``last`` holds the last training
    step's figures; it stays ``None`` for strategies without the observer (one device, ``ddp``).
    """

    def __init__(self) -> None:
        self.last: dict[str, int] | None = None
        self._step: dict[str, int] | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if hasattr(trainer.strategy, "replicated_call_observer"):
            trainer.strategy.replicated_call_observer = self._observe

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if getattr(trainer.strategy, "replicated_call_observer", None) == self._observe:
            trainer.strategy.replicated_call_observer = None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step = {"outputs": 0, "parameters": 0, "gradients": 0, "replicas": 1}

    def _observe(self, module: torch.nn.Module, outputs: Sequence[Any]) -> None:
        step = self._step
        if step is None:  # a replicated call outside a training step (validation, sanity check)
            return
        others = len(outputs) - 1
        state = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
        grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        step["outputs"] += sum(_tensor_bytes(o) for o in outputs[1:])
        step["parameters"] += others * state
        step["gradients"] += others * grads if torch.is_grad_enabled() else 0
        step["replicas"] = max(step["replicas"], len(outputs))

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, self._step = self._step, None
        if step is not None and step["replicas"] > 1:
            self.last = {**step, "total": step["outputs"] + step["parameters"] + step["gradients"]}


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
