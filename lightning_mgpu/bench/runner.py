"""Run one strategy's worker in a fresh process and turn whatever happens into one result row.

The worker gets its own process group, so a timeout can stop it together with the rank processes DDP's launcher
started, and so the next strategy starts only once every one of them has exited (their memory and CPU time would
otherwise leak into the next measurement). Its output goes to a log file whose tail is kept in the row when it fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LOG_TAIL_LINES = 20


def worker_command(strategy: str, result: Path, options: list[str], cli_args: list[str]) -> list[str]:
    """The command line of one strategy's worker (``cli_args`` go to LightningCLI after ``--``)."""
    command = [sys.executable, "-m", "lightning_mgpu.bench.worker", "--strategy", strategy, "--result", str(result)]
    return command + options + (["--", *cli_args] if cli_args else [])


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, which hold no memory, do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _stop_group(pgid: int, grace_s: float) -> None:
    """Wait up to ``grace_s`` for the group to exit, then SIGTERM it, then SIGKILL it."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                return
        deadline = time.monotonic() + (grace_s if sig is None else 5.0)
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            time.sleep(0.1)


def _signal_name(number: int) -> str:
    try:
        return f"{number} ({signal.Signals(number).name})"
    except ValueError:
        return str(number)


def _log_tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])


def run_worker(
    strategy: str, result: Path, log: Path, options: list[str], cli_args: list[str], timeout_s: float
) -> dict[str, Any]:
    """Run the worker for ``strategy``; its result row, or a failed row saying what happened."""
    result.unlink(missing_ok=True)
    command = worker_command(strategy, result, options, cli_args)
    start = time.perf_counter()
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            returncode: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        _stop_group(process.pid, grace_s=0.0 if returncode is None else 30.0)
        if returncode is None:
            process.wait()
    wall = time.perf_counter() - start
    row: dict[str, Any] | None = None
    if returncode is not None and result.exists():
        try:
            row = json.loads(result.read_text())
        except json.JSONDecodeError:
            row = None
    if row is None:
        if returncode is None:
            error = f"timed out after {timeout_s:g} s (stopped)"
        elif returncode < 0:
            error = f"killed by signal {_signal_name(-returncode)} (out of host memory? see the log)"
        else:
            error = f"exited with status {returncode} without writing a result"
        row = {"strategy": strategy, "status": "timeout" if returncode is None else "failed", "error": error}
    if row.get("status") != "ok":  # what it takes to look into a failure; a success needs none of it
        row.update(log_tail=_log_tail(log), log=str(log), command=command)
    row["wall_s"] = wall
    return row
