"""``load_model``: every kind of source gives the model and tokenizer the specific loaders give."""

from __future__ import annotations

import pytest
import torch

import oneblock as ob
from oneblock.errors import CheckpointError, InputError
from oneblock.inference.load import load_model
from oneblock.text.tokenizer import ByteTokenizer, Tokenizer


def test_preset_is_seeded_and_bytes_are_its_tokens():
    name = next(n for n, c in ob.PRESETS.items() if c.arch == "decoder" and c.vocab_size >= 256)
    first, second = load_model(name, seed=3), load_model(name, seed=3)
    assert first.kind == "preset" and first.source == name and isinstance(first.tokenizer, ByteTokenizer)
    state = second.model.state_dict()
    assert all(torch.equal(t, state[k]) for k, t in first.model.state_dict().items())
    assert not first.model.training and first.seconds > 0


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(vocab_size=256, d_model=32, n_heads=4, n_layers=1, max_seq_len=16))
    path = ob.save(model, tmp_path / "m.safetensors")
    loaded = load_model(path, dtype=torch.bfloat16)
    assert loaded.kind == "checkpoint" and isinstance(loaded.tokenizer, ByteTokenizer)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert all(torch.equal(t, expected[k]) for k, t in loaded.model.state_dict().items())


def test_every_tokenizer_satisfies_the_protocol():
    tok: Tokenizer = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo" and tok.chat_template is None
    with pytest.raises(InputError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unknown_source_names_the_choices(tmp_path):
    with pytest.raises(CheckpointError, match=r"'nope' is neither a file, a directory nor a preset name.*'gpt2'"):
        load_model("nope")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        bad = tmp_path / "x.gguf"
        bad.write_bytes(b"definitely not the gguf magic bytes")
        load_model(bad)


def test_peak_rss_is_the_programs_own_not_its_parents():
    """``ru_maxrss`` survives ``exec``: a small program started by a large parent must still report its own peak."""
    import subprocess
    import sys

    from oneblock.inference.process import peak_rss_bytes

    ballast = torch.ones(400 * 2**20 // 4)  # 400 MB held by this process, so its high-water mark is above that
    assert peak_rss_bytes() > 400 * 2**20
    code = "from oneblock.inference.process import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    del ballast
    assert 1_000_000 < child < 200 * 2**20
