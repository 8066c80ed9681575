"""Property-based tests: random values for every config field and random byte damage to every reader give either
a valid result or a oneblock error, never another exception."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oneblock import ModelConfig, build_model
from oneblock.analysis.counting import count_parameters
from oneblock.errors import ConfigError, OneBlockError
from oneblock.io import checkpoint
from oneblock.train.state import load_state, save_state

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 300),
    st.integers(10**9, 10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["decoder", "encoder", "pre", "post", "rmsnorm", "swiglu", "rope", "no", "false", ""]),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
TINY = ModelConfig(vocab_size=5, d_model=4, n_heads=1, n_layers=1, d_ff=3, max_seq_len=3)


@SETTINGS
@given(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=5))
def test_model_config_accepts_valid_values_and_refuses_the_rest(changes):
    try:
        cfg = ModelConfig(**changes)
    except ConfigError:
        return
    for f in dataclasses.fields(cfg):  # what was accepted has the annotated type
        value = getattr(cfg, f.name)
        if f.type == "bool":
            assert isinstance(value, bool)
        elif f.type == "int":
            assert isinstance(value, int) and not isinstance(value, bool)
        elif f.type == "float":
            assert math.isfinite(value)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert count_parameters(cfg).total > 0


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "m.safetensors"
    torch.manual_seed(0)
    checkpoint.save(build_model(TINY), path)
    return path.read_bytes()


DAMAGE = st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4)


def _damaged(data: bytes, damage, cut: int | None) -> bytes:
    out = bytearray(data)
    for position, mask in damage:
        out[position % len(out)] ^= mask
    return bytes(out[:cut]) if cut is not None else bytes(out)


@SETTINGS
@given(DAMAGE, st.none() | st.integers(0, 4000))
def test_damaged_checkpoints_are_refused(tmp_path, checkpoint_bytes, damage, cut):
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(damaged := _damaged(checkpoint_bytes, damage, cut))
    if damaged == checkpoint_bytes:  # the damage cancelled out
        assert checkpoint.load(path).config == TINY
        return
    with pytest.raises(OneBlockError):
        checkpoint.load(path)


@SETTINGS
@given(DAMAGE, st.none() | st.integers(0, 2000))
def test_damaged_resume_states_are_refused(tmp_path, damage, cut):
    path = tmp_path / "state.safetensors"
    save_state({"m": torch.arange(6.0), "step": 4, "data": {"position": 9}}, path)
    original = path.read_bytes()
    path.write_bytes(damaged := _damaged(original, damage, cut))
    if damaged == original:  # the damage cancelled out
        assert load_state(path)["step"] == 4
        return
    with pytest.raises(OneBlockError):
        load_state(path)


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory):
    gguf = pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("llama.block_count", 1), ("llama.context_length", 8), ("llama.embedding_length", 4),
                       ("llama.feed_forward_length", 6), ("llama.attention.head_count", 2)):  # fmt: skip
        writer.add_uint32(key, value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_tensor("token_embd.weight", np.ones((3, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@SETTINGS
@given(DAMAGE, st.none() | st.integers(0, 700))
def test_damaged_gguf_files_give_oneblock_errors_only(tmp_path, gguf_bytes, damage, cut):
    from oneblock.io.gguf.file import open_gguf, read_metadata
    from oneblock.io.gguf.load import read_gguf
    from oneblock.io.gguf.tokenizer import GGUFTokenizer

    path = tmp_path / "damaged.gguf"
    path.write_bytes(_damaged(gguf_bytes, damage, cut))
    for read in (
        lambda: read_metadata(open_gguf(path), skip_arrays_longer_than=None),
        lambda: read_gguf(path),
        lambda: GGUFTokenizer.from_gguf(path),
    ):
        with contextlib.suppress(OneBlockError):
            read()
