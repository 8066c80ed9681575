"""Choosing the path: ONEBLOCK_KERNELS, the fallback without a compiler (one line on stderr), the build command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oneblock.errors import ConfigError
from oneblock.kernels import build, cpu, ops

SRC = str(Path(__file__).resolve().parents[2] / "src")

# Runs in a fresh process: the path is chosen once per process.
PROBE = """
import numpy as np, torch
from oneblock import kernels
from oneblock.kernels import reference
w = kernels.quantize(torch.randn(5, 64), "q4_1"); x = torch.randn(3, 64)
for _ in range(2):
    y = kernels.block_mm(x, w, "q4_1")
exact = np.array_equal(y.numpy(), reference.block_mm(x.numpy(), w.numpy(), "q4_1"))
print(kernels.backend(), exact)
"""


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": SRC, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=600)


def test_without_a_compiler_the_torch_path_runs_and_says_so_once(tmp_path):
    done = _python(PROBE, XDG_CACHE_HOME=str(tmp_path), CXX=str(tmp_path / "no-such-c++"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torch", "True"]  # the fallback equals the reference bit for bit
    notes = [line for line in done.stderr.splitlines() if "oneblock" in line]
    assert len(notes) == 1 and "no C++ compiler" in notes[0] and "ONEBLOCK_KERNELS" in notes[0], done.stderr


def test_environment_variable_forces_the_scalar_path():
    if ops.backend() == "torch":
        pytest.skip("the C++ kernels did not build here")
    done = _python(PROBE, ONEBLOCK_KERNELS="scalar")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["scalar", "True"]  # scalar: the reference bit for bit
    assert "oneblock" not in done.stderr


def test_unknown_path_is_refused_with_the_choices():
    done = _python("from oneblock import kernels; kernels.backend()", ONEBLOCK_KERNELS="avx9")
    assert done.returncode != 0
    assert "ONEBLOCK_KERNELS='avx9' is not a kernel path; use one of torch, scalar, avx2" in done.stderr


def test_build_command_reports_the_path_and_the_machine():
    environment = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-m", "oneblock.kernels"], capture_output=True, text=True, env=environment, timeout=600
    )
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert lines["backend"] == ops.backend() and lines["cpu"] == cpu.model_name()
    assert lines["library"] == str(build.build_directory())
    assert done.returncode == (0 if ops.backend() != "torch" else 1)


def test_set_isa_refuses_an_unknown_name():
    if ops.backend() == "torch":
        pytest.skip("the C++ kernels did not build here")
    with pytest.raises(ConfigError, match="unknown instruction set 'sse2'; use one of scalar, avx2"):
        ops.set_isa("sse2")


def test_an_unwritable_cache_falls_back_with_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    done = _python(PROBE, XDG_CACHE_HOME=str(blocker))  # the cache root lies under a file: mkdir fails
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torch", "True"]
    notes = [line for line in done.stderr.splitlines() if "oneblock" in line]
    assert len(notes) == 1 and "ONEBLOCK_KERNELS=torch" in notes[0], done.stderr


OPENMP_PROBE = """
import json, re, torch
from oneblock import kernels
kernels.block_mm(torch.randn(2, 576), kernels.quantize(torch.randn(1024, 576), "q4_1x16"), "q4_1x16")
with open("/proc/self/maps") as f:
    print(json.dumps(sorted({line.split()[-1] for line in f if re.search(r"lib(g|i)omp", line)})))
"""


def test_the_library_runs_on_torchs_openmp_runtime_alone():
    if ops.backend() == "torch":
        pytest.skip("the C++ kernels did not build here")
    assert "-fopenmp" in build.CFLAGS  # ATen's parallel_for, inlined into the library, is serial without it
    done = _python(OPENMP_PROBE)
    assert done.returncode == 0, done.stderr
    runtimes = json.loads(done.stdout)  # the mapped OpenMP libraries: one runtime, one thread team
    shipped = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    assert len(runtimes) == 1, runtimes
    if shipped:
        assert Path(runtimes[0]).resolve() == shipped[0].resolve()
