"""Every JSON reader refuses deep nesting, huge integers, oversized and non-UTF-8 text with a oneblock error."""

from __future__ import annotations

import json
import struct

import pytest
from async_testing import run_async

from oneblock import ModelConfig, jsontext
from oneblock.errors import CheckpointError, ConfigError, ConversionError, InputError
from oneblock.io import integrity

DEEP = "[" * 50_000 + "]" * 50_000
NESTED_65 = "[" * 65 + "]" * 65
HUGE_INT = '{"n": ' + "9" * 5000 + "}"
HOSTILE = [(DEEP, "nests arrays or objects too deeply"), (HUGE_INT, "holds a number too long")]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (DEEP, r"the thing nests arrays or objects too deeply to read \(the limit is 64\)"),
        (NESTED_65, r"the thing nests arrays or objects more than 64 deep"),
        (HUGE_INT, r"the thing holds a number too long to read: .*5000 digits"),
        (b'{"a": "\xff"}', r"the thing is not JSON: not UTF-8 text \(byte 7 is 0xff\)"),
        ("{not json", r"the thing is not JSON"),
        (" " * 101, r"the thing is 101 bytes of JSON, over the limit of 100"),
    ],
)
def test_loads_refuses_with_the_callers_error(text, match):
    with pytest.raises(ConfigError, match=match):
        jsontext.loads(text, what="the thing", error=ConfigError, max_bytes=100 if text == " " * 101 else 10**6)


def test_loads_reads_what_json_reads():
    value = {"a": [1, 2.5, {"b": None, "c": "é"}], "d": True, "e": "[[[{"}
    text = json.dumps(value)
    assert jsontext.loads(text, what="x") == value == jsontext.loads(text.encode(), what="x")
    assert jsontext.loads(NESTED_65[1:-1], what="x") == json.loads(NESTED_65[1:-1])  # 64 deep: the limit itself
    assert jsontext.nesting_depth(json.loads(NESTED_65)) == 65
    assert jsontext.nesting_depth(3) == 0 and jsontext.nesting_depth({}) == 1


def _safetensors(header: str) -> bytes:
    data = header.encode()
    return struct.pack("<Q", len(data)) + data


@pytest.mark.parametrize(("text", "match"), HOSTILE)
def test_every_reader_refuses_deep_json_and_huge_integers(tmp_path, text, match):
    from oneblock.io import checkpoint

    path = tmp_path / "m.safetensors"
    path.write_bytes(_safetensors(text))
    with pytest.raises(CheckpointError, match=f"the safetensors header of .*m.safetensors' {match}"):
        checkpoint.load(path)
    with pytest.raises(ConfigError, match=f"the config {match}"):
        ModelConfig.from_json(text)
    sealed = tmp_path / "config.json"
    sealed.write_text(text)
    with pytest.raises(CheckpointError, match=f"the run config .*config.json' {match}"):
        integrity.load_json(sealed, "run config")


@pytest.mark.parametrize(("text", "match"), HOSTILE)
def test_a_hugging_face_config_json(tmp_path, text, match):
    from oneblock.io.hf.convert import from_hf

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConversionError, match=f"from_hf: .*config.json' {match}"):
        from_hf(tmp_path)


class _Request:
    def __init__(self, body: bytes) -> None:
        self.headers = {"content-length": str(len(body))}
        self.body = body

    async def stream(self):
        yield self.body


@pytest.mark.parametrize(("text", "match"), HOSTILE)
def test_the_explorers_request_body(text, match):
    from oneblock.explore.server import read_json

    with pytest.raises(InputError, match=f"the request body.* {match}"):
        run_async(read_json, _Request(text.encode()), 10**6)
    assert run_async(read_json, _Request(b'{"text": "hi"}'), 10**6) == {"text": "hi"}
