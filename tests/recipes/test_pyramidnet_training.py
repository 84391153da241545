"""The PyramidNet recipe end to end: the quickstart config under every strategy overlay through the CLI, the LR
schedule, and the GPU configs' settings. Tiny model, 64 synthetic images, two optimizer steps per run."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import yaml

from lightning_mgpu.cli import main
from recipes.pyramidnet.data import CIFAR10DataModule
from recipes.pyramidnet.model import count_parameters
from recipes.pyramidnet.module import PyramidNetModule

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "pyramidnet" / "quickstart.yaml"
STRATEGIES = ROOT / "configs" / "strategies"

# main(args=...) inside pytest: LightningCLI warns that pytest's own argv is also present; it is ignored.
pytestmark = [
    pytest.mark.filterwarnings("ignore:LightningCLI's args parameter:UserWarning"),
    pytest.mark.usefixtures("one_thread"),
]


def _fast_args(tmp_path: Path) -> list[str]:
    """Two training steps of the quickstart on 64 synthetic images, one validation batch after step 2."""
    return [
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--data.init_args.synthetic_train_size=64",
        "--data.init_args.synthetic_test_size=32",
        "--data.init_args.batch_size=16",
        "--data.init_args.eval_batch_size=16",
    ]


def _overlay(strategy: str) -> str:
    path = STRATEGIES / f"{strategy}.yaml"
    assert path.is_file(), f"strategy overlay {path} is missing"
    return str(path)


@pytest.mark.parametrize("strategy", ["single", "dp", "parallel_criterion"])
def test_quickstart_trains_two_steps_under_each_single_process_strategy(strategy: str, tmp_path: Path) -> None:
    cli = main(["fit", "-c", str(QUICKSTART), "-c", _overlay(strategy), *_fast_args(tmp_path)])
    trainer = cli.trainer
    assert trainer.global_step == 2
    metrics = trainer.callback_metrics
    assert math.isfinite(float(metrics["train_loss"]))
    assert 0.0 <= float(metrics["val_acc"]) <= 1.0 and math.isfinite(float(metrics["val_loss"]))
    assert math.isclose(float(metrics["lr"]), 0.1 * (1 + math.cos(math.pi / 2)) / 2, rel_tol=1e-6)  # cosine, step 1
    assert isinstance(cli.model, PyramidNetModule) and isinstance(cli.datamodule, CIFAR10DataModule)
    if strategy != "single":
        assert len(trainer.strategy.parallel_devices) == 2


class _RecordLayout(L.Callback):
    """Whether each training batch the data module hands over, and each input the network sees, is channels_last."""

    def __init__(self) -> None:
        self.batches: list[bool] = []
        self.net_inputs: list[bool] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.net.register_forward_pre_hook(lambda _, args: self.net_inputs.append(_channels_last(args[0])))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object,
                             batch_idx: int) -> None:
        self.batches.append(_channels_last(batch[0]))


def _channels_last(x: torch.Tensor) -> bool:
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


@pytest.mark.parametrize("channels_last", [True, False])
def test_one_layout_setting_with_a_logger(channels_last: bool, tmp_path: Path) -> None:
    # With a logger, Lightning merges the model's and the data module's hparams and refuses a key with two values;
    # the layout is the model's setting alone, and the data module hands over batches in that layout.
    cli = main(["-c", str(QUICKSTART), "-c", _overlay("single"), *_fast_args(tmp_path),
                "--trainer.max_steps=1", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
                f"--trainer.logger.save_dir={tmp_path}", f"--model.init_args.channels_last={channels_last}"],
               run=False)
    recorder = _RecordLayout()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 1
    assert recorder.batches == recorder.net_inputs == [channels_last]
    assert _channels_last(cli.model.net.conv1.weight) == channels_last
    logged = yaml.safe_load((Path(cli.trainer.logger.log_dir) / "hparams.yaml").read_text())
    assert logged["channels_last"] is channels_last and logged["source"] == "synthetic"


def test_compiled_net_keeps_its_checkpoint_keys_and_is_refused_by_replicas(tmp_path: Path) -> None:
    compiled = PyramidNetModule(arch="tiny", compile_net=True)
    assert compiled.net._compiled_call_impl is not None
    assert compiled.state_dict().keys() == PyramidNetModule(arch="tiny").state_dict().keys()  # in place: no _orig_mod
    with pytest.raises(ValueError, match=r"Cannot replicate submodule 'net': it was compiled with torch\.compile"):
        main(["fit", "-c", str(QUICKSTART), "-c", _overlay("parallel_criterion"), *_fast_args(tmp_path),
              "--model.init_args.compile_net=true"])


def test_quickstart_trains_two_steps_under_ddp(tmp_path: Path) -> None:
    # In-process ddp would re-launch pytest's own command line, so the CLI runs in a subprocess (2 gloo processes).
    cmd = [sys.executable, "-m", "lightning_mgpu", "fit", "-c", str(QUICKSTART), "-c", _overlay("ddp"),
           *_fast_args(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("PyramidNet quickstart:")]
    assert len(summary) == 1, proc.stdout[-3000:]  # printed by global rank 0 only
    assert "val_acc=" in summary[0] and "2 steps" in summary[0]


class _RecordLR(L.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object,
                             batch_idx: int) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("schedule", ["multistep", "cosine"])
def test_lr_schedule_over_the_estimated_steps(schedule: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    recorder = _RecordLR()
    model = PyramidNetModule(arch="tiny", schedule=schedule)
    data = CIFAR10DataModule(source="synthetic", batch_size=8, synthetic_train_size=32, synthetic_test_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[recorder], default_root_dir=tmp_path)
    trainer.fit(model, data)
    assert trainer.global_step == 8
    if schedule == "multistep":  # ÷10 at 50% and 75% of the 8 steps, as the paper's epochs 150 and 225 of 300
        expected = [0.1] * 4 + [0.01] * 2 + [0.001] * 2
    else:
        expected = [0.05 * (1 + math.cos(math.pi * step / 8)) for step in range(8)]
    assert recorder.lrs == pytest.approx(expected, rel=1e-6)
    optimizer = trainer.optimizers[0]
    assert optimizer.defaults["nesterov"] and optimizer.defaults["momentum"] == 0.9
    assert optimizer.defaults["weight_decay"] == 1e-4


def test_module_architecture_arguments() -> None:
    explicit = PyramidNetModule(arch=None, depth=8, alpha=12, units_per_stage=2)
    assert [len(s) for s in (explicit.net.stage1, explicit.net.stage2, explicit.net.stage3)] == [2, 2, 2]
    for module in (PyramidNetModule(arch="tiny", channel_multiple=16),
                   PyramidNetModule(arch=None, depth=8, alpha=12, channel_multiple=16)):
        assert module.net.channel_multiple == 16
        assert all(u.out_channels % 16 == 0 for s in (module.net.stage1, module.net.stage2) for u in s)
    with pytest.raises(ValueError, match="either arch"):
        PyramidNetModule(arch="tiny", depth=8)
    with pytest.raises(ValueError, match="depth and alpha are required"):
        PyramidNetModule(arch=None, depth=8)
    with pytest.raises(ValueError, match="milestones"):
        PyramidNetModule(arch="tiny", milestones=(0.5, 1.5))


@pytest.mark.parametrize(
    ("config", "arch", "batch_size", "params"),
    [
        ("seed.yaml", "seed", 768, 24_253_410),
        ("paper_110_a270.yaml", "pyramidnet110_a270", 128, None),
        ("paper_272_bottleneck_a200.yaml", "pyramidnet272_bottleneck_a200", 128, None),
    ],
)
def test_gpu_configs_hold_the_papers_recipe(config: str, arch: str, batch_size: int, params: int | None) -> None:
    path = ROOT / "configs" / "pyramidnet" / config
    # Instantiate without running, on the CPU; the data source (the Hub) is not touched before fit.
    with torch.device("meta"):
        cli = main(["-c", str(path), "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=auto",
                    "--trainer.precision=32-true", "--trainer.logger=false", "--trainer.callbacks=[]"], run=False)
    hp, data = cli.model.hparams, cli.datamodule
    assert hp.arch == arch and hp.lr == 0.1 and hp.momentum == 0.9 and hp.nesterov and hp.weight_decay == 1e-4
    assert hp.schedule == "multistep" and tuple(hp.milestones) == (0.5, 0.75) and hp.gamma == 0.1
    assert cli.trainer.max_epochs == 300
    assert data.source == "uoft-cs/cifar10" and data.batch_size == batch_size and data.augment
    assert data.crop_padding == 4 and hp.channels_last and "channels_last" not in data.hparams
    if params is not None:
        assert count_parameters(cli.model.net) == params
