"""``CPUThreads``: the number of torch's intra-op CPU threads for a run on the CPU, set from the config.

The CPU quickstarts run on small shared machines (2 cores, CI runners, laptops doing other work). torch starts one
intra-op thread per core, and every parallel region waits at a barrier for all of them, so a single competing
process stalls each region. Measured on 2 cores, the PyramidNet quickstart (imports included) took 115 s with torch's
default threads beside one busy process and 52 s idle; with one thread, 50 s either way. Putting the setting in the
config keeps the README command (``python -m lightning_mgpu fit -c ...``) as it is, instead of asking every user to
prefix ``OMP_NUM_THREADS=1``.

It applies only when the trainer's accelerator is the CPU, so the same config moved to a GPU keeps torch's default,
and it restores the previous count when the run ends (e.g. for tests that fit in-process). Under ``ddp`` on the CPU
Lightning already divides the cores among the processes when ``OMP_NUM_THREADS`` is unset; this callback, in each
process, then sets its own count.
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from typing_extensions import override

__all__ = ["CPUThreads"]


class CPUThreads(L.Callback):
    """Run with ``num_threads`` torch intra-op threads when training on the CPU (see the module docstring).

    Args:
        num_threads: intra-op threads (``torch.set_num_threads``), at least 1.
    """

    def __init__(self, num_threads: int = 1) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.num_threads = num_threads
        self._previous: int | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(trainer.accelerator, CPUAccelerator) and self._previous is None:
            self._previous = torch.get_num_threads()
            torch.set_num_threads(self.num_threads)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous is not None:
            torch.set_num_threads(self._previous)
            self._previous = None
