"""The one-command GPU suite runs its whole protocol on the CPU (``--smoke --device cpu``) and writes its report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_suite():
    path = ROOT / "benchmarks" / "gpu_suite.py"
    spec = importlib.util.spec_from_file_location("gpu_suite", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.usefixtures("one_thread")
def test_smoke_run_on_the_cpu_writes_every_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suite = _load_suite()
    out = tmp_path / "gpu_suite_smoke_cpu.json"
    args = ["--smoke", "--device", "cpu", "--replicas", "1", "2", "--windows", "1", "--steps", "1", "--out", str(out)]
    report = suite.main([*args, "--models", "pyramidnet", "bert"])
    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu" and saved["versions"]["torch"] and saved["command"].startswith("python ")
    assert "collected" in saved["cuda_tests"]["summary"]  # --smoke collects the cuda tests (none can run here)
    configs = {(r["model"], r["kind"], r["replicas"], r["compiled"]) for r in report["runs"]}
    kinds = [("one device", 1), ("shards", 2), ("replicas", 2)]
    assert configs == {(m, k, n, c) for m in ("pyramidnet", "bert") for k, n in kinds for c in (False, True)}
    assert all(r["samples_per_s"] > 0 and r["host_ms_per_step"] > 0 for r in report["runs"])
    text = out.with_suffix(".md").read_text()
    assert "pytest -m cuda" in text and "| bert | True | replicas | 2 |" in text
