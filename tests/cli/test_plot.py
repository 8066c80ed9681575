"""``oneblock plot``: the PNGs it writes, and the one-line error when matplotlib is missing."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from oneblock.cli.main import main

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_writes_both_pngs(tmp_path, capsys):
    out = tmp_path / "figs"
    assert main(["plot", "--preset", "tiny", "--tokens", "1", "2", "3", "4", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tokens"] == [1, 2, 3, 4]
    assert data["files"] == [str(out / "attention.png"), str(out / "parameters.png")]
    for name in data["files"]:
        with open(name, "rb") as f:
            head = f.read()
        assert head.startswith(PNG_MAGIC) and len(head) > 10_000
        width, height = struct.unpack(">II", head[16:24])  # the IHDR chunk follows the magic
        assert width > 500 and height > 300


def test_table_output_names_the_files(tmp_path, capsys):
    assert main(["plot", "--preset", "tiny", "--n-heads", "1", "--seq-len", "3", "--out", str(tmp_path)]) == 0
    assert f"wrote {tmp_path / 'attention.png'}" in capsys.readouterr().out


def test_missing_matplotlib_is_one_line(monkeypatch, tmp_path, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["plot", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "pip install 'oneblock[plot]'" in captured.err
    assert not (tmp_path / "attention.png").exists()


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--tokens", "10"], "--tokens [10] lie outside the vocabulary [0, 10)"),
        (["--layer", "3"], "layer 3 is out of range: the model has blocks 0..0"),
        (["--init-std", "0"], "--init-std must be positive; got 0.0"),
    ],
)
def test_errors(argv, text, tmp_path, capsys):
    assert main(["plot", "--preset", "tiny", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and text in err, err


def test_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert main(["plot", "--preset", "tiny", "--out", str(blocker / "plots")]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("oneblock: error: ")
    assert "Traceback" not in captured.err


def test_encoder_decoder_and_checkpoint(tmp_path, capsys):
    from oneblock.io.checkpoint import save
    from oneblock.models import build_model
    from oneblock.presets import get_preset

    path = tmp_path / "ed.safetensors"
    save(build_model(get_preset("tiny").replace(arch="encoder-decoder")), path)
    assert main(["plot", "--checkpoint", str(path), "--seq-len", "5", "--out", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == f"checkpoint {path}" and len(data["tokens"]) == 5
    assert all(Path(f).read_bytes().startswith(PNG_MAGIC) for f in data["files"])
