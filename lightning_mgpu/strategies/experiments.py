"""Side-effect-free runs of a step on replicas: the experiments behind the loss-normalisation check.

An experiment must leave the run exactly as it found it, so that training stays equal to one device's. Inside
:func:`side_effect_free`: no autograd, no autocast and no TF32 (mixed precision and reduced-precision matmuls would blur
a comparison made to rounding), eval mode (no dropout, no BatchNorm statistics update); afterwards: torch's, Python's
and NumPy's random states restored, logs and metric updates discarded, attributes the step rebinds undone on every
replica, items it appends to the LightningModule's lists removed, and the module's buffers that changed (a counter
the step increments in place) copied back.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_mgpu.parallel.parallel_apply import parallel_apply
from lightning_mgpu.parallel.scatter_gather import move_to
from lightning_mgpu.strategies.lightning_replicas import LightningReplicas


@contextmanager
def side_effect_free(
    module: nn.Module, replicas: LightningReplicas, count: int, *, prepare: bool = True, seed: int | None = None
) -> Iterator[list[nn.Module]]:
    """The first ``count`` replicas, for an experiment that leaves nothing behind (see the module documentation).

    ``prepare=False`` uses the replicas as the current step prepared them (a step whose autograd graph is still
    alive must not have its replicas' buffers rewritten). ``seed`` reseeds the random draws of the experiment.
    """
    lists = {name: value for name, value in vars(module).items() if isinstance(value, list) and name[0] != "_"}
    lengths = {name: len(value) for name, value in lists.items()}
    buffers = [(b, b._version, b.detach().clone()) for b in module.buffers()]
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        live = replicas.replica_set.prepare(count, "sequential") if prepare else replicas.replica_set.replicas[:count]
        for device_type in ("cpu", "cuda"):
            stack.enter_context(torch.autocast(device_type, enabled=False))
        stack.enter_context(_full_precision_matmuls())
        cuda = sorted({d.index for d in replicas.devices[:count] if d.type == "cuda"})
        stack.enter_context(torch.random.fork_rng(devices=cuda, enabled=True))
        if seed is not None:
            torch.manual_seed(seed)
        flags = [[m.training for m in replica.modules()] for replica in live]
        for replica in live:
            replica.train(False)
        try:
            yield live
        finally:
            for replica, saved in zip(live, flags, strict=True):
                for m, flag in zip(replica.modules(), saved, strict=True):
                    m.training = flag
            replicas.replica_set.restore_attributes()
            replicas.discard()
            for name, items in lists.items():
                del items[lengths[name] :]
            for buffer, version, saved_value in buffers:
                if buffer._version != version:  # written by the experiment: put the value back
                    buffer.copy_(saved_value)
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def run_side_effect_free(
    module: nn.Module,
    replicas: LightningReplicas,
    chunks: list[Any],
    call: Callable[[nn.Module, Any], Any],
    *,
    prepare: bool = True,
    seed: int | None = None,
) -> list[Any]:
    """``call(replica_i, chunk_i)`` inside :func:`side_effect_free`, each replica on its device with its chunk moved
    there, one after another."""
    devices = replicas.devices[: len(chunks)]
    with side_effect_free(module, replicas, len(chunks), prepare=prepare, seed=seed) as live:
        return parallel_apply(
            [lambda r=r, c=c, d=d: call(r, move_to(c, d)) for r, c, d in zip(live, chunks, devices, strict=True)],
            devices,
            "sequential",
        )


@contextmanager
def _full_precision_matmuls() -> Iterator[None]:
    """float32 matmuls and convolutions without TF32 (process-wide flags, restored on exit)."""
    precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
