"""``strategy="dp"``: classic DataParallel, back in Lightning 2.

The ``*_step`` runs once, on the root device, with the whole batch; only the module's ``forward`` (or the named
submodules' ``forward``) runs replicated, and its outputs are gathered on ``output_device``, where the user's loss then
runs. This is ``torch.nn.DataParallel``'s data flow: simple, manual optimization works, and the gathered outputs plus
the loss's activations sit on one device, which is why that device runs out of memory first when outputs are large.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_mgpu.parallel.devices import DeviceLike, to_device
from lightning_mgpu.parallel.parallel_apply import ExecutionMode
from lightning_mgpu.parallel.scatter_gather import NothingToSplitError, args_batch_size, gather, scatter_args
from lightning_mgpu.strategies.single_process import SingleProcessParallelStrategy


class DataParallelStrategy(SingleProcessParallelStrategy):
    """DataParallel in Lightning 2: forward replicated, outputs gathered on one device.

    Args:
        output_device: where outputs are gathered: an int is an index into the strategy's devices (with
            ``devices=[2, 3]``, ``1`` is ``cuda:3``), anything else a device (``"cuda:3"``); default the root device
            (``parallel_devices[0]``).
        parallel_modules: dotted names of the submodules whose ``forward`` runs replicated (e.g. ``["backbone"]``);
            default ``[""]``: the LightningModule's own ``forward``, i.e. every ``self(...)`` call in a step.
        dim: the batch dimension of inputs and outputs.
        execution_mode: ``"auto"`` (threads on distinct GPUs, else sequential), ``"threads"`` or ``"sequential"``.
    """

    strategy_name = "dp"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        output_device: DeviceLike | None = None,
        parallel_modules: Sequence[str] = ("",),
        dim: int = 0,
        execution_mode: ExecutionMode = "auto",
    ) -> None:
        super().__init__(accelerator, parallel_devices, checkpoint_io, precision_plugin, dim, execution_mode)
        self._output_device = output_device
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

    @property
    def output_device(self) -> torch.device:
        """The device outputs are gathered on."""
        if self._output_device is None:
            return self.root_device
        if isinstance(self._output_device, int) and not isinstance(self._output_device, bool):
            if not 0 <= self._output_device < len(self.parallel_devices):
                raise ValueError(
                    f"output_device={self._output_device} is not an index into the {len(self.parallel_devices)} "
                    "devices of this strategy."
                )
            return self.parallel_devices[self._output_device]
        return to_device(self._output_device)

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

    @contextmanager
    def _replicated_forward(self):
        """Patch each target's ``forward`` on the instance (never saved in state dicts) for the step's duration."""
        if len(self.parallel_devices) == 1:
            yield
            return
        targets = self._targets()
        for target in targets:
            target.forward = self._make_parallel_forward(target)
        try:
            yield
        finally:
            for target in targets:
                target.__dict__.pop("forward", None)

    def _make_parallel_forward(self, target: nn.Module):
        original = type(target).forward.__get__(target)

        def parallel_forward(*inputs: Any, **kwargs: Any) -> Any:
            try:
                batch_size = args_batch_size(inputs, kwargs, self.dim)
            except NothingToSplitError:
                return original(*inputs, **kwargs)  # no tensor input: run once, on root
            args_chunks, kwargs_chunks, sizes = scatter_args(
                inputs, kwargs, self.parallel_devices, self.dim, batch_size=batch_size
            )
            devices = self.parallel_devices[: len(sizes)]

            def call(index: int, replica: Any) -> Any:
                return replica(*args_chunks[index], **kwargs_chunks[index])

            outputs = self._run_replicas(target, devices, sizes, call)
            return gather(outputs, self.output_device, self.dim, sizes=sizes)

        return parallel_forward

    def _run_step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self._step_context(hook), self._replicated_forward():
            return getattr(self.lightning_module, hook)(*args, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        description = "One process, N devices: forward replicated, outputs gathered on output_device (nn.DataParallel)"
        for name in (cls.strategy_name, "data_parallel"):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description)
