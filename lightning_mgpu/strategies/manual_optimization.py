"""Manual optimization under ``parallel_criterion``: every replica runs the whole ``training_step`` on its shard, and
the replicas meet where one device would touch the shared optimizer state.

- ``self.manual_backward(loss)``: the replicas' losses are combined on the root by the loss rule and one backward pass
  runs through all of them; the gradients then lie on the original parameters, reduced, as on one device.
- ``opt.step()`` (of ``self.optimizers()``): the optimizer steps once, on the root, after every replica arrived; the
  replicas' copies are synced before any of them goes on.
- ``clip_gradients``: replica 0 alone clips the originals' gradients (before the step, which waits for it).
- ``self.lr_schedulers()``: the schedulers, stepped by replica 0 alone.
- ``toggle_optimizer`` / ``untoggle_optimizer``: replica 0 alone sets ``requires_grad`` on the original parameters (the
  others would record each other's toggled state); a gradient reaches only parameters left trainable, as on one device.

Every meeting is a rendezvous of the step's replicas (:mod:`..parallel.replica_group`): a replica that skips one fails
the others with an error naming it, never a hang.
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


class ReplicaOptimizer:
    """What ``self.optimizers()`` returns on a replica: the Lightning optimizer, whose ``step`` runs once for all
    replicas (the closure, if any, runs on each replica first: it holds that replica's ``manual_backward``)."""

    def __init__(self, optimizer: Any, after_step: Callable[[], None], first: bool) -> None:
        self._optimizer = optimizer
        self._after_step = after_step
        self._first = first

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run this replica's ``closure``, then step the optimizer once, when every replica has arrived."""
        result = closure() if closure is not None else None

        def step_once(_: list[Any]) -> Any:
            self._optimizer.step(**kwargs)
            self._after_step()  # the replicas' copies follow the root before any replica goes on

        meet("optimizer.step()", None, step_once)
        return result

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        """Lightning's ``toggle_model``, on replica 0 alone (see the module)."""
        with self._optimizer.toggle_model(sync_grad) if self._first else contextlib.nullcontext():
            yield

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def replica_overrides(module: Any, replica: ReplicaContext | None, after_step: Callable[[], None]) -> dict[str, Any]:
    """The per-replica methods that make manual optimization meet: ``optimizers``, ``toggle_optimizer``,
    ``untoggle_optimizer``, ``clip_gradients`` (bound to ``module``, the LightningModule the replicas copy)."""
    wrapped: dict[int, ReplicaOptimizer] = {}
    first = replica is None or replica.index == 0

    def optimizers(use_pl_optimizer: bool = True) -> Any:
        found = module.optimizers(use_pl_optimizer)
        if not use_pl_optimizer:
            return found
        many = isinstance(found, list)
        for optimizer in found if many else [found]:
            if id(optimizer) not in wrapped:
                wrapped[id(optimizer)] = ReplicaOptimizer(optimizer, after_step, first)
        return [wrapped[id(o)] for o in found] if many else wrapped[id(found)]

    def lr_schedulers() -> Any:
        found = module.lr_schedulers()
        if found is None:
            return None
        many = isinstance(found, list)
        schedulers = [_FirstSteps(s, first) for s in (found if many else [found])]
        return schedulers if many else schedulers[0]

    return {
        "optimizers": optimizers,
        "lr_schedulers": lr_schedulers,
        **{name: _on_first(first, getattr(module, name)) for name in _ONCE},
    }


class _FirstSteps:
    """What ``self.lr_schedulers()`` returns on a replica: the scheduler, stepped by replica 0 alone (every replica
    would step it once per step, where one device steps it once)."""

    def __init__(self, scheduler: Any, first: bool) -> None:
        self._scheduler = scheduler
        self._first = first

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._first:
            self._scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


_ONCE = ("toggle_optimizer", "untoggle_optimizer", "clip_gradients")  # they act on the originals: once, by replica 0


def _on_first(first: bool, method: Callable[..., Any]) -> Callable[..., None]:
    """``method`` of the LightningModule, called by replica 0 only (given a :class:`ReplicaOptimizer`'s optimizer)."""

    def call(optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if first:
            method(_unwrapped(optimizer), *args, **kwargs)

    return call


def _unwrapped(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, ReplicaOptimizer) else optimizer
