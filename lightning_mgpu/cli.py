"""``python -m lightning_mgpu`` and the ``lightning-mgpu`` console script: LightningCLI with this package's strategies.

Any LightningModule and LightningDataModule can be named by ``class_path`` in a YAML config, so recipe configs read
``trainer.strategy: parallel_criterion`` (or ``dp``) without the user importing anything first. Class paths resolve
from the current directory under both entry points (``class_path: recipes.pyramidnet.module.PyramidNetModule`` from
a clone's root), as ``python -m`` does by itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import overload

from lightning.pytorch.cli import LightningCLI

import lightning_mgpu  # noqa: F401  (registers the strategies with Lightning's StrategyRegistry)


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
    """
    put_cwd_on_sys_path()
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
