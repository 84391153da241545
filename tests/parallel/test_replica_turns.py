"""Replicas in threads take turns running Python; a rendezvous hands the turn over, and the last replica to arrive
goes on first; turns never block progress. The rendezvous itself never hangs: a peer that leaves, a wait past the
timeout or replicas run one after another end it with an error."""

from __future__ import annotations

import threading

import pytest

from lightning_mgpu.parallel import replica_group, run_replicas
from lightning_mgpu.parallel.replica_group import RendezvousError, current_replica

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


def test_the_last_replica_to_arrive_goes_on_first():
    """A fixed order, as if the last one had never waited: code after a meeting runs replica by replica, in the order
    that manual optimization's scheduler steps (replica 0 alone) and the others' reads of them rely on."""
    trace: list[tuple[str, int, int]] = []

    def work(i: int) -> None:
        replica = current_replica()
        assert replica is not None
        for meeting in range(10):  # short work between meetings: each finds the last one still draining
            trace.append(("arrive", meeting, i))
            replica.group.rendezvous(i, meeting, i, lambda values: values, "test", "")
            trace.append(("after", meeting, i))

    for _ in range(5):
        trace.clear()
        run_replicas([lambda i=i: work(i) for i in range(3)], ["cpu"] * 3, "threads")
        for meeting in range(10):
            arrived, went_on = ([i for e, m, i in trace if (e, m) == (event, meeting)] for event in ("arrive", "after"))
            assert went_on[0] == arrived[-1], trace


def test_a_replica_that_finishes_right_after_a_meeting_never_fails_a_peer_still_leaving_it():
    """Its departure breaks the barrier, maybe before the others woke from the meeting they completed together."""

    def work(i: int) -> int:
        replica = current_replica()
        assert replica is not None
        return replica.group.rendezvous(i, "site", i, lambda values: [sum(values)] * len(values), "test", "")

    for _ in range(50):
        assert run_replicas([lambda i=i: work(i) for i in range(4)], CPU4, "threads") == [6] * 4


def test_a_wait_that_outlives_the_timeout_names_the_replica_that_never_came(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(replica_group, "RENDEZVOUS_TIMEOUT_S", 0.2)
    gave_up = threading.Event()

    def waits() -> None:
        replica = current_replica()
        assert replica is not None
        try:
            replica.group.rendezvous(0, "site", None, lambda values: values, "the test's sync point", "")
        finally:
            gave_up.set()

    with pytest.raises(RendezvousError) as raised:
        run_replicas([waits, lambda: gave_up.wait(10)], ["cpu"] * 2, "threads")  # replica 1 blocked elsewhere
    assert str(raised.value).startswith(
        "the test's sync point: replica 0 waited 0.2 s for replica(s) [1], which neither arrived nor finished"
    )
    assert "LIGHTNING_MGPU_RENDEZVOUS_TIMEOUT_S" in str(raised.value)


def test_replicas_run_one_after_another_fail_at_a_rendezvous_instead_of_waiting():
    def meets(i: int) -> None:
        replica = current_replica()
        assert replica is not None
        replica.group.rendezvous(i, "site", i, lambda values: values, "the test's sync point", "")

    with pytest.raises(RendezvousError, match="the test's sync point makes the 2 replicas meet, but this call runs"):
        run_replicas([lambda i=i: meets(i) for i in range(2)], ["cpu"] * 2, "sequential")
