"""``python -m benchmarks.compare``: train a recipe config under each strategy and compare them.

For every strategy in ``--strategies`` a fresh worker process trains ``--steps`` batches of the config's model and
data on ``--devices`` replicas and measures throughput, step time, peak memory per device, the imbalance between
devices and the bytes each step moves to and from the root device. The report (JSON, markdown, PNG) sets these
beside the article's communication model: parameter server 2(N−1)K/b against ring all-reduce 2(N−1)K/(N·b) for the
model's K bytes of gradients on a link of ``--link-gbps``.

    python -m benchmarks.compare -c configs/pyramidnet/quickstart.yaml --accelerator cpu --devices 2 --steps 10
    python -m benchmarks.compare -c configs/pyramidnet/seed.yaml --accelerator gpu --devices 2 --steps 20 \\
        --strategies single dp parallel_criterion -- --data.init_args.source=synthetic

Arguments after ``--`` go to LightningCLI (e.g. ``--data.init_args.batch_size=64``). Exit status: 0 when at least
one strategy trained (failed strategies are rows of the report), 1 when none did or when a module of the
``[recipes]`` extra is missing (``jsonargparse``, ``matplotlib``, or one the config's classes import: the message says
how to install it), 2 for a usage error.

Every strategy, ``ddp`` included, trains with the same settings: the config's trainer settings, and the benchmark's
own for what it controls (see :mod:`benchmarks.compare.worker`), among them no progress bar, in every row. A
progress bar is display, not training: its refreshes cost host time in the timed steps, differently per strategy,
and under ``ddp`` it is drawn by rank 0 only. That users' runs with the progress bar on finish under every strategy
is checked by ``tests/cli/test_recipe_matrix.py``, not here.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_mgpu.cli import exit_on_missing_extra

DEFAULT_STRATEGIES = ("single", "dp", "parallel_criterion", "ddp")
DEFAULT_OUT = Path("lightning_logs/strategy_comparison")
DESCRIPTION = """Train a recipe config under each strategy, each in a fresh process, and compare throughput, step time,
peak memory per device, the imbalance between devices and the bytes each step moves to the root device, beside the
parameter-server and ring all-reduce communication model. Writes JSON, markdown and a PNG chart to --out.

examples (from the root of a lightning-mgpu clone):
  python -m benchmarks.compare -c configs/pyramidnet/quickstart.yaml --accelerator cpu --devices 2 --steps 10
  python -m benchmarks.compare -c configs/pyramidnet/seed.yaml --accelerator gpu --devices 2 --steps 20 \\
      --strategies single dp parallel_criterion -- --data.init_args.source=synthetic

Arguments after -- go to LightningCLI. Exit status: 0 when at least one strategy trained (failed ones are rows of
the report), 1 when none did or a module of the [recipes] extra is missing, 2 for a usage error."""
DEFAULT_LINK_GBPS = 126.0  # PCIe 3.0 x16, one direction (15.75 GB/s): the article's era of multi-GPU boxes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-c",
        "--config",
        action="append",
        required=True,
        help="LightningCLI YAML of a recipe (repeat to overlay, as with python -m lightning_mgpu)",
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=list(DEFAULT_STRATEGIES),
        help="single, dp, parallel_criterion, ddp; other names are passed to Lightning as is",
    )
    parser.add_argument("--accelerator", choices=["auto", "cpu", "gpu", "cuda"], default="auto")
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help="replicas (default: every visible GPU, or 2 on the CPU); more than the visible GPUs "
        "puts several replicas on one GPU (virtual devices)",
    )
    parser.add_argument("--steps", type=int, default=20, help="training batches per strategy")
    parser.add_argument("--warmup", type=int, default=3, help="first batches left out of the timings")
    parser.add_argument(
        "--link-gbps",
        type=float,
        default=DEFAULT_LINK_GBPS,
        help="link bandwidth b of the communication model, Gbit/s (default: PCIe 3.0 x16)",
    )
    parser.add_argument(
        "--ddp-batch",
        choices=["global", "per-process"],
        default="global",
        help="global: divide data.init_args.batch_size by N under ddp, so every strategy trains the "
        "same global batch; per-process: keep the config's batch size in every process",
    )
    parser.add_argument("--no-flops", action="store_true", help="skip the FLOP count (one 2-sample step)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads per process (sets OMP_NUM_THREADS for the workers; default: torch's "
        "own choice, and under ddp on the CPU Lightning's cores / processes)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"report folder (default {DEFAULT_OUT}; the committed results live in benchmarks/results)",
    )
    parser.add_argument("--name", default=None, help="report file stem (default strategy_comparison_<accelerator>)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per strategy before it is stopped")
    parser.add_argument("--log-dir", type=Path, default=None, help="worker logs (default: a temporary folder)")
    return parser


def _environment() -> str:
    import lightning
    import torch

    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}, "
        f"{platform.machine()} {platform.system()}."
    )


def _load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages: other work on the machine skews CPU timings, so the report says how much."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _progress(index: int, total: int, row: dict[str, Any]) -> str:
    head = f"[{index}/{total}] {row['strategy']}: "
    if row.get("status") != "ok":
        error = (row.get("error") or "").strip().splitlines()
        reason = error[0][:160] if error else ""
        return head + f"{row.get('status', 'failed').upper()} ({row['wall_s']:.1f} s): {reason}"
    peaks = (row.get("memory") or {}).get("peak_mib") or {}
    memory = ", ".join(f"{label} {value:,.0f} MiB" for label, value in peaks.items())
    speed = row.get("samples_per_s")
    step = row.get("median_step_s")
    return (
        head
        + (f"{speed:,.1f} samples/s, " if speed else "")
        + (f"median step {step * 1e3:.2f} ms, " if step else "")
        + f"peak {memory} ({row['wall_s']:.1f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write ``<out>/<name>.json``, ``.md`` and ``.png``; see the module docstring."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cli_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, cli_args = argv[:split], argv[split + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"need --steps >= 2 (one step or more is timed after the warm-up), got {args.steps}")
    if not 0 <= args.warmup < args.steps:
        given = "" if any(a.startswith("--warmup") for a in argv) else " (the default)"
        parser.error(
            f"--warmup {args.warmup}{given} leaves no timed step out of --steps {args.steps}: the first --warmup "
            f"steps are left out of the timings. Pass --warmup {args.steps - 1} or less, or --steps "
            f"{args.warmup + 1} or more."
        )
    missing = [c for c in args.config if not Path(c).is_file()]
    if missing:
        parser.error(f"config file(s) not found: {', '.join(missing)}")
    command = "python -m benchmarks.compare"
    with exit_on_missing_extra(command):
        # Checked here, before any worker starts: every worker would fail the same way.
        import jsonargparse  # noqa: F401
        import matplotlib  # noqa: F401

        return _run(args, argv, cli_args, parser)


def _run(args: argparse.Namespace, argv: list[str], cli_args: list[str], parser: argparse.ArgumentParser) -> int:
    """Run every strategy's worker, then write the report (see :func:`main`)."""
    import torch

    from benchmarks.compare.chart import write_chart
    from benchmarks.compare.devices import plan_devices
    from benchmarks.compare.report import build_report, write_report
    from benchmarks.compare.runner import run_worker

    try:
        plan = plan_devices(args.accelerator, args.devices, torch.cuda.device_count())
    except ValueError as err:
        parser.error(str(err))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="lightning_mgpu_bench_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    options = [a for c in args.config for a in ("--config", c)] + [
        "--accelerator",
        plan.accelerator,
        "--devices",
        str(len(plan.devices)),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--ddp-batch",
        args.ddp_batch,
        *(["--no-flops"] if args.no_flops else []),
    ]
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every worker and DDP rank
    load = _load_average()
    print(
        f"lightning-mgpu bench: {len(args.strategies)} strategies x {args.steps} steps; {plan.describe()} "
        f"Logs: {log_dir}",
        file=sys.stderr,
        flush=True,
    )

    rows = []
    for index, strategy in enumerate(args.strategies, start=1):
        stem = f"{index:02d}_{strategy}".replace("/", "_")
        row = run_worker(strategy, log_dir / f"{stem}.json", log_dir / f"{stem}.log", options, cli_args, args.timeout)
        rows.append(row)
        print(_progress(index, len(args.strategies), row), file=sys.stderr, flush=True)

    settings = {
        "command": "python -m benchmarks.compare " + shlex.join(argv + (["--", *cli_args] if cli_args else [])),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": _environment(),
        "configs": list(args.config),
        "cli_args": cli_args,
        "strategies": list(args.strategies),
        "steps": args.steps,
        "warmup": args.warmup,
        "link_gbps": args.link_gbps,
        "ddp_batch": args.ddp_batch,
        "threads": args.threads,
        "load_average_at_start": load,
    }
    report = build_report(rows, plan, settings)
    name = args.name or f"strategy_comparison_{plan.accelerator}"
    paths = [args.out / f"{name}.{ext}" for ext in ("json", "md", "png")]
    write_report(report, paths[0], paths[1])
    write_chart(report, paths[2])
    succeeded = sum(row.get("status") == "ok" for row in rows)
    print(
        f"{succeeded}/{len(rows)} strategies trained; wrote {', '.join(str(p) for p in paths)}",
        file=sys.stderr,
        flush=True,
    )
    return 0 if succeeded else 1
