"""The thread-local torch state (grad and inference mode, autocast with its dtype, CUDA device and stream) that a
replica's worker thread inherits none of, captured in the caller and replayed in each worker.

Keep the autocast dtype: torch's own ``parallel_apply`` drops it, so a bf16 run silently autocasts to fp16 there.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class ThreadState:
    grad_enabled: bool
    inference_mode: bool
    autocast: dict[str, tuple[bool, torch.dtype]] = field(default_factory=dict)
    autocast_cache: bool = True
    cuda_streams: dict[int, torch.cuda.Stream] = field(default_factory=dict)

    @classmethod
    def capture(cls, devices: Sequence[torch.device] = ()) -> ThreadState:
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            autocast={
                device_type: (True, torch.get_autocast_dtype(device_type))
                for device_type in _AUTOCAST_DEVICE_TYPES
                if torch.is_autocast_enabled(device_type)
            },
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
            for device_type, (enabled, dtype) in self.autocast.items():
                stack.enter_context(
                    torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache)
                )
            yield
