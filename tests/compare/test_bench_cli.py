"""``python -m benchmarks.compare`` end to end on the CPU: every strategy in its own process, one report."""

from __future__ import annotations

import contextlib
import io
import json
import struct
from pathlib import Path

import pytest

from benchmarks.compare import main

pytestmark = pytest.mark.xdist_group("test_bench_cli")  # one worker: one module fixture

TINY = "configs/bench/tiny.yaml"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _compare(out: Path) -> dict:
    """One benchmark run into ``out``: four real strategies and one that does not exist."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(
            [
                "-c",
                TINY,
                "--accelerator",
                "cpu",
                "--devices",
                "2",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--strategies",
                "single",
                "dp",
                "parallel_criterion",
                "ddp",
                "no_such_strategy",
                "--out",
                str(out),
                "--name",
                "report",
                "--log-dir",
                str(out / "logs"),
            ]
        )
    report = json.loads((out / "report.json").read_text())
    return {"code": code, "out": out, "stderr": stderr.getvalue(), "report": report}


def test_one_comparison_run_of_every_strategy(tmp_path: Path) -> None:
    # One benchmark run (about a minute on two cores) checked by the functions below: one test, so that one
    # pytest-xdist worker runs it while the other goes on with other tests.
    comparison = _compare(tmp_path)
    _every_strategy_is_a_row_and_a_missing_one_does_not_lose_the_others(comparison)
    _memory_and_transfer_figures(comparison)
    _report_says_devices_are_virtual(comparison)
    _chart_is_a_png(comparison)
    _progress_is_one_line_per_strategy(comparison)


def _every_strategy_is_a_row_and_a_missing_one_does_not_lose_the_others(comparison: dict) -> None:
    assert comparison["code"] == 0
    rows = {row["strategy"]: row for row in comparison["report"]["results"]}
    assert list(rows) == ["single", "dp", "parallel_criterion", "ddp", "no_such_strategy"]
    for name in ("single", "dp", "parallel_criterion", "ddp"):
        row = rows[name]
        assert row["status"] == "ok", row.get("error")
        assert row["samples_per_s"] > 0 and row["median_step_s"] > 0
        assert row["samples_per_step"] == 32  # ddp: 16 per process x 2, the same global batch
        assert len(row["step_times_s"]) == 2
        assert all(v > 100 for v in row["memory"]["peak_mib"].values())  # process RSS: Python + torch at least
        assert row["flops_per_batch"] > 0 and row["flops_per_s"] > 0
    failed = rows["no_such_strategy"]
    assert failed["status"] == "failed"
    assert "no_such_strategy" in failed["error"] and "Traceback" in failed["log_tail"]


def _memory_and_transfer_figures(comparison: dict) -> None:
    report = comparison["report"]
    rows = {row["strategy"]: row for row in report["results"]}
    grad_bytes = report["model"]["gradient_bytes"]
    assert grad_bytes == 4 * (32 * 64 + 64 + 2 * 64 + 64 * 10 + 10)  # TinyClassifier's float32 parameters

    # Virtual CPU replicas: one physical device, reported once, no imbalance.
    for name in ("single", "dp", "parallel_criterion"):
        assert list(rows[name]["memory"]["peak_mib"]) == ["cpu"]
        assert rows[name]["memory"]["imbalance"] is None
    # ddp: one process per replica, each measured, so an imbalance exists.
    ddp = rows["ddp"]
    assert list(ddp["memory"]["peak_mib"]) == ["rank0_cpu", "rank1_cpu"]
    assert ddp["memory"]["imbalance"] >= 1.0
    assert ddp["transfer_bytes_per_step"]["total"] == grad_bytes  # ring: 2(N-1)K/N = K for N = 2

    assert rows["single"]["transfer_bytes_per_step"]["total"] == 0
    dp, pc = rows["dp"]["transfer_bytes_per_step"], rows["parallel_criterion"]["transfer_bytes_per_step"]
    for transfer in (dp, pc):
        assert transfer["gradients"] == grad_bytes  # one other replica sends its gradients back
        assert transfer["parameters"] > grad_bytes  # parameters and BatchNorm buffers go out
    assert dp["outputs"] == 16 * 10 * 4  # dp gathers the other replica's logits: 16 samples x 10 classes
    assert pc["outputs"] == 4  # parallel_criterion: one float32 loss

    comm = report["communication_model"]
    assert comm["parameter_server_bytes_per_step"] == 2 * grad_bytes
    assert comm["ring_allreduce_bytes_per_device_per_step"] == grad_bytes
    assert comm["parameter_server_seconds_per_step"] == pytest.approx(2 * grad_bytes / (126e9 / 8))


def _report_says_devices_are_virtual(comparison: dict) -> None:
    report = comparison["report"]
    assert report["virtual_devices"] is True
    assert report["devices"]["replicas"] == ["cpu", "cpu"]
    assert "not a multi-GPU result" in report["devices"]["description"]
    markdown = (comparison["out"] / "report.md").read_text()
    assert "## Results — VIRTUAL devices: 2 replicas on 1 physical device(s), not a multi-GPU result" in markdown
    table = [line for line in markdown.splitlines() if line.startswith("| `")]
    assert [line.split(" | ")[0] for line in table] == [
        "| `single`",
        "| `dp`",
        "| `parallel_criterion`",
        "| `ddp`",
        "| `no_such_strategy`",
    ]
    assert all(line.split(" | ")[1] == "ok" for line in table[:4])
    assert table[4].split(" | ")[1].startswith("**FAILED**: ValueError")
    assert all(line.count(" | ") == 9 for line in table)  # ten columns on every row, failed ones too
    assert "## Communication model" in markdown and "## Failures" in markdown


def _chart_is_a_png(comparison: dict) -> None:
    width, height = png_size(comparison["out"] / "report.png")
    assert width >= 1000 and height >= 500


def _progress_is_one_line_per_strategy(comparison: dict) -> None:
    lines = comparison["stderr"].splitlines()
    progress = [line for line in lines if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == [f"[{i}/5" for i in range(1, 6)]
    assert "samples/s" in progress[0] and "FAILED" in progress[4]
    assert lines[-1].startswith("4/5 strategies trained; wrote ")


def test_a_strategy_that_hangs_is_stopped_and_reported(tmp_path: Path) -> None:
    code = main(
        [
            "-c",
            TINY,
            "--accelerator",
            "cpu",
            "--devices",
            "2",
            "--strategies",
            "single",
            "--timeout",
            "0.5",
            "--out",
            str(tmp_path),
            "--name",
            "r",
        ]
    )
    assert code == 1  # nothing trained
    (row,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert row["status"] == "timeout" and "timed out after 0.5 s" in row["error"]
    assert "**TIMEOUT**" in (tmp_path / "r.md").read_text()
    png_size(tmp_path / "r.png")


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    for argv in (
        ["-c", "missing.yaml"],
        ["-c", TINY, "--steps", "1"],
        ["-c", TINY, "--accelerator", "gpu", "--devices", "0"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--out", str(tmp_path)])
        assert exit_info.value.code == 2
