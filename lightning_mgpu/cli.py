"""``python -m lightning_mgpu`` and the ``lightning-mgpu`` script: LightningCLI with this package's strategies.

A missing module of the ``[recipes]`` extra, a ``class_path`` that does not import from the current directory or a
misspelled strategy is one message and exit status 1, not a traceback."""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import lightning_mgpu

if TYPE_CHECKING:
    from lightning.pytorch.cli import LightningCLI

# Top-level modules that the [recipes] extra installs (with jsonargparse[signatures]'s own dependencies).
RECIPES_EXTRA_MODULES = frozenset(
    {"jsonargparse", "docstring_parser", "typeshed_client", "transformers", "tokenizers", "datasets", "matplotlib"}
)


class CommandError(RuntimeError):
    """A config or command line that cannot work here; the message says what to change."""


class MissingExtraError(CommandError):
    """A module of the ``[recipes]`` extra is not installed; the message says how to install it, as fits the way
    lightning-mgpu itself was installed (see :func:`clone_root`)."""

    def __init__(self, module: str, command: str) -> None:
        hint = install_extra_hint(clone_root())
        super().__init__(f"{command}: the Python package {module!r} is not installed. {hint}")


def install_extra_hint(root: Path | None) -> str:
    """How to install the ``[recipes]`` extra: from the clone ``root`` where lightning-mgpu is installed editable (or
    imported from), else (``None``) next to an installed wheel."""
    if root is not None:
        return (
            "It comes with lightning-mgpu's [recipes] extra: install it from the root of your lightning-mgpu clone "
            f"({root}) with `pip install -e '.[recipes]'`."
        )
    return (
        "It comes with lightning-mgpu's [recipes] extra: `pip install 'lightning-mgpu[recipes]'` adds it to the "
        f"installed lightning-mgpu, or install the packages themselves: `pip install {RECIPES_EXTRA_REQUIREMENTS}`."
    )


# The [recipes] extra's requirements, as pyproject.toml lists them, for a pip command line.
RECIPES_EXTRA_REQUIREMENTS = (
    "'transformers>=4.40' 'tokenizers>=0.15' 'datasets>=2.18' 'jsonargparse[signatures]>=4.27' 'matplotlib>=3.7'"
)


def clone_root(
    distributions: Iterable[Any] | None = None, package_file: str | os.PathLike[str] | None = None
) -> Path | None:
    """The root of the lightning-mgpu clone this package comes from, or ``None`` for an installed wheel.

    A clone is either what an editable install points to (its ``direct_url.json`` says ``dir_info.editable``, as pip
    writes it: PEP 610) or the folder above the imported package when it holds the project's ``pyproject.toml`` (a
    clone on ``sys.path``). ``distributions`` and ``package_file`` default to this interpreter's."""
    import json
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    if distributions is None:  # every one: a clone's own *.egg-info on sys.path has no direct_url.json
        distributions = metadata.distributions(name="lightning-mgpu")
    for dist in distributions:
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "null")
        except (OSError, ValueError):
            continue
        if isinstance(direct, dict) and (direct.get("dir_info") or {}).get("editable"):
            url = urlparse(str(direct.get("url", "")))
            if url.scheme == "file" and Path(unquote(url.path)).is_dir():
                return Path(unquote(url.path))
    above = Path(package_file or lightning_mgpu.__file__).resolve().parent.parent
    return above if (above / "pyproject.toml").is_file() and (above / "lightning_mgpu").is_dir() else None


def missing_extra_module(error: BaseException) -> str | None:
    """The extra's module whose absence raised ``error`` (or an exception it was raised from), if any."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        top = (current.name or "").partition(".")[0] if isinstance(current, ModuleNotFoundError) else ""
        if top in RECIPES_EXTRA_MODULES:
            return top
        current = current.__cause__ or current.__context__
    return None


def _config_nodes(args: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """``(path, node)`` for everything in the YAML configs given with ``-c``/``--config`` (unreadable files are
    LightningCLI's to report)."""
    import yaml

    from lightning_mgpu.parallel.scatter_gather import iter_nodes

    for file in _config_files(args):
        try:
            with open(file) as f:
                config = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            continue
        yield from iter_nodes(config, "config")


def _config_files(args: Sequence[str]) -> list[str]:
    """The values of ``-c``/``--config`` options, in order."""
    files = [b for a, b in pairwise(args) if a in ("-c", "--config")]
    return files + [a.split("=", 1)[1] for a in args if a.startswith("--config=")]


def check_config_files(command: str, args: Sequence[str]) -> None:
    """Refuse a config path that does not exist, saying where recipe configs live and where to run from (jsonargparse
    prints its whole usage, then ``File does not exist``). A value that is YAML for a mapping is an inline config."""
    import yaml

    for file in _config_files(args):
        try:
            inline = not isinstance(yaml.safe_load(file), str)
        except yaml.YAMLError:
            inline = False
        if inline or os.path.exists(file):
            continue
        root = clone_root()
        where = f"{command}: the config file {file!r} does not exist"
        where += "." if os.path.isabs(file) else f" (relative to the current directory, {os.getcwd()})."
        if root is None:
            raise CommandError(
                f"{where} Recipe configs (configs/) and their code (recipes/) live in a clone of lightning-mgpu, not "
                "in the installed package: run the command from the root of a clone, or give the path of a config of "
                "your own."
            )
        found = f" ({file} is there)" if not os.path.isabs(file) and (root / file).is_file() else ""
        raise CommandError(
            f"{where} Recipe configs live in configs/ of your lightning-mgpu clone, {root}{found}: run the command "
            f"from that folder (cd {root}), or give the path of a config of your own."
        )


def _class_paths(args: Sequence[str]) -> Iterator[str]:
    for _, node in _config_nodes(args):
        if isinstance(node, dict) and isinstance(node.get("class_path"), str):
            yield node["class_path"]


def _strategy_names(args: Sequence[str]) -> Iterator[str]:
    """``trainer.strategy`` given as a name, in the configs or on the command line."""
    for path, node in _config_nodes(args):
        if path == "config['trainer']['strategy']" and isinstance(node, str):
            yield node
    for a, b in pairwise(["", *args]):
        if b.startswith("--trainer.strategy="):
            yield b.split("=", 1)[1]
        elif a == "--trainer.strategy" and not b.startswith("-"):
            yield b


def check_strategy_names(command: str, args: Sequence[str]) -> None:
    """Refuse a strategy name Lightning does not know, naming the closest, and a ``pytorch_lightning`` strategy
    class in this ``lightning.pytorch`` CLI."""
    from lightning.pytorch.strategies import StrategyRegistry

    known = [*StrategyRegistry.available_strategies(), "auto"]
    for name in _strategy_names(args):
        if name not in known:
            raise CommandError(_unknown_strategy(command, name, known))
    for class_path in _class_paths(args):
        if class_path.startswith("lightning_mgpu.strategies.pytorch_lightning."):
            name = class_path.rpartition(".")[2]
            raise CommandError(
                f"{command}: {class_path} is a pytorch_lightning strategy, but this command runs lightning.pytorch's "
                f"Trainer: use class_path: lightning_mgpu.{name}."
            )


def check_strategy_arguments(command: str, args: Sequence[str]) -> None:
    """Refuse ``--trainer.strategy.init_args...`` where the strategy in force is a name (the last config or option
    that sets it gave a string), which takes no arguments (jsonargparse says "Expected a dot import path string"),
    with the ``class_path`` option, placed before them, that makes them work."""
    from lightning.pytorch.strategies import StrategyRegistry

    name: str | None = None  # the strategy in force when it is a name
    for k, arg in enumerate(args):
        option = arg.partition("=")[0]
        if (k and args[k - 1] in ("-c", "--config")) or option == "--config":
            given = _config_strategy(arg.partition("=")[2] if option == "--config" else arg)
            name = name if given is _UNSET else given if isinstance(given, str) else None
        elif option == "--trainer.strategy":
            name = arg.partition("=")[2] if "=" in arg else (args[k + 1] if k + 1 < len(args) else None)
        elif option.startswith("--trainer.strategy.class_path"):
            name = None
        elif option.startswith("--trainer.strategy.init_args") and name in StrategyRegistry:
            raise CommandError(_arguments_for_a_name(command, option, name))


_UNSET = object()


def _config_strategy(file: str) -> Any:
    """What a config file sets ``trainer.strategy`` to (``_UNSET`` when it sets nothing or cannot be read)."""
    import yaml

    try:
        with open(file) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return _UNSET
    trainer = config.get("trainer") if isinstance(config, dict) else None
    return trainer.get("strategy", _UNSET) if isinstance(trainer, dict) else _UNSET


def _arguments_for_a_name(command: str, option: str, name: str) -> str:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[name]
    cls = entry["strategy"]
    path = f"{'lightning_mgpu' if cls.__module__.startswith('lightning_mgpu.') else cls.__module__}.{cls.__name__}"
    registered = "".join(f" --trainer.strategy.init_args.{k}={v}" for k, v in entry["init_params"].items())
    yaml_args = ", ".join([*(f"{k}: {v}" for k, v in entry["init_params"].items()), "..."])
    return (
        f"{command}: {option} sets an argument of the strategy, but trainer.strategy is the name {name!r}, which "
        f"takes none. Name its class before the init_args options: --trainer.strategy.class_path={path}{registered} "
        f"(YAML: strategy: {{class_path: {path}, init_args: {{{yaml_args}}}}})."
    )


def _unknown_strategy(command: str, name: str, known: list[str]) -> str:
    if "." in name or isinstance(getattr(lightning_mgpu, name, None), type):  # a class path, or one of ours
        path = name if "." in name else f"lightning_mgpu.{name}"
        return (
            f"{command}: trainer.strategy={name!r} is read as a registered strategy name, and that is a class. A "
            f"strategy class goes in --trainer.strategy.class_path={path} (YAML: strategy: {{class_path: {path}}}), "
            "its arguments in --trainer.strategy.init_args.<argument>=..."
        )
    lower = name.lower()  # registered names are lower case
    close = [lower] if lower in known else difflib.get_close_matches(lower, known, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    return (
        f"{command}: unknown strategy {name!r}.{hint} This package registers 'parallel_criterion' and 'dp' (alias "
        "'data_parallel'); Lightning's own include 'ddp' and 'auto'."
    )


def check_recipes_extra(command: str, args: Sequence[str] = (), modules: Iterable[str] = ("jsonargparse",)) -> None:
    """Raise :class:`MissingExtraError` if ``modules`` (``jsonargparse`` meaning ``jsonargparse[signatures]``), or a
    module that a config's ``class_path`` imports, is missing."""
    from lightning_utilities.core.imports import RequirementCache

    for module in modules:
        requirement = "jsonargparse[signatures]" if module == "jsonargparse" else module
        if not RequirementCache(requirement):
            raise MissingExtraError(requirement, command)
    for module_name in filter(None, (class_path.rpartition(".")[0] for class_path in _class_paths(args))):
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            missing = missing_extra_module(err)
            if missing is not None:
                raise MissingExtraError(missing, command) from err
            if err.name is not None and module_name.startswith(err.name.partition(".")[0]):
                raise CommandError(
                    f"{command}: cannot import {module_name!r} (a class_path in the config): no module named "
                    f"{err.name!r} here. Recipe class paths (recipes.*) import from the current directory: run the "
                    "command from the root of your lightning-mgpu clone, or put that folder on PYTHONPATH."
                ) from err
        except Exception:  # LightningCLI's to report, with its context
            continue


@contextmanager
def exit_on_command_error(command: str) -> Iterator[None]:
    """Turn a :class:`CommandError` or a missing module of the ``[recipes]`` extra into its message on stderr and exit
    status 1."""
    try:
        yield
    except Exception as err:
        if not isinstance(err, CommandError):
            module = missing_extra_module(err)
            if module is None:
                raise
            err = MissingExtraError(module, command)
        print(err, file=sys.stderr)
        raise SystemExit(1) from None


def put_cwd_on_sys_path() -> bool:
    """Put the current directory first on ``sys.path``, as ``python -m`` does (for ``class_path: recipes...`` in a
    console script); ``True`` if it was added."""
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was deleted
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
    """Run LightningCLI over any model/datamodule given by ``class_path``. With ``args`` (in place of ``sys.argv[1:]``)
    the ``LightningCLI`` is returned, else ``None`` (for ``sys.exit(main())``)."""
    put_cwd_on_sys_path()
    prog = program_name()
    given = sys.argv[1:] if args is None else list(args)
    with exit_on_command_error(prog):
        check_config_files(prog, given)
        check_recipes_extra(prog, given)
        from lightning.pytorch.cli import LightningCLI  # our strategies register as it imports (see registration.py)

        check_strategy_names(prog, given)
        check_strategy_arguments(prog, given)
        quiet_dependencies()
        cli = LightningCLI(
            model_class=None,
            datamodule_class=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": prog},
            args=None if args is None else given,
            run=run,
        )
    if args is not None:
        return cli
    # A ddp run's process group goes before the process exits: gloo's threads still running at exit can abort it.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return None


def program_name() -> str:
    """How the user ran the command: ``python -m lightning_mgpu`` or the ``lightning-mgpu`` script."""
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m lightning_mgpu" if script in ("__main__.py", "-m", "-c", "") else script


def quiet_dependencies() -> None:
    """Drop what dependencies print on every run that no user can act on: for this CLI's process only."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)`? is deprecated")  # idempotent
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_drop_tips)  # idempotent


def _drop_tips(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip")
