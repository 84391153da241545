"""After a plain ``pip install`` (no ``[recipes]`` extra), the command-line tools say what to install instead of
crashing with a traceback, and ``import lightning_mgpu`` needs none of the extra.

The entry points run in a fresh interpreter in which some of the extra's packages are made uninstalled: a
``sys.meta_path`` entry stands in for the path finder, finding neither their modules nor their distributions'
metadata, so availability checks (``importlib.util.find_spec``, ``importlib.metadata``: what torchmetrics and Lightning
consult) see them as absent. Several entry points share one interpreter (importing Lightning once), each called as
its launcher calls it, with its exit status and stderr recorded.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from benchmarks.compare.process_group import run_in_process_group

REPO = Path(__file__).resolve().parents[2]
EXTRA = ("jsonargparse", "transformers", "tokenizers", "datasets", "matplotlib")

# argv[1]: the hidden packages; argv[2]: JSON list of [entry point, arguments]. Prints one JSON line of results.
UNINSTALL_THEN_RUN = """
import contextlib, importlib.machinery, io, json, os, re, runpy, sys

hidden = set(sys.argv[1].split(","))
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()

class PathFinderWithoutHidden:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in hidden:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        found = importlib.machinery.PathFinder.find_distributions(*args, **kwargs)
        return (d for d in found if norm(d.metadata["Name"] or "") not in {norm(h) for h in hidden})

    @classmethod
    def invalidate_caches(cls):
        importlib.machinery.PathFinder.invalidate_caches()

sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = PathFinderWithoutHidden

def call(entry_point):
    if entry_point == "import lightning_mgpu":
        import lightning_mgpu
        return sorted(m for m in sys.modules if m.partition(".")[0] in hidden or m.startswith("benchmarks.compare"))
    if entry_point == "lightning-mgpu":
        # What the installed script does: no current directory on sys.path, then sys.exit(main()).
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.getcwd()]
        sys.exit(importlib.import_module("lightning_mgpu.cli").main())
    runpy.run_module(entry_point.removeprefix("python -m "), run_name="__main__", alter_sys=True)

results = []
for entry_point, args in json.loads(sys.argv[2]):
    sys.argv = [entry_point, *args]
    stderr, code, value = io.StringIO(), 0, None
    with contextlib.redirect_stderr(stderr):
        try:
            value = call(entry_point)
        except SystemExit as exit:
            code = exit.code
    results.append({"entry_point": entry_point, "code": code, "stderr": stderr.getvalue(), "value": value})
print(json.dumps(results))
"""


def _run(hidden: tuple[str, ...], calls: list[tuple[str, list[str]]], tmp_path: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", UNINSTALL_THEN_RUN, ",".join(hidden), json.dumps(calls)]
    run = run_in_process_group(command, 180, cwd=REPO, env=env, log=tmp_path / "output.log")
    assert run.returncode == 0, run.describe()
    return json.loads(run.output.strip().splitlines()[-1])


def _assert_one_clear_paragraph(result: dict, missing: str) -> None:
    message = result["stderr"].strip()
    assert result["code"] == 1, result
    assert "Traceback" not in message and len(message.splitlines()) == 1, message  # one paragraph, nothing else
    assert f"the Python package {missing!r} is not installed" in message, message
    assert f"pip install -e '{REPO}[recipes]'" in message, message  # from a clone (this checkout: editable)
    assert "pip install 'lightning-mgpu[recipes]'" not in message, message  # a wheel's form (test_install_messages)


def test_without_any_of_the_extra(tmp_path: Path) -> None:
    results = _run(
        EXTRA,
        [
            ("import lightning_mgpu", []),
            ("python -m lightning_mgpu", ["fit", "-c", "configs/pyramidnet/quickstart.yaml"]),
            ("python -m benchmarks.compare", ["-c", "configs/bench/tiny.yaml"]),
        ],
        tmp_path,
    )
    imported, cli, bench = results
    # The package imports without the extra, and without loading the benchmark.
    assert imported == {"entry_point": "import lightning_mgpu", "code": 0, "stderr": "", "value": []}
    _assert_one_clear_paragraph(cli, "jsonargparse")
    _assert_one_clear_paragraph(bench, "jsonargparse")


def test_with_jsonargparse_but_without_the_recipes_or_matplotlib(tmp_path: Path) -> None:
    results = _run(
        ("transformers", "tokenizers", "datasets", "matplotlib"),
        [
            # The BERT recipe's classes import transformers: jsonargparse finds it out as it parses the config.
            ("lightning-mgpu", ["fit", "-c", "configs/bert/quickstart.yaml"]),
            ("python -m benchmarks.compare", ["-c", "configs/bench/tiny.yaml"]),
        ],
        tmp_path,
    )
    cli, bench = results
    _assert_one_clear_paragraph(cli, "transformers")
    _assert_one_clear_paragraph(bench, "matplotlib")
