"""Broken GGUF files: metadata of the wrong type, enormous sizes, damaged bytes and bad merges are oneblock errors."""

from __future__ import annotations

import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from oneblock.errors import CheckpointError, ConversionError, OneBlockError  # noqa: E402
from oneblock.io.gguf.file import field_value, open_gguf, read_metadata  # noqa: E402
from oneblock.io.gguf.load import read_gguf  # noqa: E402
from oneblock.io.gguf.tokenizer import build_tokenizer  # noqa: E402

V, C, F = 8, 4, 6


def write_gguf(path, **overrides) -> None:
    """A tiny Llama-family GGUF file (one block of a 4-wide model); ``overrides`` replace metadata values."""
    writer = gguf.GGUFWriter(str(path), "llama")
    values = {
        "llama.block_count": 1,
        "llama.context_length": 8,
        "llama.embedding_length": C,
        "llama.feed_forward_length": F,
        "llama.attention.head_count": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }
    values.update(overrides)
    for key, value in values.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint64(key, value) if value >= 2**32 else writer.add_uint32(key, value)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (V, C), "output_norm.weight": (C,), "blk.0.attn_norm.weight": (C,),
              "blk.0.ffn_norm.weight": (C,), "blk.0.attn_q.weight": (C, C), "blk.0.attn_k.weight": (C, C),
              "blk.0.attn_v.weight": (C, C), "blk.0.attn_output.weight": (C, C), "blk.0.ffn_gate.weight": (F, C),
              "blk.0.ffn_up.weight": (F, C), "blk.0.ffn_down.weight": (C, F)}  # fmt: skip
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_tiny_file_reads(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    cfg, state = read_gguf(tmp_path / "m.gguf")
    assert (cfg.n_layers, cfg.d_model, cfg.vocab_size) == (1, C, V) and len(state) == 11


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("llama.block_count", "two", r"'llama\.block_count' must be a non-negative integer; got 'two'"),
        ("llama.context_length", 1.5, r"'llama\.context_length' must be a non-negative integer; got 1\.5"),
        ("llama.attention.layer_norm_rms_epsilon", "tiny", r"must be a finite number; got 'tiny'"),
    ],
)
def test_metadata_of_the_wrong_type_is_refused_by_name(tmp_path, key, value, match):
    write_gguf(tmp_path / "m.gguf", **{key: value})
    with pytest.raises(CheckpointError, match=match):
        read_gguf(tmp_path / "m.gguf")
    with pytest.raises(CheckpointError, match=match):
        field_value(open_gguf(tmp_path / "m.gguf"), key)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("llama.block_count", 200_000, r"200,000 blocks .*over the limit"),
        ("llama.context_length", 2**40, r"GiB as float32 .*max_seq_len=1099511627776.*over the limit"),
    ],
)
def test_enormous_sizes_fail_before_allocating(tmp_path, key, value, match):
    write_gguf(tmp_path / "m.gguf", **{key: value})
    start = time.perf_counter()
    with pytest.raises(ConversionError, match=match):
        read_gguf(tmp_path / "m.gguf")
    assert time.perf_counter() - start < 2


def test_damaged_bytes_give_oneblock_errors_only(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    data = path.read_bytes()
    rng = np.random.default_rng(1)
    for position in rng.integers(0, 400, 60):  # the header and metadata
        damaged = bytearray(data)
        damaged[position] ^= 0xFF
        path.write_bytes(bytes(damaged))
        try:
            reader = open_gguf(path)
            read_metadata(reader, skip_arrays_longer_than=None)
            read_gguf(reader)
        except OneBlockError:
            pass


def test_a_merge_outside_the_vocabulary_is_refused():
    tokens = ["a", "b", "ab"]
    with pytest.raises(ConversionError, match=r"BPE merge 1 \('b' 'c'\) uses 'c', which is not in the vocabulary"):
        build_tokenizer(tokens, ["a b", "b c"], [1, 1, 1], None)
    with pytest.raises(ConversionError, match=r"uses 'ba', which is not in the vocabulary"):
        build_tokenizer(tokens, ["b a"], [1, 1, 1], None)
