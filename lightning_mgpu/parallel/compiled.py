"""Replicas of ``torch.compile``d modules run the original's compilation (same options) bound to their own tensors:
compiled code bound to the original object would run the original's tensors. Dynamo is not thread-safe, so callers
run compiled replicas one after another."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn


def is_optimized_module(module: nn.Module) -> bool:
    """``torch.compile(module)``'s wrapper."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled can exist before dynamo is imported
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` itself runs compiled code (``module.compile()`` or ``torch.compile(module)``)."""
    return module.__dict__.get("_compiled_call_impl") is not None or is_optimized_module(module)


def compiled_call(original: nn.Module, replica: nn.Module) -> Callable[..., Any]:
    """``replica``'s ``_compiled_call_impl``: the compile context ``module.compile()`` wrapped around
    ``original._call_impl`` (read from torch internals), around ``replica._call_impl``."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    for cell in getattr(original.__dict__["_compiled_call_impl"], "__closure__", None) or ():
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(content, _TorchDynamoContext):
            return content(replica._call_impl)
    raise RuntimeError(
        f"Cannot replicate a {type(original).__name__}: it was compiled with module.compile(), but this torch version "
        "does not let its compile options be read back, so a replica cannot run the same compiled code on its own "
        "tensors. Compile with torch.compile(module) instead, train on one device, or use strategy='ddp'."
    )
