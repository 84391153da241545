"""Run one strategy's worker in a fresh process and turn whatever happens into one result row.

The worker runs in its own process group (:mod:`benchmarks.compare.process_group`), so a timeout stops it together
with the rank processes DDP's launcher started, and the next strategy starts only once every one of them has exited
(their memory and CPU time would otherwise leak into the next measurement). Its output goes to a log file whose tail
is kept in the row when it fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.compare.process_group import run_in_process_group

LOG_TAIL_LINES = 20


def worker_command(strategy: str, result: Path, options: list[str], cli_args: list[str]) -> list[str]:
    """The command line of one strategy's worker (``cli_args`` go to LightningCLI after ``--``)."""
    command = [sys.executable, "-m", "benchmarks.compare.worker", "--strategy", strategy, "--result", str(result)]
    return command + options + (["--", *cli_args] if cli_args else [])


def run_worker(
    strategy: str, result: Path, log: Path, options: list[str], cli_args: list[str], timeout_s: float
) -> dict[str, Any]:
    """Run the worker for ``strategy``; its result row, or a failed row saying what happened."""
    result.unlink(missing_ok=True)
    command = worker_command(strategy, result, options, cli_args)
    run = run_in_process_group(command, timeout_s, log=log, grace_s=30.0)
    row: dict[str, Any] | None = None
    if not run.timed_out and result.exists():
        try:
            row = json.loads(result.read_text())
        except json.JSONDecodeError:
            row = None
    if row is None:
        error = run.ending() + (" (out of host memory? see the log)" if (run.returncode or 0) < 0 else "")
        row = {"strategy": strategy, "status": "timeout" if run.timed_out else "failed", "error": error}
    if row.get("status") != "ok":  # what it takes to look into a failure; a success needs none of it
        row.update(log_tail=run.tail(LOG_TAIL_LINES), log=str(log), command=command)
    row["wall_s"] = run.wall_s
    return row
