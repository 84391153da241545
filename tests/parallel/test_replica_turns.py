"""Replicas in threads take turns running Python; a rendezvous hands the turn over; turns never block progress."""

from __future__ import annotations

import threading

import pytest

from lightning_mgpu.parallel import replica_group, run_replicas
from lightning_mgpu.parallel.replica_group import current_replica

CPU4 = ["cpu"] * 4


def test_replicas_in_threads_run_one_at_a_time():
    trace: list[tuple[int, str]] = []

    def work(i: int) -> int:
        trace.append((i, "start"))
        total = 0
        for k in range(300_000):  # Python work longer than the interpreter's switch interval (5 ms)
            total += k
        trace.append((i, "end"))
        return total

    run_replicas([lambda i=i: work(i) for i in range(4)], CPU4, "threads")
    assert all(trace[k][0] == trace[k + 1][0] for k in range(0, len(trace), 2)), trace  # start, end of one replica


def test_a_replica_waiting_at_a_rendezvous_hands_its_turn_over():
    def work(i: int) -> list[int]:
        replica = current_replica()
        assert replica is not None
        return replica.group.rendezvous(i, "site", i, lambda values: [values] * len(values), "test", "")

    results = run_replicas([lambda i=i: work(i) for i in range(4)], CPU4, "threads")
    assert results == [[0, 1, 2, 3]] * 4


def test_a_replica_blocked_outside_the_group_does_not_hang_the_others(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(replica_group, "TURN_PATIENCE_S", 0.05)
    barrier = threading.Barrier(2, timeout=10)  # the user's own sync, which knows nothing of turns

    results = run_replicas([lambda: barrier.wait() >= 0, lambda: barrier.wait() >= 0], ["cpu"] * 2, "threads")
    assert results == [True, True]
