"""``strategy="dp"``: classic DataParallel, back in Lightning 2. The ``*_step`` runs once, on the root device; only
``forward`` (or the named submodules') runs replicated, its outputs gathered on ``output_device``; a scalar loss it
returns per replica is combined by the ``loss_reduction`` rule instead of stacked."""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Sequence
from itertools import permutations
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_mgpu.parallel.devices import DeviceLike, to_device
from lightning_mgpu.parallel.loss_calls import LossCalls, can_read_calls, combine_by_record
from lightning_mgpu.parallel.merge import merge_outputs
from lightning_mgpu.parallel.replicas import OriginalOnly
from lightning_mgpu.parallel.run_replicas import ExecutionMode
from lightning_mgpu.parallel.scatter_gather import argument_roots, iter_tensors, split_arguments
from lightning_mgpu.strategies.loader_batch import step_sample_counts
from lightning_mgpu.strategies.loss_rules import unread_message
from lightning_mgpu.strategies.single_process import SingleProcessParallel


class DataParallelStrategyBase(SingleProcessParallel):
    """One process, N devices: forward replicated, outputs gathered on ``output_device`` (``nn.DataParallel``).

    Args:
        output_device: where outputs are gathered; default the root device. An int is a CUDA device index, as for
            ``nn.DataParallel``; a string (``"cuda:3"``) or ``torch.device`` works too.
        parallel_modules: names of the submodules whose ``forward`` runs replicated (e.g. ``["backbone"]``); default
            ``[""]``: the LightningModule's own ``forward``, i.e. every ``self(...)`` call in a step.
        loss_reduction: as for ``parallel_criterion``, for a scalar the replicated forward returns; ``<key>`` names a
            forward argument (``tokens:labels`` for ``labels=``, ``tokens:1`` for the second positional one).
        dim, execution_mode, sync_batchnorm: as for ``parallel_criterion``.
    """

    strategy_name = "dp"
    _STEP_PER_REPLICA = False
    aliases = ("data_parallel",)

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        output_device: DeviceLike | None = None,
        parallel_modules: Sequence[str] | None = ("",),
        loss_reduction: str = "auto",
        dim: int = 0,
        execution_mode: ExecutionMode = "auto",
        sync_batchnorm: bool = True,
    ) -> None:
        plugins = (accelerator, parallel_devices, checkpoint_io, precision_plugin)
        super().__init__(*plugins, dim, execution_mode, loss_reduction, sync_batchnorm)
        self._output_device = None if output_device is None else to_device(output_device)  # a clear error now
        self.parallel_modules = _checked_module_names(parallel_modules)
        self._wrapped: list[nn.Module] = []
        self._forward_calls: int | None = None  # replicated forward calls in the step in progress; None: no step
        self._backward_in_step = False  # manual_backward ran in the step in progress (its work: it returns None)

    @property
    @override
    def _collectives_hint(self) -> str:
        return "Under dp the step runs once, on the root, where collectives are identities: call them in the step."

    @property
    def output_device(self) -> torch.device:
        return self.root_device if self._output_device is None else self._output_device

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if len(self.parallel_devices) > 1:
            self._wrap()

    def _wrap(self) -> None:
        """Install the replicated ``forward`` on the named submodules, also on any replaced since."""
        module = self.lightning_module
        targets = []
        for name in self.parallel_modules:
            try:
                targets.append(module.get_submodule(name))
            except AttributeError as err:
                self._unwrap(self._wrapped)
                raise ValueError(
                    f"parallel_modules names {name!r}, which is not a submodule of {type(module).__name__}."
                ) from err
        self._unwrap([old for old in self._wrapped if all(old is not target for target in targets)])
        for target in targets:
            current = target.__dict__.get("forward")  # a forward replaced on the instance runs replicated too
            if not isinstance(current, ParallelForward):
                target.forward = ParallelForward(self, target, current)  # an instance attribute: not in state dicts
        self._wrapped = targets

    def _unwrap(self, targets: list[nn.Module]) -> None:
        for target in targets:  # the forward they had before dp wrapped them
            current = target.__dict__.pop("forward", None)
            if isinstance(current, ParallelForward) and current.replica_value is not None:
                target.__dict__["forward"] = current.replica_value
        self._wrapped = [kept for kept in self._wrapped if all(kept is not t for t in targets)]

    @override
    def _replicated_modules(self) -> list[nn.Module]:
        names = set(self.parallel_modules)
        return [m for n, m in self.lightning_module.named_modules() if n in names]

    @override
    def teardown(self) -> None:
        self._unwrap(self._wrapped)
        super().teardown()

    @override
    def _run_step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._wrapped:
            self._wrap()
        self._forward_calls, self._backward_in_step = 0, False
        try:
            with self._step_context(hook):
                output = getattr(self.lightning_module, hook)(*args, **kwargs)
        finally:
            calls, self._forward_calls = self._forward_calls, None
        worked = output is not None or self._backward_in_step  # a step that skipped its batch did neither
        if self._wrapped and calls == 0 and worked and hook in ("training_step", "validation_step"):
            names = [n or "self" for n in self.parallel_modules]
            children = [
                n for n, child in self.lightning_module.named_children() if any(True for _ in child.parameters())
            ]
            self._warn_once(
                f"unreplicated:{hook}",
                f"dp: `{hook}` ran on one device: it never called the replicated forward of {names} (`self(...)` for "
                "the LightningModule; `self.model(...)` bypasses it). Call `self(...)` and have `forward` call the "
                "model, or pass DataParallelStrategy(parallel_modules=[...]) naming the submodules the step calls "
                f"(this module's, with parameters: {', '.join(map(repr, children or ['model']))}).",
            )
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        self._backward_in_step = self._forward_calls is not None  # manual_backward inside the step
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _forward(self, target: nn.Module, original: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._forward_calls is None:
            return original(*inputs, **kwargs)  # outside a step (a callback's self(x))
        self._forward_calls += 1
        samples = step_sample_counts(self.lightning_module)  # a list of per-sample items is split by item
        split = self._split(
            lambda: split_arguments(inputs, kwargs, self.parallel_devices, self.dim, samples=samples),
            argument_roots(inputs, kwargs),
            f"the inputs of {type(target).__name__}.forward",
            "the forward",
        )
        if split is None:
            return original(*inputs, **kwargs)
        args_chunks, kwargs_chunks, sizes = split
        if len(sizes) == 1:
            return original(*args_chunks[0], **kwargs_chunks[0])
        # No autograd record: the loss calls say their counts (not with a fast-path layer, whose outputs would change).
        evaluating = not torch.is_grad_enabled() and can_read_calls(target)
        calls = [LossCalls() if evaluating else None for _ in sizes]

        def call(index: int, replica: nn.Module) -> Any:
            with calls[index] or contextlib.nullcontext():
                return replica(*args_chunks[index], **kwargs_chunks[index])

        outputs = self._run_replicated(target, sizes, call)
        weights = {  # a per-replica loss: combined by its rule, not stacked
            path: self._loss_weights(f"{path} of {type(target).__name__}.forward", values, split, calls)
            for path, values in _replica_scalars(outputs).items()
        }
        return merge_outputs(outputs, self.output_device, self.dim, sizes=sizes, weights=weights)

    def _loss_weights(self, where: str, values: list[Tensor], split: Any, calls: list[LossCalls | None]) -> Any:
        """How a scalar the replicas returned merges: by ``loss_reduction``, else by its record (autograd, or the loss
        call that made it in evaluation: the merged value itself), else per sample (said once)."""
        args_chunks, kwargs_chunks, sizes = split
        if self.normalization is not None:  # its keys name the forward's arguments: positions and keywords
            if self.normalization.kind == "sum":
                return "sum"
            chunks = [{**dict(enumerate(a)), **k} for a, k in zip(args_chunks, kwargs_chunks, strict=True)]
            return self.normalization.weights(chunks, sizes)
        combined = combine_by_record(values, calls, sizes, self.output_device, self._settled)
        if combined is not None:
            return combined
        why = f"{where} carries no autograd record that says how it was normalised"
        fix = "; or compute the loss in the step from the gathered outputs (call the model without labels)"
        self._warn_once(f"unread:{where}", unread_message("dp", why, self._cli_options("loss_reduction=...")) + fix)
        return sizes


class ParallelForward(OriginalOnly):
    """The replicated ``forward`` that ``dp`` installs on a target module, around the ``forward`` it had on its
    instance (``inner``, which the replicas run), else its class's; copies and pickles get that one (an EMA copy)."""

    def __init__(self, strategy: DataParallelStrategyBase, target: nn.Module, inner: Any = None) -> None:
        self.strategy = strategy
        self.target = target
        self.replica_value = inner

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.strategy._forward(self.target, _unwrapped_forward(self.target, self.replica_value), inputs, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        target = memo.get(id(self.target), self.target)
        return _unwrapped_forward(target, copy.deepcopy(self.replica_value, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return _unwrapped_forward, (self.target, self.replica_value)


def _unwrapped_forward(target: nn.Module, inner: Any = None) -> Any:
    return types.MethodType(type(target).forward, target) if inner is None else inner


def _checked_module_names(names: Sequence[str] | None) -> list[str]:
    """``parallel_modules`` as a list: strings (``""`` for the LightningModule), at least one, none inside another."""
    if isinstance(names, str):
        raise TypeError(
            f"parallel_modules must be a list of submodule names, got the string {names!r}: write "
            f"parallel_modules=[{names!r}] ('' is the LightningModule itself)."
        )
    names = [""] if names is None else list(names)
    for position, name in enumerate(names):
        if not isinstance(name, str):
            raise TypeError(
                f"parallel_modules must hold submodule names (strings, '' for the LightningModule itself), but "
                f"item {position} is {name!r} ({type(name).__name__})."
            )
    if not names:
        raise ValueError("parallel_modules is empty: name at least one submodule ('' is the LightningModule).")
    for outer, inner in permutations(names, 2):
        if outer == inner or outer == "" or inner.startswith(f"{outer}."):
            raise ValueError(
                f"parallel_modules names {outer!r} and {inner!r}, but {inner!r} runs inside {outer!r}. Name only "
                "the outermost module."
            )
    return names


def _replica_scalars(outputs: list[Any]) -> dict[str, list[Tensor]]:
    """Per-replica losses: each replica's floating 0-dim tensor at each path where they differ by replica."""
    first, *others = [dict(iter_tensors(output, "output")) for output in outputs]
    return {
        path: [tensor, *(o[path] for o in others)]
        for path, tensor in first.items()
        if tensor.dim() == 0 and tensor.is_floating_point() and any(o.get(path) is not tensor for o in others)
    }
