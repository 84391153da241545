"""What a new user reads in the first minutes: the strategy's set-up line, the one-device warning, the command's
name, its messages for a misspelled strategy and for a recipe run from outside the clone, the public names."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import pytest

import lightning_mgpu
from benchmarks.compare.process_group import run_in_process_group
from lightning_mgpu import cli

REPO = Path(__file__).resolve().parents[2]
NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def _fit_boring(ns, devices: int, tmp_path: Path) -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    module = BoringModel() if ns.__name__ == "lightning.pytorch" else _pl_boring(ns)
    trainer = ns.Trainer(
        strategy="parallel_criterion", accelerator="cpu", devices=devices, max_steps=2, default_root_dir=tmp_path
    )
    trainer.fit(module)


def _pl_boring(pl):
    from pytorch_lightning.demos.boring_classes import BoringModel

    return BoringModel()


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_the_strategy_says_how_it_runs_in_one_line(namespace, caplog, tmp_path):
    ns = pytest.importorskip(namespace)
    with caplog.at_level(logging.INFO, logger=namespace):
        _fit_boring(ns, 2, tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("parallel_criterion: 2 replicas")]
    assert lines == [
        "parallel_criterion: 2 replicas on cpu, cpu; virtual devices: 1 physical device(s); replicas run one after "
        "another (execution_mode='auto')."
    ]


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_multi_device_strategy_on_one_device_warns(namespace, tmp_path):
    ns = pytest.importorskip(namespace)
    with pytest.warns(UserWarning, match=r"parallel_criterion is running on one device \(cpu\).*devices=2"):
        _fit_boring(ns, 1, tmp_path)


def test_the_command_names_itself_as_the_user_ran_it(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(REPO / "lightning_mgpu" / "__main__.py"), "--help"])
    with pytest.raises(SystemExit):
        cli.main()
    assert capsys.readouterr().out.startswith("usage: python -m lightning_mgpu ")
    monkeypatch.setattr(sys, "argv", ["/venv/bin/lightning-mgpu"])
    assert cli.program_name() == "lightning-mgpu"


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("parallel_criterium", "parallel_criterion"),
        ("DP", "dp"),
        ("DDP", "ddp"),
        ("ParallelCriterion", "parallel_criterion"),
    ],
)
def test_a_misspelled_strategy_gets_the_registered_names(given, meant, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    with pytest.raises(SystemExit) as exit:
        cli.main(["fit", "-c", str(REPO / "configs/pyramidnet/quickstart.yaml"), f"--trainer.strategy={given}"])
    assert exit.value.code == 1
    (message,) = capsys.readouterr().err.strip().splitlines()
    assert f"unknown strategy {given!r}. Did you mean {meant!r}?" in message


@pytest.mark.parametrize("given", ["lightning_mgpu.ParallelCriterionStrategy", "ParallelCriterionStrategy"])
def test_a_strategy_class_given_as_a_name_gets_the_class_path_form_that_works(given, capsys, monkeypatch, tmp_path):
    """``--trainer.strategy=<a class>`` is a registered name to Lightning: one line says where a class goes, and the
    options it suggests run."""
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    config = ["-c", str(REPO / "configs/pyramidnet/quickstart.yaml"), f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(SystemExit) as exit:
        cli.main(["fit", *config, f"--trainer.strategy={given}"])
    assert exit.value.code == 1
    (message,) = capsys.readouterr().err.strip().splitlines()
    suggested = re.search(r"goes in (\S+)", message).group(1)
    assert suggested == "--trainer.strategy.class_path=lightning_mgpu.ParallelCriterionStrategy"
    built = cli.main([*config, suggested, "--trainer.strategy.init_args.loss_reduction=sum"], run=False)
    assert type(built.trainer.strategy).__name__ == "ParallelCriterionStrategy"
    assert built.trainer.strategy.normalization.spec() == "sum"


@pytest.mark.parametrize(
    ("name", "arguments"),
    [("parallel_criterion", ["loss_reduction=sum"]), ("ddp_spawn", ["find_unused_parameters=true"])],
)
def test_strategy_arguments_for_a_strategy_given_by_name_get_the_class_path_that_works(
    name, arguments, capsys, monkeypatch, tmp_path
):
    """``--trainer.strategy.init_args.*`` where the strategy is a name (the configs' form): one line names the class
    option to put before them (with the name's registered arguments), and the command built that way runs."""
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    config = ["-c", str(REPO / "configs/pyramidnet/quickstart.yaml"), f"--trainer.default_root_dir={tmp_path}"]
    given = [f"--trainer.strategy={name}", *(f"--trainer.strategy.init_args.{a}" for a in arguments)]
    with pytest.raises(SystemExit) as exit:
        cli.main(["fit", *config, *given])
    assert exit.value.code == 1
    (message,) = capsys.readouterr().err.strip().splitlines()
    suggested = re.search(r"before the init_args options: (.+?) \(YAML", message).group(1).split()
    built = cli.main([*config, *suggested, *given[1:]], run=False)
    for argument in arguments:
        key, value = argument.split("=")
        assert (
            str(getattr(built.trainer.strategy, key, None) or built.trainer.strategy._ddp_kwargs[key]).lower() == value
        )
    if name == "ddp_spawn":
        assert built.trainer.strategy._start_method == "spawn"


def test_strategy_arguments_after_a_config_that_names_the_class_are_accepted(monkeypatch, tmp_path):
    """A later config that gives ``class_path`` overrides the first config's strategy name: ``init_args`` options then
    work and are not refused (the last config or option that sets the strategy decides)."""
    overlay = tmp_path / "strategy.yaml"
    overlay.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_mgpu.ParallelCriterionStrategy\n"
        "    init_args:\n      loss_reduction: samples\n"
    )
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    config = ["-c", str(REPO / "configs/pyramidnet/quickstart.yaml"), f"--trainer.default_root_dir={tmp_path}"]
    built = cli.main([*config, "-c", str(overlay), "--trainer.strategy.init_args.loss_reduction=sum"], run=False)
    assert built.trainer.strategy.normalization.spec() == "sum"


def test_a_pytorch_lightning_class_in_this_cli_names_the_one_to_use(capsys, monkeypatch, tmp_path):
    config = tmp_path / "strategy.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_mgpu.strategies.pytorch_lightning.ParallelCriterionStrategy\n"
    )
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    with pytest.raises(SystemExit):
        cli.main(["fit", "-c", str(config)])
    assert "use class_path: lightning_mgpu.ParallelCriterionStrategy" in capsys.readouterr().err


def test_a_recipe_run_from_outside_the_clone_says_where_to_run_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [sys.executable, "-m", "lightning_mgpu", "fit", "-c", str(REPO / "configs/pyramidnet/quickstart.yaml")]
    run = run_in_process_group(command, 120, cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, log=tmp_path / "log")
    assert run.returncode == 1, run.describe()
    (message,) = [line for line in run.output.splitlines() if line.strip()]
    assert message.startswith("python -m lightning_mgpu: cannot import 'recipes."), message
    assert "run the command from the root of your lightning-mgpu clone" in message


def test_public_names_are_listed_and_exported():
    names = dir(lightning_mgpu)
    assert {"ParallelCriterionStrategy", "DataParallelStrategy", "uses_sync_batchnorm", "check_loss_reduction"} <= set(
        names
    )
    assert lightning_mgpu.uses_sync_batchnorm is lightning_mgpu.parallel.uses_sync_batchnorm
