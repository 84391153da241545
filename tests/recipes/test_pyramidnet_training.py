"""The PyramidNet recipe end to end through the CLI: the quickstart learns, memory layouts, dtypes under the true
precisions, the LR schedule, and the GPU configs' settings. Tiny model, synthetic images, a few optimizer steps.

Every strategy overlay runs as a user runs it (a fresh process, progress bar on) in ``tests/cli/test_recipe_matrix.py``.
"""

from __future__ import annotations

import math
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


def test_quickstart_learns_on_a_fixed_seed(tmp_path: Path) -> None:
    # The quickstart as configured (parallel_criterion on 2 CPU devices, its seed, lr and schedule, progress bar on),
    # shortened to 64 steps on 512 images. Chance is accuracy 0.1 and cross-entropy ln 10 = 2.30; measured: val_acc
    # 0.50 and train loss 1.42. A model that does not learn (e.g. lr 0) stays at chance.
    cli = main(
        [
            "fit",
            "-c",
            str(QUICKSTART),
            "--trainer.max_epochs=4",
            f"--trainer.default_root_dir={tmp_path}",
            "--data.init_args.synthetic_train_size=512",
            "--data.init_args.synthetic_test_size=256",
            "--data.init_args.batch_size=32",
        ]
    )
    trainer = cli.trainer
    assert type(trainer.strategy).__name__ == "ParallelCriterionStrategy" and trainer.num_devices == 2
    assert trainer.global_step == 64
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    assert metrics["val_acc"] > 0.35, metrics
    assert metrics["train_loss_epoch"] < 1.9 and metrics["val_loss"] < 1.9, metrics


class _RecordLayout(L.Callback):
    """Whether each training batch the data module hands over, and each input the network sees, is channels_last."""

    def __init__(self) -> None:
        self.batches: list[bool] = []
        self.net_inputs: list[bool] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.net.register_forward_pre_hook(lambda _, args: self.net_inputs.append(_channels_last(args[0])))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int
    ) -> None:
        self.batches.append(_channels_last(batch[0]))


def _channels_last(x: torch.Tensor) -> bool:
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


@pytest.mark.parametrize("channels_last", [True, False])
def test_one_layout_setting_with_a_logger(channels_last: bool, tmp_path: Path) -> None:
    # With a logger, Lightning merges the model's and the data module's hparams and refuses a key with two values;
    # the layout is the model's setting alone, and the data module hands over batches in that layout.
    cli = main(
        [
            "-c",
            str(QUICKSTART),
            "-c",
            _overlay("single"),
            *_fast_args(tmp_path),
            "--trainer.max_steps=1",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={tmp_path}",
            f"--model.init_args.channels_last={channels_last}",
        ],
        run=False,
    )
    recorder = _RecordLayout()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 1
    assert recorder.batches == recorder.net_inputs == [channels_last]
    assert _channels_last(cli.model.net.conv1.weight) == channels_last
    logged = yaml.safe_load((Path(cli.trainer.logger.log_dir) / "hparams.yaml").read_text())
    assert logged["channels_last"] is channels_last and logged["source"] == "synthetic"


def test_compiled_net_keeps_its_checkpoint_keys() -> None:
    # Compiled in place (nn.Module.compile): checkpoints move between compiled and eager runs. Training compiled
    # replicas under the single-process strategies is the core's to test (tests/parallel/test_compiled_replicas.py).
    compiled = PyramidNetModule(arch="tiny", compile_net=True)
    assert compiled.net._compiled_call_impl is not None
    assert compiled.state_dict().keys() == PyramidNetModule(arch="tiny").state_dict().keys()  # in place: no _orig_mod


class _RecordDtypes(L.Callback):
    """The dtype of every batch the network sees (training and validation) and of its weights."""

    def __init__(self) -> None:
        self.inputs: set[torch.dtype] = set()
        self.weights: set[torch.dtype] = set()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.net.register_forward_pre_hook(lambda _, args: self.inputs.add(args[0].dtype))
        self.weights = {p.dtype for p in pl_module.parameters()}


@pytest.mark.parametrize(
    ("precision", "dtype"), [("64-true", torch.float64), ("16-true", torch.float16), ("bf16-true", torch.bfloat16)]
)
def test_batches_come_in_the_dtype_of_the_true_precisions(precision: str, dtype: torch.dtype, tmp_path: Path) -> None:
    # Lightning converts a batch's float tensors before on_after_batch_transfer, where the uint8 images become
    # floats: the data module itself must hand them over in the model's dtype (64-true used to fail with "Input type
    # (torch.FloatTensor) and weight type (torch.DoubleTensor)").
    cli = main(
        ["-c", str(QUICKSTART), "-c", _overlay("single"), *_fast_args(tmp_path), f"--trainer.precision={precision}"],
        run=False,
    )
    recorder = _RecordDtypes()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    assert recorder.weights == recorder.inputs == {dtype}
    # The loss is computed in at least float32: widened from half precision, never narrowed from float64.
    assert cli.trainer.callback_metrics["train_loss"].dtype == torch.promote_types(dtype, torch.float32)
    assert math.isfinite(float(cli.trainer.callback_metrics["train_loss"]))
    assert math.isfinite(float(cli.trainer.callback_metrics["val_loss"]))


def test_quickstart_trains_in_float64(tmp_path: Path) -> None:
    # 64-true under the quickstart's own strategy (parallel_criterion, 2 devices): float64 batches reach the replicas.
    cli = main(
        [
            "-c",
            str(QUICKSTART),
            *_fast_args(tmp_path),
            "--trainer.precision=64-true",
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=4",
        ],
        run=False,
    )
    recorder = _RecordDtypes()
    cli.trainer.callbacks.append(recorder)
    before = {name: p.detach().clone() for name, p in cli.model.named_parameters()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert type(cli.trainer.strategy).__name__ == "ParallelCriterionStrategy"
    assert cli.trainer.global_step == 4 and recorder.inputs == {torch.float64}
    after = dict(cli.model.named_parameters())
    assert all(p.dtype == torch.float64 and torch.isfinite(p).all() for p in after.values())
    assert not torch.equal(after["net.conv1.weight"], before["net.conv1.weight"].double())  # it trained
    assert math.isfinite(float(cli.trainer.callback_metrics["val_loss"]))


class _RecordLR(L.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int
    ) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("schedule", ["multistep", "cosine"])
def test_lr_schedule_over_the_estimated_steps(schedule: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    recorder = _RecordLR()
    model = PyramidNetModule(arch="tiny", schedule=schedule)
    data = CIFAR10DataModule(source="synthetic", batch_size=8, synthetic_train_size=32, synthetic_test_size=8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[recorder],
        default_root_dir=tmp_path,
    )
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
    for module in (
        PyramidNetModule(arch="tiny", channel_multiple=16),
        PyramidNetModule(arch=None, depth=8, alpha=12, channel_multiple=16),
    ):
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
        cli = main(
            [
                "-c",
                str(path),
                "--trainer.accelerator=cpu",
                "--trainer.devices=1",
                "--trainer.strategy=auto",
                "--trainer.precision=32-true",
                "--trainer.logger=false",
                "--trainer.callbacks=[]",
            ],
            run=False,
        )
    hp, data = cli.model.hparams, cli.datamodule
    assert hp.arch == arch and hp.lr == 0.1 and hp.momentum == 0.9 and hp.nesterov and hp.weight_decay == 1e-4
    assert hp.schedule == "multistep" and tuple(hp.milestones) == (0.5, 0.75) and hp.gamma == 0.1
    assert cli.trainer.max_epochs == 300
    assert data.source == "uoft-cs/cifar10" and data.batch_size == batch_size and data.augment
    assert data.crop_padding == 4 and data.flip and hp.channels_last and "channels_last" not in data.hparams
    if params is not None:
        assert count_parameters(cli.model.net) == params
