"""Shared model flags: presets overridden flag by flag, and checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from oneblock.cli.main import build_parser, main
from oneblock.cli.options import config_from_args, describe
from oneblock.presets import get_preset


def _args(*argv: str):
    return build_parser().parse_args(["count", *argv])


def test_default_is_the_lesson():
    assert config_from_args(_args()) == get_preset("lesson")
    assert describe(_args()) == "lesson"


def test_flags_override_the_preset():
    cfg = config_from_args(
        _args("--preset", "gpt2", "--n-layers", "3", "--norm", "rmsnorm", "--no-bias", "--untied", "--arch", "encoder")
    )
    assert (cfg.n_layers, cfg.norm, cfg.bias, cfg.tie_embeddings, cfg.arch) == (3, "rmsnorm", False, False, "encoder")
    assert (cfg.d_model, cfg.vocab_size, cfg.activation) == (768, 50257, "gelu_tanh")  # kept from the preset
    assert describe(_args("--preset", "gpt2", "--n-layers", "3")) == "gpt2 + n_layers=3"


def test_new_d_model_gets_four_times_d_ff_unless_given():
    assert config_from_args(_args("--d-model", "32")).d_ff == 128
    assert config_from_args(_args("--d-model", "32", "--d-ff", "100")).d_ff == 100


def test_every_config_flag_reaches_the_config():
    cfg = config_from_args(
        _args(
            "--vocab-size", "37", "--d-model", "36", "--n-heads", "6", "--n-kv-heads", "3", "--max-seq-len", "9",
            "--norm-position", "post", "--activation", "relu", "--ffn", "swiglu", "--position", "rope",
            "--dropout", "0.25",
        )
    )  # fmt: skip
    assert (cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.max_seq_len) == (37, 36, 6, 3, 9)
    assert (cfg.norm_position, cfg.activation, cfg.ffn, cfg.position, cfg.dropout) == (
        "post", "relu", "swiglu", "rope", 0.25
    )  # fmt: skip


def test_bad_dropout_is_one_line(capsys):
    assert main(["count", "--dropout", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dropout must be in [0, 1); got 1.5" in err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    checkpoint_io = pytest.importorskip("oneblock.io.checkpoint")
    from oneblock.models import build_model

    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(n_layers=2, norm="rmsnorm")
    path = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    checkpoint_io.save(build_model(cfg), path)
    return path, cfg


def test_count_reads_the_checkpoint_config(checkpoint, capsys):
    path, cfg = checkpoint
    assert main(["count", "--checkpoint", str(path), "--json", "--verify"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["norm"] == cfg.norm == "rmsnorm" and data["config"]["n_layers"] == cfg.n_layers == 2
    assert data["total"] == data["measured"] and data["model"] == f"checkpoint {path}"


def test_check_and_trace_load_the_checkpoint(checkpoint, capsys):
    path, _ = checkpoint
    assert main(["check", "--checkpoint", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True
    assert main(["trace", "--checkpoint", str(path), "--json", "--seq-len", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[-1]["module"] == "lm_head" and rows[-1]["outputs"] == [[2, 3, 10]]


def test_checkpoint_refuses_config_flags(checkpoint, capsys):
    path, _ = checkpoint
    assert main(["count", "--checkpoint", str(path), "--d-model", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--checkpoint carries its own config; drop --d-model" in err


def test_missing_checkpoint_is_one_line(tmp_path, capsys):
    pytest.importorskip("oneblock.io.checkpoint")
    assert main(["check", "--checkpoint", str(tmp_path / "nope.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.safetensors" in err and "Traceback" not in err


def _broken(kind: str, good: bytes, path):
    if kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(b"not a checkpoint at all " * 20)
    elif kind == "flipped byte":
        data = bytearray(good)
        data[-7] ^= 0xFF  # inside the last tensor's data: only the stored SHA-256 can tell
        path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("kind", "text"),
    [("truncated", "is truncated"), ("empty", "is empty"), ("garbage", "is not a safetensors file"),
     ("flipped byte", "is corrupt")],
)  # fmt: skip
@pytest.mark.parametrize("command", ["count", "trace", "check"])
def test_broken_checkpoint_is_one_line(command, kind, text, checkpoint, tmp_path, capsys):
    path, _ = checkpoint
    broken = _broken(kind, path.read_bytes(), tmp_path / "broken.safetensors")
    # count reads only the header; --verify makes it load the tensors, where a flipped byte shows
    extra = ["--verify"] if command == "count" else []
    assert main([command, "--checkpoint", str(broken), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("oneblock: error: ") and text in captured.err and "Traceback" not in captured.err


def test_pickle_checkpoint_is_refused(checkpoint, tmp_path, capsys):
    path, _ = checkpoint
    from oneblock.io.checkpoint import load

    pickled = tmp_path / "model.pt"
    torch.save(load(path).state_dict(), pickled)
    assert main(["check", "--checkpoint", str(pickled)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to unpickle" in err
