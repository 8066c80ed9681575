"""Building and loading the C++ library, once per source version, cached across processes.

The library is compiled by ``torch.utils.cpp_extension.load`` (ninja, ``-O3 -fopenmp``, linked to torch's own
OpenMP runtime; no ``-march``: each vector function carries its own ``target`` attribute, so one build runs on any
x86-64 CPU) into ``$XDG_CACHE_HOME/oneblock/kernels/<hash>`` (default ``~/.cache``), the hash covering the
sources, the flags and the torch and Python versions. A ``complete`` marker recording the library's SHA-256 is
written after the first successful load; later processes that find it, and the library matching it, load the
shared object directly, without asking the compiler or ninja anything. How a killed build and a damaged library
are recovered from: :mod:`oneblock.kernels.cache`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

from oneblock.kernels import cache

NAME = "oneblock_kernels"
CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "ops.cpp",
    "dequantize.cpp",
    "dot_scalar.cpp",
    "dot_avx2.cpp",
    "dot_avx512.cpp",
    "dot_kq_scalar.cpp",  # Q5_K, IQ4_NL, IQ4_XS
    "dot_kq_avx2.cpp",  # Q4_K, Q5_K, Q6_K, IQ4_XS
    "dot_x16_scalar.cpp",
    "dot_x16_avx2.cpp",
    "dot_kx16_avx2.cpp",
    "dot_x16_avx512.cpp",
    "decode_plan.cpp",  # the native decode step
    "decode_products.cpp",
    "decode_step.cpp",
    "decode_attention.cpp",
    "decode_lora.cpp",
    "step_math.cpp",
    "attend_avx2.cpp",
    "weigh_avx512.cpp",
    "half_rows.cpp",
    "float_rows.cpp",
    "dispatch.cpp",
    "interleave.cpp",
    "quantize_avx512.cpp",
)
HEADERS = (
    "blocks.h",
    "interleaved.h",
    "dot.h",
    "dot_avx512.h",
    "dot_x16_avx2.h",
    "dot_x16_avx512.h",
    "dot_x16_each_avx512.h",
    "dot_kx16_avx512.h",
    "dot_kx16_rows_avx512.h",
    "decode_step.h",
    "step_math.h",
    "exp_avx2.h",
    "sum_avx2.h",
)
# -ffp-contract=off: no fused multiply-adds the source does not ask for, so the scalar path rounds exactly as
# the NumPy reference (the vector paths call FMA explicitly). -fopenmp: ATen's parallel_for, inlined from its
# headers, runs on torch's thread team only when the including code is compiled with OpenMP (without it every
# at::parallel_for here runs on the calling thread alone).
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")


def openmp_ldflags() -> tuple[str, ...]:
    """The OpenMP runtime to link: torch's own (its wheels ship ``torch/lib/libgomp*.so*``), by path.

    A process must hold one OpenMP runtime: two would keep two thread teams, each sized by its own
    ``omp_set_num_threads``, and oversubscribe the cores. Linked by path, the library records torch's runtime's
    soname and the loader binds it to the copy libtorch_cpu already loaded; the link also fails here, at build
    time, if the code needs an entry point torch's runtime lacks. A torch without its own copy is linked against the
    system's (``-fopenmp``), the one such a torch uses.
    """
    lib = Path(torch.__file__).parent / "lib"
    shipped = sorted(lib.glob("libgomp*.so*"))
    return (str(shipped[0]),) if shipped else ("-fopenmp",)


# What a build directory holds beyond ninja's files (see oneblock.kernels.cache); part of the hash, so that a
# oneblock that keeps its directories otherwise never shares one with this one.
LAYOUT = "layout 2: oneblock.lock, digests in complete"


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
    digest.update(" ".join((*CFLAGS, *openmp_ldflags())).encode())
    digest.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    digest.update(LAYOUT.encode())
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

    A cached library is loaded only once its SHA-256 matches the one its build recorded; a damaged one, or the
    lock file of a build that was killed, is told in one line on stderr and built again
    (:mod:`oneblock.kernels.cache`).

    Returns:
        The path of the loaded shared object.

    Raises:
        KernelBuildError: naming the cause (no compiler, compile error, unsupported CPU, another process's build
            that did not finish in time).
    """
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelBuildError(f"the kernels are written for x86-64, this CPU is {platform.machine()}")
    directory = build_directory()
    library = directory / f"{NAME}.so"
    if cache.check(directory, library)[0] is None:
        return _load_cached(directory, library)
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler: {compiler!r} is not on PATH (install g++)")
    try:
        wait = cache.build_wait()
        directory.mkdir(parents=True, exist_ok=True)
        with cache.build_lock(directory, wait=wait):
            problem, damaged = cache.check(directory, library)  # another process may have built it meanwhile
            if problem is None:
                return _load_cached(directory, library)
            if problem != "missing":
                cache.note(f"{problem}; building it again")
            cache.discard(directory, damaged)
            _build(directory)
            with contextlib.suppress(OSError):  # loaded; the next process builds (a no-op) and tries again
                cache.write_marker(directory, library, torch.__version__)  # under the lock: a waiter finds it
    except (OSError, TimeoutError, ValueError) as err:
        raise KernelBuildError(f"the build in {directory} could not start: {err}") from err
    return library


def _load_cached(directory: Path, library: Path) -> Path:
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as err:
        raise KernelBuildError(f"the cached library {library} does not load ({err}); delete {directory}") from err
    return library


def _build(directory: Path) -> None:
    """Compile (what ninja finds out of date) and load the library."""
    _with_ninja_on_path()
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=NAME,
            sources=[str(CSRC / name) for name in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(openmp_ldflags()),
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as err:  # keep one line: the first compiler error, else the exception's last line
        lines = str(err).strip().splitlines() or [type(err).__name__]
        cause = next((line for line in lines if "error:" in line), lines[-1])
        raise KernelBuildError(f"the build in {directory} failed: {cause.strip()}") from err
