"""Facts about this process: its age and its peak memory (for logs and seg-bench)."""

from __future__ import annotations

import os
import resource
import sys
import time

_IMPORTED = time.perf_counter()


def seconds_since_launch() -> float:
    """Seconds since this process started (Linux /proc; elsewhere since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024.0 * 1024.0) if sys.platform == "darwin" else rss / 1024.0
