"""What a new user reads in the first minutes: the strategy's set-up line, the one-device warning, the command's
name, the errors (Lightning's and jsonargparse's) for a misspelled strategy, for strategy arguments given to a name and
for a recipe run from outside the clone, the public names."""

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


@pytest.mark.parametrize(
    ("argv0", "usage"),
    [
        (str(REPO / "lightning_mgpu" / "__main__.py"), "python -m lightning_mgpu"),
        ("/venv/bin/lightning-mgpu", "lightning-mgpu"),
    ],
)
def test_the_command_names_itself_as_the_user_ran_it(argv0, usage, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    with pytest.raises(SystemExit):
        cli.main()
    assert capsys.readouterr().out.startswith(f"usage: {usage} ")


QUICKSTART = ["-c", str(REPO / "configs/pyramidnet/quickstart.yaml")]


@pytest.mark.parametrize("given", ["parallel_criterium", "data-parallel", "lightning_mgpu.ParallelCriterionStrategy"])
def test_an_unknown_strategy_name_is_named_in_lightnings_error(given, monkeypatch, tmp_path):
    """A misspelled name, or a class given as a name, is Lightning's own error, which names it (lower-cased)."""
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    with pytest.raises(ValueError, match=re.escape(f"invalid strategy name: `strategy={given.lower()!r}`")):
        cli.main([*QUICKSTART, f"--trainer.default_root_dir={tmp_path}", f"--trainer.strategy={given}"], run=False)


@pytest.mark.parametrize(
    ("given", "expected"), [("DP", "DataParallelStrategy"), ("Parallel_Criterion", "ParallelCriterionStrategy")]
)
def test_a_strategy_name_in_another_case_is_the_registered_one(given, expected, monkeypatch, tmp_path):
    """As in ``Trainer(strategy=...)``, which lower-cases a name."""
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    built = cli.main([*QUICKSTART, f"--trainer.default_root_dir={tmp_path}", f"--trainer.strategy={given}"], run=False)
    assert type(built.trainer.strategy).__name__ == expected


@pytest.mark.parametrize(
    ("name", "class_path", "arguments"),
    [
        ("parallel_criterion", "lightning_mgpu.ParallelCriterionStrategy", ["loss_reduction=sum"]),
        (
            "ddp_spawn",
            "lightning.pytorch.strategies.DDPStrategy",
            ["start_method=spawn", "find_unused_parameters=true"],
        ),
    ],
)
def test_strategy_arguments_go_with_a_class_path_not_a_name(name, class_path, arguments, capsys, monkeypatch, tmp_path):
    """``--trainer.strategy.init_args.*`` where the strategy is a name (the configs' form) is jsonargparse's error,
    which names the key and the name, and our one line naming the class path that takes them; with
    ``--trainer.strategy.class_path`` before them they work."""
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    config = [*QUICKSTART, f"--trainer.default_root_dir={tmp_path}"]
    options = [f"--trainer.strategy.init_args.{a}" for a in arguments]
    with pytest.raises(SystemExit) as exit:
        cli.main(["fit", *config, f"--trainer.strategy={name}", *options])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert 'Parser key "trainer.strategy"' in error and name in error, error
    hint = class_path if class_path.startswith("lightning_mgpu") else "<the strategy's class path>"
    assert f"takes no init_args: give its class, --trainer.strategy.class_path={hint}" in error, error
    strategy = cli.main([*config, f"--trainer.strategy.class_path={class_path}", *options], run=False).trainer.strategy
    if name == "parallel_criterion":
        assert strategy.normalization.spec() == "sum"
    else:
        assert strategy._start_method == "spawn" and strategy._ddp_kwargs["find_unused_parameters"] is True


def test_strategy_arguments_after_a_config_that_names_the_class_are_accepted(monkeypatch, tmp_path):
    """A later config that gives ``class_path`` overrides the first config's strategy name: ``init_args`` options then
    work (the last config or option that sets the strategy decides)."""
    overlay = tmp_path / "strategy.yaml"
    overlay.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_mgpu.ParallelCriterionStrategy\n"
        "    init_args:\n      loss_reduction: samples\n"
    )
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    config = [*QUICKSTART, f"--trainer.default_root_dir={tmp_path}"]
    built = cli.main([*config, "-c", str(overlay), "--trainer.strategy.init_args.loss_reduction=sum"], run=False)
    assert built.trainer.strategy.normalization.spec() == "sum"


def test_a_pytorch_lightning_class_in_this_cli_is_refused_by_name(capsys, monkeypatch, tmp_path):
    """This tool runs ``lightning.pytorch``'s Trainer: jsonargparse says the class is no ``Strategy`` of it."""
    config = tmp_path / "strategy.yaml"
    path = "lightning_mgpu.strategies.pytorch_lightning.ParallelCriterionStrategy"
    config.write_text(f"trainer:\n  strategy:\n    class_path: {path}\n")
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    with pytest.raises(SystemExit) as exit:
        cli.main(["fit", "-c", str(config)])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert 'Parser key "trainer.strategy"' in error and f"{path} does not correspond to a subclass of Strategy" in error


def test_a_recipe_run_from_outside_the_clone_names_the_module_it_cannot_import(tmp_path):
    """Recipe class paths import from the current directory: jsonargparse names the class path and ``recipes``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [sys.executable, "-m", "lightning_mgpu", "fit", *QUICKSTART]
    run = run_in_process_group(command, 120, cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, log=tmp_path / "log")
    assert run.returncode == 2, run.describe()
    assert "Problem with given class_path 'recipes.pyramidnet." in run.output, run.describe()
    assert "No module named 'recipes'" in run.output and "Traceback" not in run.output, run.describe()


def test_public_names_are_listed_and_exported():
    names = dir(lightning_mgpu)
    assert {"ParallelCriterionStrategy", "DataParallelStrategy", "uses_sync_batchnorm", "check_loss_reduction"} <= set(
        names
    )
    assert lightning_mgpu.uses_sync_batchnorm is lightning_mgpu.parallel.uses_sync_batchnorm
