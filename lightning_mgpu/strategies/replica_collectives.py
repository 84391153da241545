"""Whether a LightningModule's step meets the other replicas (collectives), read from its source code.

The replicas can only meet when they run at the same time, in threads; finding out by running the step would run it
twice. So the module's own classes (not Lightning's or torch's) are read for a call of a collective:
``self.all_gather(...)``, ``strategy.reduce(...)``, ``.broadcast(...)``, ``.barrier(...)`` or
``.reduce_boolean_decision(...)``. ``ParallelCriterionStrategy(collectives=...)`` says it when reading cannot.
"""

from __future__ import annotations

import inspect
import re

from torch import nn

_CALL = re.compile(r"\.(all_gather|reduce_boolean_decision|barrier|broadcast)\s*\(|strategy\.(reduce)\s*\(")
_LIBRARIES = ("lightning.", "pytorch_lightning.", "torch.", "torchmetrics.", "builtins")


def collective_call_in_source(module: nn.Module) -> str | None:
    """``"TheModule calls all_gather"`` for the first collective call in the source of ``module``'s own classes, or
    ``None`` when there is none (or no source to read, e.g. a class defined in an interactive session)."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith(_LIBRARIES) or cls is object:
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        match = _CALL.search(source)
        if match is not None:
            return f"{cls.__name__} calls {match.group(1) or match.group(2)}"
    return None
