"""Run one callable per replica, in threads or one after another, each as a member of one
:class:`~.replica_group.ReplicaGroup` and with the caller's thread-local torch state (:class:`ThreadState`).

A failing replica's own exception reaches the caller once every replica has stopped, with ``replica_index``,
``replica_device`` and a note in torch's wording (``Caught ValueError in replica 2 on device cuda:2.``); of several,
the first in replica order that is not a :class:`PeerFailedError` (a secondary failure); the note lists the others.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

import torch

from lightning_mgpu.parallel.collectives import forget_gathered
from lightning_mgpu.parallel.devices import DeviceLike, to_device
from lightning_mgpu.parallel.replica_group import PeerFailedError, ReplicaGroup

T = TypeVar("T")
ExecutionMode = Literal["auto", "threads", "sequential"]
EXECUTION_MODES: tuple[str, ...] = get_args(ExecutionMode)
Outcome = tuple[Any, BaseException | None]


@dataclass(frozen=True)
class ThreadState:
    """The caller's thread-local torch state, which a new thread does not inherit: grad mode, inference mode, autocast
    (enabled *and* dtype, per device type; torch's own ``parallel_apply`` drops the dtype: bf16 silently becomes fp16),
    the current CUDA device and stream. Process-global state (the default dtype) is left alone."""

    grad_enabled: bool
    inference_mode: bool
    autocast: dict[str, torch.dtype]  # the dtype of each device type with autocast enabled
    autocast_cache: bool
    cuda_streams: dict[int, torch.cuda.Stream]

    @classmethod
    def capture(cls, devices: Sequence[torch.device] = ()) -> ThreadState:
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            autocast={t: torch.get_autocast_dtype(t) for t in ("cpu", "cuda") if torch.is_autocast_enabled(t)},
            autocast_cache=torch.is_autocast_cache_enabled(),
            cuda_streams={d.index: torch.cuda.current_stream(d) for d in devices if d.type == "cuda"},
        )

    @contextlib.contextmanager
    def replay(self, device: torch.device | None = None) -> Iterator[None]:
        """Enter this state (and ``device``'s CUDA device and captured stream) in the current thread."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                torch.inference_mode() if self.inference_mode else torch.set_grad_enabled(self.grad_enabled)
            )
            if device is not None and device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                if (stream := self.cuda_streams.get(device.index)) is not None:
                    stack.enter_context(torch.cuda.stream(stream))
            for device_type, dtype in self.autocast.items():
                stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache))
            yield


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=64, thread_name_prefix="mgpu-replica")


if hasattr(os, "register_at_fork"):
    # A forked child inherits the pool but none of its threads: submit() would wait for them forever. Start over.
    os.register_at_fork(after_in_child=_pool.cache_clear)


def add_note(err: BaseException, note: str) -> None:
    """PEP 678's ``err.add_note(note)``, also on Python 3.10 (where tools read ``__notes__`` but tracebacks skip it)."""
    with contextlib.suppress(Exception):  # e.g. read-only attributes: the exception itself is unchanged
        notes = getattr(err, "__notes__", None)
        err.__notes__ = [*notes, note] if isinstance(notes, list) else [note]


def _first_line(err: BaseException) -> str:
    line = (str(err).strip().splitlines() or [""])[0]
    return line if len(line) <= 200 else line[:197] + "..."


def _raise_first_failure(outcomes: Sequence[Outcome], devices: Sequence[torch.device]) -> None:
    """Re-raise the first primary failure in replica order, with its replica's index and device; none: do nothing."""
    failed = [(i, error) for i, (_, error) in enumerate(outcomes) if error is not None]
    if not failed:
        return
    index, err = next(((i, e) for i, e in failed if not isinstance(e, PeerFailedError)), failed[0])
    original = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    note = f"Caught {type(err).__name__} in replica {index} on device {devices[index]}.\nOriginal {original.rstrip()}"
    others = "; ".join(f"replica {i}: {type(e).__name__}: {_first_line(e)}" for i, e in failed if i != index)
    if others:
        note += f"\nOther replicas of this call failed too: {others}"
    for name, value in (("replica_index", index), ("replica_device", devices[index])):
        with contextlib.suppress(Exception):  # a read-only attribute or __slots__: the note still carries both
            setattr(err, name, value)
    add_note(err, note)
    raise err


@functools.cache
def replica_frame(index: int) -> Callable[[Callable[[], T]], T]:
    """Calls a function through a frame named ``replica_<index>``, so tracebacks say which replica ran the code (also
    the forward traceback that anomaly detection attaches to an error in backward)."""

    def call(function: Callable[[], T]) -> T:
        return function()

    name = f"replica_{index}"
    code = call.__code__.replace(co_name=name)
    call.__code__ = code.replace(co_qualname=name) if sys.version_info >= (3, 11) else code
    return call


def resolve_mode(mode: ExecutionMode, devices: Sequence[torch.device]) -> Literal["threads", "sequential"]:
    """``"auto"`` runs replicas on CPUs or on one repeated GPU one after another: threads would only contend there."""
    if mode not in EXECUTION_MODES:
        raise ValueError(f"Unknown execution mode {mode!r}: choose one of {EXECUTION_MODES}.")
    if mode == "auto":
        one_device = len({(d.type, d.index) for d in devices}) == 1
        return "sequential" if one_device or all(d.type == "cpu" for d in devices) else "threads"
    return mode


def run_replicas(
    functions: Sequence[Callable[[], T]], devices: Sequence[DeviceLike], execution_mode: ExecutionMode = "auto"
) -> list[T]:
    """Call ``functions[i]()`` for replica ``i`` on ``devices[i]``; return the results in replica order.

    ``"threads"`` runs replica 0 in the calling thread and the others in a shared pool, and waits for all whatever was
    raised (``KeyboardInterrupt`` included): a first interrupt stops the replicas at their next sync point, a second
    gives up waiting. ``"sequential"`` stops at the first failure.
    """
    targets = [to_device(d) for d in devices]
    if len(functions) != len(targets):
        raise ValueError(f"run_replicas got {len(functions)} functions for {len(targets)} devices.")
    state = ThreadState.capture(targets)
    sequential = len(functions) <= 1 or resolve_mode(execution_mode, targets) == "sequential"
    forget_gathered()
    group = ReplicaGroup(targets, sequential=sequential)

    def run(index: int) -> Outcome:
        try:
            with group.member(index), state.replay(targets[index]):
                return replica_frame(index)(functions[index]), None
        except BaseException as err:  # KeyboardInterrupt too: the caller re-raises it once every replica stopped
            return None, err

    outcomes: list[Outcome] = []
    if sequential:
        for i in range(len(functions)):
            outcomes.append(run(i))
            if outcomes[i][1] is not None:  # the replicas after it never run
                break
    else:
        futures: list[Future] = [_pool().submit(run, i) for i in range(1, len(functions))]
        outcomes.append(run(0))
        try:
            wait(futures)
        except BaseException as err:  # run() never raises: this interrupted the wait itself
            group.interrupt(err)
            wait(futures)
            raise
        outcomes += [future.result() for future in futures]
    _raise_first_failure(outcomes, targets)
    return [value for value, _ in outcomes]
