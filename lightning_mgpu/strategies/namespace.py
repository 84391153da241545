"""The few Lightning classes the shared strategy implementation needs, per Lightning namespace.

``lightning.pytorch`` and ``pytorch_lightning`` are separate copies of Lightning, so an ``isinstance`` check or an
exception type must come from the namespace of the user's ``Trainer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

#: The Trainer's ``Accelerator``, ``CheckpointIO`` and ``Precision`` plugin, of either namespace (so not nameable
#: here); the Trainer fills them in, pass one only to override it.
Accelerator: TypeAlias = Any
CheckpointIO: TypeAlias = Any
PrecisionPlugin: TypeAlias = Any


@dataclass(frozen=True)
class LightningNamespace:
    """One Lightning namespace: its name and the classes the implementation checks against or raises."""

    name: str
    lightning_module: type
    misconfiguration: type[Exception]
    device_dtype_mixin: type
