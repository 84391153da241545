"""The few Lightning classes the shared strategy implementation needs, per Lightning namespace.

``lightning.pytorch`` (with ``lightning.fabric``) and ``pytorch_lightning`` (with ``lightning_fabric``) are separate
copies of the same code, so an ``isinstance`` check or an exception type must come from the namespace the user's
``Trainer`` belongs to. Each thin strategy class carries one :class:`LightningNamespace`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LightningNamespace:
    """One Lightning namespace: its name and the classes the implementation checks against or raises."""

    name: str
    lightning_module: type
    misconfiguration: type[Exception]
    device_dtype_mixin: type
