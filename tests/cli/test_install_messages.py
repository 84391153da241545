"""The first messages of a user outside the clone: a recipe config named by its relative path from another folder,
and a module of the ``[recipes]`` extra missing, each told what to do as fits how lightning-mgpu was installed (an
editable install from a clone, or a wheel: configs/ and recipes/ are in the clone only)."""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

import pytest

from lightning_mgpu import cli

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = "configs/pyramidnet/quickstart.yaml"


def _site(tmp_path: Path, direct_url: dict | None) -> Path:
    """A site-packages folder holding lightning-mgpu's metadata as pip writes it (PEP 610's direct_url.json)."""
    site = tmp_path / "site-packages"
    info = site / "lightning_mgpu-0.2.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lightning-mgpu\nVersion: 0.2.0\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))
    (site / "lightning_mgpu").mkdir()
    (site / "lightning_mgpu" / "__init__.py").write_text("")
    return site


def _clone_root(site: Path) -> Path | None:
    dists = metadata.distributions(name="lightning-mgpu", path=[str(site)])
    return cli.clone_root(dists, site / "lightning_mgpu" / "__init__.py")


def _last_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_this_checkout_is_found_as_the_clone():
    # The project's own *.egg-info (in the clone, on sys.path) has no direct_url.json: the editable one is found.
    assert cli.clone_root() == REPO


def test_an_editable_install_points_to_its_clone_and_a_wheel_to_none(tmp_path):
    clone = tmp_path / "clone"
    clone.mkdir()
    editable = {"url": clone.as_uri(), "dir_info": {"editable": True}}
    assert _clone_root(_site(tmp_path / "a", editable)) == clone
    wheel = {"url": "file:///tmp/dist/lightning_mgpu-0.2.0-py3-none-any.whl", "archive_info": {}}
    assert _clone_root(_site(tmp_path / "b", wheel)) is None
    assert _clone_root(_site(tmp_path / "c", None)) is None  # from an index: no direct_url.json
    built = {"url": clone.as_uri(), "dir_info": {}}  # `pip install .`: a copy in site-packages, not the clone
    assert _clone_root(_site(tmp_path / "d", built)) is None


def test_a_clone_on_sys_path_without_an_install_is_a_clone(tmp_path):
    clone = tmp_path / "clone"
    (clone / "lightning_mgpu").mkdir(parents=True)
    (clone / "pyproject.toml").write_text("[project]\nname = 'lightning-mgpu'\n")
    assert cli.clone_root([], clone / "lightning_mgpu" / "__init__.py") == clone


def test_a_relative_recipe_config_from_another_folder_says_where_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    with pytest.raises(SystemExit) as exit:
        cli.main(["fit", "-c", QUICKSTART])
    assert exit.value.code == 1
    message = _last_line(capsys)
    assert message.startswith(f"lightning-mgpu: the config file '{QUICKSTART}' does not exist"), message
    assert f"Recipe configs live in configs/ of your lightning-mgpu clone, {REPO} ({QUICKSTART} is there)" in message
    assert f"run the command from that folder (cd {REPO})" in message


def test_a_missing_config_under_a_wheel_install_says_configs_are_in_a_clone(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-mgpu"])
    monkeypatch.setattr(cli, "clone_root", lambda *args: None)
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config=my/config.yaml"])
    message = _last_line(capsys)
    assert "'my/config.yaml' does not exist (relative to the current directory" in message, message
    assert "live in a clone of lightning-mgpu, not in the installed package" in message
    assert "run the command from the root of a clone, or give the path of a config of your own" in message


def test_an_inline_yaml_config_is_not_taken_for_a_missing_file():
    cli.check_config_files("lightning-mgpu", ["fit", "-c", "{trainer: {max_steps: 1}}", "-c", str(REPO / QUICKSTART)])


def _missing_transformers_message(capsys) -> str:
    with pytest.raises(SystemExit), cli.exit_on_command_error("lightning-mgpu"):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")
    return _last_line(capsys)


def test_the_missing_extra_from_a_clone_installs_it_editable_there(capsys):
    message = _missing_transformers_message(capsys)
    assert "the Python package 'transformers' is not installed" in message
    assert f"from the root of your lightning-mgpu clone ({REPO}) with `pip install -e '.[recipes]'`" in message


def test_the_missing_extra_under_a_wheel_install_gets_the_packages(capsys, monkeypatch):
    monkeypatch.setattr(cli, "clone_root", lambda *args: None)
    message = _missing_transformers_message(capsys)
    assert "`pip install 'lightning-mgpu[recipes]'` adds it to the installed lightning-mgpu" in message
    assert "'transformers>=4.40'" in message and "'jsonargparse[signatures]>=4.27'" in message
    assert "-e '.[recipes]'" not in message and "clone" not in message


def test_the_listed_packages_are_the_extra_of_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["recipes"]
    assert " ".join(f"'{requirement}'" for requirement in extra) == cli.RECIPES_EXTRA_REQUIREMENTS
