"""Register the strategies with every Lightning namespace the project imports, and import none it does not use: one
already imported at once, the others by an import hook right after their package finishes importing. Each namespace
gets thin classes of its own (:func:`define`), importable and picklable from ``lightning_mgpu.strategies.<name>``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from typing import Any

#: Lightning namespace -> its Fabric package.
NAMESPACES = {"lightning.pytorch": "lightning.fabric", "pytorch_lightning": "lightning_fabric"}
_pending: set[str] = set()


def _strategy_module(namespace: str) -> str:
    return f"lightning_mgpu.strategies.{namespace.replace('.', '_')}"


def define(namespace: str) -> tuple[type, type]:
    """``(ParallelCriterionStrategy, DataParallelStrategy)`` of ``namespace``, registered now: the implementation put
    before the namespace's ``ParallelStrategy``."""
    from lightning_mgpu.strategies.data_parallel import DataParallelStrategyBase
    from lightning_mgpu.strategies.parallel_criterion import ParallelCriterionStrategyBase
    from lightning_mgpu.strategies.single_process import LightningNamespace

    fabric, strategies = NAMESPACES[namespace], importlib.import_module(f"{namespace}.strategies")
    lightning = LightningNamespace(
        namespace,
        importlib.import_module(namespace).LightningModule,
        importlib.import_module(f"{fabric}.utilities.exceptions").MisconfigurationException,
        importlib.import_module(f"{fabric}.utilities.device_dtype_mixin")._DeviceDtypeModuleMixin,
    )
    classes = []
    for base in (ParallelCriterionStrategyBase, DataParallelStrategyBase):
        name = base.__name__.removesuffix("Base")
        body = {"__module__": _strategy_module(namespace), "__qualname__": name, "__doc__": base.__doc__}
        classes.append(type(name, (base, strategies.ParallelStrategy), {**body, "namespace": lightning}))
    _register(strategies.StrategyRegistry, classes)
    return classes[0], classes[1]


def _register(registry: Any, classes: list[type]) -> None:
    for strategy in classes:
        for name in (strategy.strategy_name, *strategy.aliases):  # type: ignore[attr-defined]
            if name not in registry:
                registry.register(name, strategy, description=(strategy.__doc__ or name).strip().splitlines()[0])


def register_strategies(namespace: str | None = None) -> list[str]:
    """Register ``parallel_criterion``, ``dp`` and ``data_parallel`` now (idempotent) with ``namespace`` (imported if
    needed), default every namespace already imported. Returns the namespaces registered."""
    names = [namespace] if namespace is not None else [n for n in NAMESPACES if n in sys.modules]
    for name in names:
        if name not in NAMESPACES:
            raise ValueError(f"Unknown Lightning namespace {name!r}: use one of {sorted(NAMESPACES)}.")
        # Importing the strategy module registers its classes; one being imported registers them when it is done.
        classes = importlib.import_module(_strategy_module(name))
        if hasattr(classes, "DataParallelStrategy"):
            registry = importlib.import_module(f"{name}.strategies").StrategyRegistry
            _register(registry, [classes.ParallelCriterionStrategy, classes.DataParallelStrategy])
    return names


def register_on_import() -> None:
    """Register with the namespaces imported so far, and with the others as soon as they are imported."""
    for name in NAMESPACES:
        if name in sys.modules and not getattr(sys.modules[name].__spec__, "_initializing", False):
            register_strategies(name)
        else:
            _pending.add(name)
    if _pending and _RegisterAfterImport not in sys.meta_path:
        sys.meta_path.insert(0, _RegisterAfterImport)  # type: ignore[arg-type]


class _RegisterAfterImport:
    """A finder that finds nothing itself: it wraps the real loader of a pending namespace so that registration
    follows its import."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _pending:
            return None
        _pending.discard(fullname)  # first: the search below then passes over this finder
        if not _pending:
            sys.meta_path.remove(_RegisterAfterImport)  # type: ignore[arg-type]
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader, fullname)
        return spec


class _ThenRegister:
    """The real loader, registering the strategies once it has run the namespace's module."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def exec_module(self, module: Any) -> None:
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
