"""Every recipe under every strategy overlay, run as users run it: ``python -m lightning_mgpu fit -c <recipe config>
-c configs/strategies/<overlay>.yaml`` in a fresh process, with Lightning's default callbacks and progress bar on,
for a few steps on small data.

Each run is a process group with a time limit that kills the whole group (DDP's extra ranks included) and fails the
test with the output's last lines, so a hang (e.g. a collective that only some ranks enter) fails here instead of
stalling CI. On 2 idle cores a run takes 8-16 s (imports included), all eight 80 s; the limit leaves room for a
loaded machine (155 s for all eight when other jobs shared the cores).
"""

from __future__ import annotations

import csv
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.compare.process_group import GroupRun, run_in_process_group

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = ("single", "dp", "parallel_criterion", "ddp")
STEPS = 6
TIMEOUT_S = 180.0


def _env() -> dict[str, str]:
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "OMP_NUM_THREADS": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }


def _fit(recipe: str, overlay: str, cwd: Path, *overrides: str) -> GroupRun:
    """``python -m lightning_mgpu fit`` of a recipe's quickstart under an overlay, ``STEPS`` steps, in ``cwd``."""
    command = [
        sys.executable,
        "-m",
        "lightning_mgpu",
        "fit",
        "-c",
        str(REPO / "configs" / recipe / "quickstart.yaml"),
        "-c",
        str(REPO / "configs" / "strategies" / f"{overlay}.yaml"),
        f"--trainer.max_steps={STEPS}",
        "--trainer.limit_val_batches=2",
        *overrides,
    ]
    run = run_in_process_group(command, TIMEOUT_S, cwd=cwd, env=_env(), log=cwd / "output.log")
    assert not run.timed_out and run.returncode == 0, run.describe()
    assert f"`Trainer.fit` stopped: `max_steps={STEPS}` reached." in run.output, run.describe()
    return run


@pytest.fixture(scope="module")
def bert_work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared by the BERT runs: the first one writes the synthetic corpus and trains the tokenizer, the others reuse
    them (the data module checks that they were made from the same inputs)."""
    return tmp_path_factory.mktemp("bert_data")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pyramidnet_quickstart(overlay: str, tmp_path: Path) -> None:
    # 128 images in batches of 32: 4 steps per epoch in one process, 2 per rank under ddp; 6 steps cross epoch ends.
    run = _fit(
        "pyramidnet",
        overlay,
        tmp_path,
        "--data.init_args.synthetic_train_size=128",
        "--data.init_args.synthetic_test_size=64",
        "--data.init_args.batch_size=32",
    )
    lines = [line for line in run.output.splitlines() if line.strip()]
    # FinalReport's summary is the last line (after the progress bar's final render), printed once (rank 0).
    assert lines[-1].startswith("PyramidNet quickstart: val_acc="), run.describe()
    assert f", {STEPS} steps, " in lines[-1], run.describe()
    assert sum(line.startswith("PyramidNet quickstart:") for line in lines) == 1, run.describe()


def _bert_metrics(root: Path) -> list[dict[str, float]]:
    """The rows of the run's CSV log (rank 0 writes it), empty cells left out."""
    files = sorted(root.rglob("metrics.csv"))
    assert len(files) == 1, f"expected one metrics.csv under {root}, found {files}"
    with files[0].open() as f:
        return [{key: float(value) for key, value in row.items() if value} for row in csv.DictReader(f)]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_bert_quickstart(overlay: str, bert_work_dir: Path, tmp_path: Path) -> None:
    # 4 training batches per epoch, validation every 2 (val_check_interval 0.5): 6 steps = one whole epoch (with its
    # epoch end, where the ddp hang was) and a second one stopped by max_steps.
    run = _fit(
        "bert",
        overlay,
        tmp_path,
        f"--data.init_args.work_dir={bert_work_dir}",
        "--data.init_args.synthetic_documents=300",
        "--data.init_args.max_seq_length=32",
        "--data.init_args.batch_size=16",
        "--trainer.limit_train_batches=4",
        "--trainer.log_every_n_steps=1",
    )
    logs = tmp_path / "lightning_logs" / "bert-quickstart"
    # The default ModelCheckpoint saved the last state: it has trained STEPS optimizer steps.
    checkpoints = sorted(logs.rglob("*.ckpt"))
    assert len(checkpoints) == 1, run.describe()
    assert torch.load(checkpoints[0], map_location="cpu", weights_only=False)["global_step"] == STEPS

    rows = _bert_metrics(logs)
    steps = [r for r in rows if "train/loss_step" in r]
    assert len(steps) == STEPS
    for r in steps:  # the reduced total equals the sum of its (exactly merged, or rank-averaged) terms
        assert r["train/loss_step"] == pytest.approx(r["train/mlm_loss_step"] + r["train/nsp_loss_step"], rel=1e-5)
    val = [r for r in rows if "val/loss" in r]
    assert len(val) >= 2, rows  # mid-epoch and end-of-epoch validation
    for r in val:  # metrics computed (and synced across ranks) by Lightning agree with the logged epoch means
        assert r["val/loss"] == pytest.approx(r["val/mlm_loss"] + r["val/nsp_loss"], rel=1e-5)
        assert r["val/perplexity"] == pytest.approx(math.exp(r["val/mlm_loss"]), rel=1e-5)
        assert 0.0 <= r["val/mlm_acc"] <= 1.0 and 0.0 <= r["val/nsp_acc"] <= 1.0
    epochs = [r for r in rows if "train/perplexity" in r]
    assert len(epochs) == 2, rows  # both epoch ends
    for r in epochs:
        assert r["train/perplexity"] == pytest.approx(math.exp(r["train/mlm_loss_epoch"]), rel=1e-5)
