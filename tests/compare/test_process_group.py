"""``run_in_process_group``: a time limit that stops a command and every process it started, as DDP's ranks."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from benchmarks.compare.process_group import group_alive, run_in_process_group

# Starts a child, which stays in its process group (as DDP's launcher starts rank 1), writes both pids, prints, then
# hangs ignoring SIGTERM, as a rank stuck in a collective did.
HANG = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
print("started", flush=True)
time.sleep(600)
"""

# Exits at once, leaving a child behind in its group.
STRAGGLER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
print("leaving", flush=True)
sys.stderr.write("bye\\n")
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_hang_is_stopped_with_its_whole_group_and_reported(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    start = time.monotonic()
    run = run_in_process_group([sys.executable, "-c", HANG, str(pids)], timeout_s=5, log=tmp_path / "out.log")
    assert time.monotonic() - start < 30
    assert run.timed_out and run.returncode is None
    parent, child = map(int, pids.read_text().split())
    assert not _running(parent) and not _running(child) and not group_alive(parent)
    assert run.output.strip() == "started"
    assert "timed out after 5 s; its process group was killed" in run.describe()
    assert run.describe().endswith("started")


def test_stragglers_are_killed_after_the_grace_period(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    run = run_in_process_group([sys.executable, "-c", STRAGGLER, str(pid_file)], timeout_s=60, grace_s=0.5)
    assert run.returncode == 0 and not run.timed_out
    assert not _running(int(pid_file.read_text()))
    assert run.output.splitlines() == ["leaving", "bye"]  # stdout and stderr, in one log
    assert "exited with status 0" in run.describe()


def test_exit_status_environment_and_working_directory(tmp_path: Path) -> None:
    code = "import os, sys; print(os.getcwd(), os.environ['PROBE']); sys.exit(3)"
    run = run_in_process_group([sys.executable, "-c", code], 60, cwd=tmp_path, env={**os.environ, "PROBE": "x"})
    assert run.returncode == 3 and run.output.split() == [str(tmp_path), "x"]
