"""Step time of DataParallelModel + DataParallelCriterion against the plain module, in the same run.

A small CNN training step (zero_grad + forward + loss + backward + SGD step) is timed for the plain module and for
the wrapped one with N (virtual) devices, sequential and threads modes. The variants are interleaved: every repeat
times a block of steps of each variant, in a rotating order, and each figure is the median over the repeats. The
cost of ``replicate`` and ``scatter`` alone is measured per step too.

    python benchmarks/parallel_core.py --device cpu
    python benchmarks/parallel_core.py --device cuda --replicas 1 2 4

Virtual devices (``["cpu"] * N``, or N replicas of ``cuda:0``) share one physical device: the figures measure the
wrapper's overhead, not a multi-device speed-up. Results go to ``benchmarks/results/parallel_core_<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lightning_mgpu.parallel import DataParallelCriterion, DataParallelModel, replicate, scatter  # noqa: E402

NOTE = (
    "Virtual devices: the N replicas all run on one physical device ({device}), so these figures measure the "
    "wrapper's overhead (scatter, replicate, per-replica launch, reduction), not a multi-device speed-up."
)


def small_cnn(classes: int = 10) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, classes),
    )


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({torch.get_num_threads()} torch threads)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} torch threads)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(
    model: nn.Module, n: int | None, mode: str, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One training step; ``n=None`` is the plain module and criterion."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if n is None:
        criterion = nn.CrossEntropyLoss()

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            optimizer.zero_grad(set_to_none=True)
            criterion(model(x), y).backward()
            optimizer.step()

        return step
    devices = [device] * n
    dp_model = DataParallelModel(model, devices, mode=mode)
    dp_criterion = DataParallelCriterion(nn.CrossEntropyLoss(), devices, mode=mode)

    def dp_step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        dp_criterion(dp_model(x), y).backward()
        optimizer.step()

    return dp_step


def time_block(step: Callable, x: torch.Tensor, y: torch.Tensor, steps: int, device: torch.device) -> float:
    """Mean seconds per step over ``steps`` steps."""
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    sync(device)
    return (time.perf_counter() - start) / steps


def time_call(fn: Callable[[], object], calls: int, repeats: int, device: torch.device) -> float:
    """Median over ``repeats`` of the mean seconds per call."""
    samples = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def wrapper_overhead_us(device: torch.device, repeats: int) -> float:
    """What DataParallelModel + DataParallelCriterion with one device add to a step, in µs (a tiny model, so the
    difference is the wrappers' Python code and nothing else)."""
    x = torch.randn(4, 4, device=device)
    y = torch.randint(0, 2, (4,), device=device)
    model = nn.Linear(4, 2).to(device)
    criterion = nn.CrossEntropyLoss()
    dp_model, dp_criterion = DataParallelModel(model, [device]), DataParallelCriterion(criterion, [device])

    def plain() -> None:
        criterion(model(x), y)

    def wrapped() -> None:
        dp_criterion(dp_model(x), y)

    with torch.no_grad():
        diffs = [
            time_call(wrapped, 2000, 1, device) - time_call(plain, 2000, 1, device) for _ in range(max(repeats, 5))
        ]
    return statistics.median(diffs) * 1e6


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def run(args: argparse.Namespace) -> dict:
    load_before = load_average()
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine.")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
    base = small_cnn().to(device)

    variants: dict[str, tuple[int | None, str]] = {"plain": (None, "-")}
    for n in args.replicas:
        if n == 1:
            variants["N=1"] = (1, "sequential")
        else:
            for mode in ("sequential", "threads"):
                variants[f"N={n} {mode}"] = (n, mode)
    steps = {name: make_step(copy.deepcopy(base), n, mode, device) for name, (n, mode) in variants.items()}

    for step in steps.values():  # warm-up: allocator, thread pool, autograd caches
        time_block(step, x, y, args.warmup, device)

    names = list(steps)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate so no variant always runs first
        for name in order:
            samples[name].append(time_block(steps[name], x, y, args.steps, device))

    plain = samples["plain"]
    results = {}
    for name, (n, mode) in variants.items():
        times = samples[name]
        ratios = [t / p for t, p in zip(times, plain, strict=True)]
        results[name] = {
            "replicas": n or 1,
            "mode": mode,
            "median_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3,
            "samples_ms": [t * 1e3 for t in times],
            "ratio_to_plain": statistics.median(times) / statistics.median(plain),
            "median_paired_ratio": statistics.median(ratios),
        }

    # N=1 against plain, measured on its own in short blocks: each round times plain, N=1 and a second plain copy
    # (an A/A control that shows the noise floor) in a rotating order, and gives one ratio per variant against the
    # plain block of the same round, so a load change on a shared machine hits both sides of a ratio alike.
    trio = {  # three fresh copies made together, so none is favoured by its memory or its history
        "plain": make_step(copy.deepcopy(base), None, "-", device),
        "N=1": make_step(copy.deepcopy(base), 1, "sequential", device),
        "plain copy (A/A)": make_step(copy.deepcopy(base), None, "-", device),
    }
    for step in trio.values():
        time_block(step, x, y, args.warmup, device)
    blocks: dict[str, list[float]] = {name: [] for name in trio}
    trio_names = list(trio)
    for r in range(args.pairs):
        for name in trio_names[r % 3 :] + trio_names[: r % 3]:
            blocks[name].append(time_block(trio[name], x, y, args.pair_steps, device))

    def paired(name: str) -> float:
        return statistics.median(t / p for t, p in zip(blocks[name], blocks["plain"], strict=True))

    def low(name: str) -> float:  # 10th percentile: interference only ever adds time
        return statistics.quantiles(blocks[name], n=10)[0]

    one_device = {
        "median_paired_ratio": paired("N=1"),
        "p10_ratio": low("N=1") / low("plain"),
        "aa_median_paired_ratio": paired("plain copy (A/A)"),
        "aa_p10_ratio": low("plain copy (A/A)") / low("plain"),
        "rounds": args.pairs,
        "steps_per_block": args.pair_steps,
        "plain_median_ms": statistics.median(blocks["plain"]) * 1e3,
        "n1_median_ms": statistics.median(blocks["N=1"]) * 1e3,
        "wrapper_overhead_us": wrapper_overhead_us(device, args.repeats),
        "limit": 1.02,
    }
    one_device["within_limit"] = one_device["median_paired_ratio"] <= one_device["limit"]

    overheads = {}
    for n in args.replicas:
        devices = [device] * n
        model = base
        if n == 1:
            overheads[f"N={n}"] = {"replicate_us": 0.0, "scatter_us": 0.0, "note": "one device: a plain call"}
            continue
        overheads[f"N={n}"] = {
            "replicate_us": time_call(lambda d=devices, m=model: replicate(m, d), 50, args.repeats, device) * 1e6,
            "scatter_us": time_call(lambda d=devices: scatter((x, y), d), 50, args.repeats, device) * 1e6,
        }

    return {
        "benchmark": "parallel_core",
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15min": {"before": load_before, "after": load_average()},
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "note": NOTE.format(device=device),
        "config": {
            "model": "small CNN: conv3x3(3->16)-ReLU-pool-conv3x3(16->32)-ReLU-pool-linear(2048->10)",
            "input": [args.batch_size, 3, 32, 32],
            "step": "zero_grad + forward + CrossEntropyLoss + backward + SGD step",
            "steps_per_block": args.steps,
            "repeats": args.repeats,
            "warmup_steps": args.warmup,
            "statistic": "median over repeats of the mean step time of a block; variants interleaved",
        },
        "results": results,
        "one_device_vs_plain": one_device,
        "overhead_per_step": overheads,
    }


def markdown(report: dict) -> str:
    lines = [
        f"# parallel_core benchmark ({report['device']})",
        "",
        f"- device: {report['device_name']}",
        f"- torch {report['torch']}, Python {report['python']}, {report['torch_threads']} torch threads, "
        f"{report['cpu_count']} CPUs; load average (1/5/15 min) before {report['load_average_1_5_15min']['before']}, "
        f"after {report['load_average_1_5_15min']['after']}",
        f"- command: `{report['command']}`",
        f"- model: {report['config']['model']}, input {report['config']['input']}",
        f"- step: {report['config']['step']}",
        f"- {report['config']['statistic']}: {report['config']['repeats']} repeats x "
        f"{report['config']['steps_per_block']} steps",
        f"- note: {report['note']}",
        "",
        "| variant | replicas | mode | median step (ms) | min (ms) | ratio to plain | median paired ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"| {name} | {r['replicas']} | {r['mode']} | {r['median_ms']:.3f} | {r['min_ms']:.3f} | "
            f"{r['ratio_to_plain']:.3f} | {r['median_paired_ratio']:.3f} |"
        )
    one = report["one_device_vs_plain"]
    lines += [
        "",
        f"**N=1 against plain** ({one['rounds']} rounds of {one['steps_per_block']}-step blocks, rotating order): "
        f"median paired ratio **{one['median_paired_ratio']:.3f}**, 10th-percentile ratio {one['p10_ratio']:.3f} "
        f"(medians {one['n1_median_ms']:.3f} vs {one['plain_median_ms']:.3f} ms per step; limit {one['limit']}: "
        f"{'met' if one['within_limit'] else 'NOT met'}). A/A control, plain against an identical plain copy timed "
        f"the same way: median paired ratio {one['aa_median_paired_ratio']:.3f}, 10th-percentile ratio "
        f"{one['aa_p10_ratio']:.3f}. The wrappers' own cost with one device, on a tiny model: "
        f"{one['wrapper_overhead_us']:.1f} µs per step.",
    ]
    lines += ["", "| replicas | replicate per step (µs) | scatter per step (µs) |", "|---|---|---|"]
    for name, o in report["overhead_per_step"].items():
        lines.append(f"| {name} | {o['replicate_us']:.1f} | {o['scatter_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--steps", type=int, default=8, help="steps per timed block")
    parser.add_argument("--pairs", type=int, default=150, help="rounds of plain / N=1 / plain-copy blocks")
    parser.add_argument("--pair-steps", type=int, default=1, help="steps per block in those rounds")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="JSON path; the markdown table goes next to it")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.replicas):
        parser.error("--replicas must be >= 1")

    report = run(args)
    out = args.out or ROOT / "benchmarks" / "results" / f"parallel_core_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return report


if __name__ == "__main__":
    main()
