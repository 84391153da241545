"""``python -m lightning_mgpu`` and the ``lightning-mgpu`` script: LightningCLI with this package's strategies
registered. Its errors are LightningCLI's and jsonargparse's, but for a missing module of the ``[recipes]`` extra (one
line naming the pip command that installs it, exit status 1) and a strategy given by name with ``init_args``."""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

import lightning_mgpu  # registers the strategies with Lightning

# The modules of the [recipes] extra's packages (pyproject.toml; jsonargparse stands for jsonargparse[signatures]).
RECIPES_EXTRA = frozenset({"jsonargparse", "transformers", "tokenizers", "datasets", "matplotlib"})


def missing_extra_message(error: BaseException | str, command: str) -> str | None:
    """``command``'s line for an error that says a module of the extra is missing (Python's "No module named", or
    Lightning's "Requirement ... not met"), else ``None``. A clone installs the extra from itself, a wheel by name."""
    found = re.search(r"(?:No module named|Requirement) '(\w+)", str(error))
    if found is None or found[1] not in RECIPES_EXTRA:
        return None
    root = Path(lightning_mgpu.__file__).resolve().parents[1]
    clone = (root / "pyproject.toml").is_file()
    pip = f"pip install -e '{root}[recipes]'" if clone else "pip install 'lightning-mgpu[recipes]'"
    return f"{command}: the Python package {found[1]!r} is not installed; the [recipes] extra has it: {pip}"


@contextmanager
def exit_on_missing_extra(command: str) -> Iterator[None]:
    """A missing module of the ``[recipes]`` extra becomes :func:`missing_extra_message` and exit status 1."""
    try:
        yield
    except ModuleNotFoundError as err:
        if (message := missing_extra_message(err, command)) is None:
            raise
        print(message, file=sys.stderr)
        raise SystemExit(1) from None


_NAMED_WITH_OPTIONS = re.compile(r'key "trainer\.strategy".*Expected a dot import path string: (\w+)', re.DOTALL)
_CLASSES = {"parallel_criterion": "ParallelCriterionStrategy", "dp": "DataParallelStrategy"}


class _Parser(LightningArgumentParser):
    """A ``class_path`` whose module imports a missing module of the extra raises it (jsonargparse says a bad value),
    for :func:`exit_on_missing_extra`; a strategy given by name with ``init_args`` is told the form that takes them."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if self.exit_on_error and missing_extra_message(message, "") is not None:
            raise ModuleNotFoundError(message) from ex
        if (named := _NAMED_WITH_OPTIONS.search(message)) is not None:
            name = _CLASSES.get(named[1].lower())
            path = f"lightning_mgpu.{name}" if name else "<the strategy's class path>"
            message += (
                f"\nA strategy given by name takes no init_args: give its class, --trainer.strategy.class_path={path} "
                "--trainer.strategy.init_args.<option>=<value>"
            )
        super().error(message, ex)


# Lightning 2.5.1+ takes a parser class; before, a class_path that imports a missing module is jsonargparse's error.
_PARSER_CLASS = {"parser_class": _Parser} if "parser_class" in inspect.signature(LightningCLI).parameters else {}


def main(args: Sequence[str] | None = None, run: bool = True) -> LightningCLI | None:
    """LightningCLI; with ``args`` (for ``sys.argv[1:]``) return it, else ``None`` (for ``sys.exit(main())``)."""
    if os.getcwd() not in map(os.path.abspath, sys.path):  # `python -m` puts it there, a console script does not:
        sys.path.insert(0, os.getcwd())  # recipe class paths (recipes.*) import from the current directory
    prog = os.path.basename(sys.argv[0]).replace("__main__.py", "python -m lightning_mgpu")
    # Nothing a user can act on: Lightning's tips, and a deprecation inside Lightning.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)`? is deprecated")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_no_tips)
    with exit_on_missing_extra(prog):
        # Without model_class and datamodule_class, any LightningModule and LightningDataModule by class_path.
        given = None if args is None else list(args)
        cli = LightningCLI(
            save_config_kwargs={"overwrite": True}, parser_kwargs={"prog": prog}, args=given, run=run, **_PARSER_CLASS
        )
    if args is not None:
        return cli
    # A ddp run's process group goes before the process exits: gloo's threads still running at exit can abort it.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return None


def _no_tips(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip")
