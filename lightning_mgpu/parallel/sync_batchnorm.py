"""Single-process SyncBatchNorm: BatchNorm statistics over the whole batch, across the replicas of one call.

The k-th call of a layer in each replica meets the others'; the last to arrive runs one autograd node over every
replica's input (statistics weighted by shard size, running statistics on replica 0's buffers, the module's own), so
backward needs no rendezvous. Outside a replicated call, with one replica, or in eval mode with running statistics,
the layer is ``BatchNorm``. Limits: replicas in threads, calling the sync layers in the same order; one ``backward``
over the outputs (no double backward, no checkpointed segments holding sync layers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import Function, FunctionCtx, once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from typing_extensions import override

from lightning_mgpu.parallel.replica_group import current_replica

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm", "uses_sync_batchnorm"]

_HINT = (
    "Every replica must call each SyncBatchNorm layer the same number of times and in the same order (its statistics "
    "span the replicas): branch on something every replica shares, not on one shard's values or size, or keep that "
    "layer a plain BatchNorm (revert_sync_batchnorm)."
)


@dataclass(eq=False)
class _LayerKey:
    """One sync layer's identity, shared by its replicas (not by deep copies): its name and the class converted from."""

    name: str | None = None
    original_class: type[_BatchNorm] | None = None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span every replica of a replicated call, with the arguments, parameters,
    buffers and state-dict keys of ``nn.BatchNorm1d/2d/3d``; a converted layer checks input dims as its class did."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self._sync_key = _LayerKey()

    def _check_input_dim(self, input: Tensor) -> None:
        # The converted class's own check; torch.nn.SyncBatchNorm's (at least 2D) for a layer built directly.
        (self._sync_key.original_class or nn.SyncBatchNorm)._check_input_dim(self, input)

    def _uses_batch_stats(self) -> bool:
        return self.training or (self.running_mean is None and self.running_var is None)

    def forward(self, input: Tensor) -> Tensor:
        replica = current_replica()
        if replica is None and getattr(self, "_is_replica", False) and self._uses_batch_stats():
            raise RuntimeError(
                f"SyncBatchNorm layer {_describe(self)} of a replica ran outside its replicas' parallel call, where "
                "they cannot share the batch's statistics: activation checkpointing (torch.utils.checkpoint, "
                "gradient_checkpointing_enable()) reruns checkpointed blocks in the backward pass. Keep SyncBatchNorm "
                "layers out of checkpointed blocks, or train without sync_batchnorm (per-shard statistics)."
            )
        if replica is None or replica.group.size < 2 or not self._uses_batch_stats():
            return super().forward(input)
        self._check_input_dim(input)
        key = self._sync_key
        call = replica.next_call(key)
        label = f"SyncBatchNorm layer {_describe(self)} (call {call} in this forward)"
        replica.group.require_threads(
            label,
            "Run it with execution_mode='threads' instead of execution_mode='sequential' (DataParallelModel, "
            "DataParallelCriterion and the lightning_mgpu strategies switch by themselves), or put the layer in eval "
            "mode.",
        )
        if input.size(1) != self.num_features:
            raise ValueError(
                f"{label} expects {self.num_features} channels (dim 1) but got input of shape {input.shape}."
            )
        x = _contiguous(input)
        count = x.numel() // x.size(1)
        stats = _kernels(x).local_stats(x.detach(), self.eps) if count else None
        stream = torch.cuda.current_stream(x.device) if x.is_cuda else None
        part = _Part(self, x, stats, count, stream)
        return replica.group.rendezvous(replica.index, (key, call), part, _combine, label, _HINT)


def _describe(layer: SyncBatchNorm) -> str:
    name = layer._sync_key.name
    return f"<unnamed, {layer.num_features} features>" if name is None else _quoted(name)


def _quoted(name: str) -> str:
    return repr(name) if name else "<the root module>"


# --- the synchronised forward -------------------------------------------------------------------------------------
@dataclass
class _Part:
    """What one replica brings to a layer call's rendezvous: its layer (replica 0's buffers are the module's own),
    input, statistics (kernel-specific; None for an empty shard), values per channel, CUDA stream."""

    layer: SyncBatchNorm
    x: Tensor
    stats: tuple[Tensor, Tensor] | None
    count: int
    stream: torch.cuda.Stream | None


def _combine(parts: list[_Part]) -> tuple[Tensor, ...]:
    """Run by the last replica to arrive: the joint node over every replica's input, outputs in replica order."""
    layer = parts[0].layer
    if len({p.x.is_cuda for p in parts}) > 1:  # their statistics come from different kernels
        raise RuntimeError(
            f"SyncBatchNorm layer {_describe(layer)}: the replicas' inputs are on devices of different types "
            f"({[str(p.x.device) for p in parts]}); put every replica on devices of one type."
        )
    total = sum(p.count for p in parts)
    if total == 0 or (layer.training and total == 1):
        raise ValueError(
            f"Expected more than 1 value per channel when training, got {total} over all replicas "
            f"(SyncBatchNorm layer {_describe(layer)})"
        )
    tensors = [p.x for p in parts] + [p.layer.weight for p in parts] + [p.layer.bias for p in parts]
    # Each replica's stream is current on its device while the node runs *and* while autograd records its outputs.
    with _streams([p.stream for p in parts]):
        return _JointBatchNorm.apply(parts, *tensors)


def _update_running(layer: _BatchNorm, mean: Tensor, var: Tensor, total: int) -> None:
    """BatchNorm's update of ``layer``'s running statistics, with the unbiased variance of the whole batch; no host
    synchronisation (momentum None: the cumulative average's factor 1 / num_batches_tracked stays on the device)."""
    dtype = layer.running_mean.dtype
    mean, unbiased = mean.to(dtype), (var * (total / (total - 1))).to(dtype)
    if layer.momentum is None and layer.num_batches_tracked is not None:
        factor = layer.num_batches_tracked.to(torch.float64).reciprocal().to(dtype)
        layer.running_mean.mul_(1 - factor).add_(mean * factor)
        layer.running_var.mul_(1 - factor).add_(unbiased * factor)
    else:
        momentum = 0.0 if layer.momentum is None else layer.momentum  # as BatchNorm: no momentum nor counter, no update
        layer.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        layer.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


class _JointBatchNorm(Function):
    """One autograd node spanning every replica of a layer call: inputs ``(*xs, *weights, *biases)``, one output per
    replica, each on its replica's device. Backward combines the replicas' gradient sums in replica order."""

    @staticmethod
    def forward(ctx: FunctionCtx, parts: list[_Part], *tensors: Tensor | None) -> tuple[Tensor, ...]:
        n, layer, kernels = len(parts), parts[0].layer, _kernels(parts[0].x)
        xs, weights, biases = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        active = [p for p in parts if p.count]
        running = layer if layer.training and layer.track_running_stats and layer.running_mean is not None else None
        if running is not None and running.num_batches_tracked is not None:
            running.num_batches_tracked.add_(1)
        mean, invstd = kernels.joint_stats(
            [p.stats for p in active], [p.count for p in active], xs[0].device, layer.eps, running
        )
        joint = torch.cat([mean, invstd])  # the kernels' ``stats``: one tensor per device, mean then inverse std
        stats = [joint.to(x.device, non_blocking=True) for x in xs]  # no copy for replicas on its device
        outputs = [
            kernels.normalize(x, weight, bias, stats_i, layer.eps) if p.count else torch.empty_like(x)
            for p, x, weight, bias, stats_i in zip(parts, xs, weights, biases, stats, strict=True)
        ]
        # No reference to the parts is kept past the forward.
        ctx.kernels, ctx.counts, ctx.streams = kernels, [p.count for p in parts], [p.stream for p in parts]
        ctx.save_for_backward(*xs, *weights, *stats)
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        counts, kernels, n = ctx.counts, ctx.kernels, len(ctx.counts)
        xs, weights, stats = (ctx.saved_tensors[k * n : (k + 1) * n] for k in range(3))
        needs_x, needs_w, needs_b = (ctx.needs_input_grad[1 + k * n : 1 + (k + 1) * n] for k in range(3))
        input_grad = any(needs_x)
        grads_x, grads_w, grads_b = ([None] * n for _ in range(3))
        sums = []  # per active shard: sum(dy) then sum(dy * (x - mean)), on the first device
        with _streams(ctx.streams):
            dys = [_contiguous(g) for g in grads]
            for i in (i for i in range(n) if counts[i] and (input_grad or needs_w[i] or needs_b[i])):
                sum_dy, sum_dy_xmu, grad_w, grad_b = kernels.backward_reduce(
                    dys[i], xs[i], stats[i], weights[i], input_grad, needs_w[i], needs_b[i]
                )
                grads_w[i], grads_b[i] = grad_w if needs_w[i] else None, grad_b if needs_b[i] else None
                if input_grad:  # else the kernel leaves the sums undefined
                    sums.append(torch.cat([sum_dy, sum_dy_xmu]).to(xs[0].device, non_blocking=True))
            total_sums = torch.stack(sums).sum(0) if input_grad else None
            for i in (i for i in range(n) if needs_x[i]):
                sums_i = total_sums.to(xs[i].device, non_blocking=True)
                grads_x[i] = (
                    kernels.backward_elemt(dys[i], xs[i], stats[i], weights[i], sums_i, sum(counts))
                    if counts[i]
                    else torch.zeros_like(xs[i])
                )
        return (None, *grads_x, *grads_w, *grads_b)


@contextlib.contextmanager
def _streams(streams: Sequence[torch.cuda.Stream | None]) -> Iterator[None]:
    """Make each replica's CUDA stream (captured when it arrived) current on its device while one thread works on
    every device: so the work is ordered with what the replica's own thread queued before and queues after."""
    with contextlib.ExitStack() as stack:
        entered: set[Any] = set()
        for stream in streams:
            if stream is not None and stream.device not in entered:
                entered.add(stream.device)
                stack.enter_context(torch.cuda.stream(stream))
        yield


def _contiguous(t: Tensor) -> Tensor:
    """``t`` itself when dense in the default or a channels-last layout (the kernels take both), else a copy."""
    layouts = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
    return t if any(t.is_contiguous(memory_format=layout) for layout in layouts) else t.contiguous()


# --- kernels ------------------------------------------------------------------------------------------------------
def _shape(x: Tensor) -> tuple[int, ...]:
    """Broadcast shape of a per-channel vector against ``x``."""
    return (1, x.size(1)) + (1,) * (x.dim() - 2)


def _dims(x: Tensor) -> list[int]:
    """Every dim but the channels."""
    return [0, *range(2, x.dim())]


def _upcast(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class _PlainKernels:
    """The joint node's per-device steps in plain tensor ops, for devices without torch's batch-norm primitives (the
    CPU); statistics in float32 at least. ``local_stats`` returns a pair that only the same class combines."""

    @staticmethod
    def local_stats(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        var, mean = torch.var_mean(_upcast(x), _dims(x), correction=0)
        return mean, var

    @staticmethod
    def joint_stats(
        stats: Sequence[tuple[Tensor, Tensor]],
        counts: Sequence[int],
        root: torch.device,
        eps: float,
        running: _BatchNorm | None,
    ) -> tuple[Tensor, Tensor]:
        """Mean and inverse std of the whole batch on ``root``; updates the running statistics of ``running``."""
        means = torch.stack([mean.to(root) for mean, _ in stats])
        variances = torch.stack([var.to(root) for _, var in stats])
        total = sum(counts)
        weights = torch.tensor([c / total for c in counts], dtype=means.dtype, device=root).unsqueeze(1)
        mean = (weights * means).sum(0)
        var = (weights * (variances + (means - mean).square())).sum(0)  # within-shard + between-shard variance
        if running is not None:
            _update_running(running, mean, var, total)
        return mean, torch.rsqrt(var + eps)

    @staticmethod
    def normalize(x: Tensor, weight: Tensor | None, bias: Tensor | None, stats: Tensor, eps: float) -> Tensor:
        mean, invstd = stats.chunk(2)
        shape = _shape(x)
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        y = (_upcast(x) - mean.view(shape)) * scale.view(shape)
        if bias is not None:
            y = y + bias.to(y.dtype).view(shape)
        return y.to(x.dtype)

    @staticmethod
    def backward_reduce(
        dy: Tensor, x: Tensor, stats: Tensor, weight: Tensor | None, *needs: bool
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """This shard's ``sum(dy)``, ``sum(dy * (x - mean))`` per channel, and its weight and bias gradients."""
        mean, invstd = stats.chunk(2)
        dims = _dims(x)
        dy32 = dy.to(mean.dtype)
        sum_dy = dy32.sum(dims)
        sum_dy_xmu = (dy32 * (_upcast(x) - mean.view(_shape(x)))).sum(dims)
        _, weight_g, bias_g = needs
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight_g and weight is not None else None
        grad_bias = sum_dy.to(weight.dtype) if bias_g and weight is not None else None
        return sum_dy, sum_dy_xmu, grad_weight, grad_bias

    @staticmethod
    def backward_elemt(dy: Tensor, x: Tensor, stats: Tensor, weight: Tensor | None, sums: Tensor, total: int) -> Tensor:
        """The input gradient, given ``sums`` (``sum(dy)`` then ``sum(dy * (x - mean))``) over the whole batch
        (``total`` values per channel)."""
        (mean, invstd), (sum_dy, sum_dy_xmu) = stats.chunk(2), sums.chunk(2)
        shape = _shape(x)
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        xmu = _upcast(x) - mean.view(shape)
        mean_dy, mean_dy_xmu = (sum_dy / total).view(shape), (sum_dy_xmu / total).view(shape)
        grad = dy.to(mean.dtype) - mean_dy - xmu * invstd.square().view(shape) * mean_dy_xmu
        return (grad * scale.view(shape)).to(x.dtype)


class _CudaKernels(_PlainKernels):
    """torch's batch-norm primitives (those of ``torch.nn.SyncBatchNorm``): fused kernels, statistics in the
    accumulation type (float32 for half/bfloat16), no host synchronisation."""

    @staticmethod
    @override
    def local_stats(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        return torch.batch_norm_stats(x, eps)  # mean, invstd

    @staticmethod
    @override
    def joint_stats(stats, counts, root, eps, running):
        means = torch.stack([mean.to(root, non_blocking=True) for mean, _ in stats])
        invstds = torch.stack([invstd.to(root, non_blocking=True) for _, invstd in stats])
        # The kernel reads counts (and updates running stats) in the running stats' dtype, or else in the dtype of its
        # first argument: pass the statistics there, so counts stay float32/64 (never half) without running stats.
        fused = running is not None and running.momentum is not None and running.running_mean.dtype == means.dtype
        counts_dtype = running.running_mean.dtype if fused else means.dtype
        # One small asynchronous copy from pinned memory: a plain torch.tensor(..., device=root) would block the host.
        counts_tensor = torch.tensor(counts, dtype=counts_dtype).pin_memory().to(root, non_blocking=True)
        if fused:
            return torch.batch_norm_gather_stats_with_counts(
                means, means, invstds, running.running_mean, running.running_var, running.momentum, eps, counts_tensor
            )
        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            means, means, invstds, None, None, 0.0, eps, counts_tensor
        )
        if running is not None:
            _update_running(running, mean, invstd.pow(-2).sub_(eps), sum(counts))
        return mean, invstd

    @staticmethod
    @override
    def normalize(x, weight, bias, stats, eps):
        return torch.batch_norm_elemt(x, weight, bias, *stats.chunk(2), eps)

    @staticmethod
    @override
    def backward_reduce(dy, x, stats, weight, *needs):
        return torch.batch_norm_backward_reduce(dy, x, *stats.chunk(2), weight, *needs)

    @staticmethod
    @override
    def backward_elemt(dy, x, stats, weight, sums, total):
        weight = None if weight is None else weight.to(stats.dtype)  # the kernel takes it in the statistics' dtype
        # The kernel divides the sums by the sum of `count`: the whole batch's count, made on the device (no copy).
        count = torch.full((1,), total, dtype=torch.int32, device=x.device)
        return torch.batch_norm_backward_elemt(dy, x, *stats.chunk(2), weight, *sums.chunk(2), count)


def _kernels(x: Tensor) -> type[_PlainKernels]:
    return _CudaKernels if x.is_cuda else _PlainKernels


# --- conversion ---------------------------------------------------------------------------------------------------
def has_sync_batchnorm(module: nn.Module) -> bool:
    """Whether ``module`` holds a :class:`SyncBatchNorm` layer."""
    return any(isinstance(m, SyncBatchNorm) for m in module.modules())


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm (any ``_BatchNorm``) in ``module`` by a :class:`SyncBatchNorm` holding the same Parameter
    and buffer objects (optimizers stay valid), flags, hooks and attributes; return ``module`` (a new object only when
    it is itself a BatchNorm). State-dict keys are unchanged; :func:`revert_sync_batchnorm` undoes it."""

    def convert(sub: nn.Module, name: str) -> nn.Module | None:
        if isinstance(sub, SyncBatchNorm):
            _name_once(sub, name)
        if not isinstance(sub, _BatchNorm) or isinstance(sub, SyncBatchNorm):
            return None
        new = _retype(sub, SyncBatchNorm, name)
        new._sync_key = _LayerKey(name, type(sub))
        return new

    return _replace_layers(module, convert)


def revert_sync_batchnorm(module: nn.Module, default: type[_BatchNorm] | None = None) -> nn.Module:
    """Turn every :class:`SyncBatchNorm` in ``module`` back into the BatchNorm class it was converted from (``default``
    for layers built as SyncBatchNorm directly), keeping the same Parameter and buffer objects; return the module."""

    def revert(sub: nn.Module, name: str) -> nn.Module | None:
        if not isinstance(sub, SyncBatchNorm):
            return None
        cls = sub._sync_key.original_class or default
        if cls is None:
            raise ValueError(
                f"SyncBatchNorm layer {_quoted(name)} was built directly, not by convert_sync_batchnorm, so the "
                "BatchNorm class to restore is unknown: pass e.g. revert_sync_batchnorm(model, default=nn.BatchNorm2d)."
            )
        new = _retype(sub, cls, name)
        new.__dict__.pop("_sync_key", None)
        return new

    return _replace_layers(module, revert)


def _replace_layers(module: nn.Module, replace: Callable[[nn.Module, str], nn.Module | None]) -> nn.Module:
    """``module`` with each submodule for which ``replace(sub, dotted_name)`` returns a layer swapped for it (children
    of swapped layers are not visited). A module used at several places is replaced once, by one new object."""
    done: dict[int, nn.Module] = {}

    def visit(sub: nn.Module, name: str) -> nn.Module:
        if id(sub) not in done:
            new = replace(sub, name)
            if new is None:
                new = sub
                for child_name, child in list(sub._modules.items()):
                    if child is not None:
                        sub._modules[child_name] = visit(child, f"{name}.{child_name}" if name else child_name)
            done[id(sub)] = new
        return done[id(sub)]

    return visit(module, "")


def _retype(layer: _BatchNorm, cls: type[_BatchNorm], name: str) -> Any:
    """A ``cls`` instance with ``layer``'s state: the same tensors, flags, hooks and attributes (containers copied, so
    the two modules do not share later registrations)."""
    if isinstance(layer, LazyModuleMixin) and layer.has_uninitialized_params():
        raise ValueError(
            f"Cannot convert {type(layer).__name__} {_quoted(name)}: its parameters are not initialised yet. Run one "
            "forward pass (a dry run on a sample batch) before converting."
        )
    new = cls.__new__(cls)
    new.__dict__.update({k: v.copy() if isinstance(v, (dict, set)) else v for k, v in layer.__dict__.items()})
    return new


def uses_sync_batchnorm(module: nn.Module) -> bool:
    """Whether a forward of ``module`` in its current mode synchronises BatchNorm statistics (some
    :class:`SyncBatchNorm` uses batch statistics), so its replicas must run in threads. Cheap enough to call per step;
    also names the sync layers built directly, for their errors."""
    syncs = False
    for name, sub in module.named_modules():
        if isinstance(sub, SyncBatchNorm):
            _name_once(sub, name)
            syncs = syncs or sub._uses_batch_stats()
    return syncs


def _name_once(layer: SyncBatchNorm, name: str) -> None:
    if layer._sync_key.name is None:
        layer._sync_key.name = name
