"""``replace_files``: several files of a directory replaced together, or none of them when a write fails."""

from __future__ import annotations

import errno
import os

import pytest

from oneblock.errors import ConversionError
from oneblock.io import files


def test_all_files_are_replaced_and_others_kept(tmp_path):
    (tmp_path / "a").write_bytes(b"old a")
    (tmp_path / "keep").write_bytes(b"mine")
    files.replace_files(tmp_path, {"a": [b"new ", b"a"], "b": [memoryview(b"new b")]}, what="pair")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == {"a": b"new a", "b": b"new b", "keep": b"mine"}
    files.replace_files(tmp_path / "fresh" / "dir", {"c": [b"c"]}, what="pair")
    assert (tmp_path / "fresh" / "dir" / "c").read_bytes() == b"c"


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_failed_write_leaves_every_file_as_it_was(tmp_path, monkeypatch, fail_at):
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"old " + name.encode())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    original, calls = files._write_all, []

    def full_disk(fd, data):
        calls.append(1)
        if len(calls) == fail_at:
            original(fd, data[:1])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(fd, data)

    monkeypatch.setattr(files, "_write_all", full_disk)
    with pytest.raises(ConversionError, match=r"cannot write the pair into '.*': the disk is full .*; the files there "
                                              r"before are intact$"):  # fmt: skip
        files.replace_files(tmp_path, {"a": [b"new a"], "b": [b"new", b" b"]}, what="pair", error=ConversionError)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_interruption_removes_the_temporaries_and_a_directory_made_for_them(tmp_path, monkeypatch):
    def interrupted(fd, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(files, "_write_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        files.replace_files(tmp_path, {"a": [b"x"]}, what="pair")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt):
        files.replace_files(tmp_path / "new", {"a": [b"x"]}, what="pair")
    assert list(tmp_path.iterdir()) == []


def _specials(tmp_path):
    """A FIFO, a symbolic link to it, and a directory: the destinations no writer may replace."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "to-fifo").symlink_to(fifo)
    (tmp_path / "dir").mkdir()
    return {"fifo": fifo, "to-fifo": tmp_path / "to-fifo", "dir": tmp_path / "dir"}


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("fifo", r"'.*fifo': it is a FIFO \(named pipe\), not a regular file; give the path of a regular file"),
        ("to-fifo", r"'.*to-fifo': it is a FIFO \(named pipe\) \(through a symbolic link\), not a regular file"),
        ("dir", r"'.*dir': it is a directory, not a regular file; give a file name inside it"),
    ],
)
def test_every_writer_refuses_a_destination_that_is_not_a_regular_file(tmp_path, name, match):
    target = _specials(tmp_path)[name]
    with pytest.raises(ConversionError, match=rf"cannot write the thing to {match}"):
        files.write_atomic(target, [b"x"], what="thing", error=ConversionError)
    with pytest.raises(ConversionError, match=rf"cannot write the thing to {match}"):
        files.replace_files(tmp_path, {target.name: [b"x"]}, what="thing", error=ConversionError)
    assert (tmp_path / "fifo").is_fifo() and (tmp_path / "to-fifo").is_symlink() and (tmp_path / "dir").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "fifo", "to-fifo"]  # no temporary left


def test_a_regular_file_a_link_to_one_and_a_dangling_link_are_written(tmp_path):
    (tmp_path / "old").write_bytes(b"old")
    (tmp_path / "link").symlink_to(tmp_path / "old")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("old", "link", "dangling", "new"):
        files.write_atomic(tmp_path / name, [b"new " + name.encode()], what="thing")
        assert (tmp_path / name).read_bytes() == b"new " + name.encode()
        assert not (tmp_path / name).is_symlink()  # the link is replaced, never written through
    assert (tmp_path / "old").read_bytes() == b"new old"


def test_a_file_is_written_in_whole_huge_page_spans_but_its_last_write(tmp_path, monkeypatch):
    """Chunks of any size (a matrix, its padding to 4 KiB, the next matrix) reach the file in writes of whole
    2 MiB spans at span-aligned offsets, which a file cache with large folios keeps as 2 MiB pages."""
    span = files.SPAN
    chunks = [b"h" * 100, bytes(4096 - 100), os.urandom(3 * span + 12345), b"", bytes(5), os.urandom(span), b"t" * 7]
    writes: list[tuple[int, int]] = []
    write = os.write

    def recorded(fd: int, data) -> int:
        n = write(fd, data)
        writes.append((os.lseek(fd, 0, os.SEEK_CUR) - n, n))
        return n

    monkeypatch.setattr(os, "write", recorded)
    path = tmp_path / "out.bin"
    files.write_atomic(path, chunks, what="test file")
    monkeypatch.undo()
    assert path.read_bytes() == b"".join(chunks)
    total = sum(len(c) for c in chunks)
    assert sum(n for _, n in writes) == total
    assert all(at % span == 0 for at, _ in writes)
    assert all(n % span == 0 for _, n in writes[:-1]) and writes[-1] == (total // span * span, total % span)
