"""A training text is read up to a limit: a huge file is refused from its size, a device that never ends (such as
``/dev/zero``) after the limit's bytes, and a pipe under the limit is read whole."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from oneblock.errors import InputError
from oneblock.io import limits
from oneblock.train import data


def test_a_file_over_the_limit_is_refused_from_its_size(tmp_path, monkeypatch):
    path = tmp_path / "big.txt"
    path.write_bytes(b"a" * 20)
    with pytest.raises(InputError, match=r"'.*big\.txt' is 20 bytes, over the limit of 10 bytes \(max_text_bytes=10\)"):
        data.read_text(path, max_bytes=10)
    assert data.read_text(path, max_bytes=20) == b"a" * 20
    monkeypatch.setenv(limits.ENV_MAX_TEXT_BYTES, "19")
    with pytest.raises(InputError, match=r"over the limit of 19 bytes \(ONEBLOCK_MAX_TEXT_BYTES=19\); train on a pa"):
        data.read_text(path)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero on this system")
def test_a_device_that_never_ends_is_refused_after_the_limit(tmp_path, capsys, monkeypatch):
    from oneblock.cli.main import main

    with pytest.raises(InputError, match=r"text file '/dev/zero' goes on past the limit of 1,000 bytes"):
        data.read_text("/dev/zero", max_bytes=1000)
    monkeypatch.setenv(limits.ENV_MAX_TEXT_BYTES, "4096")
    code = main(["train", "--steps", "1", "--out", str(tmp_path / "run"), "--text", "/dev/zero", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("oneblock: error: ")
    assert "'/dev/zero' goes on past the limit of 4,096 bytes (ONEBLOCK_MAX_TEXT_BYTES=4096)" in err[0]


@pytest.mark.skipif(sys.platform == "win32", reason="named pipes are POSIX")
def test_a_pipe_under_the_limit_is_read_whole(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    text = "héllo pipe\n".encode() * 100

    def write() -> None:
        with open(fifo, "wb") as f:
            f.write(text)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert data.read_text(fifo, max_bytes=len(text)) == text
    finally:
        writer.join(timeout=10)
