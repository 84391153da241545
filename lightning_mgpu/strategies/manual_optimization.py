"""Manual optimization under ``parallel_criterion``: every replica runs the whole ``training_step`` on its shard, and
the replicas meet where one device would touch the shared optimizer state: at ``self.manual_backward(loss)`` (their
losses combined by the loss rule, one backward pass) and at ``opt.step()`` (one step on the root, the replicas' copies
synced before any goes on). Replica 0 steps the schedulers (the others wait there for its step) and alone calls
``clip_gradients`` and ``(un)toggle_optimizer``, which act on the originals. A replica that skips a meeting fails the
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
    label = f"{what} (call {call} of this step)"
    return replica.group.rendezvous(
        replica.index, ("manual", what, call), value, lambda v: [combine(v)] * len(v), label, _HINT
    )


class _Shared:
    """An object the replicas share, as one replica (``first``: replica 0) sees it: what is not overridden is the
    object's."""

    def __init__(self, wrapped: Any, first: bool, after_step: Callable[[], None] | None = None) -> None:
        self._wrapped, self._first, self._after_step = wrapped, first, after_step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


class ReplicaOptimizer(_Shared):
    """What ``self.optimizers()`` returns on a replica: the Lightning optimizer, whose ``step`` runs once for all
    replicas (the closure, if any, runs on each replica first: it holds that replica's ``manual_backward``), then
    ``after_step`` syncs the replicas' copies before any replica goes on."""

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        meet("optimizer.step()", None, lambda _: (self._wrapped.step(**kwargs), self._after_step()))
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
    first = replica is None or replica.index == 0
    wrapped: dict[int, ReplicaOptimizer] = {}  # one per optimizer, whichever call returns it

    def each(found: Any, wrap: Callable[[Any], Any]) -> Any:
        return [wrap(item) for item in found] if isinstance(found, list) else wrap(found)

    def optimizer(found: Any) -> ReplicaOptimizer:
        return wrapped.setdefault(id(found), ReplicaOptimizer(found, first, after_step))

    def optimizers(use_pl_optimizer: bool = True) -> Any:
        found = module.optimizers(use_pl_optimizer)
        return each(found, optimizer) if use_pl_optimizer else found

    def lr_schedulers() -> Any:
        found = module.lr_schedulers()
        return None if found is None else each(found, lambda scheduler: _Scheduler(scheduler, first))

    def once(name: str) -> Callable[..., None]:
        def call(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            if first:
                unwrapped = optimizer._wrapped if isinstance(optimizer, ReplicaOptimizer) else optimizer
                getattr(module, name)(unwrapped, *args, **kwargs)

        return call

    return {"optimizers": optimizers, "lr_schedulers": lr_schedulers, **{name: once(name) for name in _ONCE}}
