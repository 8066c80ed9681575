"""SentencePiece vocabularies in GGUF files (``tokenizer.ggml.model = "llama"``), encoded as llama.cpp encodes them.

References: llama.cpp's own expected tokenizations (``models/ggml-vocab-{llama-spm,phi-3}.gguf.inp`` and ``.out`` in
the llama-cpp-python sdist, read as ``tests/test-tokenizer-0.cpp`` reads them), llama.cpp itself (llama-cpp-python
with ``vocab_only=True``) on more texts, and ``sentencepiece`` on a small BPE model trained here and written to GGUF.
The sdist's files are missing only where ``make test`` has not unpacked it: the tests skip there, except under
``CI=true``, where they fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from converter_testing import vocab_file
from llamacpp_testing import llama_cpp_module

gguf = pytest.importorskip("gguf")

from oneblock import ConversionError  # noqa: E402
from oneblock.io.gguf.layout import read_layout  # noqa: E402
from oneblock.io.gguf.tokenizer import GGUFTokenizer  # noqa: E402
from oneblock.text.tokenizer import TextStream  # noqa: E402

SEPARATOR = "\n__ggml_vocab_test__\n"
VOCABS = ["llama-spm", "phi-3"]
TEXTS = [
    "Hello, world!",
    "  leading, inner    runs   and trailing spaces   ",
    "tabs\tand\n\nnewlines\r\n\n\n  indented",
    "emoji 😀🎉👍🏽 and flags 🇫🇷🇯🇵",
    "日本語のテキスト 中文 한국어 русский ελληνικά",
    "numbers 12345 3.14159 1,000,000 and 2024-06-01",
    "control \x00\x01\x1b bytes \x7f and rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ ǅ",
    "def f(n):\n    return n * (n - 1)  # done\n",
    "<s>special</s> <unk> in text",
    "<|user|>\nHi there<|end|>\n<|assistant|>   spaces after",
    "▁ a literal U+2581 and <0x0A> spelled out",
    "aaaaaaaaaaaaaaaaaaaaaaa",
    "",
    " ",
    "\n",
    "   ",
]


def expected_cases(path: Path) -> list[tuple[str, list[int]]]:
    """The ``(text, ids)`` pairs of ``path.inp`` and ``path.out``, cut as test-tokenizer-0.cpp cuts them."""
    raw = Path(f"{path}.inp").read_text(encoding="utf-8")
    texts = raw.split(SEPARATOR)
    if texts and texts[-1] == "":  # the file ends with the separator, which starts no further text
        texts.pop()
    lines = Path(f"{path}.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines) > 30
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=True)]


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request):
    path = vocab_file(request.param)
    return path, GGUFTokenizer.from_gguf(path)


def test_every_expected_tokenization_of_llama_cpp(vocab):
    path, ours = vocab
    for text, ids in expected_cases(path):
        assert ours.encode(text, add_bos=False) == ids, text
        assert ours.decode(ids) == text


def test_equals_llama_cpp_on_more_texts(vocab):
    path, ours = vocab
    llm = llama_cpp_module().Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for text in TEXTS:
            theirs = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
            assert ours.encode(text) == theirs, text  # with the file's BOS, special tokens matched
    finally:
        llm.close()


def test_special_ids_and_round_trips(vocab):
    path, ours = vocab
    meta = read_layout(path).metadata
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (1, meta["tokenizer.ggml.eos_token_id"], True)
    assert ours.vocab_size == len(meta["tokenizer.ggml.tokens"])
    hello = ours.encode("Hello world", add_bos=False)
    assert [ours.token(i) for i in hello] == ["▁Hello", "▁world"]
    assert ours.encode("Hello world") == [1, *hello]
    assert ours.encode("\n", add_bos=False) == [29871, 13]  # "▁" and the byte token <0x0A>
    assert ours.encode("</s>", add_bos=False) == [2]
    for text in TEXTS[:8]:
        ids = ours.encode(text, add_bos=False)
        assert ours.decode(ids) == text
        stream = TextStream(ours)  # token by token, as generation prints: the pieces join to the text
        assert "".join(stream.push([i]) for i in ids) + stream.flush() == text


def write_spm_gguf(path: Path, tokens, scores, types, **extra) -> Path:
    """A vocabulary-only GGUF file with a SentencePiece vocabulary, as llama.cpp's converter writes one."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(map(float, scores)))
    writer.add_token_types(list(map(int, types)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for key, value in extra.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        else:
            writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_without_space_prefix_equals_llama_cpp(tmp_path):
    meta = read_layout(vocab_file("llama-spm")).metadata
    columns = [meta[f"tokenizer.ggml.{key}"] for key in ("tokens", "scores", "token_type")]
    path = write_spm_gguf(tmp_path / "bare.gguf", *columns, **{"tokenizer.ggml.add_space_prefix": False})
    ours = GGUFTokenizer.from_gguf(path)
    assert ours.encode("Hello world", add_bos=False) == [10994, 3186]  # "Hello" without "▁", then "▁world"
    for text in TEXTS[:8]:  # ordinary text (a literal "▁" decodes as a space, as in llama.cpp)
        assert ours.decode(ours.encode(text, add_bos=False)) == text
    llm = llama_cpp_module().Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for text in TEXTS:
            assert ours.encode(text) == llm.tokenize(text.encode("utf-8"), add_bos=True, special=True), text
    finally:
        llm.close()


CORPUS = (
    "The quick brown fox jumps over the lazy dog. A tokenizer cuts text into pieces; the pieces it learns "
    "from this short text are the words and the parts of words that come back often: the, tok, piece, text.\n"
) * 8


def test_a_trained_sentencepiece_model_encodes_the_same(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    spec = sentencepiece.SentencePieceTrainer
    spec.train(
        sentence_iterator=iter(CORPUS.splitlines()), model_prefix=str(tmp_path / "sp"), model_type="bpe",
        vocab_size=400, byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=False, minloglevel=2, num_threads=1,
    )  # fmt: skip
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = sp.get_piece_size()
    # llama.cpp's converter: UNKNOWN 2, CONTROL 3, UNUSED 5, BYTE 6, else NORMAL 1
    types = [
        2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else 6 if sp.is_byte(i) else 1
        for i in range(n)
    ]
    pieces, scores = [sp.id_to_piece(i) for i in range(n)], [sp.get_score(i) for i in range(n)]
    path = write_spm_gguf(tmp_path / "sp.gguf", pieces, scores, types)
    ours, read = GGUFTokenizer.from_gguf(path), GGUFTokenizer.from_gguf(gguf.GGUFReader(str(path)))
    texts = [*TEXTS[:8], "pieces of text, tokenized: the quick fox", "unseen words: zebra quartz"]
    for text in texts:
        assert ours.encode(text, add_bos=False) == read.encode(text, add_bos=False) == sp.encode(text), text
        assert ours.decode(sp.encode(text)) == sp.decode(sp.encode(text)) == text


def test_bad_vocabularies_are_refused_by_name(tmp_path):
    meta = read_layout(vocab_file("llama-spm")).metadata
    tokens, scores, types = (list(meta[f"tokenizer.ggml.{key}"]) for key in ("tokens", "scores", "token_type"))
    duplicate = [*tokens[:-1], tokens[300]]
    with pytest.raises(ConversionError, match=r"holds 'et' twice \(ids 300 and 31999\)"):
        GGUFTokenizer.from_gguf(write_spm_gguf(tmp_path / "dup.gguf", duplicate, scores, types))
    no_newline = ["newline" if t == "<0x0A>" else t for t in tokens]
    with pytest.raises(ConversionError, match=r"no byte token for 1 of the 209 bytes .*first: <0x0A>"):
        GGUFTokenizer.from_gguf(write_spm_gguf(tmp_path / "bytes.gguf", no_newline, scores, types))
    with pytest.raises(ConversionError, match=r"31999 scores and 32000 token types for 32000 tokens"):
        GGUFTokenizer.from_gguf(write_spm_gguf(tmp_path / "scores.gguf", tokens, scores[:-1], types))
    prefix = {"tokenizer.ggml.add_space_prefix": "yes"}
    with pytest.raises(ConversionError, match=r"add_space_prefix must be a bool; got 'yes'"):
        GGUFTokenizer.from_gguf(write_spm_gguf(tmp_path / "prefix.gguf", tokens, scores, types, **prefix))


def test_logprob_bytes_spell_the_pieces(vocab):
    from oneblock.serve.logprob_bodies import token_bytes

    _, ours = vocab
    text = "Hello\n wörld 😀"
    ids = ours.encode(text, add_bos=False)
    assert [ours.token(i) for i in ids[:2]] == ["▁Hello", "<0x0A>"]
    assert [token_bytes(ours, i) for i in ids[:2]] == [b" Hello", b"\n"]
    assert b"".join(token_bytes(ours, i) for i in ids) == f" {text}".encode()  # the space prefix is a piece's too
    assert token_bytes(ours, 1) == b"<s>" and token_bytes(ours, ours.vocab_size) == b""


def test_a_gemma_file_from_llama_cpps_converter_equals_llama_cpp(tmp_path_factory):
    from converter_testing import made

    directory = made("gemma3")  # shared with its tests
    path = directory / "f32.gguf"
    ours = GGUFTokenizer.from_gguf(path)
    assert read_layout(path).metadata["tokenizer.ggml.add_space_prefix"] is False  # as the converter writes Gemma
    llm = llama_cpp_module().Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for text in [*TEXTS, "The quick brown fox jumps over the lazy dog."]:
            assert ours.encode(text) == llm.tokenize(text.encode("utf-8"), add_bos=True, special=True), text
    finally:
        llm.close()
