"""The replicas of one ``run_replicas`` call and their rendezvous: one :class:`threading.Barrier`, at which every
replica's k-th sync point meets the others'. A replica that finishes or raises aborts the barrier, so those waiting
for it, or arriving later, fail with an error that names it instead of hanging."""

from __future__ import annotations

import os
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

Combine = Callable[[list[Any]], Sequence[Any]]  # every replica's value, in replica order -> each replica's result
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


class ReplicaGroup:
    """The replicas of one ``run_replicas`` call; ``sequential``: they run one after another (and cannot meet). One
    replica runs Python at a time (its turn) until it finishes or waits at a sync point: otherwise the GIL changes
    hands at every torch call, which costs as much as the calls on a launch-bound step."""

    def __init__(self, devices: Sequence[torch.device], sequential: bool) -> None:
        self.devices = tuple(devices)
        self.size = len(self.devices)
        self.sequential = sequential
        self._turn = threading.Lock() if TAKE_TURNS and not sequential else None
        self._turn_holder: int | None = None
        group = weakref.ref(self)  # a bound method as the action would make each call's group a garbage cycle
        self._barrier = threading.Barrier(max(self.size, 1), action=lambda: group()._combine())  # type: ignore[union-attr]
        self._arrivals: list[tuple[Any, ...]] = [()] * self.size  # (site, label, hint, value, combine) per replica
        self._last = 0  # the replica that arrived last (while holding its turn): it goes on first
        self._results: list[Any] = []
        self._reached = [0] * self.size  # sync points each replica reached
        self._met = 0  # meetings completed
        self._departed: dict[int, BaseException | None] = {}  # index -> its exception, None when it finished
        self._failure: str | None = None  # why the barrier broke, when not a departure
        self._led = threading.Condition()  # replica 0's steps that the others follow (see lead / follow)
        self._lead_counts: Counter[Hashable] = Counter()

    @contextmanager
    def member(self, index: int) -> Iterator[None]:
        """Run the enclosed code as replica ``index`` in its turn; then it departs, finished or raising, which breaks
        the barrier for the replicas waiting at a sync point or arriving later."""
        previous = getattr(_LOCAL, "replica", None)
        _LOCAL.replica = ReplicaContext(self, index)
        if self._turn is not None:
            self._take_turn(index)
        error = None
        try:
            yield
        except BaseException as err:
            error = err
            raise
        finally:
            if self._turn is not None:
                self._give_turn(index)
            _LOCAL.replica = previous
            self._departed[index] = error
            self._barrier.abort()
            with self._led:
                self._led.notify_all()

    def _take_turn(self, index: int) -> None:
        if self._turn is not None and self._turn.acquire(timeout=TURN_PATIENCE_S):
            self._turn_holder = index

    def _give_turn(self, index: int) -> bool:
        if self._turn is None or self._turn_holder != index:
            return False
        self._turn_holder = None
        self._turn.release()
        return True

    def rendezvous(
        self, index: int, site: Hashable, value: Any, combine: Combine, label: str, hint: str, sequential_hint: str = ""
    ) -> Any:
        """Meet the other replicas at ``site``; return ``combine(values in replica order)[index]``, run once for all
        while they wait (the last to arrive goes on first). Replicas that run one after another, reach another site or
        cannot arrive fail with an error naming ``label``, then ``sequential_hint`` or ``hint``."""
        if self.sequential and self.size > 1:
            raise RendezvousError(
                f"{label} makes the {self.size} replicas meet, but this call runs them one after another, so they "
                f"cannot. {sequential_hint or 'Run the replicas in threads (execution_mode=threads).'}"
            )
        self._arrivals[index] = (site, label, hint, value, combine)
        self._reached[index] += 1
        self._last = index
        handed_over = self._give_turn(index)  # inline, not a context manager: this runs at every SyncBatchNorm layer
        try:
            self._barrier.wait(RENDEZVOUS_TIMEOUT_S)
        except threading.BrokenBarrierError:
            if self._met < self._reached[index]:  # else a departure aborted the barrier after this meeting completed
                raise self._why_broken(index, label, hint) from None
        finally:
            if handed_over and self._turn_holder != index:
                self._take_turn(index)
        return self._results[index]

    def lead(self, key: Hashable) -> None:
        """Replica 0 has done one more ``key`` (e.g. a scheduler's step): the replicas that :meth:`follow` it go on."""
        with self._led:
            self._lead_counts[key] += 1
            self._led.notify_all()

    def follow(self, index: int, key: Hashable, call: int, label: str, hint: str) -> None:
        """Wait, as replica ``index``, until replica 0 has done its ``call``-th ``key`` (replica 0 never waits); fail
        with an error naming ``label`` and ``hint`` when replica 0 raised or finished without it."""
        handed_over = self._give_turn(index)
        try:
            with self._led:
                done = self._led.wait_for(
                    lambda: self._lead_counts[key] >= call or 0 in self._departed or self._failure is not None,
                    RENDEZVOUS_TIMEOUT_S,
                )
                if self._lead_counts[key] >= call:
                    return
        finally:
            if handed_over and self._turn_holder != index:
                self._take_turn(index)
        if self._failure is not None or self._departed.get(0) is not None:
            raise PeerFailedError(f"{label}: {self._failure or 'replica 0 raised; its error is the one to read.'}")
        waited = "finished without reaching it" if done else f"did not reach it in {RENDEZVOUS_TIMEOUT_S:g} s"
        raise RendezvousError(f"{label}: replica {index} waited here for replica 0, which {waited}. {hint}")

    def _combine(self) -> None:
        """The barrier's action, run in one thread while the others wait in the barrier."""
        arrivals, self._arrivals = self._arrivals, [()] * self.size  # drop the references once combined
        self._take_turn(self._last)
        try:
            sites, labels, hints, values, combines = zip(*arrivals, strict=True)
            if len(set(sites)) > 1:
                where = "; ".join(f"replica {i} at {label}" for i, label in enumerate(labels))
                raise RendezvousError(f"The replicas reached different sync points: {where}. {hints[0]}")
            self._results = list(combines[-1](list(values)))
        except BaseException:
            self._failure = "the replica that combined the values here raised; its error is the one to read."
            raise
        self._met += 1

    def _why_broken(self, index: int, label: str, hint: str) -> RendezvousError:
        """Why the meeting at ``label`` cannot complete for replica ``index``."""
        missing = [i for i in range(self.size) if self._reached[i] < self._reached[index]]
        raised = [i for i in missing if self._departed.get(i) is not None]
        finished = [i for i in missing if i in self._departed]
        if self._failure is not None:
            return PeerFailedError(f"{label}: {self._failure}")
        if raised:
            return PeerFailedError(
                f"{label}: replica {index} stopped waiting because replica(s) {raised} raised "
                f"{type(self._departed[raised[0]]).__name__} before reaching this point; that error is the one to read."
            )
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

    def interrupt(self, reason: BaseException) -> None:
        """The caller was interrupted: replicas waiting at (or reaching) a sync point stop with PeerFailedError."""
        self._failure = f"stopped waiting because the caller was interrupted ({type(reason).__name__})."
        self._barrier.abort()
        with self._led:
            self._led.notify_all()


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
