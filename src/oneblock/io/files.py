"""Writing a file so that a reader sees the old file or the complete new one, and OS errors told in one line.

``write_atomic`` writes to a short temporary name in the target's directory, flushes the data to disk (``fsync``),
renames it over the target (``os.replace``, atomic on POSIX and Windows) and flushes the directory. Whatever fails
on the way (a full disk, a read-only file system, a name the file system refuses) the temporary file is removed,
an existing file at the target is untouched and the error names the user's path, not the temporary one.

The temporary name is ``.<8 hex digits>.tmp``, independent of the target's name: a legal 255-byte file name
must not become an illegal temporary one. ``remove_leftovers`` deletes such files after an interruption.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from oneblock.errors import CheckpointError, OneBlockError

TMP_PATTERN = re.compile(r"\.[0-9a-f]{8}\.tmp")

# errno -> (what happened, what to do); the message always ends by saying that an existing file is intact.
_REASONS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("the disk is full", "free some space and try again"),
    errno.EDQUOT: ("the disk quota is exhausted", "free some space and try again"),
    errno.EACCES: ("permission denied", "choose a directory you can write to"),
    errno.EPERM: ("permission denied", "choose a directory you can write to"),
    errno.EROFS: ("the file system is read-only", "choose a writable directory"),
    errno.ENAMETOOLONG: ("a file name is too long for the file system", "use a shorter name (most allow 255 bytes)"),
    errno.EISDIR: ("it is a directory", "give a file name inside it"),
    errno.ENOTDIR: ("a part of the path is a file, not a directory", "check the path"),
    errno.ENOENT: ("a directory on the path does not exist", "check the path"),
    errno.EEXIST: ("a part of the path is a file, not a directory", "check the path"),
}


def check_target(path: str | os.PathLike[str], what: str, error: type[OneBlockError] = CheckpointError) -> Path:
    """``path`` as a ``Path``, refused when it is empty or an existing directory.

    Args:
        path: where a file is to be written.
        what: the kind of file, for the message ("checkpoint", "training state").
        error: the error class to raise.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise error(f"the {what} path must be a string or a path; got {type(path).__name__}")
    if os.fspath(path) in ("", b""):
        raise error(f"the {what} path is empty; give a file name such as 'model.safetensors'")
    target = Path(path)
    try:
        is_dir = target.is_dir()
    except OSError:  # e.g. a name too long to look up: writing it will say so, in the same words
        is_dir = False
    if is_dir:
        raise error(f"cannot write the {what} to {str(target)!r}: it is a directory; give a file name inside it")
    return target


def check_destination(path: Path, what: str, error: type[OneBlockError] = CheckpointError) -> None:
    """Refuse to write over anything at ``path`` but a regular file (or a symbolic link to one): a device node, a
    FIFO, a socket, a directory, or a link to one of those, would be replaced by the new file (or hang the write).

    A missing ``path`` (or a dangling link) is fine: the file is created.
    """
    kind = special_kind(path)
    if kind is None:
        return
    directory = kind.startswith(_KINDS[stat.S_IFDIR])
    fix = "give a file name inside it" if directory else "give the path of a regular file, or a new one"
    raise error(f"cannot write the {what} to {str(path)!r}: it is {kind}, not a regular file; {fix}")


def special_kind(path: Path) -> str | None:
    """What is at ``path`` when it is neither missing nor a regular file ("a FIFO (named pipe)", "a directory
    (through a symbolic link)", ...), looked up without opening it (opening a FIFO waits for a writer); else None.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:  # nothing there (or a dangling link, or a name too long)
        return None
    if stat.S_ISREG(mode):
        return None
    kind = _KINDS.get(stat.S_IFMT(mode), "a special file")
    return kind + (" (through a symbolic link)" if path.is_symlink() else "")


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def describe_os_error(err: OSError, path: str | os.PathLike[str], action: str) -> str:
    """One line: what could not be done to which user path, why, and what to do."""
    reason, fix = _REASONS.get(err.errno or 0, (err.strerror or str(err), "check the path"))
    return f"cannot {action} {str(path)!r}: {reason} ({err.strerror or err}); {fix}"


def write_atomic(
    path: Path,
    chunks: Iterable[bytes | memoryview],
    *,
    what: str,
    error: type[OneBlockError] = CheckpointError,
) -> None:
    """Write the concatenation of ``chunks`` to ``path`` atomically; missing parent directories are created.

    Raises:
        ``error``: ``path`` is something other than a regular file (``check_destination``), or any ``OSError`` on
            the way, described by ``describe_os_error``; an existing file at ``path`` is untouched and no
            temporary file is left behind.
    """
    check_destination(path, what, error)
    tmp = path.parent / f".{secrets.token_hex(4)}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_durably(tmp, chunks)
        os.replace(tmp, path)
    except OSError as err:
        _unlink_quietly(tmp)
        raise error(f"{describe_os_error(err, path, f'write the {what}')}; any previous file there is intact") from None
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_directory(path.parent)


def replace_files(
    directory: Path,
    contents: Mapping[str, Iterable[bytes | memoryview]],
    *,
    what: str,
    error: type[OneBlockError] = CheckpointError,
) -> None:
    """Write several files of ``directory`` as one change: all are complete on disk before any is renamed in.

    Each file is written to its own temporary name and flushed; only when every one is complete are they renamed
    over their targets, one ``os.replace`` after another (no data is written between the renames, so a full disk
    cannot stop them half-way). Other files of the directory are left as they are.

    Args:
        directory: created if missing.
        contents: file name -> chunks, renamed in this order.
        what: what the files make up, for the message ("Hugging Face model").
        error: the error class to raise.

    Raises:
        ``error``: any ``OSError`` on the way, described by ``describe_os_error``; the directory's files are as
            they were and no temporary file is left behind.
    """
    for name in contents:
        check_destination(directory / name, what, error)
    temporaries: dict[str, Path] = {}
    created = not directory.exists()

    def undo() -> None:
        for tmp in temporaries.values():
            _unlink_quietly(tmp)
        if created:  # a directory made for the files goes with them (only if empty: never anyone else's)
            with contextlib.suppress(OSError):
                directory.rmdir()

    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, chunks in contents.items():
            temporaries[name] = directory / f".{secrets.token_hex(4)}.tmp"
            _write_durably(temporaries[name], chunks)
        for name, tmp in temporaries.items():
            os.replace(tmp, directory / name)
    except OSError as err:
        undo()
        message = describe_os_error(err, directory, f"write the {what} into")
        raise error(f"{message}; the files there before are intact") from None
    except BaseException:
        undo()
        raise
    fsync_directory(directory)


def read_bytes(
    path: Path, what: str, error: type[OneBlockError] = CheckpointError, *, limit: int | None = None
) -> bytes:
    """All bytes of the regular file ``path``; a missing path, a directory or an unreadable file is ``error``.

    Args:
        limit: refuse a file of more bytes than this, having read at most one byte more.
    """
    _check_regular(path, what, error)
    try:
        with path.open("rb") as f:
            data = f.read() if limit is None else f.read(limit + 1)
    except OSError as err:
        raise error(describe_os_error(err, path, f"read the {what}")) from None
    if limit is not None and len(data) > limit:
        raise error(f"the {what} {str(path)!r} is over the limit of {limit:,} bytes; is it the right file?")
    return data


def map_file(path: Path, what: str, error: type[OneBlockError] = CheckpointError) -> mmap.mmap | bytes:
    """The regular file ``path`` mapped into memory (copy-on-write, never written back), or ``b""`` when empty.

    Nothing is read until used: a reader checks the header's declared sizes against ``len()`` first, and the pages
    it then reads are the operating system's file cache, shared and reclaimable, not a private copy of the file.

    Raises:
        ``error``: a missing path, a directory or device, or a file that cannot be opened or mapped.
    """
    _check_regular(path, what, error)
    try:
        with path.open("rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as err:
        if isinstance(err, OSError):
            raise error(describe_os_error(err, path, f"read the {what}")) from None
        raise error(f"cannot map the {what} {str(path)!r}: {err}") from None


def prefer_huge_pages(mapped: mmap.mmap) -> None:
    """Ask that the pages of ``mapped`` be read into the file cache 2 MiB at a time and mapped whole
    (``MADV_HUGEPAGE``): for a mapping that a decoding step reads from end to end every token, where 4 KiB pages
    cost a page-table walk each. A system without the advice, or that refuses it, maps the file as before."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            mapped.madvise(advice)


def remove_leftovers(directory: Path) -> list[Path]:
    """Delete the temporary files an interrupted ``write_atomic`` left in ``directory``; returns them."""
    removed = []
    if directory.is_dir():
        for entry in directory.iterdir():
            if TMP_PATTERN.fullmatch(entry.name) and entry.is_file():
                _unlink_quietly(entry)
                removed.append(entry)
    return removed


def fsync_directory(directory: Path) -> None:
    """Make a rename durable; not possible (nor needed) on every platform."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


SPAN = 2 << 20
"""Bytes of each write but a file's last: a 2 MiB huge page's. A file cache that holds large folios makes them the
size of the aligned spans a write covers, so that a file written in whole spans can later be mapped 2 MiB at a
time (``prefer_huge_pages``), where a write ending part-way through a span leaves it in small folios."""


def _write_durably(path: Path, chunks: Iterable[bytes | memoryview]) -> None:
    """Create ``path`` (never an existing file), write ``chunks`` in whole ``SPAN``s and flush them to disk."""
    # O_EXCL: never reuse another writer's file; mode 0o666 lets the umask decide, as for a plain open().
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        pending = bytearray()  # the bytes after the last whole span written, fewer than SPAN
        for chunk in chunks:
            data = memoryview(chunk).cast("B")
            if pending:
                take = min(len(data), SPAN - len(pending))
                pending += data[:take]
                data = data[take:]
                if len(pending) == SPAN:
                    _write_all(fd, memoryview(pending))
                    pending = bytearray()
            whole = len(data) // SPAN * SPAN  # pending is empty whenever data is left
            _write_all(fd, data[:whole])
            pending += data[whole:]
        _write_all(fd, memoryview(pending))
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    data = data.cast("B")
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _check_regular(path: Path, what: str, error: type[OneBlockError]) -> None:
    """Refuse a missing ``path``, or one that is a directory or a device, naming ``what`` it should be."""
    if not path.exists():
        raise error(f"no {what} at {str(path)!r}: the file does not exist")
    if not path.is_file():
        raise error(f"{str(path)!r} is not a file (a directory or a device); a {what} is one regular file")
