"""The first messages of a user outside the clone: a module of the ``[recipes]`` extra missing, told how to install the
extra as fits how lightning-mgpu was installed (from a clone, or a wheel: configs/ and recipes/ are in the clone only),
and a config path that does not exist (jsonargparse's own error)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import lightning_mgpu
from lightning_mgpu import cli

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = "configs/pyramidnet/quickstart.yaml"


def _missing_transformers_message(capsys) -> str:
    with pytest.raises(SystemExit) as exit, cli.exit_on_missing_extra("lightning-mgpu"):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")
    assert exit.value.code == 1
    (message,) = capsys.readouterr().err.strip().splitlines()
    return message


def test_the_missing_extra_from_a_clone_installs_it_editable_from_there(capsys):
    message = _missing_transformers_message(capsys)
    assert message.startswith("lightning-mgpu: the Python package 'transformers' is not installed"), message
    assert f"pip install -e '{REPO}[recipes]'" in message, message


def test_the_missing_extra_under_a_wheel_install_installs_it_by_name(capsys, monkeypatch, tmp_path):
    package = tmp_path / "site-packages" / "lightning_mgpu"
    package.mkdir(parents=True)
    monkeypatch.setattr(lightning_mgpu, "__file__", str(package / "__init__.py"))
    message = _missing_transformers_message(capsys)
    assert "pip install 'lightning-mgpu[recipes]'" in message and "-e" not in message, message


def test_lightnings_missing_jsonargparse_is_the_extra_too():
    """Lightning reports jsonargparse[signatures] as a requirement not met (a ModuleNotFoundError without a name)."""
    error = ModuleNotFoundError("Requirement 'jsonargparse[signatures]>=4.27.7' not met. HINT: Try running ...")
    assert "the Python package 'jsonargparse' is not installed" in cli.missing_extra_message(error, "lightning-mgpu")


def test_a_module_outside_the_extra_is_not_ours_to_explain():
    with pytest.raises(ModuleNotFoundError, match="my_models"), cli.exit_on_missing_extra("lightning-mgpu"):
        raise ModuleNotFoundError("No module named 'my_models'", name="my_models")


def test_a_missing_config_file_is_named_by_jsonargparse(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    with pytest.raises(SystemExit) as exit:
        cli.main(["fit", "-c", QUICKSTART])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert "does not exist" in error and str(tmp_path / QUICKSTART) in error, error  # where it was looked for


def test_an_inline_yaml_config_is_a_config(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    given = ["-c", str(REPO / QUICKSTART), "-c", "{trainer: {max_steps: 3}}", f"--trainer.default_root_dir={tmp_path}"]
    assert cli.main(given, run=False).trainer.max_steps == 3


def test_the_extra_of_pyproject_is_known():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["recipes"]
    assert {re.match(r"[\w-]+", requirement)[0] for requirement in extra} == cli.RECIPES_EXTRA
