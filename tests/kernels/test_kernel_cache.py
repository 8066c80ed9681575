"""The kernel cache recovers, with one line on stderr, from a build killed by a signal and from a damaged library.

Each case runs in a fresh process over a copy of this machine's build directory in a temporary XDG_CACHE_HOME,
so a rebuild is a relink (the object files are copied), not a compile.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_kernel_build import PROBE, SRC

from oneblock.kernels import build, cache, ops

# Old code hangs on a stale lock; a relink and a load take seconds, so this only bounds a failing run.
TIMEOUT = 240
SCALAR = {"ONEBLOCK_KERNELS": "scalar"}  # the path that equals the reference bit for bit


def _python(code: str, cache_home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": SRC, "XDG_CACHE_HOME": str(cache_home), **SCALAR, **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=TIMEOUT
    )


def _notes(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stderr.splitlines() if "oneblock" in line]


@pytest.fixture
def built(tmp_path) -> Path:
    """A copy of the built cache directory under ``tmp_path / "cache"``; its path."""
    if ops.backend() == "torch":
        pytest.skip("the C++ kernels did not build here")
    source = build.build_directory()
    if cache.check(source, source / f"{build.NAME}.so")[0] is not None:
        pytest.skip("this machine's kernel build is not complete")
    copy = tmp_path / "cache" / "oneblock" / "kernels" / source.name
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(cache.LOCK, cache.TORCH_LOCK))
    return copy


def _library(directory: Path) -> Path:
    return directory / f"{build.NAME}.so"


def _assert_native_and_recorded(done: subprocess.CompletedProcess[str], directory: Path) -> None:
    assert done.returncode == 0, done.stderr
    backend, exact = done.stdout.split()
    assert (backend, exact) == ("scalar", "True"), done.stderr  # the C++ library, equal to the reference
    assert cache.check(directory, _library(directory)) == (None, [])  # a new marker matches the new library
    assert not (directory / cache.TORCH_LOCK).exists()


def test_a_stale_lock_is_removed_with_one_line_and_the_build_completes(built):
    (built / cache.MARKER).unlink()  # the build did not finish ...
    (built / cache.TORCH_LOCK).touch()  # ... and left torch's lock behind
    done = _python(PROBE, built.parents[2])
    _assert_native_and_recorded(done, built)
    notes = _notes(done)
    assert len(notes) == 1 and "lock" in notes[0] and "killed" in notes[0], done.stderr


def test_a_build_killed_by_a_signal_does_not_block_the_next_process(built, tmp_path):
    (built / cache.MARKER).unlink()
    _library(built).unlink()  # ninja must link again: the compiler runs, under torch's lock
    started = tmp_path / "compiler-started"
    compiler = tmp_path / "slow-c++"
    compiler.write_text(f'#!/bin/sh\ntouch "{started}"\nexec sleep 600\n')
    compiler.chmod(0o755)
    environment = {**os.environ, "PYTHONPATH": SRC, "XDG_CACHE_HOME": str(built.parents[2]), "CXX": str(compiler)}
    first = subprocess.Popen(
        [sys.executable, "-c", PROBE],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while not started.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), "the build never reached the compiler"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the process, ninja and the compiler, as a closed terminal does
        first.wait()
    assert (built / cache.TORCH_LOCK).exists()  # what the killed build leaves
    done = _python(PROBE, built.parents[2])
    _assert_native_and_recorded(done, built)
    notes = _notes(done)
    assert len(notes) == 1 and "lock" in notes[0], done.stderr


def _truncate(library: Path) -> None:
    os.truncate(library, library.stat().st_size // 2)


def _zero_middle(library: Path) -> None:
    size = library.stat().st_size
    with library.open("r+b") as f:
        f.seek(size // 4)
        f.write(bytes(size // 2))


def _foreign(library: Path) -> None:
    import numpy as np

    other = next(Path(np.__file__).parent.rglob("_multiarray_umath*.so"))
    shutil.copyfile(other, library)


@pytest.mark.parametrize("damage", [_truncate, _zero_middle, _foreign], ids=["truncated", "zeroed", "foreign"])
def test_a_damaged_library_is_told_and_rebuilt(built, damage):
    damage(_library(built))
    done = _python(PROBE, built.parents[2])
    _assert_native_and_recorded(done, built)
    notes = _notes(done)
    assert len(notes) == 1 and "does not match its recorded SHA-256" in notes[0], done.stderr
    assert "building it again" in notes[0]


def test_a_damaged_object_file_is_named_for_deletion(built):
    obj = next(built.glob("*.o"))
    with obj.open("r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    assert cache.check(built, _library(built)) == (None, [])  # the library is what is loaded: it still matches
    _library(built).unlink()
    problem, damaged = cache.check(built, _library(built))
    assert problem is not None and "missing" in problem and damaged == [obj]


def test_waiting_for_another_build_is_bounded(built, monkeypatch):
    import fcntl

    holder = os.open(built / cache.LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a live build: this process holds the lock
    os.write(holder, b"12345\n")
    told: list[str] = []
    refused = pytest.raises(TimeoutError, match=r"process 12345 has been building .* ONEBLOCK_KERNEL_BUILD_WAIT")
    try:
        with refused, cache.build_lock(built, wait=2.5, tell=told.append):
            pass
    finally:
        os.close(holder)
    assert len(told) == 1 and "waiting for process 12345 to finish building" in told[0]  # said once, not silent
    monkeypatch.setenv(cache.ENV_WAIT, "soon")
    with pytest.raises(ValueError, match="ONEBLOCK_KERNEL_BUILD_WAIT='soon' must be a positive number"):
        cache.build_wait()


def _dead_by_sighup(code: str = "import time; time.sleep(600)") -> int:
    """The pid of a process that ran ``code`` and died by SIGHUP (a closed terminal)."""
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    if process.stdout is not None and "print" in code:
        process.stdout.readline()  # it holds what it was to hold
    process.send_signal(signal.SIGHUP)
    assert process.wait(timeout=TIMEOUT) == -signal.SIGHUP
    return process.pid


def test_a_lock_of_a_builder_dead_by_sighup_is_taken_over_with_flock(tmp_path):
    holder = (
        "import fcntl, os, time\n"
        f"fd = os.open({str(tmp_path / cache.LOCK)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, f'{os.getpid()}\\n'.encode())\n"
        f"open({str(tmp_path / cache.TORCH_LOCK)!r}, 'x').close()\n"
        "print('held', flush=True); time.sleep(600)\n"
    )
    _dead_by_sighup(holder)
    told: list[str] = []
    with cache.build_lock(tmp_path, wait=600, tell=told.append):
        assert not (tmp_path / cache.TORCH_LOCK).exists()
    assert len(told) == 1 and "removing" in told[0] and "killed" in told[0], told


def test_without_flock_a_lock_of_a_dead_builder_is_taken_over_and_a_live_one_waited_for_aloud(tmp_path, monkeypatch):
    import errno

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "no locks on this file system")

    monkeypatch.setattr(cache.fcntl, "flock", no_flock)
    (tmp_path / cache.LOCK).write_text(f"{_dead_by_sighup()}\n")
    (tmp_path / cache.TORCH_LOCK).touch()  # fresh: its age alone would keep a process waiting 600 s
    told: list[str] = []

    def stuck(signum, frame):
        raise AssertionError("waited for the lock of a dead builder")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(60)  # a regression fails here instead of waiting the full 600 s
    try:
        with cache.build_lock(tmp_path, wait=600, tell=told.append):
            assert not (tmp_path / cache.TORCH_LOCK).exists()
            assert (tmp_path / cache.LOCK).read_text() == f"{os.getpid()}\n"  # the next one knows whom to ask
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert len(told) == 1 and "removing" in told[0], told
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (tmp_path / cache.LOCK).write_text(f"{live.pid}\n")
        (tmp_path / cache.TORCH_LOCK).touch()
        told.clear()
        with cache.build_lock(tmp_path, wait=3.0, tell=told.append):
            pass
    finally:
        live.kill()
        live.wait()
    assert len(told) == 2 and f"waiting for process {live.pid} to finish building" in told[0], told
    assert "removing" in told[1]  # older than the wait: stale
