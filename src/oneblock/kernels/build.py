"""Building and loading the C++ library, once per source version, cached across processes.

The library is compiled by ``torch.utils.cpp_extension.load`` (ninja, ``-O3``, no ``-march``: each vector
function carries its own ``target`` attribute, so one build runs on any x86-64 CPU) into
``$XDG_CACHE_HOME/oneblock/kernels/<hash>`` (default ``~/.cache``), the hash covering the sources, the flags and
the torch and Python versions. A ``complete`` marker is written after the first successful load; later processes
that find it load the shared object directly, without asking the compiler or ninja anything.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

NAME = "oneblock_kernels"
CSRC = Path(__file__).parent / "csrc"
SOURCES: tuple[str, ...] = ("ops.cpp", "dequantize.cpp", "dot_scalar.cpp", "dot_avx2.cpp", "dot_avx512.cpp")
SOURCES += ("decode_plan.cpp", "decode_step.cpp", "step_math.cpp")  # the native decode step
HEADERS = ("blocks.h", "dot.h", "dot_avx512.h", "decode_step.h", "step_math.h")
# -ffp-contract=off: no fused multiply-adds the source does not ask for, so the scalar path rounds exactly as
# the NumPy reference (the vector paths call FMA explicitly).
CFLAGS = ("-O3", "-ffp-contract=off")
_MARKER = "complete"


class KernelBuildError(RuntimeError):
    """The C++ library could not be built or loaded (no compiler, a failed compile, a non-x86 CPU)."""


def cache_root() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/oneblock/kernels`` (default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "oneblock" / "kernels"


def build_directory() -> Path:
    """The build directory of the current sources: a hash of them, the flags and the torch/Python versions."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    return cache_root() / digest.hexdigest()[:16]


def _with_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip package keeps it beside this interpreter."""
    try:
        import ninja

        bin_dir = str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def load_library() -> Path:
    """Load the C++ ops into ``torch.ops.oneblock``, building them first if this version was never built.

    Returns:
        The path of the loaded shared object.

    Raises:
        KernelBuildError: naming the cause (no compiler, compile error, unsupported CPU).
    """
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelBuildError(f"the kernels are written for x86-64, this CPU is {platform.machine()}")
    directory = build_directory()
    library = directory / f"{NAME}.so"
    if (directory / _MARKER).exists() and library.exists():
        try:
            torch.ops.load_library(str(library))
        except (OSError, RuntimeError) as err:
            raise KernelBuildError(f"the cached library {library} does not load ({err}); delete {directory}") from err
        return library
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler: {compiler!r} is not on PATH (install g++)")
    _with_ninja_on_path()
    from torch.utils import cpp_extension

    try:
        directory.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=NAME,
            sources=[str(CSRC / name) for name in SOURCES],
            extra_cflags=list(CFLAGS),
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as err:  # keep one line: the first compiler error, else the exception's last line
        lines = str(err).strip().splitlines() or [type(err).__name__]
        cause = next((line for line in lines if "error:" in line), lines[-1])
        raise KernelBuildError(f"the build in {directory} failed: {cause.strip()}") from err
    try:
        marker = directory / f"{_MARKER}.{os.getpid()}"
        marker.write_text(f"{torch.__version__}\n")
        marker.replace(directory / _MARKER)  # atomic: a reader sees no marker or a whole one
    except OSError:
        pass  # loaded; the next process builds (a no-op for ninja) and tries the marker again
    return library
