"""What this process has cost so far (seconds since it started, its peak resident memory: Linux figures),
Python's cyclic garbage collector held off while the process starts, and the C heap's free memory handed back
(Python's free lists emptied first).

Start-up (``import torch``, loading a model and its tokenizer) creates a few million objects and almost no garbage
cycle, yet the collector, counting allocations, walks every object the process holds several times: 10-12% of
``import torch``'s CPU time, and 0.1-0.3 s for each full collection that the vocabulary's tens of thousands of
merge pairs set off during a load. ``collector_paused`` turns it off for a block (``load_model`` runs in one);
a command that runs for a while after a heavy start (``oneblock generate``, ``oneblock chat``) turns it off first
(``pause_for_start_up``) and, once loaded, freezes what start-up made (``gc.freeze``: those objects stay, and are
never walked again) and turns it back on (``start_up_done``), so that the generation's own garbage is collected
as usual.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

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


def return_free_memory() -> bool:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``), Python's free lists emptied
    first (``empty_free_lists``); whether any was returned.

    Freed Python objects of more than 512 bytes, and the lists that held a vocabulary's strings, were allocated
    from the C heap, whose free space glibc keeps for later allocations: after a load has dropped its temporaries,
    tens of MB that the process no longer uses stay resident, and count in its peak once the model's pages join
    them. Without glibc (macOS, musl) only the free lists are emptied.
    """
    empty_free_lists()
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def empty_free_lists() -> None:
    """Empty the interpreter's lists of freed objects kept for reuse, so that the small-object arenas they lie in
    can go back to the system.

    Python keeps up to 2,000 freed tuples of each length and some freed lists, dicts and floats; after a load has
    dropped a vocabulary's hundreds of thousands of small objects, those few lie scattered over arenas (1 MiB each)
    otherwise empty, and hold them resident (3 MiB for Qwen2's). Only a full collection empties the lists: it runs
    with every object frozen (``gc.freeze``), so that it walks none of them (half a millisecond instead of 60-80).
    Where objects are frozen already (a process past ``start_up_done``), nothing happens: unfreezing ours would
    unfreeze those too.
    """
    if gc.get_freeze_count():
        return
    gc.freeze()
    try:
        gc.collect()
    finally:
        gc.unfreeze()


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # here: the CLI imports this module before anything else

    try:
        return ctypes.CDLL(None).malloc_trim  # the C library the interpreter runs on
    except (OSError, AttributeError):  # not glibc
        return None


_start_up = False  # the collector was turned off by pause_for_start_up, and not yet back on


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off inside the block, restored after (reference counting frees as usual)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def pause_for_start_up() -> None:
    """Turn the collector off until ``start_up_done`` (nothing happens if it is already off)."""
    global _start_up
    if gc.isenabled():
        gc.disable()
        _start_up = True


def start_up_done(*, freeze: bool = True) -> None:
    """Turn the collector back on, if ``pause_for_start_up`` turned it off; first, with ``freeze``, move every
    object start-up made to the permanent generation (``gc.freeze``), which no collection walks again."""
    global _start_up
    if _start_up:
        _start_up = False
        if freeze:
            gc.freeze()
        gc.enable()
