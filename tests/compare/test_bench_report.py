"""The benchmark's pure parts: device plans, the communication model, number formatting, the markdown page."""

from __future__ import annotations

import pytest

from benchmarks.compare.comm import communication_model, parameter_server_bytes, ring_allreduce_bytes
from benchmarks.compare.devices import plan_devices
from benchmarks.compare.report import build_report, human_bytes, markdown, si


def test_device_plans() -> None:
    cpu = plan_devices("auto", None, cuda_count=0)
    assert (cpu.accelerator, cpu.devices, cpu.virtual) == ("cpu", ("cpu", "cpu"), True)
    two = plan_devices("gpu", 2, cuda_count=4)
    assert (two.devices, two.virtual) == (("cuda:0", "cuda:1"), False)
    shared = plan_devices("cuda", 2, cuda_count=1)  # --devices 2 on one GPU: virtual replicas
    assert (shared.devices, shared.physical, shared.virtual) == (("cuda:0", "cuda:0"), ("cuda:0",), True)
    assert "not a multi-GPU result" in shared.describe()
    assert plan_devices("gpu", 3, cuda_count=2).devices == ("cuda:0", "cuda:1", "cuda:0")
    assert plan_devices("auto", None, cuda_count=2).devices == ("cuda:0", "cuda:1")
    with pytest.raises(ValueError, match="no CUDA device"):
        plan_devices("gpu", 1, cuda_count=0)
    with pytest.raises(ValueError, match="--devices"):
        plan_devices("cpu", 0, cuda_count=0)


def test_communication_model_matches_the_article() -> None:
    k = 97_013_640  # the seed PyramidNet's float32 gradients: 24,253,410 parameters x 4 bytes
    assert parameter_server_bytes(k, 4) == 6 * k
    assert ring_allreduce_bytes(k, 4) == 1.5 * k
    model = communication_model(k, devices=4, link_gbps=100)
    assert model["parameter_server_seconds_per_step"] == pytest.approx(6 * k / 12.5e9)
    assert model["ring_allreduce_seconds_per_step"] == pytest.approx(1.5 * k / 12.5e9)
    assert ring_allreduce_bytes(k, 1) == parameter_server_bytes(k, 1) == 0


def test_formatting() -> None:
    assert human_bytes(4) == "4 B"
    assert human_bytes(11560) == "11.3 KiB"
    assert human_bytes(3 * 1024**3) == "3 GiB"
    assert human_bytes(None) == "—"
    assert si(2.5e12, "FLOP/s") == "2.5 TFLOP/s"
    assert si(None, "FLOP/s") == "—"


def ok_row(strategy: str, kind: str, peaks: dict[str, float], imbalance: float | None) -> dict:
    return {
        "strategy": strategy,
        "status": "ok",
        "kind": kind,
        "devices": ["cuda:0", "cuda:1"],
        "device_names": ["NVIDIA H100 80GB HBM3"],
        "samples_per_s": 1000.0,
        "tokens_per_s": None,
        "median_step_s": 0.25,
        "epoch_estimate_s": 16.0,
        "samples_per_step": 768,
        "precision": "bf16-mixed",
        "flops_per_s": 3e14,
        "memory": {"peak_mib": peaks, "imbalance": imbalance},
        "transfer_bytes_per_step": {
            "outputs": 30720,
            "parameters": 10**8,
            "gradients": 97_013_640,
            "total": 10**8 + 97_013_640 + 30720,
            "replicas": 2,
        },
        "model": {"parameters": 24_253_410, "parameter_bytes": 97_013_640, "gradient_bytes": 97_013_640},
    }


def test_markdown_for_distinct_gpus_with_an_oom_row() -> None:
    plan = plan_devices("gpu", 2, cuda_count=2)
    rows = [
        ok_row("dp", "single-process", {"cuda:0": 30000.0, "cuda:1": 12000.0}, 2.5),
        {
            "strategy": "single",
            "status": "oom",
            "error": "OutOfMemoryError: CUDA out of memory.\nmore",
            "log_tail": "x",
        },
    ]
    settings = {
        "command": "python -m benchmarks.compare -c seed.yaml",
        "created": "now",
        "environment": "env",
        "configs": ["configs/pyramidnet/seed.yaml"],
        "cli_args": [],
        "strategies": ["dp", "single"],
        "steps": 20,
        "warmup": 3,
        "link_gbps": 100.0,
        "ddp_batch": "global",
    }
    report = build_report(rows, plan, settings)
    assert report["virtual_devices"] is False
    assert report["devices"]["names"] == ["NVIDIA H100 80GB HBM3"]
    page = markdown(report)
    assert "VIRTUAL" not in page
    assert "| `dp` | ok | 1,000.0 | — | 250.00 | 16.0 | cuda:0 30,000 · cuda:1 12,000 | 2.50 |" in page
    assert "| `single` | **OOM**: OutOfMemoryError: CUDA out of memory. |" in page
    assert "2(N−1)K through the root | 185 MiB | 15.5 ms |" in page  # 2 x 97 MB at 12.5 GB/s
