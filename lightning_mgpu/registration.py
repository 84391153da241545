"""Register the strategies with every Lightning namespace the project imports, and import none it does not use:
a namespace already imported at once, the others by an import hook right after their package finishes importing.
Each namespace gets thin classes of its own (:func:`define`), which import and pickle from its module here."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

#: Lightning namespace -> the module of this package that defines its strategy classes.
STRATEGY_MODULES = {
    "lightning.pytorch": "lightning_mgpu.strategies.lightning_pytorch",
    "pytorch_lightning": "lightning_mgpu.strategies.pytorch_lightning",
}

_pending: set[str] = set()


def define(namespace: str, fabric: str, module: str) -> tuple[type, type]:
    """``(ParallelCriterionStrategy, DataParallelStrategy)`` of ``module``, registered now: the implementation put
    before the ``ParallelStrategy`` of the Lightning ``namespace`` (``fabric``: its Fabric package)."""
    from lightning_mgpu.strategies.data_parallel import DataParallelStrategyBase
    from lightning_mgpu.strategies.parallel_criterion import ParallelCriterionStrategyBase
    from lightning_mgpu.strategies.single_process import LightningNamespace

    strategies = importlib.import_module(f"{namespace}.strategies")
    lightning = LightningNamespace(
        namespace,
        importlib.import_module(namespace).LightningModule,
        importlib.import_module(f"{fabric}.utilities.exceptions").MisconfigurationException,
        importlib.import_module(f"{fabric}.utilities.device_dtype_mixin")._DeviceDtypeModuleMixin,
    )
    classes = []
    for base in (ParallelCriterionStrategyBase, DataParallelStrategyBase):
        name = base.__name__.removesuffix("Base")
        attributes = {"__module__": module, "__qualname__": name, "__doc__": base.__doc__, "namespace": lightning}
        classes.append(type(name, (base, strategies.ParallelStrategy), attributes))
    _register(strategies.StrategyRegistry, classes)
    return classes[0], classes[1]


def _register(registry: Any, classes: Sequence[type]) -> None:
    for strategy in classes:
        for name in (strategy.strategy_name, *strategy.aliases):  # type: ignore[attr-defined]
            if name not in registry:
                registry.register(name, strategy, description=(strategy.__doc__ or name).strip().splitlines()[0])


def register_strategies(namespace: str | None = None) -> list[str]:
    """Register ``parallel_criterion``, ``dp`` and ``data_parallel`` now (idempotent) with ``namespace`` (imported if
    needed), default every namespace already imported. Returns the namespaces registered."""
    names = [namespace] if namespace is not None else [n for n in STRATEGY_MODULES if n in sys.modules]
    for name in names:
        if name not in STRATEGY_MODULES:
            raise ValueError(f"Unknown Lightning namespace {name!r}: use one of {sorted(STRATEGY_MODULES)}.")
        # Importing the strategy module registers its classes; one being imported registers them when it is done.
        classes = importlib.import_module(STRATEGY_MODULES[name])
        if hasattr(classes, "DataParallelStrategy"):
            registry = importlib.import_module(f"{name}.strategies").StrategyRegistry
            _register(registry, (classes.ParallelCriterionStrategy, classes.DataParallelStrategy))
    return names


def register_on_import() -> None:
    """Register with the namespaces imported so far, and with the others as soon as they are imported."""
    for name in STRATEGY_MODULES:
        spec = getattr(sys.modules.get(name), "__spec__", None)
        if name in sys.modules and not getattr(spec, "_initializing", False):
            register_strategies(name)
        else:
            _pending.add(name)
    if _pending and not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of a pending namespace so that registration follows its import."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _pending:
            return None
        _pending.discard(fullname)  # first: the search below then passes over this finder
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            _pending.add(fullname)
            return None
        if not _pending:
            sys.meta_path.remove(self)
        spec.loader = _ThenRegister(spec.loader, fullname)
        return spec


class _ThenRegister:
    """The real loader, registering the strategies once it has run the namespace's module."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        try:
            register_strategies(self._name)
        except Exception as err:  # never break the user's `import lightning`
            warnings.warn(
                f"lightning_mgpu could not register its strategies with {self._name}: {err!r}. Call "
                f"lightning_mgpu.register_strategies({self._name!r}) to see the full error.",
                stacklevel=2,
            )

    def __getattr__(self, name: str) -> Any:  # create_module, get_resource_reader... of the real loader
        return getattr(self._loader, name)
