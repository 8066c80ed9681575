"""llama.cpp's ``/tokenize`` and ``/detokenize``: the ids the server reads a text as, and back, with refusals."""

from __future__ import annotations

import httpx
import pytest
from serve_testing import KEY

from oneblock.text.tokenizer import ByteTokenizer

HEADERS = {"Authorization": f"Bearer {KEY}"}


def post(running, path: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(running.base + path, json=body, headers=HEADERS if headers is None else headers, timeout=60)


def test_tokenize_and_detokenize_round_trip_as_the_tokenizer(tiny):
    text = "héllo, wörld"
    tokens = post(tiny, "/tokenize", {"content": text})
    assert tokens.status_code == 200 and tokens.json() == {"tokens": ByteTokenizer().encode(text)}
    back = post(tiny, "/detokenize", {"tokens": tokens.json()["tokens"]})
    assert back.status_code == 200 and back.json() == {"content": text, "prompt": text}
    assert post(tiny, "/tokenize", {"content": ""}).json() == {"tokens": []}
    assert post(tiny, "/detokenize", {"tokens": []}).json() == {"content": "", "prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "param", "match"),
    [
        ("/tokenize", {"text": "a"}, "content", 'the body must be {"content": text}'),
        ("/tokenize", {"content": "a", "prompt": "a"}, "content", "(or vLLM's"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": 1}, "add_special_tokens", "true or false"),
        ("/tokenize", {"prompt": "a", "with_pieces": True}, "with_pieces", "only ['add_special_tokens'"),
        ("/tokenize", {"content": 5}, "content", "got {'content': 5}"),
        ("/tokenize", {"content": "a", "add_special": True}, "add_special", "only ['content']"),
        ("/detokenize", {"tokens": [1, "a"]}, "tokens", 'the body must be {"tokens": [token ids]}'),
        ("/detokenize", {"tokens": [256]}, "tokens", "id 256, outside the vocabulary [0, 256)"),
        ("/detokenize", {"tokens": [1], "with_pieces": True}, "with_pieces", "only 'tokens'"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(tiny, path, body, param, match):
    response = post(tiny, path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and match in error["message"], error
    assert post(tiny, "/tokenize", {"content": "ok"}).json() == {"tokens": [111, 107]}


def test_vllms_dialect_and_tokenizer_info(tiny):
    """What lm-eval's ``remote`` tokenizer backend sends and reads."""
    tokens = post(tiny, "/tokenize", {"prompt": "héllo", "add_special_tokens": False, "model": "m"})
    ids = ByteTokenizer().encode("héllo")
    assert tokens.json() == {"tokens": ids, "count": len(ids), "max_model_len": tiny.engine.context}
    info = httpx.get(tiny.base + "/tokenizer_info", headers=HEADERS, timeout=60)
    assert info.status_code == 200
    assert info.json() == {
        "tokenizer_class": "ByteTokenizer", "bos_token": None, "eos_token": None, "pad_token": None,
        "chat_template": None, "model_max_length": tiny.engine.context, "vocab_size": 256,
    }  # fmt: skip


def test_they_need_the_key_when_one_is_set(tiny):
    for path, body in (("/tokenize", {"content": "a"}), ("/detokenize", {"tokens": [97]})):
        response = post(tiny, path, body, headers={})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.get(tiny.base + "/tokenizer_info", timeout=60)
    assert response.status_code == 401
