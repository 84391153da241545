"""Run one callable per replica, in threads or one after another, with the caller's thread-local torch state.

A new thread inherits none of: grad mode, inference mode, autocast (enabled *and* dtype, per device type), the
current CUDA device and stream. They are captured in the caller and replayed in every worker; torch's own
``parallel_apply`` drops the autocast dtype, so a bf16 run would silently autocast to fp16 there. Process-global
state (the default dtype) is left alone: set it once in the caller.

When every device is a CPU, threads only fight torch's intra-op thread pool (measured 2-7x slower on 2 cores), and
when every replica is on one GPU ("virtual devices") they only contend for it (measured on an H100, N=2: 6.35 ms with
threads vs 4.69 ms sequential), so the default mode runs the replicas sequentially in both cases.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

from lightning_mgpu.parallel.devices import DeviceLike, all_cpu, to_device

T = TypeVar("T")
ExecutionMode = Literal["auto", "threads", "sequential"]
EXECUTION_MODES = ("auto", "threads", "sequential")

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
_POOL_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
_POOL_WORKERS = 64


class ReplicaError(RuntimeError):
    """A replica failed and its exception type could not be re-created; the original is the ``__cause__``."""


@dataclass(frozen=True)
class ThreadState:
    """The thread-local torch state a worker must replay to behave like its caller."""

    grad_enabled: bool
    inference_mode: bool
    autocast: dict[str, tuple[bool, torch.dtype]] = field(default_factory=dict)
    autocast_cache: bool = True
    cuda_streams: dict[int, torch.cuda.Stream] = field(default_factory=dict)

    @classmethod
    def capture(cls, devices: Sequence[torch.device] = ()) -> ThreadState:
        autocast = {}
        for device_type in _AUTOCAST_DEVICE_TYPES:
            if torch.is_autocast_enabled(device_type):
                autocast[device_type] = (True, torch.get_autocast_dtype(device_type))
        streams = {}
        for device in devices:
            if device.type == "cuda" and device.index not in streams:
                streams[device.index] = torch.cuda.current_stream(device)
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            autocast=autocast,
            autocast_cache=torch.is_autocast_cache_enabled(),
            cuda_streams=streams,
        )

    @contextmanager
    def replay(self, device: torch.device | None = None):
        """Enter this state (and ``device``'s CUDA device and captured stream) in the current thread."""
        with ExitStack() as stack:
            if self.inference_mode:
                stack.enter_context(torch.inference_mode())
            else:
                stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            if device is not None and device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                stream = self.cuda_streams.get(device.index)
                if stream is not None:
                    stack.enter_context(torch.cuda.stream(stream))
            for device_type, (enabled, dtype) in self.autocast.items():
                stack.enter_context(
                    torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache)
                )
            yield


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=_POOL_WORKERS, thread_name_prefix="mgpu-replica")
        return _POOL


def _forget_pool_in_child() -> None:
    """A forked child inherits the executor but none of its threads: its idle-thread count would make submit() wait
    for threads that do not exist (a deadlock, e.g. in a fork-started worker after a threads-mode step). Start over."""
    global _POOL, _POOL_LOCK
    _POOL_LOCK = threading.Lock()
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def _reraise(index: int, device: torch.device, err: BaseException) -> None:
    """Raise in the caller: same exception type when possible, with the replica index and the original traceback."""
    original = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    message = f"Caught {type(err).__name__} in replica {index} on device {device}.\nOriginal traceback:\n{original}"
    if isinstance(err, KeyError):
        # KeyError's str() is the repr of its argument: it would print the traceback on one line with \n escapes.
        message = _KeyErrorMessage(message)
    try:
        new_err = type(err)(message)
    except Exception:
        new_err = ReplicaError(message)
    raise new_err from err


class _KeyErrorMessage(str):
    """A message whose repr is itself, so ``str(KeyError(msg))`` keeps its lines (as torch's ExceptionWrapper does)."""

    def __repr__(self) -> str:
        return self


def resolve_mode(mode: ExecutionMode, devices: Sequence[torch.device]) -> Literal["threads", "sequential"]:
    if mode not in EXECUTION_MODES:
        raise ValueError(f"Unknown execution mode {mode!r}: choose one of {EXECUTION_MODES}.")
    if mode == "auto":
        one_device = len({(d.type, d.index) for d in devices}) == 1  # virtual devices: threads only contend
        return "sequential" if all_cpu(devices) or one_device else "threads"
    return mode


def parallel_apply(
    functions: Sequence[Callable[[], T]], devices: Sequence[DeviceLike], mode: ExecutionMode = "auto"
) -> list[T]:
    """Call ``functions[i]()`` for replica ``i`` on ``devices[i]``; return the results in replica order.

    ``mode="threads"`` runs replica 0 in the calling thread and the others in a shared thread pool;
    ``"sequential"`` runs them one after another; ``"auto"`` picks sequential on CPUs or one repeated device.
    A failing replica raises in the caller, naming its index and carrying its original traceback.
    """
    targets = [to_device(d) for d in devices]
    if len(functions) != len(targets):
        raise ValueError(f"parallel_apply got {len(functions)} functions for {len(targets)} devices.")
    if not functions:
        return []
    state = ThreadState.capture(targets)

    def run(index: int) -> Any:
        with state.replay(targets[index]):
            return functions[index]()

    if len(functions) == 1 or resolve_mode(mode, targets) == "sequential":
        results = []
        for i in range(len(functions)):
            try:
                results.append(run(i))
            except Exception as err:
                _reraise(i, targets[i], err)
        return results

    futures = [_pool().submit(run, i) for i in range(1, len(functions))]
    outcomes: list[tuple[bool, Any]] = []
    try:
        outcomes.append((True, run(0)))
    except Exception as err:
        outcomes.append((False, err))
    for future in futures:
        try:
            outcomes.append((True, future.result()))
        except Exception as err:
            outcomes.append((False, err))
    for i, (ok, value) in enumerate(outcomes):
        if not ok:
            _reraise(i, targets[i], value)
    return [value for _, value in outcomes]
