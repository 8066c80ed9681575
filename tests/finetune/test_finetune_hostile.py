"""Fine-tuning data from elsewhere: JSON too deep or numbers too long, lone surrogates, files over the size limit
and held-out data that is the training data are each refused in one line (exit 2), before anything is trained."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from finetune_testing import pair_records, tiny_llama_checkpoint, write_jsonl

from oneblock.cli.main import main
from oneblock.errors import InputError
from oneblock.finetune.records import read_data

SRC = str(Path(__file__).resolve().parents[2] / "src")
DEEP = "[" * 100_000 + "]" * 100_000
LONG_NUMBER = "9" * 5000
SURROGATE = '"a\\ud800b"'  # JSON's escape for a lone high surrogate


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("base") / "base.safetensors")


def _finetune(base: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--steps", "1",
            "--seq-len", "16", "--quiet", *extra]  # fmt: skip


def _one_line(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("deep.jsonl", '{"prompt": ' + DEEP + ', "completion": "b"}\n', r"deep\.jsonl:1: the record nests"),
        ("long.jsonl", '{"prompt": "a", "completion": "b", "n": ' + LONG_NUMBER + "}\n", r"long\.jsonl:1: .*number"),
        ("deep.json", DEEP, r"deep\.json: the Alpaca file .* nests"),
        ("long.json", "[" + LONG_NUMBER + "]", r"long\.json: the Alpaca file .* number too long"),
    ],
)
def test_json_too_deep_or_too_long_is_one_line(tmp_path, base, capsys, name, content, match):
    data = tmp_path / name
    data.write_text(content)
    err = _one_line(capsys, main(_finetune(base, data, tmp_path / "r")))
    assert re.search(match, err), err
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        (
            "chat.jsonl",
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ' + SURROGATE + "}]}\n",
            r"chat\.jsonl:1: message 1's content holds a lone surrogate U\+D800 at character offset 1",
        ),
        ("pair.jsonl", '{"prompt": ' + SURROGATE + ', "completion": "b"}\n', r"pair\.jsonl:1: 'prompt' holds a lone"),
        (
            "alpaca.json",
            '[{"instruction": "a", "input": "", "output": ' + SURROGATE + "}]",
            r"alpaca\.json\[0\]: 'output' holds a lone surrogate",
        ),
    ],
)
def test_a_lone_surrogate_is_refused_by_the_text_checks(tmp_path, base, capsys, name, content, match):
    data = tmp_path / name
    data.write_text(content)
    with pytest.raises(InputError, match=match):
        read_data(data)
    err = _one_line(capsys, main(_finetune(base, data, tmp_path / "r")))
    assert "lone surrogate" in err and "internal error" not in err


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", pair_records() * 10)
    size = data.stat().st_size
    with pytest.raises(
        InputError, match=rf"d\.jsonl' is {size:,} bytes, over the limit of 100 bytes \(max_text_bytes=100\)"
    ):
        read_data(data, max_bytes=100)
    monkeypatch.setenv("ONEBLOCK_MAX_TEXT_BYTES", "200")
    for suffix in ("jsonl", "json", "txt"):
        path = tmp_path / f"big.{suffix}"
        path.write_bytes(data.read_bytes())
        with pytest.raises(InputError, match=r"over the limit of 200 bytes \(ONEBLOCK_MAX_TEXT_BYTES=200\).*raise"):
            read_data(path)
    monkeypatch.setenv("ONEBLOCK_MAX_TEXT_BYTES", str(size))
    assert len(read_data(data).records) == 40  # at the limit exactly: read


def test_a_huge_sparse_data_file_costs_no_memory(tmp_path):
    """512 MiB of zeros that occupy no disk: refused from the file's size; the peak memory barely moves."""
    path = tmp_path / "sparse.jsonl"
    with path.open("wb") as f:
        f.truncate(512 * 2**20)
    code = f"""
from oneblock.inference.process import peak_rss_bytes
from oneblock.errors import InputError
from oneblock.finetune.records import read_data
before = peak_rss_bytes()
try:
    read_data({str(path)!r})
except InputError as error:
    print(peak_rss_bytes() - before, error)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=300
    )
    grown, message = done.stdout.split(" ", 1)
    assert "over the limit of 268,435,456 bytes (the default)" in message, done.stderr
    assert int(grown) < 64 * 2**20  # the whole file would be 512 MiB, and 1 GiB once decoded


def test_eval_naming_the_training_data_is_refused(tmp_path, base, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", pair_records())
    err = _one_line(capsys, main(_finetune(base, data, tmp_path / "r", "--eval", str(data))))
    assert "--eval" in err and "holds the same data as the training data" in err and "--eval-share" in err
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(data.read_bytes())  # another name, the same bytes
    err = _one_line(capsys, main(_finetune(base, data, tmp_path / "r", "--eval", str(copy))))
    assert "holds the same data as the training data" in err
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_eval_sharing_examples_with_the_training_data_is_told(tmp_path, base, capsys):
    records = pair_records()
    data = write_jsonl(tmp_path / "d.jsonl", records)
    evaluation = write_jsonl(tmp_path / "e.jsonl", [records[2], {"prompt": "owl>", "completion": "lwo."}])
    assert main(_finetune(base, data, tmp_path / "r", "--eval", str(evaluation), "--json")) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "held-out" in line]
    assert len(notes) == 1 and "1 of 2 held-out examples (e.g. " in notes[0] and "e.jsonl:1)" in notes[0], notes
    assert "also training examples" in notes[0]


def test_held_out_share_of_duplicated_data_is_told(tmp_path, base, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", pair_records() * 3)  # every example three times
    assert main(_finetune(base, data, tmp_path / "r", "--eval-share", "0.25", "--json")) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "held-out" in line]
    assert len(notes) == 1 and re.search(r"[123] of 3 held-out examples", notes[0]), notes
