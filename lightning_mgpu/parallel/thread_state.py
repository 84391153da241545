"""The thread-local torch state a replica's worker thread replays to behave like the caller. A new thread inherits
none of: grad mode, inference mode, autocast (enabled *and* dtype, per device type; torch's own ``parallel_apply``
drops the dtype: bf16 silently becomes fp16), the current CUDA device and stream."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ThreadState:
    """The caller's thread-local torch state; process-global state (the default dtype) is left alone."""

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
            for device_type, dtype in self.autocast.items():
                stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=self.autocast_cache))
            yield
