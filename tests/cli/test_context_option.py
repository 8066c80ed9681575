"""``--context N``: generate and chat load a GGUF file for N positions, as ``load_model(context=N)`` does (llama.cpp's
``--ctx-size``): a Phi-3 file runs LongRoPE's short factors within its original context (4 in the test model) and
its long ones beyond it; a context beyond the model's is refused in one line."""

from __future__ import annotations

import json

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
