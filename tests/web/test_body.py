"""JSON bodies: deep nesting, long numbers, bad UTF-8 and lone surrogates are one InputError each."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")

from oneblock.errors import InputError
from oneblock.web.body import MAX_DEPTH, nesting_depth, parse_json


@pytest.mark.parametrize(
    ("body", "depth"),
    [(b"1", 0), (b"[]", 1), (b'{"a": [[1], {"b": 2}]}', 3), (b'["[[[[", "]}"]', 1), (rb'["\"[["]', 1)],
)
def test_nesting_depth_ignores_brackets_in_strings(body, depth):
    assert nesting_depth(body) == depth


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested 100000 deep; the limit is 32"),
        (b'{"a":' * 33 + b"1" + b"}" * 33, "nested 33 deep; the limit is 32"),
        (b'{"seed": ' + b"9" * 5000 + b"}", "a number has 5000 digits; the limit is 40"),
        (b'{"t": 1' + b"0" * 400 + b".5}", "a number has 403 digits; the limit is 50"),
        (b'{"text": "caf\xff"}', r"not UTF-8 text \(byte 13 is 0xff\)"),
        (b'{"text": "\\ud800"}', r"body\.text holds a lone surrogate U\+D800 at character offset 0"),
        (b'{"text": "ok \\udfff!"}', r"lone surrogate U\+DFFF at character offset 3"),
        (b'{"\\ud800": 1}', "a key of body holds a lone surrogate"),
        (b'{"ids": ["a", "\\udc80"]}', r"body\.ids\[1\] is not valid UTF-8: byte 0x80"),
        (b"{oops", "not JSON"),
    ],
)
def test_bad_bodies(body, match):
    with pytest.raises(InputError, match=match):
        parse_json(body)


def test_good_bodies_parse_as_json_does():
    value = {"text": "caf\u00e9 \U0001f600", "ids": [1, 2, 3], "temperature": 0.7, "nested": [[{"a": None}]]}
    raw = json.dumps(value).encode()
    assert parse_json(raw) == json.loads(raw) == value
    deep = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert nesting_depth(deep) == MAX_DEPTH
    parse_json(deep)
