"""``python -m lightning_mgpu`` and the ``lightning-mgpu`` console script (LightningCLI) with the strategies by
registered name and by class_path, and recipe class paths resolved from the current directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

import lightning_mgpu
from benchmarks.compare.process_group import run_in_process_group
from lightning_mgpu.cli import main

REPO = Path(__file__).resolve().parents[2]
MODEL = {"class_path": "lightning.pytorch.demos.boring_classes.BoringModel"}
DATA = {"class_path": "lightning.pytorch.demos.boring_classes.BoringDataModule"}
TRAINER = {"accelerator": "cpu", "devices": 2, "max_steps": 2, "limit_val_batches": 1}  # default callbacks and logger


def _write(path: Path, trainer: dict) -> Path:
    trainer = {**TRAINER, "default_root_dir": str(path.parent), **trainer}  # LightningCLI saves config.yaml there
    path.write_text(yaml.safe_dump({"trainer": trainer, "model": MODEL, "data": DATA}))
    return path


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("parallel_criterion", lightning_mgpu.ParallelCriterionStrategy),
        ("dp", lightning_mgpu.DataParallelStrategy),
        (
            {"class_path": "lightning_mgpu.ParallelCriterionStrategy", "init_args": {"loss_reduction": "samples"}},
            lightning_mgpu.ParallelCriterionStrategy,
        ),
    ],
)
def test_yaml_selects_the_strategy(tmp_path, strategy, expected):
    cli = main(["fit", "-c", str(_write(tmp_path / "cfg.yaml", {"strategy": strategy}))])
    assert isinstance(cli.trainer.strategy, expected)
    assert cli.trainer.num_devices == 2 and cli.trainer.global_step == 2
    if isinstance(strategy, dict):
        assert cli.trainer.strategy.loss_reduction == "samples"


def test_strategy_overlays_compose_with_a_config(tmp_path):
    cfg = _write(tmp_path / "cfg.yaml", {})
    for name, expected in [
        ("parallel_criterion", lightning_mgpu.ParallelCriterionStrategy),
        ("dp", lightning_mgpu.DataParallelStrategy),
    ]:
        overlay = REPO / "configs" / "strategies" / f"{name}.yaml"
        cli = main(["-c", str(cfg), "-c", str(overlay)], run=False)
        assert isinstance(cli.trainer.strategy, expected)
    cli = main(["-c", str(cfg), "-c", str(REPO / "configs/strategies/single.yaml")], run=False)
    assert cli.trainer.num_devices == 1


def test_module_entry_point_runs_in_a_fresh_process(tmp_path):
    cfg = _write(tmp_path / "cfg.yaml", {"strategy": "parallel_criterion"})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_in_process_group(
        [sys.executable, "-m", "lightning_mgpu", "fit", "-c", str(cfg)], 300, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.describe()
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in done.output, done.describe()


# What the installed `lightning-mgpu` script does, minus its own folder on sys.path: no current directory on sys.path
# (unlike `python -m` and `python -c`), then `sys.exit(main())`.
_CONSOLE_SCRIPT = """
import importlib.util, os, sys
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.getcwd()]
assert importlib.util.find_spec("recipes") is None, "recipes is importable without the current directory"
from lightning_mgpu.cli import main
sys.exit(main())
"""


def test_console_script_runs_a_recipe_config_from_the_current_directory(tmp_path):
    args = [
        "fit",
        "-c",
        "configs/pyramidnet/quickstart.yaml",
        "-c",
        "configs/strategies/single.yaml",
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        f"--trainer.default_root_dir={tmp_path}",
        "--data.init_args.synthetic_train_size=32",
        "--data.init_args.synthetic_test_size=16",
        "--data.init_args.batch_size=16",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = run_in_process_group(
        [sys.executable, "-c", _CONSOLE_SCRIPT, *args], 300, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.describe()  # 1 if main() returned an object to sys.exit
    assert "No module named 'recipes'" not in done.output
    assert "`Trainer.fit` stopped: `max_steps=1` reached." in done.output
    assert "PyramidNet quickstart:" in done.output  # the recipe's FinalReport callback ran
    assert "LightningCLI object" not in done.output


def test_current_directory_goes_on_sys_path_once(tmp_path, monkeypatch):
    """First, as ``python -m`` puts it (the console script's path lacks it), and once over several calls."""
    monkeypatch.chdir(tmp_path)
    cwd = os.getcwd()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or os.curdir) != cwd])
    cfg = _write(tmp_path / "cfg.yaml", {})
    for _ in range(2):
        main(["-c", str(cfg)], run=False)
    assert sys.path[0] == cwd and sys.path.count(cwd) == 1
