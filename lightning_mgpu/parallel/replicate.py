"""Differentiable module replicas: gradients of every replica accumulate into the original parameters.

Distinct CUDA devices use ``torch.nn.parallel.replicate`` (a coalesced broadcast whose backward reduce-adds the
gradients onto the root). Everything else — CPU devices, one device repeated ("virtual devices"), which torch refuses —
uses shallow replicas: on the parameter's own device a replica holds the original ``Parameter`` objects, elsewhere a
differentiable ``.to(device)`` copy. Tied parameters stay tied inside each replica.

Buffers follow ``torch.nn.DataParallel``'s documented semantics: replica 0 shares the original buffers (so in-place
updates such as BatchNorm running statistics, computed from chunk 0, are kept); the other replicas get copies whose
updates are dropped.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_mgpu.parallel.devices import DeviceLike, distinct_cuda, to_device


def replicate(module: nn.Module, devices: Sequence[DeviceLike], detach: bool = False) -> list[nn.Module]:
    """One replica of ``module`` per device. With ``detach=True`` replicas hold no autograd link (for inference)."""
    targets = [to_device(d) for d in devices]
    if not targets:
        raise ValueError("replicate() needs at least one device.")
    if distinct_cuda(targets) and not isinstance(module, torch.jit.ScriptModule):
        if any(_is_compiled(sub) for sub in module.modules()):
            _refuse_compiled(module)
        return list(torch.nn.parallel.replicate(module, targets, detach=detach))
    return [_shallow_replica(module, device, share_buffers=(i == 0), detach=detach) for i, device in enumerate(targets)]


def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` was torch.compile'd (``module.compile()`` or ``torch.compile(module)``)."""
    if module.__dict__.get("_compiled_call_impl") is not None:
        return True
    if "torch._dynamo" not in sys.modules:  # no OptimizedModule can exist without dynamo loaded
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def _refuse_compiled(root: nn.Module) -> None:
    name = next(name for name, sub in root.named_modules() if _is_compiled(sub))
    where = f"submodule '{name}'" if name else "the module"
    raise ValueError(
        f"Cannot replicate {where}: it was compiled with torch.compile (module.compile() or "
        "torch.compile(module)). The compiled code stays bound to the original module, so every replica would "
        "silently run the original's parameters and buffers instead of its own (torch.nn.DataParallel has the "
        "same limitation). Train a compiled model on one device, or with strategy='ddp' (one process per "
        "device), or drop the compile call."
    )


def _move(tensor: Tensor, device: torch.device, detach: bool) -> Tensor:
    if detach:
        tensor = tensor.detach()
    return tensor if tensor.device == device else tensor.to(device)


def _shallow_replica(module: nn.Module, device: torch.device, share_buffers: bool, detach: bool) -> nn.Module:
    """Copy the module tree (not the tensors), re-pointing parameters and buffers as described in the module doc."""
    module_copies: dict[int, nn.Module] = {}
    tensor_copies: dict[int, Tensor] = {}

    def param_for(param: Tensor) -> Tensor:
        key = id(param)
        if key not in tensor_copies:
            tensor_copies[key] = _move(param, device, detach)
        return tensor_copies[key]

    def buffer_for(buffer: Tensor) -> Tensor:
        key = id(buffer)
        if key not in tensor_copies:
            if share_buffers and buffer.device == device:
                tensor_copies[key] = buffer
            elif buffer.device == device:
                tensor_copies[key] = buffer.detach().clone() if detach or not buffer.requires_grad else buffer.clone()
            else:
                tensor_copies[key] = _move(buffer, device, detach or not buffer.requires_grad)
        return tensor_copies[key]

    def copy_module(original: nn.Module) -> nn.Module:
        key = id(original)
        if key in module_copies:  # a submodule used twice stays one module in the replica
            return module_copies[key]
        if _is_compiled(original):  # checked here, in the walk replication makes anyway: no extra pass per step
            _refuse_compiled(module)
        replica = original._replicate_for_data_parallel()
        module_copies[key] = replica
        for name, param in original._parameters.items():
            replica._parameters[name] = None if param is None else param_for(param)
        for name, buffer in original._buffers.items():
            replica._buffers[name] = None if buffer is None else buffer_for(buffer)
        for name, child in original._modules.items():
            replica._modules[name] = None if child is None else copy_module(child)
        if isinstance(replica, nn.RNNBase):
            # RNNs run on a cached list of their weights, which must hold this replica's tensors (on its device,
            # detached or not), not the original's; without flatten_parameters(), which would rewrite storage.
            replica._flat_weights = [
                replica._parameters.get(wn) if wn in replica._parameters else getattr(replica, wn, None)
                for wn in replica._flat_weights_names
            ]
        return replica

    return copy_module(module)
