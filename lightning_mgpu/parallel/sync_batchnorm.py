"""Single-process SyncBatchNorm: BatchNorm statistics over the whole batch, across the replicas of one call.

The k-th call of a layer in each replica meets the others'; the last to arrive normalises every replica's input at once
(statistics weighted by shard size, running statistics on replica 0's buffers, the module's own), so backward needs no
rendezvous: on CUDA in one autograd node running torch's batch-norm primitives (those of ``torch.nn.SyncBatchNorm``),
elsewhere in plain tensor ops. Outside a replicated call, with one replica, or in eval mode with running statistics,
the layer is ``BatchNorm``. Limits: replicas in threads, calling the sync layers in the same order; one ``backward``
over the outputs (no double backward, no checkpointed segments holding sync layers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.function import Function, FunctionCtx, once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from lightning_mgpu.parallel.replica_group import current_replica

_HINT = (
    "Every replica must call each SyncBatchNorm layer the same number of times and in the same order (its statistics "
    "span the replicas): branch on something every replica shares, not on one shard's values or size, or keep that "
    "layer a plain BatchNorm (revert_sync_batchnorm)."
)
_SEQUENTIAL_HINT = (
    "Run it with execution_mode='threads' instead of execution_mode='sequential' (DataParallelModel, "
    "DataParallelCriterion and the lightning_mgpu strategies switch by themselves), or put the layer in eval mode."
)
_CHECKPOINTED = (
    "of a replica ran outside its replicas' parallel call, where they cannot share the batch's statistics: activation "
    "checkpointing (torch.utils.checkpoint, gradient_checkpointing_enable()) reruns checkpointed blocks in the "
    "backward pass. Keep SyncBatchNorm layers out of checkpointed blocks, or train without sync_batchnorm (per-shard "
    "statistics)."
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
        replica, synced = current_replica(), self._uses_batch_stats()
        if replica is None or replica.group.size < 2 or not synced:
            if replica is None and synced and getattr(self, "_is_replica", False):  # torch's replicas set _is_replica
                raise RuntimeError(
                    f"SyncBatchNorm layer {_quoted(self._sync_key.name, self.num_features)} {_CHECKPOINTED}"
                )
            return super().forward(input)
        self._check_input_dim(input)
        call = replica.next_call(self._sync_key)
        label = f"SyncBatchNorm layer {_quoted(self._sync_key.name, self.num_features)} (call {call} in this forward)"
        if input.size(1) != self.num_features:
            raise ValueError(
                f"{label} expects {self.num_features} channels (dim 1) but got input of shape {input.shape}."
            )
        x = _contiguous(input)
        count = x.numel() // x.size(1)
        stats = torch.batch_norm_stats(x.detach(), self.eps) if count and x.is_cuda else None
        part = _Part(self, x, stats, count, torch.cuda.current_stream(x.device) if x.is_cuda else None)
        site = (self._sync_key, call)
        return replica.group.rendezvous(replica.index, site, part, _combine, label, _HINT, _SEQUENTIAL_HINT)


def _quoted(name: str | None, features: int = 0) -> str:
    """How errors name a layer: its dotted name, or its size before a conversion or check named it."""
    return f"<unnamed, {features} features>" if name is None else repr(name) if name else "<the root module>"


class _Part(NamedTuple):
    """What one replica brings to a layer call's rendezvous: its layer (replica 0's buffers are the module's own),
    input, mean and inverse std (CUDA only, None for an empty shard), values per channel, CUDA stream."""

    layer: SyncBatchNorm
    x: Tensor
    stats: tuple[Tensor, Tensor] | None
    count: int
    stream: torch.cuda.Stream | None


def _combine(parts: list[_Part]) -> tuple[Tensor, ...]:
    """The joint node over every replica's input, once per layer call; outputs in replica order."""
    layer, total = parts[0].layer, sum(p.count for p in parts)
    if total <= 1:  # as BatchNorm, whenever it normalises with batch statistics
        raise ValueError(
            f"Expected more than 1 value per channel when training, got {total} over all replicas "
            f"(SyncBatchNorm layer {_quoted(layer._sync_key.name, layer.num_features)})"
        )
    if not parts[0].x.is_cuda:
        return _plain_joint(parts, total)
    tensors = [p.x for p in parts] + [p.layer.weight for p in parts] + [p.layer.bias for p in parts]
    # Each replica's stream is current on its device while the node runs *and* while autograd records its outputs.
    with _streams([p.stream for p in parts]):
        return _JointBatchNorm.apply(parts, *tensors)


def _plain_joint(parts: list[_Part], total: int) -> list[Tensor]:
    """The layer call in differentiable tensor ops, where torch has no batch-norm primitives (the CPU): statistics in
    float32 at least, the whole batch's variance as the count-weighted within- plus between-shard variances. No sum
    over a stack of shards: ``loss_coupling.coupling`` would take it for a reduction over the batch dimension."""
    layer, root, dims = parts[0].layer, parts[0].x.device, [0, *range(2, parts[0].x.dim())]
    shards = [(p.count / total, torch.var_mean(_upcast(p.x), dims, correction=0)) for p in parts if p.count]
    mean = sum(w * m.to(root) for w, (_, m) in shards)
    var = sum(w * (v.to(root) + (m.to(root) - mean).square()) for w, (v, m) in shards)
    invstd = (var + layer.eps).rsqrt()
    _update_running(layer, mean.detach(), invstd.detach(), total)
    outputs = []
    for p in parts:
        shape, weight, bias = (1, -1) + (1,) * (p.x.dim() - 2), p.layer.weight, p.layer.bias
        scale = invstd.to(p.x.device) if weight is None else invstd.to(p.x.device) * weight.to(invstd.dtype)
        y = (_upcast(p.x) - mean.to(p.x.device).view(shape)) * scale.view(shape)
        outputs.append((y if bias is None else y + bias.to(y.dtype).view(shape)).to(p.x.dtype))
    return outputs


class _JointBatchNorm(Function):
    """One autograd node spanning every replica of a layer call: inputs ``(*xs, *weights, *biases)``, one output per
    replica, each on its replica's device. Backward sums the replicas' gradient sums in replica order."""

    @staticmethod
    def forward(ctx: FunctionCtx, parts: list[_Part], *tensors: Tensor | None) -> tuple[Tensor, ...]:
        n, layer = len(parts), parts[0].layer
        xs, weights, biases = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        root, active = xs[0].device, [p for p in parts if p.count]
        means, invstds = (torch.stack([p.stats[k].to(root, non_blocking=True) for p in active]) for k in range(2))
        counts = torch.tensor([p.count for p in active], dtype=means.dtype)  # copied without blocking the host:
        counts = counts.pin_memory().to(root, non_blocking=True)
        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            means, means, invstds, None, None, 0.0, layer.eps, counts
        )
        _update_running(layer, mean, invstd, sum(p.count for p in parts))
        joint = torch.stack([mean, invstd])
        stats = [joint.to(x.device, non_blocking=True) for x in xs]  # one copy per other device
        outputs = [
            torch.batch_norm_elemt(x, weight, bias, *stats_i, layer.eps) if p.count else torch.empty_like(x)
            for p, x, weight, bias, stats_i in zip(parts, xs, weights, biases, stats, strict=True)
        ]
        # No reference to the parts is kept past the forward.
        ctx.counts, ctx.streams = [p.count for p in parts], [p.stream for p in parts]
        ctx.save_for_backward(*xs, *weights, *stats)
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        counts, n = ctx.counts, len(ctx.counts)
        xs, weights, stats = (ctx.saved_tensors[k * n : (k + 1) * n] for k in range(3))
        needs_x, needs_w, needs_b = (ctx.needs_input_grad[1 + k * n : 1 + (k + 1) * n] for k in range(3))
        input_grad, grads_x, grads_w, grads_b, sums = any(needs_x), [None] * n, [None] * n, [None] * n, []
        with _streams(ctx.streams):
            dys = [_contiguous(g) for g in grads]
            for i in (i for i in range(n) if counts[i] and (input_grad or needs_w[i] or needs_b[i])):
                sum_dy, sum_dy_xmu, grads_w[i], grads_b[i] = torch.batch_norm_backward_reduce(
                    dys[i], xs[i], *stats[i], weights[i], input_grad, needs_w[i], needs_b[i]
                )
                if input_grad:  # else the sums are left undefined
                    sums.append(torch.stack([sum_dy, sum_dy_xmu]).to(xs[0].device, non_blocking=True))
            total_sums = torch.stack(sums).sum(0) if input_grad else None
            for i in (i for i in range(n) if needs_x[i]):
                weight = weights[i] if weights[i] is None else weights[i].to(stats[i].dtype)  # as the kernel takes it
                # The kernel divides by the sum of `count`: the whole batch's, made on the device (no copy).
                count = torch.full((1,), sum(counts), dtype=torch.int32, device=xs[i].device)
                sums_i = total_sums.to(xs[i].device, non_blocking=True)
                grads_x[i] = (
                    torch.batch_norm_backward_elemt(dys[i], xs[i], *stats[i], weight, *sums_i, count)
                    if counts[i]
                    else torch.zeros_like(xs[i])
                )
        return (None, *grads_x, *grads_w, *grads_b)


def _update_running(layer: _BatchNorm, mean: Tensor, invstd: Tensor, total: int) -> None:
    """BatchNorm's update of ``layer``'s counter and running statistics, with the whole batch's unbiased variance; no
    host synchronisation (momentum None: the cumulative average's factor 1 / num_batches_tracked stays a tensor)."""
    if not (layer.training and layer.track_running_stats):
        return
    tracked = layer.num_batches_tracked
    if tracked is not None:
        tracked.add_(1)
    if layer.running_mean is None:
        return
    dtype = layer.running_mean.dtype
    factor: Any = layer.momentum if layer.momentum is not None else 0.0  # as BatchNorm: no momentum nor counter
    if layer.momentum is None and tracked is not None:
        factor = tracked.to(torch.float64).reciprocal().to(dtype)
    unbiased = (invstd.pow(-2) - layer.eps) * (total / (total - 1))
    layer.running_mean.lerp_(mean.to(dtype), factor)
    layer.running_var.lerp_(unbiased.to(dtype), factor)


@contextlib.contextmanager
def _streams(streams: Sequence[torch.cuda.Stream | None]) -> Iterator[None]:
    """Make each replica's CUDA stream (captured when it arrived) current on its device while one thread works on
    every device: so the work is ordered with what the replica's own thread queued before and queues after."""
    with contextlib.ExitStack() as stack:
        for stream in {s.device: s for s in reversed(streams) if s is not None}.values():  # the first per device
            stack.enter_context(torch.cuda.stream(stream))
        yield


def _contiguous(t: Tensor) -> Tensor:
    """``t`` itself when dense in the default or a channels-last layout (the kernels take both), else a copy."""
    layouts = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
    return t if any(t.is_contiguous(memory_format=layout) for layout in layouts) else t.contiguous()


def _upcast(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def has_sync_batchnorm(module: nn.Module) -> bool:
    """Whether ``module`` holds a :class:`SyncBatchNorm` layer."""
    return any(isinstance(m, SyncBatchNorm) for m in module.modules())


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm (any ``_BatchNorm``) in ``module`` by a :class:`SyncBatchNorm` holding the same Parameter
    and buffer objects (optimizers stay valid), flags, hooks and attributes; return ``module`` (a new object only when
    it is itself a BatchNorm). State-dict keys are unchanged; :func:`revert_sync_batchnorm` undoes it."""
    uses_sync_batchnorm(module)  # names the layers built as SyncBatchNorm, for their errors
    return _retype_layers(module, lambda layer, name: None if isinstance(layer, SyncBatchNorm) else SyncBatchNorm)


def revert_sync_batchnorm(module: nn.Module, default: type[_BatchNorm] | None = None) -> nn.Module:
    """Turn every :class:`SyncBatchNorm` in ``module`` back into the BatchNorm class it was converted from (``default``
    for layers built as SyncBatchNorm directly), keeping the same Parameter and buffer objects; return the module."""

    def original(layer: _BatchNorm, name: str) -> type[_BatchNorm] | None:
        if not isinstance(layer, SyncBatchNorm):
            return None
        if (cls := layer._sync_key.original_class or default) is None:
            raise ValueError(
                f"SyncBatchNorm layer {_quoted(name)} was built directly, not by convert_sync_batchnorm, so the "
                "BatchNorm class to restore is unknown: pass e.g. revert_sync_batchnorm(model, default=nn.BatchNorm2d)."
            )
        return cls

    return _retype_layers(module, original)


def _retype_layers(module: nn.Module, new_class: Callable[[_BatchNorm, str], type[_BatchNorm] | None]) -> nn.Module:
    """``module`` with each BatchNorm for which ``new_class(layer, dotted_name)`` gives a class swapped for an instance
    of it with the layer's state: the same tensors, flags, hooks and attributes (containers copied, so the two modules
    do not share later registrations). A layer used at several places is offered once (under its first name) and
    replaced everywhere by one new object."""
    new: dict[int, nn.Module] = {}
    for name, sub in module.named_modules():
        if not isinstance(sub, _BatchNorm) or (cls := new_class(sub, name)) is None:
            continue
        if isinstance(sub, LazyModuleMixin) and sub.has_uninitialized_params():
            raise ValueError(
                f"Cannot convert {type(sub).__name__} {_quoted(name)}: its parameters are not initialised yet. Run one "
                "forward pass (a dry run on a sample batch) before converting."
            )
        layer = new[id(sub)] = cls.__new__(cls)
        state = {k: v.copy() if isinstance(v, (dict, set)) else v for k, v in sub.__dict__.items() if k != "_sync_key"}
        layer.__dict__.update(state)
        if isinstance(layer, SyncBatchNorm):
            layer._sync_key = _LayerKey(name, type(sub))
    for path, sub in list(module.named_modules(remove_duplicate=False)):
        if path and id(sub) in new:
            parent, _, leaf = path.rpartition(".")
            setattr(module.get_submodule(parent), leaf, new[id(sub)])
    return new.get(id(module), module)


def uses_sync_batchnorm(module: nn.Module) -> bool:
    """Whether a forward of ``module`` in its current mode synchronises BatchNorm statistics (some
    :class:`SyncBatchNorm` uses batch statistics), so its replicas must run in threads. Cheap enough to call per step;
    also names the sync layers built directly, for their errors."""
    syncs = False
    for name, sub in module.named_modules():
        if isinstance(sub, SyncBatchNorm):
            if sub._sync_key.name is None:
                sub._sync_key.name = name
            syncs = syncs or sub._uses_batch_stats()
    return syncs
