"""GGUF layouts llama.cpp's reader refuses are refused here too, by name; every other damage is a oneblock error.

The files are written byte by byte (``gguf_bytes``): duplicate keys and names, tensors that overlap, alias or
start off alignment, impossible alignments, nested arrays, zero dimensions, partial quantization blocks, and a
file truncated after it was mapped.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf_bytes import (
    ARRAY,
    F32,
    GGML_F32,
    GGML_Q4_0,
    I32,
    STRING,
    U32,
    gguf_file,
    kv,
    string,
    strings,
    two_tensors,
    u32,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oneblock.errors import CheckpointError, OneBlockError
from oneblock.io import limits
from oneblock.io.gguf.cursor import MAX_ARRAY_DEPTH
from oneblock.io.gguf.dequant import dequantize
from oneblock.io.gguf.layout import read_layout


def _read(tmp_path, data: bytes, **kwargs):
    path = tmp_path / "t.gguf"
    path.write_bytes(data)
    return read_layout(path, **kwargs)


def test_a_well_formed_file_reads_its_values(tmp_path):
    for align in (32, 64):
        kvs = [u32("general.alignment", align)] if align != 32 else []
        layout = _read(tmp_path, two_tensors(align, kvs, align))
        assert torch.equal(dequantize(layout.tensors["a"]), torch.ones(4))
        assert torch.equal(dequantize(layout.tensors["b"]), torch.full((4,), 2.0))


@pytest.mark.parametrize(
    ("offset", "match"),
    [
        (0, r"tensor 'b' starts at data offset 0, expected 32 \(the aligned end of the tensor before it\)"),
        (8, r"tensor 'b' starts at data offset 8, expected 32"),  # overlaps 'a'
        (33, r"tensor 'b' starts at data offset 33, expected 32"),  # one byte off alignment
        (64, r"tensor 'b' starts at data offset 64, expected 32"),  # a gap
    ],
)
def test_tensors_that_alias_overlap_or_stray_from_alignment_are_refused(tmp_path, offset, match):
    with pytest.raises(CheckpointError, match=match):
        _read(tmp_path, two_tensors(offset))


def test_duplicate_keys_and_tensor_names_are_refused(tmp_path):
    data = two_tensors(kvs=[kv("general.name", STRING, string("x")), kv("general.name", STRING, string("y"))])
    with pytest.raises(CheckpointError, match=r"corrupt .*the metadata key 'general\.name' appears twice"):
        _read(tmp_path, data)
    four = np.ones(4, np.float32).tobytes()
    data = gguf_file([], [("a", (4,), GGML_F32, 0), ("a", (4,), GGML_F32, 32)], four + b"\0" * 16 + four)
    with pytest.raises(CheckpointError, match=r"corrupt .*the tensor name 'a' appears twice"):
        _read(tmp_path, data)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (kv("general.alignment", U32, struct.pack("<I", 0)), "0"),
        (kv("general.alignment", U32, struct.pack("<I", 48)), "48"),
        (kv("general.alignment", F32, struct.pack("<f", 0.5)), "0.5"),
        (kv("general.alignment", STRING, string("abc")), "'abc'"),
        (kv("general.alignment", ARRAY, struct.pack("<IQI", U32, 1, 32)), r"\[32\]"),
        (kv("general.alignment", I32, struct.pack("<i", -32)), "-32"),
    ],
)
def test_an_alignment_that_is_not_a_positive_power_of_two_is_refused(tmp_path, value, shown):
    with pytest.raises(CheckpointError, match=f"general.alignment is {shown}, but it must be a positive power of two"):
        _read(tmp_path, two_tensors(kvs=[value]))


def test_deeply_nested_arrays_are_refused(tmp_path):
    nested = struct.pack("<IQ", ARRAY, 1) * 50_000 + struct.pack("<IQ", U32, 0)
    with pytest.raises(CheckpointError, match=f"metadata 'x' nests arrays more than {MAX_ARRAY_DEPTH} deep"):
        _read(tmp_path, two_tensors(kvs=[kv("x", ARRAY, nested)]))
    shallow = struct.pack("<IQ", ARRAY, 1) * (MAX_ARRAY_DEPTH - 1) + struct.pack("<IQI", U32, 1, 7)
    value = _read(tmp_path, two_tensors(kvs=[kv("x", ARRAY, shallow)])).metadata["x"]
    for _ in range(MAX_ARRAY_DEPTH - 1):
        value = value[0]
    assert value.tolist() == [7]


def test_a_zero_dimension_and_partial_blocks_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"tensor 'e' has a zero dimension \(GGUF dimensions \[4, 0\]\)"):
        _read(tmp_path, gguf_file([], [("e", (4, 0), GGML_F32, 0)], b""))
    q4 = gguf_file([], [("q", (16, 2), GGML_Q4_0, 0)], b"\0" * 64)  # rows of 16 values: half a block each
    with pytest.raises(CheckpointError, match=r"tensor 'q' \(Q4_0, shape \(2, 16\)\) has rows of 16 values, not a mu"):
        _read(tmp_path, q4)
    five = gguf_file([], [("f", (1, 1, 1, 1, 1), GGML_F32, 0)], b"\0" * 32)
    with pytest.raises(CheckpointError, match=r"tensor 'f' has 5 dimensions; GGUF tensors have at most 4"):
        _read(tmp_path, five)
    unknown = gguf_file([], [("u", (4,), 9999, 0)], b"\0" * 32)
    with pytest.raises(CheckpointError, match=r"tensor 'u' has the unknown GGML type id 9999"):
        _read(tmp_path, unknown)


def test_a_file_truncated_while_mapped_is_refused_not_a_crash(tmp_path):
    path = tmp_path / "t.gguf"
    path.write_bytes(two_tensors())
    layout = read_layout(path)
    assert torch.equal(dequantize(layout.tensors["a"]), torch.ones(4))
    with path.open("r+b") as f:
        f.truncate(layout.tensors["b"].offset)  # the pages of 'b' are now past the end of the file
    with pytest.raises(CheckpointError, match=r"the GGUF file changed while it was open: tensor 'b' needs bytes"):
        dequantize(layout.tensors["b"])


def test_string_arrays_are_capped_and_numeric_arrays_stay_views(tmp_path, monkeypatch):
    words = [f"w{i}" for i in range(10)]
    data = two_tensors(
        kvs=[strings("tokenizer.ggml.tokens", words), kv("n", ARRAY, struct.pack("<IQ5i", I32, 5, *range(5)))]
    )
    with pytest.raises(
        CheckpointError, match=r"'tokenizer\.ggml\.tokens' holds 10 strings, over the limit of 9 \(max_v"
    ):
        _read(tmp_path, data, max_vocab=9)
    monkeypatch.setenv(limits.ENV_MAX_VOCAB, "9")
    with pytest.raises(CheckpointError, match=r"over the limit of 9 \(ONEBLOCK_MAX_VOCAB=9\); .*raise the limit"):
        _read(tmp_path, data)
    layout = _read(tmp_path, data, max_vocab=10)
    assert layout.metadata["tokenizer.ggml.tokens"] == words
    numbers = layout.metadata["n"]
    assert isinstance(numbers, np.ndarray) and numbers.tolist() == [0, 1, 2, 3, 4] and not numbers.flags.writeable
    assert not numbers.flags.owndata  # a view of the mapped file, not a copy


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4))
def test_random_damage_to_the_header_gives_oneblock_errors_only(tmp_path, damage):
    words = [f"w{i}" for i in range(6)]
    data = bytearray(two_tensors(kvs=[strings("tokenizer.ggml.tokens", words), u32("general.alignment", 32)]))
    header = len(data) - 80  # everything before the tensor data
    for position, value in damage:
        data[position % header] = value
    try:
        layout = _read(tmp_path, bytes(data))
        for record in layout.tensors.values():
            dequantize(record)
    except OneBlockError:
        pass


def test_copied_reads_a_tensors_bytes_without_touching_the_mapping(tmp_path):
    """A small tensor's bytes read with ``preadv``: a mapped read would map the pages around it too."""
    path = tmp_path / "t.gguf"
    path.write_bytes(two_tensors())
    layout = read_layout(path)
    record = layout.tensors["b"]
    copy = layout.copied(record)
    mapped_start = record.data.data_ptr() - record.offset  # the mapping's first byte
    assert copy.mapped is None and not mapped_start <= copy.data.data_ptr() < mapped_start + len(layout.mapped)
    assert (copy.name, copy.shape, copy.ggml_type, copy.offset) == (record.name, record.shape, 0, record.offset)
    assert torch.equal(copy.data, record.data) and torch.equal(dequantize(copy), torch.full((4,), 2.0))
    replaced = tmp_path / "new.gguf"
    replaced.write_bytes(two_tensors())
    replaced.replace(path)  # another file at the path now: the mapped one is the one read
    assert layout.copied(record) is record


def test_from_gguf_decodes_the_files_small_tensors_from_copies_not_the_mapping(tmp_path, monkeypatch):
    from family_testing import LLAMA3_VOCAB, write_family_gguf

    from oneblock.io.gguf import load

    seen: dict[str, bool] = {}

    def decode(record):
        seen[record.name] = record.mapped is None
        return dequantize(record)

    monkeypatch.setattr(load, "dequantize", decode)
    path = write_family_gguf(tmp_path, LLAMA3_VOCAB)
    model = load.from_gguf(path)
    assert "token_embd.weight" in seen and "output_norm.weight" in seen and all(seen.values()), seen
    monkeypatch.undo()
    _, state = load.read_gguf(path)  # decoded from the mapping
    loaded = model.state_dict()
    assert state.keys() <= loaded.keys() and all(torch.equal(loaded[name], t) for name, t in state.items())


def test_long_string_arrays_decode_last_in_the_file_s_key_order(tmp_path):
    """Arrays of 64 strings or more are decoded after the tensor table, in place: values and key order as stored, and
    a bad string in one is refused as in any other."""
    words = [f"w{i}é" for i in range(100)]
    merges = [f"w{i} w{i + 1}" for i in range(99)]
    kvs = [u32("first", 1), strings("tokenizer.ggml.tokens", words), strings("short", ["a", "b"]),
           strings("tokenizer.ggml.merges", merges), u32("last", 2)]  # fmt: skip
    layout = _read(tmp_path, two_tensors(kvs=kvs))
    assert list(layout.metadata) == ["first", "tokenizer.ggml.tokens", "short", "tokenizer.ggml.merges", "last"]
    assert layout.metadata["tokenizer.ggml.tokens"] == words and layout.metadata["tokenizer.ggml.merges"] == merges
    assert torch.equal(dequantize(layout.tensors["b"]), torch.full((4,), 2.0))
    bad = two_tensors(kvs=[strings("tokenizer.ggml.tokens", [*words[:70], "BADX", *words[71:]])])
    with pytest.raises(CheckpointError, match="corrupt or truncated GGUF file: 'utf-8' codec can't decode"):
        _read(tmp_path, bad.replace(b"BADX", b"\xff\xfeAB"))


def test_the_layout_is_made_before_the_long_string_arrays(tmp_path, monkeypatch):
    """What the parse keeps, the layout object included, exists before the vocabulary's strings are made, so that
    nothing it keeps lies among them once they are dropped."""
    from oneblock.io.gguf import layout as layout_module
    from oneblock.io.gguf.cursor import Cursor

    events: list[str] = []
    init, decode = layout_module.GGUFLayout.__init__, Cursor.decode
    monkeypatch.setattr(
        layout_module.GGUFLayout, "__init__", lambda self, *a: events.append("layout") or init(self, *a)
    )
    monkeypatch.setattr(Cursor, "decode", lambda self, *a: events.append("strings") or decode(self, *a))
    words = [f"w{i}" for i in range(100)]
    layout = _read(tmp_path, two_tensors(kvs=[strings("tokenizer.ggml.tokens", words)]))
    assert events == ["layout", "strings"]
    assert layout.metadata["tokenizer.ggml.tokens"] == words
