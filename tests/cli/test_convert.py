"""``oneblock convert``: Hugging Face directory -> oneblock checkpoint -> Hugging Face directory, exactly."""

from __future__ import annotations

import errno
import json
import os
import re

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from oneblock.cli.main import main
from oneblock.io import checkpoint

ATOL = 1e-5


def cli(*argv: str) -> int:
    """``oneblock convert ...`` in-process, through the real entry point."""
    return main(["convert", *argv])


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Noise on every tensor, so no LayerNorm keeps its ones and no bias its zeros."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    import transformers

    cfg = transformers.GPT2Config(vocab_size=101, n_positions=13, n_embd=36, n_layer=2, n_head=3, n_inner=37)
    model = _perturbed(transformers.GPT2LMHeadModel(cfg))
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=101, hidden_size=36, num_hidden_layers=2, num_attention_heads=3, intermediate_size=37,
        max_position_embeddings=13,
    )  # fmt: skip
    model = _perturbed(transformers.BertModel(cfg))
    path = tmp_path_factory.mktemp("bert")
    model.save_pretrained(path)
    return path, model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 101, (3, 7), generator=torch.Generator().manual_seed(1))


def test_gpt2_round_trip(gpt2_dir, tmp_path, capsys):
    import transformers

    src, reference = gpt2_dir
    dst = tmp_path / "gpt2.safetensors"
    assert cli(str(src), str(dst)) == 0
    assert "Hugging Face -> oneblock" in capsys.readouterr().out
    model = checkpoint.load(dst)
    assert model.lm_head.weight is model.embed.tok.weight
    with torch.no_grad():
        expected = reference(_tokens()).logits
        assert (model(_tokens()) - expected).abs().max().item() < ATOL

    back = tmp_path / "gpt2-hf"
    assert cli(str(dst), str(back), "--to-hf") == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        assert (again(_tokens()).logits - expected).abs().max().item() < ATOL


def test_bert_round_trip(bert_dir, tmp_path, capsys):
    import transformers

    src, reference = bert_dir
    dst = tmp_path / "bert.safetensors"
    assert cli(str(src), str(dst), "--json") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["arch"] == "encoder" and summary["sha256"] == checkpoint.read_info(dst).sha256
    assert summary["parameters"] == sum(p.numel() for p in reference.parameters())
    model = checkpoint.load(dst)
    assert checkpoint.read_info(dst).metadata["converted_from"] == str(src.resolve())
    with torch.no_grad():
        expected = reference(_tokens()).last_hidden_state
        assert (model(_tokens()) - expected).abs().max().item() < ATOL

    back = tmp_path / "bert-hf"
    assert cli(str(dst), str(back), "--to-hf") == 0
    again = transformers.BertModel.from_pretrained(back).eval()
    with torch.no_grad():
        assert (again(_tokens()).last_hidden_state - expected).abs().max().item() < ATOL


def test_dtype_cast(gpt2_dir, tmp_path, capsys):
    dst = tmp_path / "bf16.safetensors"
    assert cli(str(gpt2_dir[0]), str(dst), "--dtype", "bfloat16", "--json") == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    assert checkpoint.load(dst).embed.tok.weight.dtype == torch.bfloat16


def test_refuses_to_overwrite_without_force(gpt2_dir, tmp_path, capsys):
    dst = tmp_path / "taken.safetensors"
    dst.write_bytes(b"old")
    assert cli(str(gpt2_dir[0]), str(dst)) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert dst.read_bytes() == b"old"
    assert cli(str(gpt2_dir[0]), str(dst), "--force") == 0
    assert checkpoint.load(dst).config.arch == "decoder"


def test_direction_mistakes_are_explained(gpt2_dir, tmp_path, capsys):
    ckpt = tmp_path / "m.safetensors"
    assert cli(str(gpt2_dir[0]), str(ckpt)) == 0
    capsys.readouterr()
    assert cli(str(ckpt), str(tmp_path / "out")) == 2
    assert "is a file (add --to hf" in capsys.readouterr().err
    assert cli(str(gpt2_dir[0]), str(tmp_path / "out"), "--to-hf") == 2
    assert "is a directory (drop --to hf" in capsys.readouterr().err
    assert cli(str(tmp_path / "missing"), str(tmp_path / "out")) == 2
    assert "does not exist" in capsys.readouterr().err


def test_to_hf_refuses_a_pickle(tmp_path, capsys):
    torch.save({"w": torch.zeros(2)}, tmp_path / "model.pt")
    assert cli(str(tmp_path / "model.pt"), str(tmp_path / "out"), "--to-hf") == 2
    assert "refusing to unpickle" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fail_at", [1, 2])
def test_to_hf_force_on_a_full_disk_keeps_the_old_directory_whole(gpt2_dir, tmp_path, capsys, monkeypatch, fail_at):
    """The disk fills up while the new weights (1) or the new config (2) are written: the old pair stays whole."""
    from oneblock.io import files

    ckpt = tmp_path / "m.safetensors"
    assert cli(str(gpt2_dir[0]), str(ckpt)) == 0
    dst = tmp_path / "hf"
    assert cli(str(ckpt), str(dst), "--to-hf", "--dtype", "bfloat16") == 0
    (dst / "tokenizer.json").write_text("{}")  # a file of the user's, beside the model
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    capsys.readouterr()
    original, calls = files._write_all, []

    def full_disk(fd, data):
        calls.append(len(data))
        if len(calls) == fail_at:
            original(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(fd, data)

    monkeypatch.setattr(files, "_write_all", full_disk)
    code = cli(str(ckpt), str(dst), "--to-hf", "--force")
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and captured.err.count("\n") == 1
    assert re.fullmatch(
        rf"oneblock: error: cannot write '{ckpt}' as a Hugging Face model: cannot write the Hugging Face model into "
        rf"'{dst}': the disk is full \(No space left on device\); free some space and try again; the files there "
        r"before are intact\n",
        captured.err,
    )
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before  # no temporaries, nothing changed
    monkeypatch.setattr(files, "_write_all", original)
    assert cli(str(ckpt), str(dst), "--to-hf", "--force", "--json") == 0
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == "float32"
    assert (dst / "tokenizer.json").read_text() == "{}"
