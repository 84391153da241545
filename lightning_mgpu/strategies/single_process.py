"""What ``parallel_criterion`` and ``dp`` share, for either Lightning namespace.

One process drives every device: ranks are 0 and ``world_size`` is 1. Weights and optimizer state live on the root
device (``parallel_devices[0]``); the LightningModule is stored unwrapped, so checkpoints move between strategies.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn
from typing_extensions import override

from lightning_mgpu.parallel import collectives, sync_batchnorm
from lightning_mgpu.parallel.modules import say_split_sensitive_layers
from lightning_mgpu.parallel.replica_group import TAKE_TURNS, current_replica
from lightning_mgpu.parallel.replicas import SYNC_BATCHNORM_THREADS, ReplicaCache
from lightning_mgpu.parallel.run_replicas import EXECUTION_MODES, ExecutionMode, add_note, resolve_mode
from lightning_mgpu.parallel.scatter_gather import shared_state, split_or_run_once
from lightning_mgpu.strategies import manual_optimization
from lightning_mgpu.strategies.checks import (
    StepChecks,
    distributed_gather_message,
    distributed_gathers,
    functional_metric_message,
)
from lightning_mgpu.strategies.lightning_replicas import LightningReplicas
from lightning_mgpu.strategies.loss_rules import LossNormalization
from lightning_mgpu.strategies.replica_logging import LossCopy


@dataclass(frozen=True)
class LightningNamespace:
    """Classes from the user's Lightning namespace (``lightning.pytorch`` and ``pytorch_lightning`` are copies)."""

    name: str
    lightning_module: type
    misconfiguration: type[Exception]
    device_dtype_mixin: type


T = TypeVar("T")


def _step_hook(hook: str) -> Callable[..., Any]:
    """The strategy's ``hook`` (``training_step``...), which Lightning calls: the subclass's ``_run_step``."""

    def step(self: SingleProcessParallel, *args: Any, **kwargs: Any) -> Any:
        return self._run_step(hook, args, kwargs)

    step.__name__ = step.__qualname__ = hook
    return override(step)


class SingleProcessParallel:
    """Shared implementation of ``parallel_criterion`` and ``dp``; mixed in before a Lightning ``ParallelStrategy``."""

    strategy_name: ClassVar[str] = ""
    _STEP_PER_REPLICA: ClassVar[bool] = True  # the replicated call runs the whole step (dp: the forward alone)
    aliases: ClassVar[tuple[str, ...]] = ()
    namespace: ClassVar[LightningNamespace]
    if TYPE_CHECKING:  # provided by the Lightning ParallelStrategy this class is mixed into
        lightning_module: Any
        model: Any
        parallel_devices: list[torch.device]
        precision_plugin: Any
        _layer_sync: Any

    def __init__(
        self,
        accelerator: Any,
        parallel_devices: list[torch.device] | None,
        checkpoint_io: Any,
        precision_plugin: Any,
        dim: int,
        execution_mode: ExecutionMode,
        loss_reduction: str,
        sync_batchnorm: bool = True,
    ) -> None:
        # A mixin: ParallelStrategy(accelerator, parallel_devices, cluster_environment, ...) is next in the MRO.
        super().__init__(accelerator, parallel_devices, None, checkpoint_io, precision_plugin)  # type: ignore[call-arg]
        if execution_mode not in EXECUTION_MODES:
            raise ValueError(f"execution_mode must be one of {EXECUTION_MODES}, got {execution_mode!r}.")
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"dim must be an int (the batch dimension), got {dim!r}.")
        if not isinstance(sync_batchnorm, bool):
            raise TypeError(f"sync_batchnorm must be True or False, got {sync_batchnorm!r}.")
        self.dim, self.execution_mode, self.sync_batchnorm = dim, execution_mode, sync_batchnorm
        self.normalization = LossNormalization.parse(loss_reduction)
        self.loss_reduction = loss_reduction
        self._replicas = ReplicaCache(partial(LightningReplicas, namespace=self.namespace))
        self._converted_batchnorm = False
        self._announced: set[str] = set()
        #: What each number the run's losses divide or multiply by was read as (a count, a constant), by the loss's
        #: shape: a step whose shards make it ambiguous (a constant equal to every shard's size) follows earlier ones.
        self._settled: dict[Any, str] = {}
        self._replicated_on: list[torch.device] = []
        self._checks = StepChecks(self)

    # --- one Trainer per instance: the connector reads `_accelerator` of an instance it receives: refused there ---
    @property
    @override
    def accelerator(self) -> Any:
        return self.__dict__.get("_mgpu_accelerator")

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:  # called by the Trainer that takes this instance
        self.__dict__.update(_mgpu_accelerator=accelerator, _mgpu_configured=True)

    @property
    def _accelerator(self) -> Any:
        if self.__dict__.get("_mgpu_configured"):
            raise self.namespace.misconfiguration(
                f"This {type(self).__name__} instance already belongs to another Trainer. Create a new instance for "
                f"each Trainer, or pass strategy={self.strategy_name!r}."
            )
        return self.__dict__.get("_mgpu_accelerator")

    @_accelerator.setter
    def _accelerator(self, accelerator: Any) -> None:  # Strategy.__init__
        self.__dict__["_mgpu_accelerator"] = accelerator

    # --- one process: constant ranks (shadowing ParallelStrategy's properties), collectives across the replicas -------
    global_rank = local_rank = node_rank = 0
    world_size = 1
    is_distributed = False  # no DistributedSampler; self.log(sync_dist=True) is a no-op
    distributed_sampler_kwargs = None
    training_step = _step_hook("training_step")
    validation_step = _step_hook("validation_step")
    test_step = _step_hook("test_step")
    predict_step = _step_hook("predict_step")

    @property
    @override
    def is_global_zero(self) -> bool:
        """In a replicated call, replica 0 alone (DDP's rank 0): `self.print` and code guarded by it run once per step,
        on replica 0's shard, not once per replica."""
        replica = current_replica()
        return replica is None or replica.index == 0

    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError(f"{type(self).__name__} has no devices yet; it gets them when the Trainer is built.")
        return self.parallel_devices[0]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return collectives.reduce(tensor, reduce_op, sequential_hint=self._collectives_hint)

    @override
    def barrier(self, name: str | None = None) -> None:
        collectives.barrier(sequential_hint=self._collectives_hint)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast(obj, src, sequential_hint=self._collectives_hint)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return collectives.all_gather(tensor, sync_grads, sequential_hint=self._collectives_hint)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return collectives.all_true(decision, all, sequential_hint=self._collectives_hint)

    @property
    def _collectives_hint(self) -> str:
        return (
            f"Pass {type(self).__name__}(collectives=True) (CLI: {self._cli_options('collectives=true')}) so that the "
            "replicas run in threads and meet."
        )

    def _cli_options(self, init_arg: str) -> str:
        """LightningCLI options that set ``init_arg`` (a strategy given by name takes no ``init_args``)."""
        cls = type(self)
        short = self.namespace.name == "lightning.pytorch"
        path = f"lightning_mgpu.{cls.__name__}" if short else f"{cls.__module__}.{cls.__name__}"
        return f"--trainer.strategy.class_path={path} --trainer.strategy.init_args.{init_arg}"

    # --- set-up and teardown -----------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        synchronised = self._layer_sync is not None or (self.sync_batchnorm and len(self.parallel_devices) > 1)
        if synchronised and not self._converted_batchnorm:
            # Before the optimizers exist; the converted layers keep the same Parameter objects anyway.
            sync_batchnorm.convert_sync_batchnorm(trainer.lightning_module)
            self._converted_batchnorm = True
        super().setup(trainer)  # type: ignore[misc]  # a mixin: ParallelStrategy is next in the MRO
        self._say_setup()

    def _say_setup(self) -> None:
        """One line beside Lightning's own ("GPU available: ..."): the replicas, how they run, BatchNorm; then warnings
        of what the module's code computes per shard."""
        devices, module = list(self.parallel_devices), self.lightning_module
        if len(devices) == 1:
            warnings.warn(
                f"{self.strategy_name} is running on one device ({devices[0]}), as without the strategy. Pass "
                "devices=N for N replicas (accelerator='cpu', devices=2 tries 2 virtual CPU devices).",
                UserWarning,
                stacklevel=2,
            )
            return
        threads = resolve_mode(self.execution_mode, devices) == "threads"
        chosen = " (execution_mode='auto')" if self.execution_mode == "auto" else ""
        synced = sync_batchnorm.has_sync_batchnorm(module)
        meets = self._why_replicas_meet(module, "training_step")
        notice = None if meets is None else _meeting_notice(meets)  # the key of _mode_for's override notice
        if meets is None and synced:
            meets, notice = SYNC_BATCHNORM_THREADS.partition(":")[0], SYNC_BATCHNORM_THREADS
        if meets is not None and not threads:
            threads, chosen = True, f" ({meets})"
            if self.execution_mode == "auto":  # this line says it: no override notice at the first step
                self._announced.add(notice)
        physical = len({(d.type, d.index) for d in devices})
        virtual = f"; virtual devices: {physical} physical device(s)" if physical < len(devices) else ""
        mode = "in threads, one per device" if threads else "one after another"
        batchnorm = (
            f"; BatchNorm synchronised across the replicas, as one device on the whole batch (opt out: "
            f"{type(self).__name__}(sync_batchnorm=False))"
            if synced
            else "; BatchNorm normalises each shard with its own statistics (sync_batchnorm=False)"
            if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
            else ""
        )
        self._log(
            f"{self.strategy_name}: {len(devices)} replicas on {', '.join(map(str, devices))}{virtual}; replicas run "
            f"{mode}{chosen}{batchnorm}."
        )
        for replicated in self._replicated_modules():
            say_split_sensitive_layers(replicated, self.strategy_name)
        if self._STEP_PER_REPLICA:  # dp: the step runs once, on the whole batch
            if found := distributed_gathers(module):
                self._warn_once("torch.distributed", distributed_gather_message(self.strategy_name, found))
            if message := functional_metric_message(self.strategy_name, module):
                self._warn_once("functional metric", message)

    def _replicated_modules(self) -> list[nn.Module]:
        return [self.lightning_module]

    @override
    def teardown(self) -> None:
        for replicas in self._replicas.pop_all():
            replicas.release()
        if self._converted_batchnorm and self.lightning_module is not None:
            sync_batchnorm.revert_sync_batchnorm(self.lightning_module)  # the module leaves with its own classes
            self._converted_batchnorm = False
        super().teardown()  # type: ignore[misc]  # a mixin: ParallelStrategy is next in the MRO

    # --- optimization ------------------------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_reduce() -> Any:
            result = closure()
            # A last micro-batch that skipped its backward pass (training_step returned None) left the reduction of
            # the earlier ones waiting; their backward passes ran while no hook read them (else none would wait).
            for replicas in self._replicas.values():
                if replicas.replica_set.pending:
                    replicas.replica_set.reduce_gradients(run_hooks=False)
            return result

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)  # type: ignore[misc]  # mixin

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._STEP_PER_REPLICA and current_replica() is not None:  # manual_backward inside a replicated step
            # The replicas meet: their losses combined by the loss rule, one backward pass through all of them, the
            # gradients reduced onto the originals (those trainable now), as one device's manual_backward leaves them.
            def backward_once(losses: list[torch.Tensor]) -> torch.Tensor:
                combined = self._combine_replica_losses(losses)
                self._backward_on_root(combined, optimizer, args, kwargs)
                for replicas in self._replicas.values():
                    replicas.replica_set.after_manual_backward()
                return combined

            return manual_optimization.meet("manual_backward", closure_loss, backward_once)
        return self._backward_on_root(closure_loss, optimizer, args, kwargs)

    def _combine_replica_losses(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The step's replicas' losses as one loss on the root (by the strategy's loss rule)."""
        raise NotImplementedError

    def _backward_on_root(
        self, closure_loss: torch.Tensor, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.Tensor:
        if (inputs := kwargs.get("inputs")) is not None:
            # manual_backward(loss, inputs=[...]) names the module's parameters; the graph reaches the leaves the
            # replicas hold of them (threads, other devices), whose gradients reach them by the reduction.
            sets, kwargs["inputs"] = [replicas.replica_set for replicas in self._replicas.values()], []
            for tensor in [inputs] if isinstance(inputs, torch.Tensor) else inputs:
                kwargs["inputs"].extend(next((found for rs in sets if (found := rs.leaves_of(tensor))), [tensor]))
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]  # mixin
        except Exception as err:
            if devices := self._replicated_on:
                add_note(
                    err,
                    f"Raised in the backward pass of a step that ran replicated on {len(devices)} devices "
                    f"({', '.join(map(str, devices))}). With Trainer(detect_anomaly=True) the forward traceback names "
                    "the replica in a frame `replica_<index>`.",
                )
            raise

    # --- replicated calls --------------------------------------------------------------------------------------------
    def _mode_for(self, replicas: LightningReplicas, count: int) -> tuple[ExecutionMode, bool]:
        """Threads or one after another (compiled code needs one thread, collectives many), and whether the threads
        could interleave: they take turns, one whole step each, unless they meet inside it or turns are off."""
        mode, reason = replicas.replica_set.execution_mode(self.execution_mode, count)
        meets = self._why_replicas_meet(replicas.module, self.lightning_module._current_fx_name) if count > 1 else None
        if meets is not None and resolve_mode(mode, replicas.devices[:count]) == "sequential":
            if replicas.replica_set.compiled:
                raise self.namespace.misconfiguration(
                    f"{meets}, so the replicas must run in threads to meet, but the model is compiled with "
                    "torch.compile, which is not thread-safe. Do not compile the model under this strategy, or use "
                    "strategy='dp' (the step runs once, on the whole batch) or strategy='ddp'."
                )
            mode, reason = "threads", _meeting_notice(meets)
        if reason is not None:  # a mode chosen by 'auto' is no override: said as information
            message = f"{self.strategy_name}: execution_mode={self.execution_mode!r} overridden: {reason}."
            self._warn_once(reason, message, log=self.execution_mode == "auto")
        threads = count > 1 and resolve_mode(mode, replicas.devices[:count]) == "threads"
        return mode, threads and (not TAKE_TURNS or meets is not None or replicas.replica_set.meets_at_batchnorm)

    def _why_replicas_meet(self, module: nn.Module, hook: str) -> str | None:
        """Why the replicas of ``module`` meet inside a ``hook`` call (so they run in threads), or ``None``."""
        if self._STEP_PER_REPLICA and hook == "training_step" and not self.lightning_module.automatic_optimization:
            return "manual optimization: the replicas meet at each manual_backward and optimizer step"
        return self._collectives_reason(module)

    def _collectives_reason(self, module: nn.Module) -> str | None:
        """Why the replicas of ``module`` meet inside a step (its collectives), or ``None``."""
        return None

    def _run_replicated(
        self,
        module: nn.Module,
        sample_counts: Sequence[int],
        call: Callable[[int, nn.Module], Any],
        loss_copy: Callable[[list[Any]], LossCopy] | None = None,
    ) -> list[Any]:
        """Run ``call(i, replica_i)`` on the first ``len(sample_counts)`` devices; merge logs and metrics into the
        LightningModule. ``loss_copy(outputs)`` merges logged values that are losses by their rule."""
        replicas = self._replicas.of(module, self.parallel_devices)
        replica_set, root, count = replicas.replica_set, self.lightning_module, len(sample_counts)
        self._replicated_on = replicas.devices[:count]
        if count < len(self.parallel_devices):  # said once: BoringModel's batches of 1 sample
            self._warn_once(
                "fewer samples than devices",
                f"{self.strategy_name}: a batch of {sum(sample_counts)} sample(s) ran on {count} of the "
                f"{len(self.parallel_devices)} devices (at least one sample per device); the others had nothing to do.",
                log=True,
            )
        hook = root._current_fx_name
        if replicas.hook != hook:  # a new stage: callbacks swap weights in through .data (EMA), which moves no
            replicas.hook = hook  # version counter: copy everything once
            replica_set.mark_stale()
        # Accumulating: replicas keep their gradients until the last backward pass, unless something reads them between.
        training = hook == "training_step"
        waiting = replica_set.defer_reduction  # the last micro-batch's reduction waits
        accumulating = (
            training and root.automatic_optimization and root.trainer.fit_loop.epoch_loop._should_accumulate()
        )
        reads = (waiting or accumulating) and self._reads_gradients_between_backward_passes(root)
        if waiting and reads:  # a hook (on_train_batch_start) came after the backward passes whose reduction waits
            replica_set.reduce_gradients(run_hooks=False)
        replica_set.defer_reduction = accumulating and not reads
        # On the first two calls of each hook only: what a call could change once per replica (StepChecks).
        checking = count > 1 and self._checks.calls[hook] < 2
        if checking:
            self._checks.before(hook, module, root)
        snapshots: list[dict[str, Any]] = [{}] * count  # replaced, never mutated
        manual = self._STEP_PER_REPLICA and training and not root.automatic_optimization

        def watched(index: int, replica: nn.Module) -> Any:
            if manual:  # the replicas meet at the shared optimizers
                after_step = partial(replica_set.after_optimizer_step, count)
                replica.__dict__.update(manual_optimization.replica_overrides(root, current_replica(), after_step))
            if index == 0 or checking:
                snapshots[index] = replica.__dict__.copy()  # once prepared: what the step may rebind
            return call(index, replica)

        mode, interleaved = self._mode_for(replicas, count)
        outputs = replicas.run(count, watched, mode)
        kept = replica_set.keep_first_replicas(snapshots[0])  # the root module stands for replica 0
        if checking:
            used = replica_set.replicas[:count]
            self._checks.after(hook, kept, used, snapshots, manual=manual, interleaved=interleaved)
        copy = loss_copy(outputs) if loss_copy is not None else None
        if alone := replicas.merge_into(root, sample_counts, copy, outputs):  # logged behind is_global_zero
            index = next(iter(alone.values()))
            self._warn_once(
                f"logged alone:{hook}",
                f"{self.strategy_name}: `{hook}` logged {', '.join(map(repr, alone))} on replica {index} alone (behind "
                f"`self.trainer.is_global_zero`, or a condition only its shard met), so the value logged is replica "
                f"{index}'s, from its shard ({sample_counts[index]} of {sum(sample_counts)} samples), not the whole "
                "batch's as on one device (ModelCheckpoint and EarlyStopping read it too). Call self.log on every "
                "replica (without the condition; rank_zero_only=True may stay): their values merge into one device's. "
                "A value that does not depend on the batch (a learning rate) is right as it is.",
            )
        return outputs

    def _reads_gradients_between_backward_passes(self, root: Any) -> bool:
        """Whether ``on_after_backward`` or a gradient hook must see each backward pass's gradients."""
        if any(p._backward_hooks or p._post_accumulate_grad_hooks for p in root.parameters()):
            return True
        is_overridden = importlib.import_module(f"{self.namespace.name}.utilities.model_helpers").is_overridden
        return any(is_overridden("on_after_backward", obj) for obj in (root, *root.trainer.callbacks))

    def _log(self, message: str) -> None:
        logging.getLogger(self.namespace.name).info(message)

    def _warn_once(self, key: str, message: str, log: bool = False) -> None:
        """Say ``message`` once per ``key``: a warning, or information (``log``)."""
        if key not in self._announced:
            self._announced.add(key)
            if log:
                self._log(message)
            else:
                warnings.warn(message, UserWarning, stacklevel=3)

    def _split(self, split: Callable[[], T], roots: Sequence[tuple[str, Any]], what: str, runs: str) -> T | None:
        """``split()``, or ``None`` when ``what`` holds nothing to split or a cache every replica would change: then
        ``runs`` runs once, on the root, which is said once."""
        result = split_or_run_once(split, roots)
        if result is None and (held := shared_state(roots)) is not None:
            self._warn_once(
                f"unsplit:cache:{runs}",
                f"{self.strategy_name}: {what} holds {held}, a transformers cache every replica would append to, so "
                f"{runs} runs once, unsplit, on {self.root_device} while it holds one: nothing runs in parallel then.",
            )
        elif result is None:
            self._warn_once(
                f"unsplit:{runs}",
                f"{self.strategy_name}: nothing in {what} can be split along dim {self.dim}, so {runs} runs once, on "
                f"{self.root_device}: nothing runs in parallel. Pass tensors in tuples, lists, dicts, namedtuples or "
                "dataclasses.",
            )
        return result

    # --- the four step hooks Lightning calls on the strategy (above) run this -----------------------------------------
    def _run_step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _step_context(self, hook: str) -> AbstractContextManager[Any]:
        """The precision plugin's context for ``hook``."""
        self._replicated_on = []
        name = hook.replace("training", "train").replace("validation", "val")
        return getattr(self.precision_plugin, f"{name}_context")()


def _meeting_notice(meets: str) -> str:
    """Why replicas that meet inside the step run in threads."""
    return f"{meets}: replicas run in threads so that they meet"
