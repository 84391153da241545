"""Smoke test of benchmarks/host_overhead.py and benchmarks/step_trace.py: each main() end to end, tiny settings."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import host_overhead, step_trace


def test_host_overhead_tiny(tmp_path: Path) -> None:
    out = tmp_path / "host_overhead.json"
    argv = ["--rounds", "1", "--steps", "1", "--warmup", "1", "--replicas", "2", "--depth", "2", "--out", str(out)]
    report = host_overhead.main(argv)
    assert report["config"]["replicas"] == [2]
    assert report["config"]["modes"] == ["sequential", "threads"]
    row = report["results"]["2"]
    assert row["baseline_median_us"] > 0
    for mode in ("sequential", "threads"):
        entry = row[mode]
        for key in ("wrapper_median_us", "median_ratio", "ratio_of_medians", "cpu_median_ratio", "target_met"):
            assert key in entry
        assert entry["median_ratio"] > 0
    assert json.loads(out.read_text())["results"]["2"]["threads"]["median_ratio"] == row["threads"]["median_ratio"]
    text = out.with_suffix(".md").read_text()
    assert "| sequential | 2 |" in text and "| threads | 2 |" in text
    assert "virtual CPU devices" in text and "Command:" in text


def test_move_counting() -> None:
    calls = [("a", "f"), ("a", "g"), ("b", "f"), ("a", "f"), ("c", "h"), ("b", "f")]
    r = step_trace.analyse(calls, top=2)
    assert (r["package_calls"], r["functions"], r["modules"]) == (6, 4, 3)
    assert r["moves"] == 4  # a->b, b->a, a->c, c->b
    assert r["returns"] == 2  # b->a (a left at a->b), c->b (b left at b->a)
    assert r["top_functions"][0] == ("a.f", 2)


def test_step_trace_tiny(tmp_path: Path) -> None:
    out = tmp_path / "step_trace.md"
    report = step_trace.main(["--batch-index", "1", "--batch-size", "4", "--out", str(out)])
    assert set(report["traces"]) == {f"{s}/{w}" for s in step_trace.STRATEGIES for w in step_trace.WINDOWS}
    for key, r in report["traces"].items():
        assert r["package_calls"] > 0, key
        assert 0 < r["modules"] <= r["functions"] <= r["package_calls"]
        assert r["returns"] <= r["moves"] < r["package_calls"]
        assert r["top_functions"]
    text = out.read_text()
    assert "historical reference" in text and "| parallel_criterion | period |" in text
