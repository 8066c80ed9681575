"""A GGUF tokenizer's decoding half (``TokenPieces``) against the full tokenizer's ``decode``.

References: the ``tokenizers`` library's decoders (byte-level BPE and SentencePiece's byte fallback) on llama.cpp's
own vocabularies from the llama-cpp-python sdist (skipped where ``make test`` has not unpacked it; a failure under
``CI=true``), SmolLM2's file, and a small vocabulary with control and user-defined tokens written here.
"""

from __future__ import annotations

import gc
import random

import pytest
from converter_testing import vocab_file

gguf = pytest.importorskip("gguf")

from oneblock import InputError  # noqa: E402
from oneblock.inference.smollm2 import smollm2_gguf_path  # noqa: E402
from oneblock.io.gguf.pieces import TokenPieces  # noqa: E402
from oneblock.io.gguf.tokenizer import GGUFTokenizer  # noqa: E402
from oneblock.text.tokenizer import TextStream  # noqa: E402

VOCABS = ["llama-spm", "phi-3", "qwen2", "llama-bpe", "gpt-2"]
TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces   ",
    "tabs\tand\n\nnewlines\r\n",
    "emoji 😀🎉👍🏽 日本語 русский",
    "control \x00\x01\x1b bytes \x7f",
    "<s>special</s> <|im_start|>user\nhi<|im_end|>",
    "",
    " ",
]


def sdist_vocab(name: str) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(vocab_file(name))


@pytest.fixture(scope="module", params=[*VOCABS, "smollm2", "written"])
def pair(request, tmp_path_factory):
    if request.param == "smollm2":
        full = GGUFTokenizer.from_gguf(smollm2_gguf_path())
    elif request.param == "written":
        from test_gguf_tokenizer import write_tokenizer_gguf  # control tokens and a user-defined <think>

        full = GGUFTokenizer.from_gguf(write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "tok.gguf"))
    else:
        full = sdist_vocab(request.param)
    return full, TokenPieces.of(full)


def random_ids(rng: random.Random, vocab: int) -> list[int]:
    """Up to 12 ids, a third of them from the first 300 (bytes, byte pieces and control tokens live there)."""
    size = rng.randint(1, 12)
    return [rng.randrange(vocab) if rng.random() < 0.67 else rng.randrange(min(vocab, 300)) for _ in range(size)]


def test_random_ids_decode_as_the_full_tokenizer_decodes(pair):
    full, pieces = pair
    assert pieces.vocab_size == full.vocab_size
    rng = random.Random(0)
    for _ in range(1500):
        ids = random_ids(rng, full.vocab_size)
        for skip in (False, True):
            assert pieces.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip), ids


def test_texts_come_back_and_stream_as_with_the_full_tokenizer(pair):
    full, pieces = pair
    for text in TEXTS:
        ids = full.encode(text)
        assert pieces.decode(ids) == full.decode(ids)
        streamed = [TextStream(t) for t in (full, pieces)]
        for i in ids:
            assert streamed[0].push([i]) == streamed[1].push([i]), text
        assert streamed[0].flush() == streamed[1].flush()


def test_the_stops_and_names_are_the_tokenizer_s(pair):
    full, pieces = pair
    assert (pieces.stop_ids, pieces.eos_id, pieces.bos_id, pieces.name) == (
        full.stop_ids, full.eos_id, full.bos_id, full.name,
    )  # fmt: skip


def test_bad_ids_and_encoding_are_refused_by_name(pair):
    full, pieces = pair
    with pytest.raises(InputError, match=rf"outside \[0, {full.vocab_size}\)"):
        pieces.decode([0, full.vocab_size])
    with pytest.raises(InputError, match="-1"):
        pieces.decode([-1])
    with pytest.raises(InputError, match="decoding only"):
        pieces.encode("hi")


def test_the_pieces_outlive_the_full_tokenizer_in_a_fraction_of_its_size():
    full = sdist_vocab("qwen2")
    ids = full.encode("The pieces decode this sentence alone. 😀")
    text = full.decode(ids)
    pieces = TokenPieces.of(full)
    del full
    gc.collect()
    assert pieces.decode(ids) == text
    assert len(pieces.blob) + pieces.offsets.nbytes + pieces.special.nbytes < 3_000_000  # 151,936 ids
