"""``oneblock generate``: streamed text equal to the library's, tokenizers found beside checkpoints, one-line errors."""

from __future__ import annotations

import io
import json
import os
import re

import pytest
import torch
from cli_testing import one_line_error

import oneblock as ob
from oneblock.cli.main import main
from oneblock.inference.generation import generate
from oneblock.io.checkpoint import save
from oneblock.text.tokenizer import ByteTokenizer

PROMPT = "Once upon a time"


pytestmark = pytest.mark.usefixtures("one_thread")  # small models run fastest on one thread


def _perturbed(model):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def byte_checkpoint(tmp_path_factory):
    """A byte-level decoder (vocab 256, no tokenizer file): the byte fallback applies."""
    torch.manual_seed(0)
    cfg = ob.ModelConfig(vocab_size=256, d_model=32, n_heads=4, n_layers=2, max_seq_len=48)
    model = _perturbed(ob.build_model(cfg))
    path = tmp_path_factory.mktemp("bytes") / "model.safetensors"
    save(model, path)
    return path, model


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A small transformers GPT-2 saved with save_pretrained, with a byte-level BPE tokenizer.json beside it."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=300, n_embd=36, n_head=3, n_layer=2, n_positions=64)
    torch.manual_seed(0)
    hf = _perturbed(transformers.GPT2LMHeadModel(cfg))
    path = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(path)
    tokenizer = _train_bpe(300)
    tokenizer.save(str(path / "tokenizer.json"))
    return path, hf, tokenizer


def _train_bpe(vocab_size: int):
    """A small GPT-2-style byte-level BPE with ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(["the cat sat on the mat", "the dog ate the log", "a cat and a dog"] * 20, trainer)
    return tok


def test_greedy_text_equals_the_library(byte_checkpoint, capsys):
    path, model = byte_checkpoint
    code = main(["generate", "--checkpoint", str(path), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "20"])
    assert code == 0
    out = capsys.readouterr().out
    ids = generate(model, ByteTokenizer().encode(PROMPT), 20, greedy=True)
    assert out == ByteTokenizer().decode(ids.tolist()) + "\n"


def test_tokens_are_written_as_they_come(byte_checkpoint, monkeypatch):
    path, _ = byte_checkpoint
    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return super().write(text)

    monkeypatch.setattr("sys.stdout", Recorder())
    argv = ["generate", "--checkpoint", str(path), "--prompt", "ab", "--max-new-tokens", "12", "--seed", "3"]
    assert main([*argv, "--no-echo", "--temperature", "0.7", "--top-k", "5"]) == 0
    assert len([w for w in writes if w]) >= 3  # not one write at the end
    assert not writes[0].startswith("ab")  # --no-echo


def test_seeded_sampling_repeats(byte_checkpoint, capsys):
    path, _ = byte_checkpoint
    argv = ["generate", "--checkpoint", str(path), "--prompt", "xyz", "--seed", "5", "--top-p", "0.9", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert (second["new_ids"], second["completion"]) == (first["new_ids"], first["completion"])
    assert first["prompt_ids"] == list(b"xyz") and len(first["new_ids"]) == 48 - 3 and first["tokenizer"] == "bytes"


def test_hugging_face_directory_with_its_tokenizer(gpt2_dir, capsys):
    path, hf, tokenizer = gpt2_dir
    argv = ["generate", "--checkpoint", str(path), "--prompt", "the cat", "--greedy", "--max-new-tokens", "15"]
    assert main([*argv, "--json", "--ignore-eos"]) == 0
    data = json.loads(capsys.readouterr().out)
    prompt = tokenizer.encode("the cat").ids
    assert data["prompt_ids"] == prompt and data["tokenizer"].endswith("tokenizer.json")
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=15, do_sample=False, eos_token_id=None)
    assert data["new_ids"] == theirs[0, len(prompt) :].tolist()
    assert data["completion"] == tokenizer.decode(data["new_ids"])
    assert main([*argv, "--ignore-eos"]) == 0
    assert capsys.readouterr().out == "the cat" + data["completion"] + "\n"


def test_int8_and_stats(byte_checkpoint, capsys):
    path, _ = byte_checkpoint
    argv = ["generate", "--checkpoint", str(path), "--prompt", PROMPT, "--greedy", "--int8", "--stats"]
    assert main([*argv, "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(PROMPT) and "8 tokens in" in captured.err and "tokens/s" in captured.err


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--top-k", "0"], "top_k must be a positive integer"),
        (["--top-p", "1.5"], r"top_p must lie in \(0, 1\]"),
        (["--max-new-tokens", "-3"], "--max-new-tokens must be >= 0"),
        (["--max-new-tokens", "40"], r"16 tokens\) plus 40 new tokens exceeds the model's context of 48 tokens; pass"),
        (["--max-new-tokens", "48"], r"--max-new-tokens \(48\) must be below the model's context of 48 tokens"),
        (["--tokenizer", "/nonexistent/tokenizer.json"], "does not exist"),
    ],
)
def test_bad_flags_are_one_line_errors(byte_checkpoint, capsys, flags, match):
    path, _ = byte_checkpoint
    code = main(["generate", "--checkpoint", str(path), "--prompt", PROMPT, *flags])
    assert re.search(match, one_line_error(capsys, code, empty_stdout=False))


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("caf\udcff", "--prompt is not valid UTF-8: byte 0xff at character offset 3"),
        ("a\ud800b", r"--prompt holds a lone surrogate U\+D800 at character offset 1"),
    ],
)
def test_a_prompt_that_is_not_unicode_is_one_line(byte_checkpoint, capsys, prompt, match):
    path, _ = byte_checkpoint
    code = main(["generate", "--checkpoint", str(path), "--prompt", prompt])
    assert re.search(match, one_line_error(capsys, code, empty_stdout=False))


def test_missing_checkpoint_and_crop(byte_checkpoint, tmp_path, capsys):
    code = main(["generate", "--checkpoint", str(tmp_path / "nope.safetensors"), "--prompt", "x"])
    assert "does not exist" in one_line_error(capsys, code, empty_stdout=False)
    path, model = byte_checkpoint
    long = "y" * 40
    assert main(["generate", "--checkpoint", str(path), "--prompt", long, "--greedy", "--crop", "--no-echo"]) == 0
    out = capsys.readouterr().out
    ids = generate(model, list(long.encode()), 47, greedy=True, crop=True)  # the default: 50 capped to 48 - 1
    assert out == ByteTokenizer().decode(ids[len(long) :].tolist()) + "\n"


def test_json_reports_load_first_token_decode_rate_and_memory(byte_checkpoint, capsys):
    path, _ = byte_checkpoint
    argv = ["generate", "--checkpoint", str(path), "--prompt", "ab", "--greedy", "--max-new-tokens", "6", "--json"]
    argv += ["--cache-dtype", "bfloat16"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["new_ids"]) == 6
    assert 0 < data["load_seconds"] < data["first_token_seconds"]  # first token counted from process start
    assert data["decode_tokens_per_second"] > 0 and data["peak_rss_bytes"] > 10_000_000


def test_a_float16_cache_decodes_natively_as_the_library_does(byte_checkpoint, capsys):
    import torch

    path, model = byte_checkpoint
    argv = ["generate", "--checkpoint", str(path), "--prompt", "abc", "--greedy", "--max-new-tokens", "8", "--json"]
    assert main([*argv, "--cache-dtype", "float16"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["decode_step"] == "native"
    want = generate(model, list(b"abc"), 8, greedy=True, cache_dtype=torch.float16)
    assert data["new_ids"] == want[3:].tolist()


def test_a_fifo_model_is_told_as_not_a_regular_file(tmp_path, capsys):
    os.mkfifo(tmp_path / "m.gguf")
    code = main(["generate", "--model", str(tmp_path / "m.gguf"), "--prompt", "x"])
    line = one_line_error(capsys, code, empty_stdout=False)
    assert "'.gguf' is a FIFO" not in line and "m.gguf' is a FIFO (named pipe), not a regular file" in line
    assert "does not exist" not in line


def test_a_chat_model_stops_at_its_end_of_turn_and_json_says_why(tmp_path, capsys):
    from family_testing import LLAMA3_VOCAB, write_family_gguf

    path = write_family_gguf(tmp_path, LLAMA3_VOCAB)  # eos <|end_of_text|> (257), eot <|eot_id|> (263)
    prompt = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    argv = ["generate", "--model", str(path), "--prompt", prompt, "--greedy", "--max-new-tokens", "10", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_ids"] == [ord("H"), ord("i"), ord("!"), 263]
    assert (out["completion"], out["finish_reason"]) == ("Hi!<|eot_id|>", "stop")
    assert main([*argv, "--ignore-eos"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completion"] == "Hi!<|eot_id|>\nHi!<|eot_id|>\n" and out["finish_reason"] == "length"
