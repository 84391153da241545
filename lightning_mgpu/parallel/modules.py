"""``DataParallelModel`` + ``DataParallelCriterion``: outputs and losses stay on their devices (``nn.DataParallel``
gathers every output on one device, which runs out of memory first); only one scalar loss per device moves to the
root, weighted so that the result equals the criterion on the whole batch."""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mgpu.parallel.compiled import is_compiled
from lightning_mgpu.parallel.devices import DeviceLike, check_module_on, module_device, resolve_devices, to_device
from lightning_mgpu.parallel.loss_calls import LossCalls, combine_by_record
from lightning_mgpu.parallel.merge import merge_outputs
from lightning_mgpu.parallel.reduce import reduce_losses
from lightning_mgpu.parallel.replicas import ReplicaCache, ReplicaSet
from lightning_mgpu.parallel.run_replicas import ExecutionMode, add_note, resolve_mode, run_replicas
from lightning_mgpu.parallel.scatter_gather import (
    BatchSplitError,
    NothingToSplitError,
    agreed_size,
    argument_roots,
    is_namedtuple,
    iter_tensors,
    move_to,
    split_arguments,
    split_or_run_once,
)

WeightFn = Callable[[Any, tuple[Any, ...]], float | int | Tensor]
#: Keywords of torch's loss functions that hold one value per class, not per sample: they go whole to every device.
_PER_CLASS = ((F.cross_entropy, "weight"), (F.nll_loss, "weight"), (F.binary_cross_entropy_with_logits, "pos_weight"))


def say_split_sensitive_layers(module: nn.Module, who: str) -> None:
    """Warn that ``module``'s results can differ from one device's, naming its layers whose result depends on how the
    batch is split: embeddings that scale gradients by token frequencies or renormalise looked-up rows in place."""
    layers = []
    for name, sub in module.named_modules():
        if not isinstance(sub, (nn.Embedding, nn.EmbeddingBag)):
            continue
        name = name or type(sub).__name__
        if sub.scale_grad_by_freq:
            layers.append(
                f"{name} (scale_grad_by_freq=True) scales its gradient by each device's token frequencies, not the "
                "whole batch's"
            )
        if sub.max_norm is not None:
            layers.append(
                f"{name} (max_norm={sub.max_norm}) renormalises the rows it looks up in place during forward: rows "
                "renormalised on devices other than the first are lost, and a weight tied to another layer is read by "
                "each replica before or after the others' renormalisation"
            )
    if layers:
        warnings.warn(
            f"{who}: {'; '.join(layers)}, so results can differ from one device's. Without that option the layer "
            "trains as on one device.",
            UserWarning,
            stacklevel=3,
        )


class _Replicated(nn.Module):
    """What both modules share: their devices, batch dimension, execution mode, lasting replicas and run path."""

    def __init__(self, devices: list[torch.device], dim: int, execution_mode: ExecutionMode) -> None:
        super().__init__()
        self.device_ids = devices
        self.dim = dim
        resolve_mode(execution_mode, devices)  # checks the value
        self.execution_mode: ExecutionMode = execution_mode
        self._replicas: ReplicaCache[ReplicaSet] = ReplicaCache(ReplicaSet)
        self._said: set[str] = set()  # overrides of the execution mode, warned once each

    def _run(
        self, module: Any, devices: list[torch.device], count: int, replicate: bool, call: Callable[[Any, int], Any]
    ) -> list[Any]:
        """``call(replica, i)`` on the first ``count`` devices, with lasting replicas of ``module`` where ``replicate``
        (else ``module`` itself: stateless, safe to call from threads), the outputs watched so that backward reduces
        the replicas' gradients. A failed run ends at once, keeping what replica 0 rebound (its hooks are global)."""
        # A compiled module runs one replica after another: Dynamo is not thread-safe.
        mode: ExecutionMode = "sequential" if is_compiled(module) else self.execution_mode
        replica_set, replicas = None, [module] * count
        if replicate:
            replica_set = self._replicas.of(module, devices)
            mode, reason = replica_set.execution_mode(self.execution_mode, count)
            if reason is not None and self.execution_mode != "auto" and reason not in self._said:  # once, as chosen
                self._said.add(reason)
                message = f"{type(self).__name__}: execution_mode={self.execution_mode!r} overridden: {reason}."
                warnings.warn(message, UserWarning, stacklevel=3)
            replicas = replica_set.prepare(count)
        calls, outputs = [functools.partial(call, r, i) for i, r in enumerate(replicas)], []
        try:
            outputs = run_replicas(calls, devices[:count], mode)
        finally:
            if replica_set is not None:
                replica_set.watch(outputs)
        return outputs


class DataParallelModel(_Replicated):
    """Run ``module`` (its parameters on ``device_ids[0]``, the root) on chunks of the batch split along ``dim`` on
    ``device_ids`` (ints, strings or devices, repeats allowed; ``None``: every visible GPU, else the module's device);
    return the per-device outputs, not gathered (:meth:`gather` puts them on ``output_device``, default the root).
    ``execution_mode``: ``"auto"`` (threads on distinct GPUs, else sequential), ``"threads"`` or ``"sequential"``
    (compiled modules run sequentially, :class:`SyncBatchNorm` training in threads).

    One device, a batch of one sample or inputs with no batch dimension: the module runs once, on the root. Replicas
    last across calls. :attr:`last_split_sizes`: the last call's per-replica samples.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        execution_mode: ExecutionMode = "auto",
    ) -> None:
        super().__init__(resolve_devices(device_ids, fallback=module_device(module)), dim, execution_mode)
        self.module = module
        self.output_device = to_device(output_device) if output_device is not None else self.device_ids[0]
        self.last_split_sizes: tuple[int, ...] = ()
        check_module_on(module, self.device_ids[0])
        if len(self.device_ids) > 1:
            say_split_sensitive_layers(module, "DataParallelModel")

    def forward(self, *inputs: Any, **kwargs: Any) -> list[Any]:
        if len(self.device_ids) > 1:
            roots = argument_roots(inputs, kwargs)
            split = split_or_run_once(lambda: split_arguments(inputs, kwargs, self.device_ids, self.dim), roots)
        else:
            split = [inputs], [kwargs], [agreed_size((inputs, kwargs), self.dim) or 0]
        args, kwargs_chunks, sizes = split or ([inputs], [kwargs], [])
        self.__dict__["last_split_sizes"] = tuple(sizes)  # skips nn.Module.__setattr__'s checks
        if len(args) == 1:  # one run on the root, no replica needed
            call_args, call_kwargs = _placed((args[0], kwargs_chunks[0]), self.device_ids[0])
            return [self.module(*call_args, **call_kwargs)]
        return self._run(self.module, self.device_ids, len(sizes), True, lambda r, i: r(*args[i], **kwargs_chunks[i]))

    def gather(self, outputs: Sequence[Any]) -> Any:
        """Concatenate per-device outputs on ``output_device`` (for metrics, logging), with the last call's split
        sizes, which tell per-sample lists of plain items (ids) from fixed ones."""
        sizes = self.last_split_sizes if len(self.last_split_sizes) == len(outputs) else None
        return merge_outputs(outputs, self.output_device, self.dim, sizes=sizes)


class DataParallelCriterion(_Replicated):
    """Compute ``criterion`` on every device from :class:`DataParallelModel`'s per-device outputs.

    Call it as ``criterion(outputs, *targets, **kwargs)`` with the whole targets: they are split as the outputs are
    (targets without a batch dimension go whole to every replica). A plain-tuple output is unpacked into positional
    arguments (``TripletMarginLoss``). The losses are reduced on ``device_ids[0]`` by ``criterion.reduction``:
    ``"mean"`` weighted by per-device counts (``weight_fn(output, targets)`` gives another), ``"sum"``, ``"none"``.
    """

    def __init__(
        self,
        criterion: nn.Module | Callable[..., Tensor],
        device_ids: Sequence[DeviceLike] | None = None,
        dim: int = 0,
        execution_mode: ExecutionMode = "auto",
        weight_fn: WeightFn | None = None,
    ) -> None:
        if not callable(criterion):
            raise TypeError(f"criterion must be callable (an nn.Module or a function), got {type(criterion).__name__}.")
        fallback = module_device(criterion) if isinstance(criterion, nn.Module) else None
        super().__init__(resolve_devices(device_ids, fallback=fallback), dim, execution_mode)
        self.criterion = criterion
        self.weight_fn = weight_fn
        self._said_sample_weights = False

    def forward(self, outputs: Sequence[Any], *targets: Any, **kwargs: Any) -> Tensor:
        self._check_outputs(outputs)
        if len(outputs) == 1:  # a plain call on the one output: exactly the criterion's result, whatever its reduction
            targets, kwargs = _placed((targets, kwargs), _output_device(outputs[0], self.device_ids[0]))
            return self.criterion(*_as_args(outputs[0]), *targets, **kwargs)
        devices = [_output_device(o, d) for o, d in zip(outputs, self.device_ids, strict=False)]
        target_chunks, kwargs_chunks, samples = self._split_targets(outputs, targets, kwargs, devices)
        reduction, root = _reduction(self.criterion, kwargs), self.device_ids[0]
        # What each device's mean divides by: weight_fn's count, else the loss's record (its graph, or its loss calls).
        read = self.weight_fn is None and reduction not in ("none", "sum")
        losses, calls = self._losses(outputs, target_chunks, kwargs_chunks, devices, read)
        if reduction == "none":
            return merge_outputs(losses, root, self.dim)
        if reduction == "sum":
            return reduce_losses(losses, device=root, reduction="sum")
        if self.weight_fn is not None:
            weights = [self.weight_fn(o, t) for o, t in zip(outputs, target_chunks, strict=True)]
            return reduce_losses(losses, weights, device=root)
        if (combined := combine_by_record(losses, calls, [n or 1 for n in samples], root)) is not None:
            return combined
        if not self._said_sample_weights:
            self._said_sample_weights = True
            name = getattr(self.criterion, "__name__", type(self.criterion).__name__)
            warnings.warn(
                f"DataParallelCriterion weights each device's {name} loss by its sample count, which equals one "
                "device for a mean over samples: the loss's record (its autograd graph, or without gradients the "
                "torch loss functions it called) does not say what it divides by. For another mean pass "
                "weight_fn=lambda output, targets: <what it divides by> "
                "(e.g. (targets[0] != -100).sum() for non-ignored labels), or use a torch loss module such as "
                "nn.CrossEntropyLoss(ignore_index=-100); a loss returning a sum needs my_loss.reduction = 'sum'. "
                "weight_fn=lambda output, targets: len(targets[0]) says samples and silences this.",
                UserWarning,
                stacklevel=4,  # the caller of the criterion module
            )
        if 0 in samples:  # an output without a batch dimension, and no targets split
            raise ValueError(
                "Cannot tell how many samples a replica's loss averages over: its output has no batch dimension "
                f"{self.dim} and no targets were split. Pass DataParallelCriterion(..., weight_fn=lambda output, "
                "targets: count) to give each replica's weight."
            )
        return reduce_losses(losses, samples, device=root)

    def _check_outputs(self, outputs: Sequence[Any]) -> None:
        if not isinstance(outputs, list):
            raise TypeError(
                "DataParallelCriterion expects the list of per-device outputs returned by DataParallelModel, got "
                f"{type(outputs).__name__}. For one gathered output, call the criterion itself."
                + (
                    " A tuple is taken as one model output (anchor, positive, negative): wrap it in a list for one "
                    "device, or pass list(outputs) if it holds per-device outputs."
                    if isinstance(outputs, tuple)
                    else ""
                )
            )
        if not outputs:
            raise ValueError("DataParallelCriterion got an empty list of outputs.")
        if len(outputs) > len(self.device_ids):
            raise ValueError(
                f"Got outputs from {len(outputs)} devices but the criterion has {len(self.device_ids)} device_ids; "
                "use the same device_ids for DataParallelModel and DataParallelCriterion."
            )

    def _losses(
        self, outputs: list[Any], targets: list[Any], kwargs: list[Any], devices: list[torch.device], record: bool
    ) -> tuple[list[Tensor], list[LossCalls | None]]:
        """Each device's loss on its output and targets (from lasting replicas of a criterion that holds tensors), and
        with ``record`` the loss calls of each loss without an autograd record."""
        criterion = self.criterion
        stateful = isinstance(criterion, nn.Module) and module_device(criterion) is not None
        if stateful:
            check_module_on(criterion, self.device_ids[0], what="criterion")
        # Loss calls say the count of a loss that will carry no autograd record (no gradients, or outputs without).
        grads = torch.is_grad_enabled()
        calls = [
            LossCalls() if record and not (grads and any(t.requires_grad for _, t in iter_tensors(o))) else None
            for o in outputs
        ]

        def call(replica: Any, i: int) -> Tensor:
            with contextlib.nullcontext() if calls[i] is None else calls[i]:
                return replica(*_as_args(outputs[i]), *targets[i], **kwargs[i])

        try:
            return self._run(criterion, devices, len(outputs), stateful, call), calls
        except TypeError as err:
            if isinstance(outputs[0], tuple) and not is_namedtuple(outputs[0]):
                add_note(
                    err,
                    f"DataParallelCriterion passes each item of a tuple output as its own argument: criterion(*output, "
                    f"*targets), here {len(outputs[0])} items before the targets. Take them as separate parameters "
                    "(def criterion(logits, aux, target)), or return a namedtuple or dict, which is passed whole.",
                )
            raise

    def _split_targets(
        self, outputs: list[Any], targets: tuple[Any, ...], kwargs: dict[str, Any], devices: list[torch.device]
    ) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]], list[int]]:
        """Targets chunked as the outputs are (by their batch sizes when every output has one), and each device's
        samples (0: unknown); per-class options of torch's loss functions (``F.cross_entropy``'s weight) go whole."""
        base = self.criterion.func if isinstance(self.criterion, functools.partial) else self.criterion
        options = {name for function, name in _PER_CLASS if function is base}
        whole = {k: v for k, v in kwargs.items() if k in options}
        per_sample = {k: v for k, v in kwargs.items() if k not in options}
        out_sizes = [agreed_size(o, self.dim) or 0 for o in outputs]
        _refuse_per_device_targets(targets, out_sizes, self.dim)
        sizes = out_sizes if all(out_sizes) else None
        total = None if sizes is None else sum(sizes)  # plain lists of that length (class ids) are split by item
        try:
            target_chunks, kwarg_chunks, used = split_arguments(
                tuple(targets), per_sample, devices, self.dim, total, sizes=sizes, names=("targets", "kwargs")
            )
        except NothingToSplitError:
            # No targets (TripletMarginLoss) nor batch values, some output's size unknown: each replica gets them whole.
            return [move_to(targets, d) for d in devices], [move_to(kwargs, d) for d in devices], out_sizes
        except BatchSplitError as err:
            option = (
                " Keyword arguments of the criterion call are split like the targets. One that is an option, not a "
                "per-sample value (a per-class weight), belongs to the criterion: pass a loss module built with it "
                "(nn.BCEWithLogitsLoss(weight=...), or your own nn.Module holding it as a buffer), which reaches every "
                "device whole."
            )
            raise BatchSplitError(
                f"Outputs and targets do not line up: {err} The per-device outputs hold {out_sizes} samples along dim "
                f"{self.dim}; the targets must hold as many: the samples of the inputs given to DataParallelModel."
                + (option if per_sample else "")
            ) from None
        # Only when some output's size is unknown (sizes is None): the targets were split evenly.
        for i, (out_size, target_size) in enumerate(itertools.zip_longest(out_sizes, used, fillvalue=0)):
            if not target_size or (out_size and out_size != target_size):
                raise ValueError(
                    f"Outputs and targets do not line up on device {i}: the output has "
                    f"{out_size or 'an unknown number of'} samples along dim {self.dim} but its targets have "
                    f"{target_size}. The targets must have the same batch size as the model's inputs."
                )
        return target_chunks, [{**kw, **move_to(whole, d)} for kw, d in zip(kwarg_chunks, devices, strict=True)], used


def _refuse_per_device_targets(targets: tuple[Any, ...], out_sizes: list[int], dim: int) -> None:
    """Raise where a target is a list of one tensor per device sized as the outputs: another DataParallelModel's
    outputs (a teacher's), which the criterion would split as one batch."""
    for index, target in enumerate(targets):
        if not isinstance(target, list) or len(out_sizes) < 2:
            continue
        if [t.shape[dim] if isinstance(t, Tensor) and t.dim() > dim else None for t in target] == out_sizes:
            raise ValueError(
                f"targets[{index}] is a list of one tensor per device, sized as the outputs ({out_sizes}): another "
                "DataParallelModel's outputs? DataParallelCriterion splits whole-batch targets itself: pass "
                "teacher.gather(teacher_outputs) (the whole batch, on its output device), detached if it is a target."
            )


def _reduction(criterion: Any, kwargs: dict[str, Any]) -> str:
    """The reduction of a call: its ``reduction=`` keyword, a partial's, else the criterion's attribute, else mean."""
    keywords = criterion.keywords if isinstance(criterion, functools.partial) else {}
    return kwargs.get("reduction", keywords.get("reduction", getattr(criterion, "reduction", "mean")))


def _placed(values: Any, device: torch.device) -> Any:
    """``values`` with its tensors on ``device``: the very objects when they all are (a plain call gets its own)."""
    return values if all(t.device == device for _, t in iter_tensors(values)) else move_to(values, device)


def _as_args(output: Any) -> tuple[Any, ...]:
    return output if isinstance(output, tuple) and not is_namedtuple(output) else (output,)


def _output_device(output: Any, default: torch.device) -> torch.device:
    return next((tensor.device for _, tensor in iter_tensors(output)), default)
