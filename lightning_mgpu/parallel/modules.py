"""``DataParallelModel`` + ``DataParallelCriterion``: data parallelism that keeps outputs and losses on every device.

``nn.DataParallel`` gathers every replica's output on one device and computes the loss there, so that device runs
out of memory first (an MLM head's ``batch x seq x vocab`` logits, a segmentation map). Here the model returns the
per-device outputs ungathered, the criterion scatters the targets the same way, computes the loss on each device and
moves only one scalar per device to the root, weighted so the result equals the criterion on the whole batch::

    model = DataParallelModel(net.to("cuda:0"), device_ids=[0, 1, 2, 3])
    criterion = DataParallelCriterion(nn.CrossEntropyLoss(), device_ids=[0, 1, 2, 3])
    outputs = model(images)                 # list: one output per device, each still on its device
    loss = criterion(outputs, labels)       # scalar on cuda:0, equal to CrossEntropyLoss on the whole batch
    loss.backward()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mgpu.parallel.devices import DeviceLike, check_module_on, module_device, resolve_devices
from lightning_mgpu.parallel.parallel_apply import ExecutionMode, parallel_apply, resolve_mode
from lightning_mgpu.parallel.reduce import reduce_losses
from lightning_mgpu.parallel.replicate import replicate
from lightning_mgpu.parallel.scatter_gather import (
    BatchSplitError,
    batch_size_of,
    gather,
    iter_tensors,
    move_to,
    scatter_args,
)

WeightFn = Callable[[Any, tuple[Any, ...]], float | int | Tensor]


class DataParallelModel(nn.Module):
    """Run ``module`` on chunks of the batch on several devices; return the per-device outputs, not gathered.

    Args:
        module: the model, with its parameters on ``device_ids[0]`` (the root, where gradients accumulate).
        device_ids: devices as ints (CUDA indices), strings or ``torch.device``; repeats are allowed ("virtual
            devices", e.g. ``["cpu"] * 4``). ``None``: every visible CUDA device, or the module's device without CUDA.
        output_device: where :meth:`gather` puts outputs; default ``device_ids[0]``.
        dim: the batch dimension of inputs and outputs.
        mode: ``"auto"`` (threads on GPUs, sequential on CPUs), ``"threads"`` or ``"sequential"``.

    Any output type works: tensor, tuple, list, dict, dataclass, ``transformers`` ``ModelOutput``. With one device the
    module is called directly (no scatter, no replica). After each call, :attr:`last_split_sizes` holds the number of
    samples each replica received.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        mode: ExecutionMode = "auto",
    ) -> None:
        super().__init__()
        self.module = module
        self.device_ids = resolve_devices(device_ids, fallback=module_device(module))
        self.output_device = resolve_devices([output_device])[0] if output_device is not None else self.device_ids[0]
        self.dim = dim
        self.mode = resolve_mode(mode, self.device_ids)
        self.last_split_sizes: tuple[int, ...] = ()
        check_module_on(module, self.device_ids[0])

    def forward(self, *inputs: Any, **kwargs: Any) -> list[Any]:
        if len(self.device_ids) == 1:
            self.last_split_sizes = (_safe_batch_size((inputs, kwargs), self.dim),)
            return [self.module(*inputs, **kwargs)]
        args_chunks, kwargs_chunks, sizes = scatter_args(inputs, kwargs, self.device_ids, self.dim)
        self.last_split_sizes = tuple(sizes)
        used = self.device_ids[: len(sizes)]
        replicas = replicate(self.module, used, detach=not torch.is_grad_enabled())
        calls = [
            (lambda r=r, a=a, k=k: r(*a, **k)) for r, a, k in zip(replicas, args_chunks, kwargs_chunks, strict=True)
        ]
        return parallel_apply(calls, used, self.mode)

    def gather(self, outputs: Sequence[Any]) -> Any:
        """Concatenate per-device outputs on ``output_device`` (for metrics, logging, visualisation)."""
        return gather(outputs, self.output_device, self.dim)


def _safe_batch_size(obj: Any, dim: int) -> int:
    try:
        return batch_size_of(obj, dim)
    except BatchSplitError:
        return 0


def _count_weight(criterion: nn.Module, output: Any, targets: tuple[Any, ...], dim: int) -> float | Tensor:
    """How many items this replica's mean loss averages over, so the weighted mean equals the whole-batch mean.

    Class-index targets of a criterion with ``ignore_index`` (CrossEntropyLoss, NLLLoss) count non-ignored targets,
    each weighted by its class ``weight`` when the criterion has one (that is torch's own normaliser). Anything else
    counts samples along ``dim``; with a fixed per-sample shape this is proportional to the element count that
    element-wise losses (MSE, BCE...) average over.
    """
    target = targets[0] if targets else None
    ignore_index = getattr(criterion, "ignore_index", None)
    if isinstance(target, Tensor) and ignore_index is not None and not target.is_floating_point():
        valid = target != ignore_index
        class_weight = getattr(criterion, "weight", None)
        if isinstance(class_weight, Tensor):
            return class_weight.to(target.device)[target[valid]].sum()
        return valid.sum()
    return batch_size_of((output, targets), dim, path="criterion inputs")


class DataParallelCriterion(nn.Module):
    """Compute ``criterion`` on every device from :class:`DataParallelModel`'s per-device outputs.

    Call it as ``criterion(outputs, *targets, **kwargs)`` with the *whole* targets: they are scattered exactly as the
    inputs were. A plain-tuple output is unpacked into positional arguments (so ``(anchor, positive, negative)``
    feeds a ``TripletMarginLoss``); other outputs are passed as one argument.

    The per-device losses are reduced on the root device (``device_ids[0]``) according to ``criterion.reduction``:
    ``"mean"`` (default): weighted by per-device counts (:func:`_count_weight`), equal to the whole-batch value;
    ``"sum"``: summed; ``"none"``: per-sample losses concatenated on the root. ``weight_fn(output, targets)``
    overrides the count for criteria whose normaliser is something else.
    """

    def __init__(
        self,
        criterion: nn.Module | Callable[..., Tensor],
        device_ids: Sequence[DeviceLike] | None = None,
        dim: int = 0,
        mode: ExecutionMode = "auto",
        weight_fn: WeightFn | None = None,
    ) -> None:
        super().__init__()
        if not callable(criterion):
            raise TypeError(f"criterion must be callable (an nn.Module or a function), got {type(criterion).__name__}.")
        self.criterion = criterion
        fallback = module_device(criterion) if isinstance(criterion, nn.Module) else None
        self.device_ids = resolve_devices(device_ids, fallback=fallback)
        self.dim = dim
        self.mode = resolve_mode(mode, self.device_ids)
        self.weight_fn = weight_fn

    @property
    def reduction(self) -> str:
        return getattr(self.criterion, "reduction", "mean")

    def forward(self, outputs: Sequence[Any], *targets: Any, **kwargs: Any) -> Tensor:
        if not isinstance(outputs, (list, tuple)) or (isinstance(outputs, tuple) and hasattr(outputs, "_fields")):
            raise TypeError(
                "DataParallelCriterion expects the list of per-device outputs returned by DataParallelModel, got "
                f"{type(outputs).__name__}. For one gathered output, call the criterion itself."
            )
        if not outputs:
            raise ValueError("DataParallelCriterion got an empty list of outputs.")
        if len(outputs) > len(self.device_ids):
            raise ValueError(
                f"Got outputs from {len(outputs)} devices but the criterion has {len(self.device_ids)} device_ids; "
                "use the same device_ids for DataParallelModel and DataParallelCriterion."
            )
        devices = [_output_device(o, d) for o, d in zip(outputs, self.device_ids, strict=False)]
        if len(outputs) == 1:
            target_chunks, kwargs_chunks = [move_to(targets, devices[0])], [move_to(kwargs, devices[0])]
        else:
            target_chunks, kwargs_chunks, _ = scatter_args(targets, kwargs, devices, self.dim)
            if len(target_chunks) != len(outputs):
                raise ValueError(
                    f"The targets split into {len(target_chunks)} chunks but there are {len(outputs)} outputs: "
                    "the targets' batch size does not match the inputs given to DataParallelModel."
                )
        for i, (output, chunk) in enumerate(zip(outputs, target_chunks, strict=True)):
            _check_aligned(output, chunk, i, self.dim)

        criterion = self.criterion
        if isinstance(criterion, nn.Module) and len(outputs) > 1:
            replicas: Sequence[Any] = replicate(criterion, devices, detach=not torch.is_grad_enabled())
        else:
            replicas = [criterion] * len(outputs)
        calls = [
            (lambda c=c, o=o, t=t, k=k: c(*_as_args(o), *t, **k))
            for c, o, t, k in zip(replicas, outputs, target_chunks, kwargs_chunks, strict=True)
        ]
        losses = parallel_apply(calls, devices, self.mode) if len(calls) > 1 else [calls[0]()]
        root = self.device_ids[0]
        if self.reduction == "none":
            return gather(losses, root, self.dim)
        if self.reduction == "sum":
            return reduce_losses(losses, device=root, reduction="sum")
        weigh = self.weight_fn or (lambda o, t: _count_weight(criterion, o, t, self.dim))  # type: ignore[arg-type]
        weights = [weigh(o, t) for o, t in zip(outputs, target_chunks, strict=True)]
        return reduce_losses(losses, weights, device=root, reduction="weighted")


def _as_args(output: Any) -> tuple[Any, ...]:
    if isinstance(output, tuple) and not hasattr(output, "_fields"):
        return output
    return (output,)


def _output_device(output: Any, default: torch.device) -> torch.device:
    for _, tensor in iter_tensors(output):
        return tensor.device
    return default


def _check_aligned(output: Any, targets: tuple[Any, ...], index: int, dim: int) -> None:
    out_size = _safe_batch_size(output, dim)
    target_size = _safe_batch_size(targets, dim)
    if out_size and target_size and out_size != target_size:
        raise ValueError(
            f"Outputs and targets do not line up on device {index}: the output has {out_size} samples along dim {dim} "
            f"but its targets have {target_size}. The targets must have the same batch size as the model's inputs."
        )
