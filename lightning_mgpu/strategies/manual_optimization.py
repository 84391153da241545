"""Manual optimization under ``parallel_criterion``: every replica runs the whole ``training_step`` on its shard, and
the replicas meet where one device would touch the shared optimizer state: at ``self.manual_backward(loss)`` (their
losses combined by the loss rule, one backward pass) and at ``opt.step()`` (one step on the root, the replicas' copies
synced before any goes on). Replica 0 steps the schedulers; another replica that steps one waits there for replica
0's step, so that none reads the rate before it changed. ``clip_gradients`` and ``toggle_optimizer`` /
``untoggle_optimizer`` act on the originals: replica 0 alone calls them. A replica that skips a meeting fails the
others with an error naming it (:mod:`..parallel.replica_group`), never a hang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from lightning_mgpu.parallel.replica_group import ReplicaContext, current_replica

_HINT = (
    "Under parallel_criterion with manual optimization every replica must call manual_backward and opt.step() the "
    "same number of times, in the same order: branch on something every replica shares (batch_idx, the epoch), not "
    "on one shard's values or size."
)
_FOLLOW = (
    "Under parallel_criterion with manual optimization replica 0 steps the schedulers for all replicas and the others "
    "wait for its step: call the scheduler's step() on every replica alike (unconditionally, or behind something "
    "every replica shares: batch_idx, the epoch), or on replica 0 alone (behind self.trainer.is_global_zero)."
)
_ONCE = ("toggle_optimizer", "untoggle_optimizer", "clip_gradients")  # they act on the originals: once, by replica 0


def meet(what: str, value: Any, combine: Callable[[list[Any]], Any]) -> Any:
    """Meet the other replicas of the step at the next ``what``; ``combine(values in replica order)`` runs once, in
    the last replica to arrive; every replica gets its result."""
    replica = current_replica()
    assert replica is not None
    call = replica.next_call(what)
    return replica.group.rendezvous(
        replica.index,
        ("manual", what, call),
        value,
        lambda values: [combine(values)] * len(values),
        f"{what} (call {call} of this step)",
        _HINT,
    )


class _Shared:
    """An object the replicas share, as one replica sees it: what is not overridden is the object's."""

    def __init__(self, wrapped: Any, first: bool) -> None:
        self._wrapped = wrapped
        self._first = first  # replica 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


class ReplicaOptimizer(_Shared):
    """What ``self.optimizers()`` returns on a replica: the Lightning optimizer, whose ``step`` runs once for all
    replicas (the closure, if any, runs on each replica first: it holds that replica's ``manual_backward``)."""

    def __init__(self, optimizer: Any, after_step: Callable[[], None], first: bool) -> None:
        super().__init__(optimizer, first)
        self._after_step = after_step

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None

        def step_once(_: list[Any]) -> None:
            self._wrapped.step(**kwargs)
            self._after_step()  # the replicas' copies follow the root before any replica goes on

        meet("optimizer.step()", None, step_once)
        return result

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        with self._wrapped.toggle_model(sync_grad) if self._first else contextlib.nullcontext():
            yield


class _Scheduler(_Shared):
    """What ``self.lr_schedulers()`` returns on a replica: replica 0 steps it, once a step as on one device; another
    replica that steps it waits there for replica 0's step, so that none reads the rate before it changed (a step
    replica 0 takes alone, behind ``self.trainer.is_global_zero``, is fine)."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        replica, key = current_replica(), ("lr_scheduler.step()", id(self._wrapped))
        if replica is None or replica.index == 0:
            self._wrapped.step(*args, **kwargs)
            if replica is not None:
                replica.group.lead(key)
        else:
            call = replica.next_call(key)
            replica.group.follow(replica.index, key, call, f"lr_scheduler.step() (call {call} of this step)", _FOLLOW)


def replica_overrides(module: Any, replica: ReplicaContext | None, after_step: Callable[[], None]) -> dict[str, Any]:
    """The per-replica methods that make manual optimization meet: ``optimizers``, ``lr_schedulers`` and those of
    ``_ONCE`` (bound to ``module``, the LightningModule the replicas copy)."""
    wrapped: dict[int, ReplicaOptimizer] = {}
    first = replica is None or replica.index == 0

    def optimizer(found: Any) -> ReplicaOptimizer:
        if id(found) not in wrapped:
            wrapped[id(found)] = ReplicaOptimizer(found, after_step, first)
        return wrapped[id(found)]

    def optimizers(use_pl_optimizer: bool = True) -> Any:
        found = module.optimizers(use_pl_optimizer)
        return _each(found, optimizer) if use_pl_optimizer else found

    def lr_schedulers() -> Any:
        found = module.lr_schedulers()
        return None if found is None else _each(found, lambda scheduler: _Scheduler(scheduler, first))

    def once(name: str) -> Callable[..., None]:
        def call(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            if first:
                unwrapped = optimizer._wrapped if isinstance(optimizer, ReplicaOptimizer) else optimizer
                getattr(module, name)(unwrapped, *args, **kwargs)

        return call

    return {"optimizers": optimizers, "lr_schedulers": lr_schedulers, **{name: once(name) for name in _ONCE}}


def _each(found: Any, wrap: Callable[[Any], Any]) -> Any:
    """``wrap`` applied to ``found``, or to each of its items where it is a list."""
    return [wrap(item) for item in found] if isinstance(found, list) else wrap(found)
