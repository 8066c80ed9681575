"""Checkpoints are mapped, not read: the header's sizes are checked against the file before its body is touched,
and the tensors are views of the mapping copied once into the model."""

from __future__ import annotations

import json
import pathlib
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oneblock import ModelConfig, build_model
from oneblock.errors import CheckpointError, OneBlockError
from oneblock.io import checkpoint, files, integrity

TINY = ModelConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=1, d_ff=12, max_seq_len=6)


def _header(entries: dict, data_bytes: int = 0) -> bytes:
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text + b"\0" * data_bytes


def test_a_checkpoint_loads_without_reading_the_file_whole(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = build_model(TINY).eval()
    path = checkpoint.save(model, tmp_path / "m.safetensors")

    real = pathlib.Path.read_bytes

    def refuse(self, *args, **kwargs):
        if pathlib.Path(self) == path:
            raise AssertionError("the checkpoint was read into memory instead of mapped")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_bytes", refuse)
    monkeypatch.setattr(files, "read_bytes", refuse)
    loaded = checkpoint.load(path)
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(loaded(ids), model(ids))
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_a_huge_sparse_file_is_refused_from_its_header(tmp_path, monkeypatch):
    def no_hashing(*args, **kwargs):
        raise AssertionError("the body was hashed before the header was checked")

    monkeypatch.setattr(integrity.hashlib, "sha256", no_hashing)
    path = tmp_path / "sparse.safetensors"
    with path.open("wb") as f:
        f.truncate(2**30)  # 1 GiB of zeros that occupy no disk
    with pytest.raises(CheckpointError, match=r"the safetensors header of .*sparse\.safetensors' is not JSON"):
        checkpoint.load(path)
    entry = {"w": {"dtype": "F32", "shape": [2**29], "data_offsets": [0, 2**31]}}
    with path.open("wb") as f:
        f.write(_header(entry))
        f.truncate(2**30)
    with pytest.raises(CheckpointError, match=r"sparse\.safetensors' is truncated: its tensors need 2147483648 bytes"):
        checkpoint.load(path)


def _f32(name: str, shape: list[int], low: int, high: int, dtype: str = "F32") -> dict:
    return {name: {"dtype": dtype, "shape": shape, "data_offsets": [low, high]}}


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        (
            _f32("a", [2], 0, 8) | _f32("b", [2], 4, 12),
            r"tensor 'b' starts at data byte 4, expected 8 \(tensors overlap",
        ),
        (_f32("a", [2], 0, 8) | _f32("b", [2], 12, 20), r"tensor 'b' starts at data byte 12, expected 8"),
        (_f32("a", [3], 0, 8), r"tensor 'a' \(F32, shape \(3,\)\) needs 12 bytes, its offsets give 8"),
        (_f32("a", [8], 0, 8, "F8_E4M3"), r"stores tensor 'a' as 'F8_E4M3', a dtype oneblock does not read"),
    ],
)
def test_tensors_must_tile_the_data_exactly(entries, match):
    data_bytes = max(entry["data_offsets"][1] for entry in entries.values())
    with pytest.raises(CheckpointError, match=match):
        integrity.tensors_of(_header(entries, data_bytes), "'t.safetensors'")


def test_tensors_of_reads_bytes_and_mappings_alike(tmp_path):
    tensors = {
        "w": torch.arange(6.0).reshape(2, 3),
        "i": torch.tensor([3, -1], dtype=torch.int64),
        "s": torch.tensor(2.5),
    }
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"".join(integrity.dump_safetensors(tensors, {})))
    mapped = files.map_file(path, "test file")
    for blob, copy in ((path.read_bytes(), True), (mapped, True), (mapped, False)):
        out = integrity.tensors_of(blob, "t", copy=copy)
        assert out.keys() == tensors.keys()
        for key, value in tensors.items():
            assert out[key].dtype == value.dtype and torch.equal(out[key], value), key


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4), st.booleans())
def test_random_damage_to_a_checkpoint_gives_oneblock_errors_only(tmp_path, damage, shorten):
    path = tmp_path / "m.safetensors"
    torch.manual_seed(0)
    blob = bytearray(checkpoint.save(build_model(TINY), path).read_bytes())
    header = 8 + struct.unpack("<Q", blob[:8])[0]
    for position, value in damage:
        blob[position % header] = value  # the length and the JSON: what is read before the digest
    path.write_bytes(bytes(blob[: len(blob) // 2] if shorten else blob))
    try:
        integrity.tensors_of(integrity.load_sealed(path, "checkpoint")[2], "m")
        checkpoint.load(path)
    except OneBlockError:
        pass
