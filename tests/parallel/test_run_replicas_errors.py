"""run_replicas re-raises a failing replica's own exception, annotated, and only once every replica has stopped."""

from __future__ import annotations

import signal
import threading
import time
import traceback

import pytest
import torch

from lightning_mgpu.parallel import run_replicas
from lightning_mgpu.parallel.replica_group import PeerFailedError

MODES = ["threads", "sequential"]


class Quota(Exception):
    """A custom exception whose fields live in attributes, not only in args."""

    def __init__(self, user: str, limit: int) -> None:
        super().__init__(f"{user} is over quota")
        self.user = user
        self.limit = limit


def raising(err: BaseException):
    def run():
        raise err

    return run


def ok(value=1):
    return lambda: value


@pytest.mark.parametrize("mode", MODES)
def test_the_original_exception_object_reaches_the_caller(mode):
    err = FileNotFoundError(2, "nope", "/data/x.bin")
    with pytest.raises(FileNotFoundError) as info:
        run_replicas([ok(), raising(err)], ["cpu"] * 2, execution_mode=mode)
    assert info.value is err
    assert (err.errno, err.strerror, err.filename, err.args) == (2, "nope", "/data/x.bin", (2, "nope"))
    assert err.replica_index == 1 and err.replica_device == torch.device("cpu")


@pytest.mark.parametrize("mode", MODES)
def test_custom_exception_fields_and_frames_are_kept(mode):
    def check_quota():
        raise Quota("ada", 3)

    with pytest.raises(Quota) as info:
        run_replicas([check_quota, ok()], ["cpu"] * 2, execution_mode=mode)
    assert (info.value.user, info.value.limit, str(info.value)) == ("ada", 3, "ada is over quota")
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "check_quota" in frames  # the replica's own frames, not only the re-raise site
    assert info.value.replica_index == 0


@pytest.mark.parametrize("mode", MODES)
def test_note_uses_torch_wording(mode):
    def explode():
        raise ValueError("bad chunk")

    with pytest.raises(ValueError) as info:
        run_replicas([ok(), ok(), explode], ["cpu"] * 3, execution_mode=mode)
    assert str(info.value) == "bad chunk"  # the message itself is untouched
    (note,) = info.value.__notes__
    assert note.startswith(
        "Caught ValueError in replica 2 on device cpu.\nOriginal Traceback (most recent call last):\n"
    )
    assert "in explode" in note and note.rstrip().endswith("ValueError: bad chunk")


def test_key_error_keeps_its_message():
    def fails():
        return {}["missing"]

    with pytest.raises(KeyError) as info:
        run_replicas([ok(), fails], ["cpu"] * 2, execution_mode="threads")
    assert str(info.value) == "'missing'" and info.value.args == ("missing",)
    assert info.value.__notes__[0].startswith("Caught KeyError in replica 1 on device cpu.")


def test_several_failures_raise_the_first_and_name_the_others():
    first, second = RuntimeError("first"), TypeError("second")
    with pytest.raises(RuntimeError) as info:
        run_replicas([ok(), raising(first), raising(second)], ["cpu"] * 3, execution_mode="threads")
    assert info.value is first
    assert "Other replicas of this call failed too: replica 2: TypeError: second" in info.value.__notes__[0]


def test_a_primary_failure_wins_over_peers_that_only_stopped_because_of_it():
    secondary, primary = PeerFailedError("gave up waiting for replica 2"), OSError("disk full")
    with pytest.raises(OSError) as info:
        run_replicas([raising(secondary), ok(), raising(primary)], ["cpu"] * 3, execution_mode="threads")
    assert info.value is primary and info.value.replica_index == 2
    assert "replica 0: PeerFailedError: gave up waiting for replica 2" in info.value.__notes__[0]


@pytest.mark.parametrize("interrupted", [0, 1], ids=["replica 0 (caller thread)", "replica 1 (pool thread)"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit], ids=lambda e: e.__name__)
def test_base_exception_waits_for_the_other_replicas(interrupted, error):
    """Lightning's graceful shutdown must not start while user code still runs in other threads."""
    raised = threading.Event()
    finished = []

    def interrupt():
        raised.set()
        raise error()

    def slow():
        raised.wait(10)
        time.sleep(0.2)  # still working when the interrupt has been raised
        finished.append(True)
        return 2

    functions = [ok(), ok(), slow]
    functions[interrupted] = interrupt
    with pytest.raises(error) as info:
        run_replicas(functions, ["cpu"] * 3, execution_mode="threads")
    assert finished == [True]
    assert info.value.replica_index == interrupted
    assert info.value.__notes__[0].startswith(f"Caught {error.__name__} in replica {interrupted} on device cpu.")


def test_sequential_mode_stops_at_the_first_failure():
    ran = []

    def record(i):
        def run():
            ran.append(i)
            if i == 1:
                raise KeyboardInterrupt
            return i

        return run

    with pytest.raises(KeyboardInterrupt) as info:
        run_replicas([record(i) for i in range(3)], ["cpu"] * 3, execution_mode="sequential")
    assert ran == [0, 1] and info.value.replica_index == 1


def test_exception_with_read_only_attributes_still_gets_its_note():
    class Frozen(Exception):
        __slots__ = ()

        def __setattr__(self, name, value):  # Python's own dunders only
            if not name.startswith("__"):
                raise AttributeError(name)
            super().__setattr__(name, value)

    with pytest.raises(Frozen) as info:
        run_replicas([raising(Frozen("x")), ok()], ["cpu"] * 2, execution_mode="threads")
    assert not hasattr(info.value, "replica_index")
    assert info.value.__notes__[0].startswith("Caught Frozen in replica 0 on device cpu.")


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_ctrl_c_in_the_waiting_caller_still_waits_for_the_replicas():
    """A SIGINT that lands while the caller waits for the pool threads: they are let finish, then it is raised."""
    replica0_done = threading.Event()
    finished = []

    def first():
        replica0_done.set()
        return 0

    def second():
        replica0_done.wait(10)
        time.sleep(0.05)  # let the caller reach its wait (if it has not, the interrupt lands in replica 0: same result)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.2)
        finished.append(True)
        return 1

    assert threading.current_thread() is threading.main_thread()
    with pytest.raises(KeyboardInterrupt):
        run_replicas([first, second], ["cpu"] * 2, execution_mode="threads")
    assert finished == [True]
