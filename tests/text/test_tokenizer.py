"""Tokenizers for generation: bytes as the fallback, byte-level BPE files found beside a checkpoint, streaming."""

from __future__ import annotations

import json
import random

import pytest

from oneblock.errors import CheckpointError, InputError
from oneblock.text.tokenizer import BPETokenizer, ByteTokenizer, TextStream, find_tokenizer, load_tokenizer

tokenizers = pytest.importorskip("tokenizers")

CORPUS = ["the cat sat on the mat", "the dog sat on the log", "naïve café — déjà vu", "12 + 30 = 42"] * 20


def train_bpe(vocab_size: int = 300):
    """A small GPT-2-style byte-level BPE trained here, with ``<|endoftext|>`` as its first id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def test_bytes_round_trip_any_text():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓ 🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256 and tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode([0xF0, 0x9F]) == "\ufffd"  # half an emoji decodes to the replacement character
    with pytest.raises(InputError, match=r"byte token ids must lie in \[0, 256\); got \[300\]"):
        tok.decode([65, 300])
    with pytest.raises(InputError, match="encode expects a str"):
        tok.encode(b"bytes")


def test_stream_holds_back_partial_characters():
    stream = TextStream(ByteTokenizer())
    pieces = [stream.push([b]) for b in "a🙂é".encode()]
    assert pieces == ["a", "", "", "", "🙂", "", "é"]
    assert "".join(pieces) == "a🙂é"
    stream.push([0xC3])  # a dangling lead byte comes out on flush
    assert stream.flush() == "\ufffd"


def test_bpe_from_tokenizer_json_beside_a_checkpoint(tmp_path):
    trained = train_bpe()
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"")  # only its location matters here
    assert find_tokenizer(checkpoint) is None
    assert isinstance(load_tokenizer(checkpoint), ByteTokenizer)
    trained.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(checkpoint, vocab_size=1000)
    assert isinstance(tok, BPETokenizer) and tok.eos_id == 0 and tok.vocab_size == trained.get_vocab_size()
    text = "the cat sat on the log, café"
    ids = tok.encode(text)
    assert ids == trained.encode(text).ids and len(ids) < len(text.encode())
    assert tok.decode(ids) == text
    stream = TextStream(tok)
    assert "".join(stream.push([i]) for i in ids) + stream.flush() == text
    # A <stem>.tokenizer.json wins over the shared tokenizer.json; a directory is searched inside.
    (tmp_path / "model.tokenizer.json").write_text((tmp_path / "tokenizer.json").read_text())
    assert find_tokenizer(checkpoint) == tmp_path / "model.tokenizer.json"
    assert find_tokenizer(tmp_path) == tmp_path / "tokenizer.json"


def test_bpe_from_gpt2_vocab_and_merges(tmp_path):
    trained = train_bpe()
    state = json.loads(trained.to_str())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(state["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = load_tokenizer(tmp_path)
    text = "the dog sat on the mat"
    assert tok.encode(text) == trained.encode(text).ids and tok.decode(tok.encode(text)) == text
    (tmp_path / "merges.txt").unlink()
    with pytest.raises(CheckpointError, match=r"needs 'merges.txt' beside it"):
        load_tokenizer(tmp_path)


def test_a_tokenizer_too_large_for_the_model_is_refused(tmp_path):
    train_bpe().save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(InputError, match=r"has \d{3} ids but the model's vocab_size is 101; this tokenizer belongs"):
        load_tokenizer(tmp_path, vocab_size=101)
    with pytest.raises(InputError, match=r"\(bytes\) has 256 ids.*smaller than 256 ids"):
        load_tokenizer(tmp_path / "empty" / "model.safetensors", vocab_size=101)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tokenizer(tokenizer=tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"is not a readable tokenizer\.json"):
        load_tokenizer(tokenizer=tmp_path / "broken.json")


class CountingBytes(ByteTokenizer):
    """A byte tokenizer that records how many ids each decode call reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []

    def decode(self, ids):
        self.lengths.append(len(ids))
        return super().decode(ids)


def test_streaming_decodes_a_window_not_everything_so_far():
    tokenizer = CountingBytes()
    stream = TextStream(tokenizer)
    text = "caf\u00e9 \U0001f642 " * 500  # 3,500 characters, 6,000 bytes
    pieces = [stream.push([b]) for b in text.encode()] + [stream.flush()]
    assert "".join(pieces) == text
    assert max(tokenizer.lengths) <= TextStream.HOLD + 1  # the window, never the whole history


@pytest.mark.parametrize("seed", range(5))
def test_streamed_text_equals_the_full_decode_with_split_characters(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", " ", "\u00e9", "\u20ac", "\U0001f642", "\n"]) for _ in range(300))
    data = bytearray(text.encode())
    stream = TextStream(ByteTokenizer())
    pieces, i = [], 0
    while i < len(data):  # tokens of 1 to 3 bytes, cutting characters anywhere
        n = rng.randint(1, 3)
        pieces.append(stream.push(list(data[i : i + n])))
        i += n
    pieces.append(stream.flush())
    assert "".join(pieces) == bytes(data).decode() == text
    assert all(not piece.endswith("\ufffd") for piece in pieces)


@pytest.mark.parametrize("seed", range(5))
def test_invalid_bytes_do_not_hold_the_stream_or_lose_characters(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", "\u00e9", "\u20ac", "\U0001f642"]) for _ in range(200))
    data = bytearray(text.encode())
    for _ in range(10):  # stray continuation and lead bytes a model may sample
        data.insert(rng.randrange(len(data)), rng.choice([0x80, 0xBF, 0xE2, 0xF0, 0xFF]))
    tokenizer = CountingBytes()
    stream = TextStream(tokenizer)
    pieces = [stream.push([b]) for b in data] + [stream.flush()]
    full = bytes(data).decode("utf-8", errors="replace")
    # Every valid character comes out, in order; only the count of U+FFFD may differ at a split invalid sequence.
    assert "".join(pieces).replace("\ufffd", "") == full.replace("\ufffd", "")
    assert max(tokenizer.lengths) <= 2 * TextStream.HOLD + 2


def test_streamed_bpe_text_equals_the_full_decode(tmp_path):
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    hf = Tokenizer(BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    corpus = ["caf\u00e9 na\u00efve \u20ac5 \U0001f642 stra\u00dfe"] * 20
    hf.train_from_iterator(corpus, BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = BPETokenizer(hf, name="trained")
    text = "\u00e9\u20ac \U0001f642\U0001f642 na\u00efve caf\u00e9 \u00df" * 30
    ids = tok.encode(text)
    stream = TextStream(tok)
    assert "".join(stream.push([i]) for i in ids) + stream.flush() == tok.decode(ids) == text


def test_a_model_with_more_than_256_ids_and_no_tokenizer_decodes_the_extra_ids_as_replacement(tmp_path):
    tok = load_tokenizer(tmp_path / "model.safetensors", vocab_size=300)
    assert tok.vocab_size == 300
    ids = [72, 105, 271, 0xC3, 299, 0xA9, 33]  # an extra id even inside a character
    assert (
        tok.decode(ids)
        == "Hi\ufffd\ufffd\ufffd\ufffd!"
        == bytes([72, 105, 0xFF, 0xC3, 0xFF, 0xA9, 33]).decode(errors="replace")
    )
    stream = TextStream(tok)
    assert "".join(stream.push([i]) for i in ids) + stream.flush() == tok.decode(ids)
    with pytest.raises(InputError, match=r"byte token ids must lie in \[0, 300\); got \[300\]"):
        tok.decode([1, 300])
    with pytest.raises(InputError, match="a byte tokenizer has at least 256 ids; got vocab_size=10"):
        ByteTokenizer(10)
