"""``generation_config.json``'s ``eos_token_id`` (an int or a list): every id a Hugging Face model ends a reply with,
as ``stop_ids`` of the tokenizer ``load_model`` gives."""

from __future__ import annotations

import json

import pytest

import oneblock as ob
from oneblock.errors import ConversionError
from oneblock.inference.load import load_model
from oneblock.io.hf import save_hf
from oneblock.io.hf.generation_config import generation_stop_ids
from oneblock.text.tokenizer import stop_ids_of


def _write(directory, value):
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": value}))
    return directory


@pytest.mark.parametrize(
    ("value", "ids"),
    [([128001, 128008, 128009], (128001, 128008, 128009)), (106, (106,)), ([1, 106, 1], (1, 106)), (None, ())],
)
def test_an_int_or_a_list_in_file_order(tmp_path, value, ids):
    assert generation_stop_ids(_write(tmp_path, value), 128256) == ids


def test_absent_file_and_ids_outside_the_vocabulary_give_nothing(tmp_path):
    assert generation_stop_ids(tmp_path, 100) == ()
    assert generation_stop_ids(_write(tmp_path, [50256, 7]), 100) == (7,)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"eos_token_id": "2"}', r"eos_token_id must be an int or a list of ints; got '2'"),
        ('{"eos_token_id": [2, true]}', r"eos_token_id must be an int or a list of ints; got \[2, True\]"),
        ("[2]", "must hold a JSON object; got a list"),
        ("{", "generation_config.json"),
    ],
)
def test_a_malformed_file_is_refused(tmp_path, text, match):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ConversionError, match=match):
        generation_stop_ids(tmp_path, 100)


def test_load_model_stops_on_the_generation_config_ids(tmp_path):
    cfg = ob.ModelConfig(
        vocab_size=256, d_model=32, n_heads=4, n_layers=1, max_seq_len=16, norm="rmsnorm", ffn="swiglu",
        position="rope", bias=False, eos_token_id=2,
    )  # fmt: skip
    directory = save_hf(ob.build_model(cfg), tmp_path / "m")
    plain = load_model(directory)
    assert stop_ids_of(plain.tokenizer, plain.model.config.eos_token_id) == (2,)  # one eos: as before
    loaded = load_model(_write(directory, [7, 2, 9]))
    assert loaded.tokenizer.stop_ids == (2, 7, 9)  # the config's eos first (the byte tokenizer has none)
    assert stop_ids_of(loaded.tokenizer, loaded.model.config.eos_token_id) == (2, 7, 9)
