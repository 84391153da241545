"""``python -m lightning_mgpu`` (LightningCLI) with the strategies by registered name and by class_path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import lightning_mgpu
from lightning_mgpu.cli import main

REPO = Path(__file__).resolve().parents[2]
MODEL = {"class_path": "lightning.pytorch.demos.boring_classes.BoringModel"}
DATA = {"class_path": "lightning.pytorch.demos.boring_classes.BoringDataModule"}
TRAINER = {
    "accelerator": "cpu",
    "devices": 2,
    "max_steps": 2,
    "limit_val_batches": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


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
            {"class_path": "lightning_mgpu.ParallelCriterionStrategy", "init_args": {"loss_reduction": "mean"}},
            lightning_mgpu.ParallelCriterionStrategy,
        ),
    ],
)
def test_yaml_selects_the_strategy(tmp_path, strategy, expected):
    cli = main(["fit", "-c", str(_write(tmp_path / "cfg.yaml", {"strategy": strategy}))])
    assert isinstance(cli.trainer.strategy, expected)
    assert cli.trainer.num_devices == 2 and cli.trainer.global_step == 2
    if isinstance(strategy, dict):
        assert cli.trainer.strategy.loss_reduction == "mean"


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
    done = subprocess.run(
        [sys.executable, "-m", "lightning_mgpu", "fit", "-c", str(cfg)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in done.stderr + done.stdout
    assert torch.__version__  # the same interpreter ran it
