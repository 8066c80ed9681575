"""What the CPU is and which vector extensions it reports, for benchmark headers and ``python -m oneblock.kernels``.

The kernels themselves ask the CPU directly (``__builtin_cpu_supports``); this reads ``/proc/cpuinfo`` (Linux)
only to describe the machine a figure came from.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

VECTOR_PREFIXES = ("avx", "fma", "f16c", "amx", "sse4", "ssse3")


@functools.cache  # the CPU does not change while the process runs
def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor describes them all
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows elsewhere."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine() or "unknown CPU"


def vector_extensions() -> list[str]:
    """The SIMD extensions the CPU lists (``avx2``, ``avx512f``, ``avx512_vnni``, ...), in its order."""
    flags = _cpuinfo().get("flags", "").split()
    return [flag for flag in flags if flag.startswith(VECTOR_PREFIXES)]


def describe() -> str:
    """One line: model name and vector extensions."""
    extensions = " ".join(vector_extensions()) or "none listed"
    return f"{model_name()} | vector extensions: {extensions}"


def has_bf16_products() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (Linux only, else False).

    That is AMX tiles with bfloat16 (``amx_tile`` and ``amx_bf16``: Intel Xeon from Sapphire Rapids on) or
    AVX-512 BF16's dot products (``avx512_bf16``: AMD from Zen 4 on, Intel from Cooper Lake on).
    """
    return has_amx() or "avx512_bf16" in _cpuinfo().get("flags", "").split()


def has_amx() -> bool:
    """Whether the CPU has AMX tiles with bfloat16 (Intel Xeon from Sapphire Rapids on; Linux only)."""
    return {"amx_tile", "amx_bf16"} <= set(_cpuinfo().get("flags", "").split())
