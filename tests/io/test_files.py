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


def test_an_interruption_removes_the_temporaries(tmp_path, monkeypatch):
    def interrupted(fd, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(files, "_write_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        files.replace_files(tmp_path, {"a": [b"x"]}, what="pair")
    assert list(tmp_path.iterdir()) == []
