"""The replicas of one ``run_replicas`` call and their rendezvous: one :class:`threading.Barrier`, at which every
replica's k-th sync point meets the others'. A replica that finishes or raises aborts the barrier, so those waiting
for it, or arriving later, fail with an error that names it instead of hanging."""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

RENDEZVOUS_TIMEOUT_S = float(os.environ.get("LIGHTNING_MGPU_RENDEZVOUS_TIMEOUT_S", 1800))
"""Last-resort bound (seconds) on one wait at a rendezvous, for a replica that neither arrives nor leaves."""

TAKE_TURNS = os.environ.get("LIGHTNING_MGPU_TAKE_TURNS", "1") != "0"
"""Whether replicas in threads take turns running Python (default on; ``0`` lets their threads compete for the GIL)."""

TURN_PATIENCE_S = float(os.environ.get("LIGHTNING_MGPU_TURN_PATIENCE_S", 2))
"""How long (seconds) a replica waits for its turn before it runs anyway: turns never hold up progress."""


class RendezvousError(RuntimeError):
    """The replicas of one call cannot meet at a sync point (one skipped it, they reached different sync points, they
    run sequentially, or a wait outlived :data:`RENDEZVOUS_TIMEOUT_S`)."""


class PeerFailedError(RendezvousError):
    """A replica stopped waiting because another one failed (or the caller was interrupted): a secondary error, so
    ``run_replicas`` re-raises the other replica's exception instead."""


class _Arrival(NamedTuple):
    site: Hashable
    label: str
    hint: str
    value: Any
    combine: Callable[[list[Any]], Sequence[Any]]
    order: int


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
        # Its action through a weak reference: a bound method would make each call's group a garbage cycle.
        group = weakref.ref(self)
        self._barrier = threading.Barrier(max(self.size, 1), action=lambda: group()._combine())  # type: ignore[union-attr]
        self._arrivals: list[_Arrival | None] = [None] * self.size
        self._results: list[Any] = []
        self._reached = [0] * self.size  # sync points each replica reached
        self._arrival_order = itertools.count()
        self._met = 0  # meetings completed
        self._departed: dict[int, BaseException | None] = {}  # index -> its exception, None when it finished
        self._failure: str | None = None  # why the barrier broke, when not a departure

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
        """Meet the other replicas at ``site``; return ``combine(values in replica order)[index]``. ``combine`` runs
        once for all (e.g. one autograd node spanning the replicas) while every replica waits, its turn given up; the
        last to arrive goes on first. A replica that reaches another site, or cannot arrive, fails them with an error
        naming ``label`` and ``hint``."""
        if self.size > 1:  # a backstop: callers say how to run in threads first
            self.require_threads(label, "Run the replicas in threads (execution_mode='threads').")
        self._arrivals[index] = _Arrival(site, label, hint, value, combine, next(self._arrival_order))
        self._reached[index] += 1
        handed_over = self._give_turn(index)
        try:
            self._barrier.wait(RENDEZVOUS_TIMEOUT_S)
        except threading.BrokenBarrierError:
            if self._met < self._reached[index]:  # else a departure aborted the barrier after this meeting completed
                raise self._why_broken(index, label, hint) from None
        finally:
            if handed_over and self._turn_holder != index:
                self._take_turn(index)
        return self._results[index]

    def _combine(self) -> None:
        """The barrier's action, run in the last thread to enter the barrier while the others wait in it."""
        arrivals, self._arrivals = self._arrivals, [None] * self.size  # drop the references once combined
        # The last to arrive (while holding its turn) goes on first, as if it had never waited: a fixed order.
        self._take_turn(max(range(self.size), key=lambda i: arrivals[i].order))
        try:
            if len({a.site for a in arrivals}) > 1:
                where = "; ".join(f"replica {i} at {a.label}" for i, a in enumerate(arrivals))
                raise RendezvousError(f"The replicas reached different sync points: {where}. {arrivals[0].hint}")
            self._results = list(arrivals[-1].combine([a.value for a in arrivals]))
        except BaseException:
            self._failure = "the replica that combined the values here raised; its error is the one to read."
            raise
        self._met += 1

    def _why_broken(self, index: int, label: str, hint: str) -> RendezvousError:
        """Why the meeting at ``label`` cannot complete for replica ``index``."""
        if self._failure is not None:
            return PeerFailedError(f"{label}: {self._failure}")
        missing = [i for i in range(self.size) if self._reached[i] < self._reached[index]]
        raised = [i for i in missing if self._departed.get(i) is not None]
        if raised:
            return PeerFailedError(
                f"{label}: replica {index} stopped waiting because replica(s) {raised} raised "
                f"{type(self._departed[raised[0]]).__name__} before reaching this point; that error is the one to read."
            )
        finished = [i for i in missing if i in self._departed]
        if finished:
            return RendezvousError(
                f"{label}: replica {index} waited here for replica(s) {finished}, which finished without reaching it. "
                f"{hint}"
            )
        return RendezvousError(
            f"{label}: replica {index} waited {RENDEZVOUS_TIMEOUT_S:g} s for replica(s) {missing}, which neither "
            "arrived nor finished (a replica blocked outside this group?). If one legitimately needs longer, raise "
            "the environment variable LIGHTNING_MGPU_RENDEZVOUS_TIMEOUT_S."
        )

    def depart(self, index: int, error: BaseException | None) -> None:
        """Record that replica ``index`` finished (``error=None``) or raised ``error``: it reaches no more sync points,
        so the barrier breaks for the replicas waiting at one or arriving later."""
        self._departed[index] = error
        self._barrier.abort()

    def interrupt(self, reason: BaseException) -> None:
        """The caller was interrupted: replicas waiting at (or reaching) a sync point stop with PeerFailedError."""
        self._failure = f"stopped waiting because the caller was interrupted ({type(reason).__name__})."
        self._barrier.abort()


@dataclass
class ReplicaContext:
    """The group, index and per-site call counters of the replica a thread runs as."""

    group: ReplicaGroup
    index: int
    calls: Counter[Hashable] = field(default_factory=Counter)

    def next_call(self, key: Hashable) -> int:
        """1 for this replica's first call with ``key``, 2 for its second...: pairs the k-th calls of all replicas."""
        self.calls[key] += 1
        return self.calls[key]


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
