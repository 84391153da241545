"""The PyramidNet throughput benchmark runs end to end on the CPU and writes its JSON + markdown report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_benchmark():
    path = ROOT / "benchmarks" / "pyramidnet_throughput.py"
    spec = importlib.util.spec_from_file_location("pyramidnet_throughput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_cpu_benchmark_writes_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load_benchmark()
    args = [
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--batch-size",
        "8",
        "--warmup",
        "1",
        "--window",
        "2",
        "--windows",
        "2",
        "--rounds",
        "2",
        "--pool-batches",
        "2",
        "--out-dir",
        str(tmp_path),
        "--out-name",
        "bench",
    ]
    report = bench.main(args)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["config"]["model"] == "tiny" and saved["config"]["precision"] == "bf16-mixed"
    assert saved["config"]["channels_last"] is True and saved["device_type"] == "cpu"
    rounds = saved["rounds"]
    loops = ["plain", "lightning", "lightning_no_log"]
    assert [r["order"] for r in rounds] == [loops, loops[1:] + loops[:1]]  # each loop runs first in turn
    for rnd in rounds:
        assert rnd["ratio_no_log_over_plain"] == pytest.approx(
            rnd["lightning_no_log"]["images_per_s_median"] / rnd["plain"]["images_per_s_median"]
        )
        for loop in loops:
            assert len(rnd[loop]["images_per_s_windows"]) == 2 and rnd[loop]["images_per_s_median"] > 0
        assert rnd["ratio_lightning_over_plain"] == pytest.approx(
            rnd["lightning"]["images_per_s_median"] / rnd["plain"]["images_per_s_median"]
        )
    paired = sorted(r["ratio_lightning_over_plain"] for r in rounds)
    assert saved["ratio_lightning_over_plain"] == pytest.approx(sum(paired) / 2)  # median of two rounds
    assert saved["ratio_lightning_over_plain"] == pytest.approx(report["ratio_lightning_over_plain"])
    assert "--model tiny" in saved["command"] and saved["versions"]["torch"]
    markdown = (tmp_path / "bench.md").read_text()
    assert "| plain |" in markdown and "| lightning |" in markdown and "| lightning_no_log |" in markdown
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert last_line.startswith("pyramidnet_throughput: tiny batch 8 bf16-mixed") and "ratio" in last_line


def test_gpu_invocation_parses() -> None:
    args = _load_benchmark().parse_args(
        ["--device", "cuda", "--model", "seed", "--batch-size", "256", "--precision", "bf16-mixed"]
    )
    assert (args.model, args.batch_size, args.precision, args.channels_last) == ("seed", 256, "bf16-mixed", True)
    assert (args.warmup, args.window, args.windows, args.rounds) == (15, 20, 5, 3)


@pytest.mark.parametrize("option", ["--rounds", "--window", "--warmup", "--batch-size"])
def test_counts_below_one_are_refused(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _load_benchmark().parse_args(["--device", "cpu", option, "0"])
    assert f"{option} must be at least 1" in capsys.readouterr().err
