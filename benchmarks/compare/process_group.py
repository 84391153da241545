"""Run a command in its own process group, with a time limit that stops the whole group.

Training under DDP starts more processes than the one launched (Lightning's launcher re-runs the command once per
extra rank). A plain ``subprocess.run(..., timeout=...)`` kills only the launcher; the other ranks live on, keep the
output pipes open (so the call waits for them forever) and keep their memory and CPU. Here the command gets a new
session, hence its own process group, and a time limit kills every process of the group with SIGKILL (a rank stuck in
a collective may ignore SIGTERM). After a normal exit, stragglers of the group get ``grace_s`` to exit and are then
killed too. Output (stdout and stderr, interleaved as a terminal would show them) goes to a file, never a pipe.

Used by the strategy-comparison benchmark (one worker per strategy) and by the tests that run recipes as users do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GroupRun", "group_alive", "kill_group", "run_in_process_group", "signal_name"]


@dataclass(frozen=True)
class GroupRun:
    """What happened to a command run by :func:`run_in_process_group`."""

    command: list[str]
    returncode: int | None  # None: the time limit was reached and the group was killed
    timeout_s: float
    wall_s: float
    log: Path  # stdout and stderr, interleaved

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def output(self) -> str:
        """Everything the command (and every process of its group) printed."""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the output."""
        return "\n".join(self.output.splitlines()[-lines:])

    def ending(self) -> str:
        """How the run ended, in words: timed out (and its group killed), killed by a signal, or its exit status."""
        if self.returncode is None:
            return f"timed out after {self.timeout_s:g} s; its process group was killed"
        if self.returncode < 0:
            return f"killed by signal {signal_name(-self.returncode)}"
        return f"exited with status {self.returncode} after {self.wall_s:.1f} s"

    def describe(self, lines: int = 40) -> str:
        """One paragraph for a failure message: the command, how it ended, and the output's last lines."""
        command = " ".join(self.command)
        return f"{command}\n{self.ending()}. Last {lines} lines of its output ({self.log}):\n{self.tail(lines)}"


def signal_name(number: int) -> str:
    """``"9 (SIGKILL)"`` for 9; the bare number for one that names no signal."""
    try:
        return f"{number} ({signal.Signals(number).name})"
    except ValueError:
        return str(number)


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, which hold no memory or CPU, do not count).

    Zombies matter in containers whose PID 1 does not reap orphans: ``killpg(pgid, 0)`` would report them alive.
    """
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


def kill_group(pgid: int, grace_s: float = 0.0) -> None:
    """Give group ``pgid`` up to ``grace_s`` seconds to exit by itself, then SIGKILL every process left in it."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.1)
    if not group_alive(pgid):
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.05)


def run_in_process_group(
    command: Sequence[str],
    timeout_s: float,
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    grace_s: float = 30.0,
) -> GroupRun:
    """Run ``command`` in a new process group; kill the whole group when it runs longer than ``timeout_s``.

    Args:
        command: the program and its arguments.
        timeout_s: wall-clock limit; when reached every process of the group is killed (``returncode`` is None).
        cwd, env: as for ``subprocess.Popen`` (``env=None`` inherits this process's environment).
        log: where the output goes (default: a new temporary file, kept for the caller to read).
        grace_s: after the command exits, how long the rest of its group may take to exit before it is killed.
    """
    if log is None:
        handle, name = tempfile.mkstemp(prefix="lightning_mgpu_run_", suffix=".log")
        os.close(handle)
        log = Path(name)
    command = [str(part) for part in command]
    start = time.perf_counter()
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=None if env is None else dict(env),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own session and process group, whose id is its pid
        )
        try:
            returncode: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        kill_group(process.pid, grace_s=0.0 if returncode is None else grace_s)
        if returncode is None:
            process.wait()
    return GroupRun(command, returncode, timeout_s, time.perf_counter() - start, log)
