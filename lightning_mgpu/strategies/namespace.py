"""The few Lightning classes the shared strategy implementation needs, per Lightning namespace.

``lightning.pytorch`` (with ``lightning.fabric``) and ``pytorch_lightning`` (with ``lightning_fabric``) are separate
copies of the same code, so an ``isinstance`` check or an exception type must come from the namespace the user's
``Trainer`` belongs to. Each thin strategy class carries one :class:`LightningNamespace`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

#: Lightning plugins of the Trainer's namespace that a strategy takes in its constructor: an ``Accelerator``, a
#: ``CheckpointIO`` and a ``Precision`` plugin of ``lightning.pytorch`` or of ``pytorch_lightning``. One class serves
#: both namespaces, so their types cannot be named here; the Trainer fills them in, pass one only to override it.
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
