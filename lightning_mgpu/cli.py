"""``python -m lightning_mgpu`` and the ``lightning-mgpu`` console script: LightningCLI with this package's strategies.

Any LightningModule and LightningDataModule can be named by ``class_path`` in a YAML config, so recipe configs read
``trainer.strategy: parallel_criterion`` (or ``dp``) without the user importing anything first. Class paths resolve
from the current directory under both entry points (``class_path: recipes.pyramidnet.module.PyramidNetModule`` from
a clone's root), as ``python -m`` does by itself.

The command-line tools need the ``[recipes]`` extra (``jsonargparse`` for LightningCLI, ``transformers``,
``tokenizers`` and ``datasets`` for the recipes, ``matplotlib`` for the benchmark's chart), which a plain
``pip install`` of the package leaves out. When a module of the extra is missing, they say which one and how to
install the extra, and exit with status 1, instead of a traceback (:func:`exit_on_missing_extra`). The module
imports nothing heavy at the top, so the benchmark's entry point can share these checks.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import pairwise
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    from lightning.pytorch.cli import LightningCLI

# Top-level modules that the [recipes] extra installs (with jsonargparse[signatures]'s own dependencies).
RECIPES_EXTRA_MODULES = frozenset(
    {"jsonargparse", "docstring_parser", "typeshed_client", "transformers", "tokenizers", "datasets", "matplotlib"}
)
INSTALL_RECIPES_EXTRA = "pip install -e '.[recipes]'"  # from a clone: the package is not on the index


class MissingExtraError(RuntimeError):
    """A module of the ``[recipes]`` extra is not installed; the message says how to install it."""

    def __init__(self, module: str, command: str) -> None:
        self.module = module
        super().__init__(
            f"{command}: the Python package {module!r} is not installed. It comes with lightning-mgpu's [recipes] "
            "extra, which a plain `pip install` of the package leaves out. Install the extra from the root of your "
            f"lightning-mgpu clone with `{INSTALL_RECIPES_EXTRA}`, then run the command again."
        )


def missing_extra_module(error: BaseException) -> str | None:
    """The extra's module whose absence raised ``error`` (or one of the exceptions it was raised from), if any."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ModuleNotFoundError) and current.name:
            top = current.name.partition(".")[0]
            if top in RECIPES_EXTRA_MODULES:
                return top
        current = current.__cause__ or current.__context__
    return None


def _config_class_paths(args: Sequence[str]) -> Iterator[str]:
    """Every ``class_path`` string in the YAML files given with ``-c``/``--config`` (unreadable files are skipped:
    LightningCLI reports those itself)."""
    import yaml

    files = [b for a, b in pairwise(args) if a in ("-c", "--config")]
    files += [a.split("=", 1)[1] for a in args if a.startswith("--config=")]

    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            if isinstance(node.get("class_path"), str):
                yield node["class_path"]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    for file in files:
        try:
            with open(file) as f:
                yield from walk(yaml.safe_load(f))
        except (OSError, yaml.YAMLError):
            continue


def check_recipes_extra(command: str, args: Sequence[str] = (), modules: Iterable[str] = ("jsonargparse",)) -> None:
    """Raise :class:`MissingExtraError` if ``modules``, or a module that a config's ``class_path`` imports, is missing.

    Importing the configs' classes here, before LightningCLI parses anything, turns a missing ``transformers`` into
    one clear message instead of a parser error about the class path. ``jsonargparse`` is checked with its
    ``[signatures]`` extra, which LightningCLI needs.
    """
    from lightning_utilities.core.imports import RequirementCache

    for module in modules:
        requirement = "jsonargparse[signatures]" if module == "jsonargparse" else module
        if not RequirementCache(requirement):
            raise MissingExtraError(requirement, command)
    for class_path in _config_class_paths(args):
        module_name = class_path.rpartition(".")[0]
        if not module_name:
            continue
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            missing = missing_extra_module(err)
            if missing is not None:
                raise MissingExtraError(missing, command) from err
        except Exception:  # any other problem with the class is LightningCLI's to report, with its context
            continue


@contextmanager
def exit_on_missing_extra(command: str) -> Iterator[None]:
    """Turn a missing module of the ``[recipes]`` extra into its one-paragraph message on stderr and exit status 1.

    Anything else propagates unchanged.
    """
    try:
        yield
    except MissingExtraError as err:
        print(err, file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as err:
        module = missing_extra_module(err)
        if module is None:
            raise
        print(MissingExtraError(module, command), file=sys.stderr)
        raise SystemExit(1) from None


def put_cwd_on_sys_path() -> bool:
    """Put the current directory first on ``sys.path``, as ``python -m`` does; ``True`` if it was added.

    A console script's ``sys.path`` starts with the script's own folder (``.venv/bin``), not the current directory,
    so ``class_path: recipes...`` would fail with ``No module named 'recipes'``. Nothing changes when the directory
    is already there, by any spelling (``''``, relative or absolute), or when it no longer exists.
    """
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was deleted: nothing to import from
        return False
    if any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        return False
    sys.path.insert(0, cwd)
    return True


@overload
def main(args: None = None, run: bool = True) -> None: ...


@overload
def main(args: Sequence[str], run: bool = True) -> LightningCLI: ...


def main(args: Sequence[str] | None = None, run: bool = True) -> LightningCLI | None:
    """Run LightningCLI over any model/datamodule given by ``class_path``.

    ``args`` replaces ``sys.argv[1:]`` (tests drive the CLI in-process this way) and the ``LightningCLI`` is returned;
    ``run=False`` only instantiates. From the command line (``args=None``) it returns ``None``: the console script
    ends with ``sys.exit(main())``, which would print a returned object and exit with status 1 after a successful run.
    A missing module of the ``[recipes]`` extra exits with status 1 and a message saying how to install it.
    """
    put_cwd_on_sys_path()
    with exit_on_missing_extra("lightning-mgpu"):
        check_recipes_extra("lightning-mgpu", sys.argv[1:] if args is None else args)
        from lightning.pytorch.cli import LightningCLI

        import lightning_mgpu  # noqa: F401  (registers the strategies with Lightning's StrategyRegistry)

        cli = LightningCLI(
            model_class=None,
            datamodule_class=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            args=list(args) if args is not None else None,
            run=run,
        )
    return cli if args is not None else None
