"""What this process has cost so far: seconds since it started and its peak resident memory (Linux figures)."""

from __future__ import annotations

import os
import resource
import sys
import time

_IMPORTED = time.perf_counter()  # the fallback origin where /proc is missing


def process_seconds() -> float:
    """Seconds since the operating system started this process (interpreter start-up and imports included).

    Linux reports the start in clock ticks (10 ms); elsewhere this counts from the first import of this module.
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in ticks
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


def peak_rss_bytes() -> int:
    """The most resident memory this process has held, in bytes.

    On Linux this is ``VmHWM`` of ``/proc/self/status``, the high-water mark of this program's own memory:
    ``getrusage``'s ``ru_maxrss`` survives ``exec``, so a process started by a large parent would report the
    parent's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux kilobytes
