"""``--context N``: generate and chat load a GGUF file for N positions, as ``load_model(context=N)`` does (llama.cpp's
``--ctx-size``): a Phi-3 file runs LongRoPE's short factors within its original context (4 in the test model) and
its long ones beyond it; a context beyond the model's is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from converter_testing import made

from oneblock.cli.main import main
from oneblock.inference.generation import generate
from oneblock.inference.load import load_model


def _greedy(capsys, path, context: int) -> list[int]:  # 2 tokens: a context of 4 holds the prompt and them
    argv = ["generate", "--model", str(path), "--prompt", "a b", "--greedy", "--ignore-eos", "--max-new-tokens", "2"]
    code = main([*argv, "--context", str(context), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0, data
    return data["new_ids"]


def test_generate_runs_the_file_for_the_context_it_is_given(capsys):
    path = made("phi3") / "f32.gguf"
    for context in (4, 64):  # the short factors, then the long ones
        loaded = load_model(path, dtype=torch.float32, context=context)
        assert loaded.model.config.max_seq_len == context
        ids = torch.tensor([loaded.tokenizer.encode("a b")])
        want = generate(loaded.model, ids, 2, greedy=True)[0, ids.shape[1] :].tolist()
        assert _greedy(capsys, path, context) == want
    with torch.no_grad():  # the two tables give the model different logits
        short = load_model(path, dtype=torch.float32, context=4).model(torch.tensor([[5, 6, 7]]))
        long = load_model(path, dtype=torch.float32, context=64).model(torch.tensor([[5, 6, 7]]))
    assert (short - long).abs().max() > 1e-3


def test_a_context_beyond_the_model_is_refused_in_one_line(capsys):
    path = made("phi3") / "f32.gguf"
    code = main(["generate", "--model", str(path), "--prompt", "a", "--context", "100000000"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "100000000" in err.replace(",", "")


def test_chat_loads_its_model_for_the_context_it_is_given(monkeypatch, tmp_path, capsys):
    from oneblock.cli import chat as chat_cli
    from oneblock.errors import InputError

    seen = {}

    def load_chat_model(path, **kwargs):
        seen.update(kwargs)
        raise InputError("loaded")  # the command stops here, in one line

    monkeypatch.setattr(chat_cli, "load_chat_model", load_chat_model)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    assert main(["chat", "--model", str(path), "--context", "512", "hello"]) == 2
    assert seen["context"] == 512 and "loaded" in capsys.readouterr().err


def _served(monkeypatch, argv: list[str]) -> torch.nn.Module:
    """The model ``oneblock serve`` would serve with ``argv`` (the server itself is not started)."""
    from oneblock.serve import server

    engines = []
    monkeypatch.setattr(server, "serve", lambda engine, **options: engines.append(engine))
    assert main(["serve", "--embedding-model", "none", "--cache-budget", "0", *argv]) == 0
    engines[0].close(grace=1)
    return engines[0].decoder.model


def _longrope_factors(model: torch.nn.Module) -> list[float]:
    """The divisors of the rotary frequencies, read back from the table at position 1: its angles are
    ``1 / (factor * theta ** (2i / Dh))``."""
    rope = model.rope
    rope.fill(2)  # the table read directly: its rows filled first
    angles = torch.atan2(rope.sin[1, : rope.d_head // 2], rope.cos[1, : rope.d_head // 2]).double()
    powers = rope.theta ** (torch.arange(0, rope.d_head, 2, dtype=torch.float64) / rope.d_head)
    return (1.0 / (angles * powers)).tolist()


def test_serve_opens_the_file_for_its_max_context(monkeypatch, capsys):
    """The test model's original context is 4: served for 64 positions it runs the long factors (2.0, 2.1, ...),
    served for 4 the short ones (1.0, 1.1, ...); beyond the model's 2048 it is refused in one line."""
    path = str(made("phi3") / "f32.gguf")
    for context, first in ((64, 2.0), (4, 1.0)):
        model = _served(monkeypatch, ["--model", path, "--max-context", str(context)])
        assert model.config.max_seq_len == context
        assert _longrope_factors(model) == pytest.approx([first + 0.1 * i for i in range(6)], rel=1e-4)
    code = main(["serve", "--model", path, "--embedding-model", "none", "--max-context", "100000"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "--max-context must be a positive integer up to the model's max_seq_len (2048); got 100000" in err


def test_serve_caps_a_learned_position_table_at_its_max_context(monkeypatch, tmp_path):
    """A GPT-2 directory keeps its table of 64 rows; --max-context caps the requests as before."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=36, n_head=3, n_layer=2, n_positions=64, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    from oneblock.serve import server

    engines = []
    monkeypatch.setattr(server, "serve", lambda engine, **options: engines.append(engine))
    argv = ["serve", "--model", str(tmp_path), "--embedding-model", "none", "--max-context", "16"]
    assert main(argv) == 0
    engines[0].close(grace=1)
    assert (engines[0].decoder.model.config.max_seq_len, engines[0].context) == (64, 16)
