"""The benchmark's report: one JSON document and a markdown page with the results table and the communication model."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from benchmarks.compare.comm import communication_model
from benchmarks.compare.devices import DevicePlan


def human_bytes(value: float | None) -> str:
    """``12.3 MiB``-style bytes."""
    if value is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def si(value: float | None, unit: str) -> str:
    """``1.23 GFLOP/s``-style figures."""
    if value is None or not math.isfinite(value):
        return "—"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _number(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def model_figures(rows: list[dict[str, Any]]) -> dict[str, int] | None:
    """Parameter count and bytes, from the first strategy that trained (the model is the same in every row)."""
    return next((row["model"] for row in rows if row.get("status") == "ok" and row.get("model")), None)


def build_report(rows: list[dict[str, Any]], plan: DevicePlan, settings: dict[str, Any]) -> dict[str, Any]:
    """Everything the JSON file holds: settings, devices, model, the communication model and one row per strategy."""
    model = model_figures(rows)
    comm = None
    if model is not None:
        comm = communication_model(model["gradient_bytes"], len(plan.devices), settings["link_gbps"])
    names = sorted({name for row in rows for name in row.get("device_names") or []})
    return {
        "benchmark": "lightning-mgpu strategy comparison",
        **settings,
        "devices": {**plan.to_json(), "names": names or None},
        "virtual_devices": plan.virtual,
        "model": model,
        "communication_model": comm,
        "results": rows,
    }


def _memory_cell(row: dict[str, Any]) -> str:
    peaks = (row.get("memory") or {}).get("peak_mib") or {}
    if not peaks:
        return "—"
    cells = [f"{label} {value:,.0f}" for label, value in peaks.items()]
    replicas = len(row.get("devices") or [])
    if row.get("kind") == "single-process" and len(peaks) < replicas:
        cells[-1] += f" ({replicas} replicas)"
    return " · ".join(cells)


def _transfer_cell(row: dict[str, Any]) -> str:
    transfer = row.get("transfer_bytes_per_step")
    if not transfer:
        return "—"
    if row.get("kind") == "multi-process":
        return f"{human_bytes(transfer['total'])} per device (ring all-reduce, formula)"
    if not transfer["total"]:
        return "0 (one device)"
    return (
        f"{human_bytes(transfer['total'])}: outputs {human_bytes(transfer['outputs'])}, parameters "
        f"{human_bytes(transfer['parameters'])}, gradients {human_bytes(transfer['gradients'])}"
    )


def _status_cell(row: dict[str, Any]) -> str:
    status = row.get("status", "failed")
    if status == "ok":
        return "ok"
    first = (row.get("error") or "").strip().splitlines()
    reason = first[0] if first else ""
    return f"**{status.upper()}**: {reason[:140]}{'…' if len(reason) > 140 else ''}"


def _imbalance_cell(row: dict[str, Any]) -> str:
    ratio = (row.get("memory") or {}).get("imbalance")
    if ratio is not None:
        return f"{ratio:.2f}"
    return "n/a (one physical device)" if row.get("status") == "ok" else "—"


def _load_note(report: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    threads = sorted({row["torch_threads"] for row in rows if row.get("torch_threads")})
    note = f" torch threads per process: {', '.join(map(str, threads))}." if threads else ""
    load = report.get("load_average_at_start")
    if load:
        note += f" Load average at start: {load[0]:g} (1 min), {os.cpu_count()} CPUs."
    return note


def markdown(report: dict[str, Any]) -> str:
    """The markdown page: header (saying plainly when devices are virtual), results, communication model, failures."""
    devices = report["devices"]
    rows = report["results"]
    n = len(devices["replicas"])
    lines = [f"# Strategy comparison ({devices['accelerator']}, {n} replica{'s' if n > 1 else ''})", ""]
    if report["virtual_devices"]:
        lines += [f"> **{devices['description']}**", ""]
    names = f" ({', '.join(devices['names'])})" if devices.get("names") else ""
    lines += [
        f"Command: `{report['command']}`  ",
        f"Config: {', '.join(f'`{c}`' for c in report['configs'])}"
        + (f" with `{' '.join(report['cli_args'])}`" if report["cli_args"] else "")
        + "  ",
        f"Devices: {n} replica(s) on {', '.join(devices['replicas'])}{names}"
        + (" (virtual: see above)  " if report["virtual_devices"] else "  "),
        f"{report['steps']} training steps per strategy, the first {report['warmup']} not timed; each strategy in a "
        f"fresh process. {report['environment']}" + _load_note(report, rows),
        "",
    ]
    ok = [r for r in rows if r.get("status") == "ok"]
    if ok:
        batch = ok[0].get("samples_per_step")
        lines += [f"Batch: {batch} samples per step over all replicas; precision {ok[0].get('precision')}."]
        notes = sorted({r["batch_note"] for r in ok if r.get("batch_note")})
        lines += [f"ddp: {note}." for note in notes]
        lines += [""]
    memory_kind = (
        "peak allocated by the CUDA caching allocator"
        if devices["accelerator"] == "gpu"
        else "process peak RSS, Python + torch + Lightning included"
    )
    heading = "## Results"
    if report["virtual_devices"]:
        physical = len(devices["physical_devices"])
        heading += f" — VIRTUAL devices: {n} replicas on {physical} physical device(s), not a multi-GPU result"
    lines += [
        heading,
        "",
        f"| strategy | status | samples/s | tokens/s | median step (ms) | epoch est. (s) | peak memory per "
        f"{'physical ' if report['virtual_devices'] else ''}device (MiB; {memory_kind}) | imbalance (max/min) "
        "| to/from root per step | FLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        good = row.get("status") == "ok"
        step = row.get("median_step_s")
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{row['strategy']}`",
                    _status_cell(row),
                    _number(row.get("samples_per_s")) if good else "—",
                    _number(row.get("tokens_per_s"), 0) if good and row.get("tokens_per_s") else "—",
                    _number(step * 1e3 if step is not None else None, 2) if good else "—",
                    _number(row.get("epoch_estimate_s"), 1) if good else "—",
                    _memory_cell(row) if good else "—",
                    _imbalance_cell(row),
                    _transfer_cell(row) if good else "—",
                    si(row.get("flops_per_s"), "FLOP/s") if good else "—",
                ]
            )
            + " |"
        )
    lines += [""]
    comm = report.get("communication_model")
    if comm is not None:
        k, gbps = comm["gradient_bytes"], comm["link_gbps"]
        lines += [
            f"## Communication model (K = {human_bytes(k)} of gradients, "
            f"{report['model']['parameters']:,} parameters; N = {comm['devices']}; link b = {gbps:g} Gbit/s)",
            "",
            "| scheme | bytes per step | seconds per step at b |",
            "|---|---|---|",
            f"| parameter server (`dp`, `parallel_criterion`): 2(N−1)K through the root | "
            f"{human_bytes(comm['parameter_server_bytes_per_step'])} | "
            f"{comm['parameter_server_seconds_per_step'] * 1e3:.3g} ms |",
            f"| ring all-reduce (`ddp`): 2(N−1)K/N per device, all links at once | "
            f"{human_bytes(comm['ring_allreduce_bytes_per_device_per_step'])} | "
            f"{comm['ring_allreduce_seconds_per_step'] * 1e3:.3g} ms |",
            "",
        ]
    lines += [
        "Notes: samples/s and tokens/s are Lightning's `ThroughputMonitor` over the timed steps (data loading "
        "included); the median step is forward + loss + backward + optimizer step, synchronised on every device; "
        "the epoch estimate is that median times the batches per epoch. Memory is the peak over the training steps "
        "(`DeviceMemoryMonitor`). \"to/from root\" is counted from each step's outputs and the module's size: the "
        "bytes a step would move between the root and the other devices were they distinct (for `ddp`, the ring "
        "all-reduce formula). FLOP/s come from "
        "`measure_flops` on a 2-sample step scaled to the batch, unless the module defines `flops_per_batch`. "
        "Every strategy, `ddp` included, trains with the same settings: the config's trainer settings, with the "
        "progress bar, checkpointing, model summary, validation and loggers off in every row (their display and I/O "
        "would be timed, at a cost that differs between strategies). That runs with the progress bar on, as users "
        "have it, finish under every strategy is tested for each recipe (`tests/cli/test_recipe_matrix.py`).",
        "",
    ]
    failed = [r for r in rows if r.get("status") != "ok"]
    if failed:
        lines += ["## Failures", ""]
        for row in failed:
            lines += [f"### `{row['strategy']}`: {row.get('status')}", "", "```", (row.get("error") or "").strip()]
            if row.get("log_tail"):
                lines += ["--- last lines of the log ---", row["log_tail"].rstrip()]
            lines += ["```", ""]
    return "\n".join(lines)


def write_report(report: dict[str, Any], json_path: Path, md_path: Path) -> None:
    """Write the JSON and the markdown files."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md_path.write_text(markdown(report))
