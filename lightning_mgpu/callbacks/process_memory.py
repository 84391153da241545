"""This process's peak and current resident set size (RSS): the CPU's memory figures.

The peak is Linux's resettable ``VmHWM``; ``ru_maxrss``, the fallback elsewhere, cannot be reset and after ``fork`` +
``exec`` may still hold the parent's peak.
"""

from __future__ import annotations

import os
import sys

MIB = 1024**2


def peak_rss_bytes() -> int | None:
    """Peak RSS of this process in bytes, since it started or since the last :func:`reset_peak_rss`."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024  # bytes on macOS, KiB on Linux


def current_rss_bytes() -> int | None:
    """Current RSS of this process in bytes (``/proc/self/statm``), or ``None`` where that file does not exist."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            resident_pages = int(statm.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux 4.0+); ``False`` where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False
