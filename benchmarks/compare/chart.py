"""The benchmark's picture: peak memory per device and throughput, per strategy (matplotlib, Agg, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT_COLOR = "#d62728"  # the root device, where nn.DataParallel piles up
OTHER_COLOR = "#1f77b4"
SHARED_COLOR = "#7f7f7f"  # one physical device shared by virtual replicas
FAILED_COLOR = "#bbbbbb"


def _memory_bars(rows: list[dict[str, Any]]) -> list[tuple[str, float | None, str, str]]:
    """(tick label, MiB or None, colour, annotation) for every device bar, strategy after strategy."""
    bars = []
    for row in rows:
        name = row["strategy"]
        peaks = (row.get("memory") or {}).get("peak_mib") or {}
        if row.get("status") != "ok" or not peaks:
            bars.append((name, None, FAILED_COLOR, str(row.get("status", "failed")).upper()))
            continue
        one_process = row.get("kind") == "single-process"
        shared = one_process and len(peaks) < len(row.get("devices") or [])
        for index, (label, value) in enumerate(peaks.items()):
            root = one_process and index == 0 and len(peaks) > 1
            color = SHARED_COLOR if shared else (ROOT_COLOR if root else OTHER_COLOR)
            bars.append((f"{name}\n{label}", value, color, f"{value:,.0f}"))
    return bars


def write_chart(report: dict[str, Any], path: Path) -> None:
    """Two panels: peak memory of every device (root in red) and samples/s, one group per strategy."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, no display needed

    rows = report["results"]
    bars = _memory_bars(rows)
    figure = Figure(figsize=(max(10.0, 1.1 * len(bars) + 5), 5.6), dpi=110, layout="constrained")
    memory_ax, speed_ax = figure.subplots(1, 2, width_ratios=[max(len(bars), 2), max(len(rows), 2)])

    positions = list(range(len(bars)))
    heights = [value or 0.0 for _, value, _, _ in bars]
    memory_ax.bar(positions, heights, color=[color for _, _, color, _ in bars])
    top = max(heights, default=0.0) or 1.0
    for x, (_, value, _, text) in zip(positions, bars, strict=True):
        memory_ax.text(
            x,
            (value or 0.0) + 0.01 * top,
            text,
            ha="center",
            va="bottom",
            fontsize=8,
            color="black" if value is not None else "#990000",
        )
    memory_ax.set_xticks(positions, [label for label, _, _, _ in bars], fontsize=8)
    memory_ax.set_ylim(0, top * 1.3)  # room for the legend
    kind = "CUDA peak allocated" if report["devices"]["accelerator"] == "gpu" else "process peak RSS"
    memory_ax.set_ylabel(f"MiB ({kind})")
    memory_ax.set_title("Peak memory per device", fontsize=10)
    legend = {
        ROOT_COLOR: "root device of dp / parallel_criterion",
        OTHER_COLOR: "a device (single; ddp: one process each)",
        SHARED_COLOR: "one device shared by virtual replicas",
    }
    used = [color for color in legend if any(bar[2] == color for bar in bars)]
    if used:
        from matplotlib.patches import Patch

        memory_ax.legend(handles=[Patch(color=c, label=legend[c]) for c in used], fontsize=8, loc="upper left")

    names = [row["strategy"] for row in rows]
    speeds = [row.get("samples_per_s") if row.get("status") == "ok" else None for row in rows]
    speed_ax.bar(
        range(len(rows)),
        [s or 0.0 for s in speeds],
        color=[OTHER_COLOR if s is not None else FAILED_COLOR for s in speeds],
    )
    top = max((s or 0.0 for s in speeds), default=0.0) or 1.0
    for x, (row, speed) in enumerate(zip(rows, speeds, strict=True)):
        if speed is None:
            text = str(row.get("status", "failed")).upper()
        else:
            step = row.get("median_step_s")
            text = f"{speed:,.0f}" + (f"\n{step * 1e3:.1f} ms/step" if step else "")
        speed_ax.text(x, (speed or 0.0) + 0.01 * top, text, ha="center", va="bottom", fontsize=8)
    speed_ax.set_xticks(range(len(rows)), names, fontsize=8)
    speed_ax.set_ylim(0, top * 1.2)
    speed_ax.set_ylabel("samples/s (all replicas)")
    speed_ax.set_title("Throughput", fontsize=10)

    devices = report["devices"]
    title = (
        f"{', '.join(Path(c).name for c in report['configs'])}: {len(devices['replicas'])} replica(s) on "
        f"{', '.join(devices['physical_devices'])}"
    )
    if devices.get("names"):
        title += f" ({', '.join(devices['names'])})"
    figure.suptitle(title, fontsize=11)
    if report["virtual_devices"]:
        figure.supxlabel(
            "VIRTUAL DEVICES: the replicas share one physical device - not a multi-GPU result "
            "(a grey bar is the shared device's total for all its replicas)",
            fontsize=9,
            color="#990000",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
