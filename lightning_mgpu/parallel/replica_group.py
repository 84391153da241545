"""The replicas of one ``run_replicas`` call and the rendezvous where they meet. A replica that finishes or raises
*departs* and wakes those waiting for it, so one that skips a sync point fails its peers clearly instead of hanging."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

RENDEZVOUS_TIMEOUT_S = float(os.environ.get("LIGHTNING_MGPU_RENDEZVOUS_TIMEOUT_S", 1800))
"""Last-resort bound (seconds) on one wait at a rendezvous, for a replica that neither arrives nor leaves."""

TAKE_TURNS = os.environ.get("LIGHTNING_MGPU_TAKE_TURNS", "1") != "0"
"""Whether replicas in threads take turns running Python (default on; ``0`` lets their threads compete for the GIL)."""

TURN_PATIENCE_S = float(os.environ.get("LIGHTNING_MGPU_TURN_PATIENCE_S", 2))
"""How long (seconds) a replica waits for its turn before it runs anyway: turns never hold up progress."""


class RendezvousError(RuntimeError):
    """The replicas of one call cannot meet at a sync point (one skipped it, they reached sync points in different
    orders, they run sequentially, or a wait outlived :data:`RENDEZVOUS_TIMEOUT_S`)."""


class PeerFailedError(RendezvousError):
    """A replica stopped waiting because another one failed (or the caller was interrupted): a secondary error, so
    ``run_replicas`` re-raises the other replica's exception instead."""


@dataclass(eq=False, slots=True)
class _Site:
    """One sync point (e.g. the k-th call of one SyncBatchNorm layer) where every replica must arrive."""

    label: str
    arrived: dict[int, Any] = field(default_factory=dict)
    results: list[Any] | None = None
    failed_in: int | None = None  # the replica whose combine step raised


class ReplicaGroup:
    """The replicas of one ``run_replicas`` call; ``sequential``: they run one after another (and cannot meet)."""

    def __init__(self, devices: Sequence[torch.device], sequential: bool) -> None:
        self.devices = tuple(devices)
        self.size = len(self.devices)
        self.sequential = sequential
        # One replica runs Python at a time, until it finishes or waits at a sync point: otherwise the GIL changes
        # hands at every torch call, which costs as much as the calls on a launch-bound step.
        self._turn = threading.Lock() if TAKE_TURNS and not sequential else None
        self._turn_holder: int | None = None
        self._cond = threading.Condition()
        self._departed: dict[int, BaseException | None] = {}  # index -> its exception, None when it finished
        self._waiting: dict[int, _Site] = {}
        self._sites: dict[Hashable, _Site] = {}
        self._interrupted: BaseException | None = None

    @contextmanager
    def turn(self, index: int) -> Iterator[None]:
        """Run the enclosed code (replica ``index``'s work) in its turn (see :data:`TURN_PATIENCE_S`)."""
        self._take_turn(index)
        try:
            yield
        finally:
            self._give_turn(index)

    def _take_turn(self, index: int) -> None:
        if self._turn is not None and self._turn.acquire(timeout=TURN_PATIENCE_S):
            self._turn_holder = index

    def _give_turn(self, index: int) -> bool:
        if self._turn is None or self._turn_holder != index:
            return False
        self._turn_holder = None
        self._turn.release()
        return True

    def require_threads(self, what: str, hint: str) -> None:
        """Raise :class:`RendezvousError` naming ``what``, then ``hint``, if the replicas run one after another."""
        if self.sequential:
            raise RendezvousError(
                f"{what} makes the {self.size} replicas meet, but this call runs them one after another, so they "
                f"cannot. {hint}"
            )

    def rendezvous(
        self,
        index: int,
        site: Hashable,
        value: Any,
        combine: Callable[[list[Any]], Sequence[Any]],
        label: str,
        hint: str,
    ) -> Any:
        """Meet the other replicas at ``site``; return ``combine(values in replica order)[index]``. The last to arrive
        runs ``combine`` once for all (e.g. one autograd node spanning the replicas); the others wait, giving up their
        turn. A replica that cannot arrive fails the waiters with an error naming ``label``, then ``hint``."""
        handed_over = False
        try:
            with self._cond:
                state = self._sites.get(site)
                if state is None:
                    state = self._sites[site] = _Site(label)
                state.arrived[index] = value
                if len(state.arrived) == self.size:
                    del self._sites[site]
                    values = [state.arrived[i] for i in range(self.size)]
                    state.arrived.clear()  # results are all waiters need now: drop the references
                    try:
                        state.results = list(combine(values))
                    except BaseException:
                        state.failed_in = index
                        raise
                    finally:
                        self._cond.notify_all()
                    return state.results[index]
                self._waiting[index] = state
                handed_over = self._give_turn(index)
                try:
                    return self._wait(state, index, label, hint)
                finally:
                    del self._waiting[index]
        finally:
            if handed_over:  # taken back outside the lock: the replica holding the turn may need the lock to arrive
                self._take_turn(index)

    def _wait(self, state: _Site, index: int, label: str, hint: str) -> Any:
        """Replica ``index``'s result at ``state``, once the last replica combined; called with the lock held."""
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while state.results is None:
            failure = self._diagnose(state, hint)
            if failure is not None:
                self._cond.notify_all()  # the others re-check: this replica leaves
                raise failure
            remaining = deadline - time.monotonic()
            if (remaining <= 0 or not self._cond.wait(remaining)) and state.results is None:
                missing = [i for i in range(self.size) if i not in state.arrived]
                raise RendezvousError(
                    f"{label}: replica {index} waited {RENDEZVOUS_TIMEOUT_S:.0f} s for replica(s) {missing}, which "
                    "neither arrived nor finished (a replica blocked outside this group?). If one legitimately needs "
                    "longer, raise the environment variable LIGHTNING_MGPU_RENDEZVOUS_TIMEOUT_S."
                )
        return state.results[index]

    def _diagnose(self, state: _Site, hint: str) -> RendezvousError | None:
        """Why ``state`` can never complete, or None while it still can. Called with the lock held."""
        if state.failed_in is not None:
            return PeerFailedError(
                f"{state.label}: replica {state.failed_in} failed while combining the replicas' values here; its "
                "error is the one to read."
            )
        if self._interrupted is not None:
            return PeerFailedError(f"{state.label}: stopped waiting because the caller was interrupted.")
        waiters = sorted(state.arrived)
        missing = [i for i in range(self.size) if i not in state.arrived]
        raised = [i for i in missing if self._departed.get(i) is not None]
        if raised:
            first = self._departed[raised[0]]
            return PeerFailedError(
                f"{state.label}: replica(s) {waiters} stopped waiting because replica(s) {raised} raised "
                f"{type(first).__name__} before reaching this point; that error is the one to read."
            )
        finished = [i for i in missing if i in self._departed]
        if finished:
            return RendezvousError(
                f"{state.label}: replica(s) {waiters} waited here for replica(s) {finished}, which finished without "
                f"reaching it. {hint}"
            )
        live = [i for i in range(self.size) if i not in self._departed]
        stuck = {i: site for i, site in self._waiting.items() if site.results is None and site.failed_in is None}
        if all(i in stuck for i in live) and len({id(site) for site in stuck.values()}) > 1:
            where = "; ".join(f"replica {i} waits at {stuck[i].label}" for i in live)
            return RendezvousError(f"The replicas wait at different sync points and can never meet: {where}. {hint}")
        return None

    def depart(self, index: int, error: BaseException | None) -> None:
        """Record that replica ``index`` finished (``error=None``) or raised ``error``; wake its waiting peers."""
        with self._cond:
            self._departed[index] = error
            self._cond.notify_all()

    def interrupt(self, reason: BaseException) -> None:
        """The caller was interrupted: replicas waiting at (or reaching) a sync point stop with PeerFailedError."""
        with self._cond:
            self._interrupted = reason
            self._cond.notify_all()


@dataclass
class ReplicaContext:
    """The group, index and per-site call counters of the replica a thread runs as."""

    group: ReplicaGroup
    index: int
    calls: dict[Hashable, int] = field(default_factory=dict)

    def next_call(self, key: Hashable) -> int:
        """1 for this replica's first call with ``key``, 2 for its second...: pairs the k-th calls of all replicas."""
        count = self.calls.get(key, 0) + 1
        self.calls[key] = count
        return count


_LOCAL = threading.local()


def current_replica() -> ReplicaContext | None:
    """The replica the current thread runs as, inside a :func:`~.run_replicas.run_replicas` call; None outside one."""
    return getattr(_LOCAL, "replica", None)


@contextmanager
def as_replica(group: ReplicaGroup, index: int) -> Iterator[None]:
    """Run the enclosed code as member ``index`` of ``group`` (what :func:`current_replica` returns)."""
    previous = current_replica()
    _LOCAL.replica = ReplicaContext(group, index)
    try:
        yield
    finally:
        _LOCAL.replica = previous
