"""``strategy="dp"``: classic DataParallel, back in Lightning 2.

The ``*_step`` runs once, on the root device, with the whole batch; only the module's ``forward`` (or the named
submodules' ``forward``) runs replicated, and its outputs are gathered on ``output_device``, where the user's loss then
runs. This is ``torch.nn.DataParallel``'s data flow: simple, manual optimization works, and the gathered outputs plus
the loss's activations sit on one device, which is why that device runs out of memory first when outputs are large.

Two things differ from ``nn.DataParallel``, both so that training equals one device: a scalar a forward returns per
replica (a ``transformers`` model's ``.loss``) is combined into one value by the rule ``loss_reduction`` or the
module's objects declare (as ``parallel_criterion`` combines step losses) instead of being stacked; and a step that
never calls a replicated forward (``self.model(...)`` instead of ``self(...)``) is reported instead of silently
running on one device.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_mgpu.parallel.devices import DeviceLike, to_device
from lightning_mgpu.parallel.merge import merge_outputs
from lightning_mgpu.parallel.run_replicas import ExecutionMode
from lightning_mgpu.parallel.scatter_gather import (
    args_batch_size,
    argument_roots,
    iter_tensors,
    split_arguments,
    split_or_run_once,
)
from lightning_mgpu.strategies.loss_normalization import (
    SAMPLES,
    LossNormalization,
    assumed_samples_notice,
    known_rule,
)
from lightning_mgpu.strategies.namespace import Accelerator, CheckpointIO, PrecisionPlugin
from lightning_mgpu.strategies.single_process import SingleProcessParallel


class DataParallelStrategyBase(SingleProcessParallel):
    """One process, N devices: forward replicated, outputs gathered on ``output_device`` (``nn.DataParallel``).

    Args:
        output_device: where outputs are gathered; default the root device (``parallel_devices[0]``). An int is a
            CUDA device index, as for ``nn.DataParallel`` and ``DataParallelModel`` (and Lightning's
            ``devices=[2, 3]``); a string (``"cuda:3"``) or ``torch.device`` works too.
        parallel_modules: names of the submodules whose ``forward`` runs replicated (e.g. ``["backbone"]``); default
            (or ``None``) ``[""]``: the LightningModule's own ``forward``, i.e. every ``self(...)`` call in a step.
        loss_reduction: how a scalar that the replicated forward returns (a ``transformers`` model's ``.loss``) is
            normalised on each replica, as for ``parallel_criterion``; ``<key>`` names a forward argument
            (``tokens:labels`` for ``labels=``, ``tokens:1`` for the second positional one). ``"auto"`` (default):
            what the module's objects say, else a per-sample mean, said once with the fix.
        dim: the batch dimension of inputs and outputs.
        execution_mode: ``"auto"`` (threads on distinct GPUs, else sequential), ``"threads"`` or ``"sequential"``.
    """

    strategy_name = "dp"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: PrecisionPlugin | None = None,
        output_device: DeviceLike | None = None,
        parallel_modules: Sequence[str] | None = ("",),
        loss_reduction: str = "auto",
        dim: int = 0,
        execution_mode: ExecutionMode = "auto",
    ) -> None:
        super().__init__(accelerator, parallel_devices, checkpoint_io, precision_plugin, dim, execution_mode)
        self.normalization = LossNormalization.parse(loss_reduction)
        self.loss_reduction = loss_reduction
        if output_device is not None:
            to_device(output_device)  # a clear error now, not at the first step
        self._output_device = output_device
        if parallel_modules is None:
            parallel_modules = ("",)
        if isinstance(parallel_modules, str):
            raise TypeError(
                f"parallel_modules must be a list of submodule names, got the string {parallel_modules!r}: write "
                f"parallel_modules=[{parallel_modules!r}] for one module ('' is the LightningModule itself)."
            )
        for position, name in enumerate(parallel_modules):
            if not isinstance(name, str):
                raise TypeError(
                    f"parallel_modules must hold submodule names (strings, '' for the LightningModule itself), but "
                    f"item {position} is {name!r} ({type(name).__name__})."
                )
        self.parallel_modules = list(parallel_modules)
        if not self.parallel_modules:
            raise ValueError("parallel_modules is empty: name at least one submodule ('' is the LightningModule).")
        for i, outer in enumerate(self.parallel_modules):
            for j, inner in enumerate(self.parallel_modules):
                if i != j and (outer == inner or outer == "" or inner.startswith(f"{outer}.")):
                    raise ValueError(
                        f"parallel_modules names {outer!r} and {inner!r}, but {inner!r} runs inside {outer!r}: its "
                        "forward would be replicated again inside each replica. Name only the outermost module."
                    )
        self._wrapped: list[nn.Module] = []
        self._in_step = False
        self._forward_calls = 0
        self._scalar_rules: dict[str, LossNormalization] = {}
        self._warned_unreplicated: set[str] = set()

    @classmethod
    @override
    def registered_names(cls) -> tuple[str, ...]:
        return (cls.strategy_name, "data_parallel")

    @property
    @override
    def _collectives_hint(self) -> str:
        return "Under dp the step runs once, on the root, where collectives are identities: call them in the step."

    @property
    def output_device(self) -> torch.device:
        """The device outputs are gathered on."""
        return self.root_device if self._output_device is None else to_device(self._output_device)

    # --- the parallel forward, installed once per fit/validate/test/predict ------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if len(self.parallel_devices) > 1:
            for target in self._targets():
                target.forward = ParallelForward(self, target)  # an instance attribute: never in state dicts
                self._wrapped.append(target)

    @override
    def teardown(self) -> None:
        for target in self._wrapped:
            target.__dict__.pop("forward", None)
        self._wrapped = []
        super().teardown()

    def _targets(self) -> list[nn.Module]:
        module = self.lightning_module
        targets = []
        for name in self.parallel_modules:
            try:
                targets.append(module.get_submodule(name) if name else module)
            except AttributeError as err:
                raise ValueError(
                    f"parallel_modules names {name!r}, which is not a submodule of {type(module).__name__}."
                ) from err
        return targets

    @override
    def _run_step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        module = self.lightning_module
        self._in_step, self._forward_calls = True, 0
        try:
            with self._step_context(hook):
                output = getattr(module, hook)(*args, **kwargs)
        finally:
            self._in_step = False
        if self._wrapped and self._forward_calls == 0 and hook in ("training_step", "validation_step"):
            self._warn_unreplicated(hook)
        return output

    def _warn_unreplicated(self, hook: str) -> None:
        if hook in self._warned_unreplicated:
            return
        self._warned_unreplicated.add(hook)
        names = [n or "self" for n in self.parallel_modules]
        warnings.warn(
            f"dp: `{hook}` ran on one device: it never called the replicated forward of {names} (`self(...)` for "
            "the LightningModule), so nothing ran in parallel. A call such as `self.model(...)` bypasses it: call "
            "`self(...)` and have `forward` call the model, or pass DataParallelStrategy(parallel_modules=['model']).",
            UserWarning,
            stacklevel=2,
        )

    def _forward(self, target: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        original = types.MethodType(type(target).forward, target)
        if not self._in_step:
            return original(*inputs, **kwargs)  # outside a step (a callback's self(x)): a plain call
        self._forward_calls += 1
        batch_size = split_or_run_once(
            lambda: args_batch_size(inputs, kwargs, self.dim), argument_roots(inputs, kwargs)
        )
        if batch_size is None:
            return original(*inputs, **kwargs)  # nothing to split: run once, on the root
        devices = self.parallel_devices
        args_chunks, kwargs_chunks, sizes = split_arguments(inputs, kwargs, devices, self.dim, batch_size=batch_size)
        if len(sizes) == 1:
            return original(*args_chunks[0], **kwargs_chunks[0])

        def call(index: int, replica: nn.Module) -> Any:
            return replica(*args_chunks[index], **kwargs_chunks[index])

        outputs = self._run_replicated(target, sizes, call)
        chunks = [_arguments(a, k) for a, k in zip(args_chunks, kwargs_chunks, strict=True)]
        weights = self._scalar_weights(target, outputs, chunks, sizes, _arguments(inputs, kwargs))
        return merge_outputs(outputs, self.output_device, self.dim, sizes=sizes, weights=weights)

    # --- scalars in forward outputs (a transformers model's .loss) --------------------------------------------------
    def _scalar_weights(
        self, target: nn.Module, outputs: list[Any], chunks: list[dict[Any, Any]], sizes: list[int], whole: Any
    ) -> dict[str, Any]:
        """How to combine each floating scalar of the outputs that differs between replicas: sample counts for a
        per-sample mean, token counts for a token mean, summed for a sum."""
        weights: dict[str, Any] = {}
        for path in _floating_scalar_paths(outputs):
            rule = self._scalar_rules.get(path)
            if rule is None:
                rule = self._scalar_rules[path] = self._rule_for(target, path, whole)
            if rule.kind == "sum":
                weights[path] = "sum"
            elif rule.kind == "replica_mean":
                weights[path] = [1] * len(outputs)
            else:
                weights[path] = rule.weights(chunks, sizes)
        return weights

    def _rule_for(self, target: nn.Module, path: str, arguments: dict[Any, Any]) -> LossNormalization:
        """``loss_reduction``, else what ``target``'s objects say (said once), else per-sample (said once)."""
        if self.normalization is not None:
            return self.normalization
        known = known_rule(target, arguments, method="forward")
        where = f"{path} of {type(target).__name__}.forward"
        if known is not None:
            rule, source = known
            self._log(
                f"dp: {where} is {rule.describe()}, as {source} says; the replicas' values are combined "
                f"accordingly (loss_reduction={rule.spec()!r})."
            )
            return rule
        fixes = (
            "declare it: DataParallelStrategy(loss_reduction='sum' | 'tokens:<labels argument>') (CLI: "
            "--trainer.strategy.init_args.loss_reduction=...), or compute the loss in the step from the gathered "
            "outputs (call the model without labels)"
        )
        warnings.warn(assumed_samples_notice("dp", where, fixes), UserWarning, stacklevel=2)
        return SAMPLES


class ParallelForward:
    """The replicated ``forward`` that ``dp`` installs on each target module for a run (removed at teardown).

    Copies and pickles of the module get a plain bound ``forward`` instead, so an EMA copy or a pickled module never
    carries the strategy along."""

    def __init__(self, strategy: DataParallelStrategyBase, target: nn.Module) -> None:
        self.strategy = strategy
        self.target = target

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.strategy._forward(self.target, inputs, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copy = memo.get(id(self.target), self.target)
        return types.MethodType(type(copy).forward, copy)

    def __reduce__(self) -> tuple[Any, ...]:
        return _plain_forward, (self.target,)


def _plain_forward(target: nn.Module) -> Any:
    return types.MethodType(type(target).forward, target)


def _floating_scalar_paths(outputs: list[Any]) -> list[str]:
    """Paths (as gather names them) of floating 0-dim tensors in the first output whose values differ by replica."""
    paths = []
    for path, tensor in iter_tensors(outputs[0], "output"):
        if tensor.dim() == 0 and tensor.is_floating_point():
            values = [_at(o, path) for o in outputs]
            if not all(v is tensor for v in values[1:]):
                paths.append(path)
    return paths


def _at(output: Any, path: str) -> Any:
    """The value of ``output`` at a path as ``iter_tensors`` names it (``output['loss']``, ``output.x``)."""
    for candidate, tensor in iter_tensors(output, "output"):
        if candidate == path:
            return tensor
    return None


def _arguments(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Any, Any]:
    """A forward's arguments as one mapping, as ``loss_reduction`` keys name them: positions and keywords."""
    return {**dict(enumerate(args)), **kwargs}
