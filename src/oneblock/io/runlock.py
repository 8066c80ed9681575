"""One writer per run directory: an exclusive ``fcntl.flock`` on ``DIR/.lock``, held while the run writes.

Two processes writing the same run directory interleave their logs and prune each other's checkpoints, so every
command that writes one (``oneblock train``, its ``--resume``) holds this lock for as long as it writes::

    with RunLock(run_dir, command="oneblock train"):
        ...

A second process asking for the same directory is refused at once with one line naming the holder (its pid,
when it started, the command). The lock belongs to the open file, not to the file's existence: the kernel drops
it when the holder exits, however it exits (SIGKILL included), so a stale ``.lock`` file never blocks a run and
is never deleted (deleting it would let a third process lock a fresh file while the second still holds the old
one). ``flock`` is advisory and local: it does not stop other programs, and on some network file systems it
locks only within one machine.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from types import TracebackType

from oneblock.errors import CheckpointError, OneBlockError
from oneblock.io import files

LOCK_FILE = ".lock"
_MAX_HOLDER_BYTES = 4096  # the holder's record is one short JSON line; never read more


class RunLock:
    """An exclusive lock on a run directory, for one process at a time.

    Args:
        directory: the run directory (created if missing).
        command: what holds the lock, shown to a process that is refused ("oneblock train").
        error: the error class raised when the directory is held or cannot be locked.

    Raises:
        ``error`` (on ``acquire``): another process holds the directory, naming it; or the lock file cannot be
            created (a read-only directory, a path through a file), in one line.
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, command: str, error: type[OneBlockError] = CheckpointError
    ) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.command = command
        self.error = error
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock without waiting, and record this process as its holder."""
        if self._fd is not None:
            return self
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            raise self.error(files.describe_os_error(err, self.directory, "lock the run directory")) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise self.error(
                f"{str(self.directory)!r} is in use by another process ({holder}); wait for it to finish, or "
                "choose another directory"
            ) from None
        try:  # who holds it, for the message of the next process that asks
            record = {"pid": os.getpid(), "started": time.time(), "command": self.command}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except OSError:
            pass  # the lock holds without the record; the refusal then just names no holder
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays; see the module's docstring)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()


def _describe_holder(fd: int, wait: float = 0.5) -> str:
    """``pid 1234, started 2026-12-01 15:20:03 UTC, oneblock train`` from the lock file, as far as it is readable.

    A holder records itself just after it takes the lock, so an empty or partial record is read again for up to
    ``wait`` seconds before the refusal says that none is recorded.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            record = json.loads(os.pread(fd, _MAX_HOLDER_BYTES, 0).decode("utf-8"))
            pid, started, command = int(record["pid"]), float(record["started"]), str(record["command"])
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
        except (OSError, ValueError, TypeError, KeyError, OverflowError, RecursionError, AttributeError):
            if time.monotonic() >= deadline:
                return "its pid is not recorded"
            time.sleep(0.01)
            continue
        return f"pid {pid}, started {when}, {command[:80]}"
