"""A peft adapter from elsewhere: its config goes through the bounded JSON reader, and its weights are mapped and
their header checked before the body is read, as checkpoints are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oneblock import ModelConfig, build_model
from oneblock.adapters.apply import apply_lora, lora_modules
from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.peft import CONFIG_NAME, WEIGHTS_NAME, load_adapter, save_adapter
from oneblock.cli.main import main
from oneblock.errors import CheckpointError
from oneblock.io import files
from oneblock.io.checkpoint import load, save

SRC = str(Path(__file__).resolve().parents[2] / "src")
LLAMA = ModelConfig(
    vocab_size=260, d_model=36, n_heads=3, n_kv_heads=1, n_layers=2, d_ff=37, max_seq_len=32, norm="rmsnorm",
    ffn="swiglu", position="rope", bias=False, activation="silu", tie_embeddings=False,
)  # fmt: skip
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


@pytest.fixture
def adapter(tmp_path):
    """(checkpoint, adapter directory written by oneblock, the adapted model)."""
    torch.manual_seed(0)
    model = build_model(LLAMA).eval()
    save(model, tmp_path / "model.safetensors")
    apply_lora(model, LoraConfig(rank=2, alpha=4.0))
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.normal_()
    save_adapter(model, tmp_path / "adapter", cfg=LoraConfig(rank=2, alpha=4.0))
    return tmp_path / "model.safetensors", tmp_path / "adapter", model


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"peft_type": "LORA", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", r"nests arrays or objects too deeply"),
        ('{"peft_type": "LORA", "r": ' + "7" * 5000 + "}", r"holds a number too long to read"),
    ],
)
def test_a_hostile_config_is_one_line_exit_2(adapter, capsys, text, match):
    checkpoint, directory, _ = adapter
    (directory / CONFIG_NAME).write_text(text)
    with pytest.raises(CheckpointError, match=r"adapter_config\.json' " + match):
        load_adapter(build_model(LLAMA), directory)
    code = main(["generate", "--model", str(checkpoint), "--adapter", str(directory), "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "internal error" not in err, err
    assert "adapter_config.json" in err


def test_the_weights_are_mapped_not_read(adapter, monkeypatch):
    checkpoint, directory, model = adapter
    real = files.read_bytes

    def refuse(path, *args, **kwargs):
        if Path(path).name == WEIGHTS_NAME:
            raise AssertionError("the adapter weights were read into memory instead of mapped")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(files, "read_bytes", refuse)
    monkeypatch.setattr("oneblock.adapters.peft.read_bytes", refuse)
    fresh = load(checkpoint)
    load_adapter(fresh, directory)
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(fresh(ids), model(ids))


def test_a_huge_sparse_weights_file_is_refused_from_its_header(tmp_path):
    """768 MiB of zeros that occupy no disk: refused by the header, and the peak memory barely moves."""
    directory = tmp_path / "adapter"
    directory.mkdir()
    (directory / CONFIG_NAME).write_text(json.dumps(CONFIG))
    with (directory / WEIGHTS_NAME).open("wb") as f:
        f.truncate(768 * 2**20)
    code = f"""
from oneblock import ModelConfig, build_model
from oneblock.errors import CheckpointError
from oneblock.inference.process import peak_rss_bytes
from oneblock.adapters.peft import load_adapter
model = build_model(ModelConfig(**{LLAMA.to_dict()!r}))
before = peak_rss_bytes()
try:
    load_adapter(model, {str(directory)!r})
except CheckpointError as error:
    print(peak_rss_bytes() - before, error)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=300
    )
    grown, message = done.stdout.split(" ", 1)
    assert "adapter_model.safetensors" in message and "not JSON" in message, done.stderr
    assert int(grown) < 64 * 2**20  # reading it whole cost 768 MiB and more
