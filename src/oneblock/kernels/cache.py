"""The state of one build directory of the kernel cache: who is building it, and what a finished build holds.

Two hazards of a cache shared by every process of a machine:

- **A build killed by a signal** (a closed terminal, a timeout, the OOM killer). ``torch.utils.cpp_extension``
  guards its build with a ``lock`` file that it creates and deletes (``FileBaton``); a process killed in between
  leaves it, and every later process waits for it to vanish, forever and silently. So a oneblock build first
  takes ``oneblock.lock``, an exclusive ``fcntl.flock`` that the kernel drops when its holder dies, however it
  dies: a process holding it knows that no live oneblock process is building, so a ``lock`` it finds is stale,
  and it says so on stderr, removes it and builds. While another live process builds, a process waits for it
  (saying so once), at most ``ONEBLOCK_KERNEL_BUILD_WAIT`` seconds (default 600), and then runs the PyTorch path.
  Where ``flock`` is not supported the builder's pid, recorded in ``oneblock.lock``, decides instead: when that
  process is gone (killed by SIGKILL, SIGHUP, SIGTERM, anything) the ``lock`` is stale at once; otherwise a
  ``lock`` older than the wait is. Every wait says on stderr what it waits for.
- **A damaged library**: a truncated ``.so`` kills the loading process with SIGBUS, one with zeroed pages with
  SIGSEGV, a foreign one raises something no caller expects. So the ``complete`` marker records the SHA-256 of
  the library and of every object file, and a process checks the library against it before loading it. On a
  mismatch it says so, deletes what differs (ninja then rebuilds exactly that), rebuilds and loads the new build.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

MARKER = "complete"
LOCK = "oneblock.lock"
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton, in the build directory
ENV_WAIT = "ONEBLOCK_KERNEL_BUILD_WAIT"
DEFAULT_WAIT = 600.0
_HEADER = "oneblock-kernels 1"
_MAX_MARKER_BYTES = 1 << 16  # a marker is a few lines; never read more
_NOTE_AFTER = 2.0  # seconds of waiting before saying so
_POLL = 0.2

Note = Callable[[str], None]


def note(message: str) -> None:
    """One line on stderr, as every kernel message is told."""
    print(f"oneblock: {message}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_marker(directory: Path, library: Path, torch_version: str) -> None:
    """Record the digests of the built library and object files; atomic (a reader sees no marker or a whole one).

    Raises:
        OSError: the directory cannot be written (the caller carries on: the next process builds again).
    """
    names = [library.name, *sorted(p.name for p in directory.glob("*.o"))]
    lines = [_HEADER, f"torch {torch_version}", *(f"sha256 {sha256_of(directory / n)} {n}" for n in names)]
    tmp = directory / f"{MARKER}.{os.getpid()}"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(directory / MARKER)


def check(directory: Path, library: Path) -> tuple[str | None, list[Path]]:
    """``(problem, damaged files)`` of the build in ``directory``: ``(None, [])`` when the library matches its marker.

    The problem is ``"missing"`` when no build finished here (nothing to say: a first build, or one interrupted
    before its marker, which ninja resumes); otherwise a sentence for the user. The damaged files are those to
    delete before building again: the library whenever it is not verified (ninja would keep a foreign or truncated
    one whose time stamp looks new), and the object files whose digests differ.
    """
    marker = directory / MARKER
    present = [library] if library.exists() else []
    try:
        with marker.open("rb") as f:
            text = f.read(_MAX_MARKER_BYTES + 1).decode("utf-8")
    except FileNotFoundError:
        return "missing", present
    except (OSError, UnicodeDecodeError) as err:
        return f"its record {marker} is unreadable ({err})", present
    recorded = _digests(text)
    if len(text) > _MAX_MARKER_BYTES or recorded is None or library.name not in recorded:
        return f"its record {marker} is not one this oneblock writes", present
    if not library.exists():
        problem = f"the library {library} is missing"
    elif sha256_of(library) == recorded[library.name]:
        return None, []
    else:
        problem = f"the library {library} does not match its recorded SHA-256 (damaged or replaced)"
    objects = [directory / name for name in recorded if name != library.name]
    damaged = [path for path in objects if path.exists() and sha256_of(path) != recorded[path.name]]
    return problem, [*present, *damaged]


def _digests(text: str) -> dict[str, str] | None:
    lines = text.splitlines()
    if not lines or lines[0] != _HEADER:
        return None
    out = {}
    for line in lines[1:]:
        parts = line.split(" ")
        if parts[0] == "sha256":
            if len(parts) != 3 or len(parts[1]) != 64 or "/" in parts[2]:
                return None
            out[parts[2]] = parts[1]
    return out


def discard(directory: Path, damaged: list[Path]) -> None:
    """Delete the marker and the damaged files, so that the build that follows makes them again."""
    for path in (directory / MARKER, *damaged):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def build_wait() -> float:
    """Seconds to wait for another process's build: ``ONEBLOCK_KERNEL_BUILD_WAIT``, else ``DEFAULT_WAIT``.

    Raises:
        ValueError: the variable is not a positive number.
    """
    text = os.environ.get(ENV_WAIT, "").strip()
    if not text:
        return DEFAULT_WAIT
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{ENV_WAIT}={text!r} must be a positive number of seconds")
    return value


@contextlib.contextmanager
def build_lock(directory: Path, *, wait: float, tell: Note = note) -> Iterator[None]:
    """Hold the directory's build lock; then no live oneblock process builds there, so a torch lock is stale.

    Raises:
        TimeoutError: another process held the lock for more than ``wait`` seconds (its pid named).
        OSError: the lock file cannot be created.
    """
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o666)  # not inherited by the compiler (PEP 446)
    try:
        locked = _acquire(fd, directory, wait, tell)
        holder = None if locked else _holder(fd)
        _clear_torch_lock(directory, wait if not locked else 0.0, tell, holder=holder)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, directory: Path, wait: float, tell: Note) -> bool:
    """Take the flock, waiting at most ``wait`` seconds; ``False`` where the file system has no flock."""
    start, told = time.monotonic(), False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as err:
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False
            raise
        waited = time.monotonic() - start
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        if waited > wait:
            raise TimeoutError(
                f"process {holder} has been building the kernels in {directory} for over {wait:g} s; wait for it, "
                f"or set {ENV_WAIT} to wait longer"
            )
        if not told and waited > _NOTE_AFTER:
            tell(f"waiting for process {holder} to finish building the kernels in {directory}")
            told = True
        time.sleep(_POLL)


def _holder(fd: int) -> int | None:
    """The pid the lock file records (the last process that built), if it records one."""
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _clear_torch_lock(directory: Path, younger_than: float, tell: Note, *, holder: int | None = None) -> None:
    """Remove torch's ``lock`` left by a killed build: any, under our flock; without flock, one whose builder
    (``holder``) has died, however it died, or one older than the wait.

    Without flock a live build's lock is waited for, up to ``younger_than`` seconds of its age, saying so once.
    """
    path = directory / TORCH_LOCK
    start, told = time.monotonic(), False
    while True:
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= younger_than or (holder is not None and holder != os.getpid() and not _alive(holder)):
            break
        if not told and time.monotonic() - start > _NOTE_AFTER:
            who = f"process {holder}" if holder is not None else "another process"
            tell(f"waiting for {who} to finish building the kernels in {directory} (its lock {path}), at most "
                 f"{younger_than - age:.0f} s more")  # fmt: skip
            told = True
        time.sleep(_POLL)
    tell(f"removing {path}, the lock of a kernel build that was killed before it finished; building again")
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
