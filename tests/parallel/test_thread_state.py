"""Worker threads replay the caller's thread-local torch state; failures re-raise in the caller."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch
from torch import nn

from lightning_mgpu.parallel import DataParallelModel, run_replicas
from lightning_mgpu.parallel.run_replicas import ThreadState

N = 3


class Recorder(nn.Module):
    """Records, inside each replica, the thread-local state it runs under."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.records: list[dict] = []
        self.lock = threading.Lock()

    def forward(self, x):
        out = self.lin(x)
        with self.lock:  # the list is shared by all replicas (shallow copies)
            self.records.append(
                {
                    "thread": threading.current_thread().name,
                    "autocast": torch.is_autocast_enabled("cpu"),
                    "autocast_dtype": torch.get_autocast_dtype("cpu"),
                    "grad": torch.is_grad_enabled(),
                    "inference": torch.is_inference_mode_enabled(),
                    "out_dtype": out.dtype,
                }
            )
        return out


def run_threads(model, x):
    model.records.clear()
    outputs = DataParallelModel(model, ["cpu"] * N, execution_mode="threads")(x)
    return outputs, list(model.records)


def assert_other_threads(records):
    """Replica 0 runs in the caller; the others in pool threads (one may serve two short replicas in turn)."""
    names = [r["thread"] for r in records]
    assert len(records) == N
    assert names.count(threading.current_thread().name) == 1
    assert sum(name.startswith("mgpu-replica") for name in names) == N - 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_reaches_every_worker_with_its_dtype(dtype):
    model = Recorder()
    x = torch.randn(6, 4)
    with torch.autocast("cpu", dtype=dtype):
        outputs, records = run_threads(model, x)
    assert_other_threads(records)
    assert all(r["autocast"] and r["autocast_dtype"] == dtype and r["out_dtype"] == dtype for r in records)
    assert all(o.dtype == dtype for o in outputs)
    # Pool threads are reused: nothing of the autocast state may stay behind in them.
    _, records = run_threads(model, x)
    assert all(not r["autocast"] and r["out_dtype"] == torch.float32 for r in records)


def test_inference_mode_in_workers():
    class InPlace(Recorder):
        def forward(self, x):
            x.mul_(2)  # in-place on an inference tensor: only allowed inside inference mode
            return super().forward(x)

    model = InPlace()
    with torch.inference_mode():
        x = torch.ones(6, 4)
        outputs, records = run_threads(model, x)
    assert_other_threads(records)
    assert all(r["inference"] and not r["grad"] for r in records)
    assert all(o.is_inference() for o in outputs)
    assert torch.equal(x, torch.full((6, 4), 2.0))  # the chunks are views of the caller's tensor


def test_no_grad_in_caller_means_no_graph_in_replicas():
    model = Recorder()
    x = torch.randn(6, 4, requires_grad=True)
    with torch.no_grad():
        outputs, records = run_threads(model, x)
    assert_other_threads(records)
    assert all(not r["grad"] and not r["inference"] for r in records)
    assert all(o.grad_fn is None and not o.requires_grad for o in outputs)
    outputs, records = run_threads(model, x)
    assert all(r["grad"] for r in records) and all(o.requires_grad for o in outputs)


def test_thread_state_capture_and_replay():
    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
        state = ThreadState.capture()
    assert state.autocast == {"cpu": torch.float16} and not state.grad_enabled
    seen = {}

    def worker():
        with state.replay():
            seen["inside"] = (
                torch.is_grad_enabled(),
                torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"),
            )
        seen["after"] = (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"inside": (False, True, torch.float16), "after": (True, False)}


class Exploding(nn.Module):
    """Fails on the replica whose chunk holds sample 9 (the last one)."""

    def forward(self, x):
        if (x[:, 0] == 9).any():
            self._explode(x)
        return x * 2

    def _explode(self, x):
        raise ValueError(f"bad chunk of {x.shape[0]} samples")


@pytest.mark.parametrize("mode", ["threads", "sequential"])
def test_replica_exception_reraised_in_caller(mode):
    x = torch.arange(10.0)[:, None]
    with pytest.raises(ValueError) as info:
        DataParallelModel(Exploding(), ["cpu"] * 3, execution_mode=mode)(x)  # chunks 4, 3, 3: sample 9 is in replica 2
    # The replica's own exception, unchanged, with its index attached (the note is in torch's wording).
    assert str(info.value) == "bad chunk of 3 samples" and info.value.replica_index == 2
    (note,) = info.value.__notes__
    assert note.startswith("Caught ValueError in replica 2 on device cpu.\nOriginal Traceback (most recent call last):")
    assert "_explode" in note and "bad chunk of 3 samples" in note
    assert info.value.__traceback__ is not None


def test_key_error_message_stays_readable():
    def fails():
        return {}["missing"]

    with pytest.raises(KeyError, match="Caught KeyError in replica 1") as info:  # pytest matches notes too
        run_replicas([lambda: 1, fails], ["cpu"] * 2, execution_mode="threads")
    assert str(info.value) == "'missing'"
    assert "\n" in info.value.__notes__[0]  # real line breaks, not an escaped repr


def test_exception_without_message_constructor_is_raised_as_is():
    class Picky(Exception):
        def __init__(self, code: int, detail: str) -> None:
            super().__init__(code, detail)

    def fails():
        raise Picky(3, "x")

    with pytest.raises(Picky, match="Caught Picky in replica 0") as info:
        run_replicas([fails, lambda: 1], ["cpu"] * 2, execution_mode="threads")
    assert info.value.args == (3, "x")


def test_run_replicas_keeps_order_and_waits_for_all():
    done = []

    def slow(i):
        def run():
            done.append(i)
            return i * 10

        return run

    assert run_replicas([slow(i) for i in range(5)], ["cpu"] * 5, execution_mode="threads") == [0, 10, 20, 30, 40]
    assert sorted(done) == list(range(5))
    done.clear()

    def boom():
        raise RuntimeError("first fails")

    with pytest.raises(RuntimeError, match="replica 0"):
        run_replicas([boom, slow(1), slow(2)], ["cpu"] * 3, execution_mode="threads")
    assert sorted(done) == [1, 2]  # the others still ran to completion before the error was raised


def _threads_mode_in_child(queue) -> None:
    queue.put(run_replicas([lambda: 1, lambda: 2, lambda: 3], ["cpu"] * 3, execution_mode="threads"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Python 3.12+: fork() of a multi-threaded process
def test_threads_mode_works_in_a_forked_child():
    """The pool's threads do not survive fork(): a child must not wait for them (it used to deadlock)."""
    # Two replicas that overlap leave two idle pool threads behind in this process.
    run_replicas([lambda: 0, lambda: time.sleep(0.1), lambda: time.sleep(0.1)], ["cpu"] * 3, execution_mode="threads")
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_threads_mode_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=20) == [1, 2, 3]
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
