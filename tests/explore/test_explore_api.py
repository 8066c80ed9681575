"""The explorer's JSON API through Starlette's test client, against the models' own outputs.

The attention maps must be the very tensors ``model(..., return_attention=True)`` returns for the same ids; the
logit lens at the last layer must be the model's own next-token distribution; the next-token bars must be
softmax(logits / T) over the whole vocabulary; bad requests must give 400 with a message and no traceback.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from explore_testing import tiny

from oneblock.explore import analysis as analysis_module
from oneblock.explore.analysis import unpack
from oneblock.explore.requests import Limits
from oneblock.explore.server import create_app, is_loopback
from oneblock.inference.sampling import sample_next

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient

TEXT = "Attention is all you need."


def client(explorable, limits: Limits | None = None) -> TestClient:
    return TestClient(create_app(explorable, limits), base_url="http://127.0.0.1:8000")


def analyse(explorable, **body):
    response = client(explorable).post("/api/analyze", json={"text": TEXT, **body})
    assert response.status_code == 200, response.text
    return response.json()


def maps(result) -> dict[str, torch.Tensor]:
    return {group["name"]: unpack(group["weights"]) for group in result["attention"]}


def ids_of(result, key: str = "tokens") -> torch.Tensor:
    return torch.tensor([[t["id"] for t in result[key]]])


@pytest.mark.parametrize("which", ["decoder", "encoder"])
def test_attention_maps_are_the_models_own(which, request):
    explorable = request.getfixturevalue(which)
    result = analyse(explorable)
    ids = ids_of(result)
    assert ids[0].tolist() == list(TEXT.encode())
    with torch.no_grad():
        _, expected = explorable.model(ids, return_attention=True)
    got = maps(result)["self"]  # (L, H, T, T)
    assert got.shape == (2, 3, len(TEXT), len(TEXT))
    torch.testing.assert_close(got, torch.cat(expected), rtol=0, atol=0)


def test_encoder_decoder_maps_are_the_models_own(seq2seq):
    result = analyse(seq2seq, target="Hi there")
    src, tgt = ids_of(result), ids_of(result, "target_tokens")
    assert tgt[0].tolist() == list(b"Hi there")
    with torch.no_grad():
        _, expected = seq2seq.model(src, tgt, return_attention=True)
    got = maps(result)
    assert set(got) == {"encoder", "decoder", "cross"}
    s, t = len(TEXT), 8
    assert got["encoder"].shape == (2, 3, s, s)
    assert got["decoder"].shape == (3, 3, t, t)
    assert got["cross"].shape == (3, 3, t, s)  # T x S: decoder queries over the source
    for name in got:
        torch.testing.assert_close(got[name], torch.cat(expected[name]), rtol=0, atol=0)
    assert (got["cross"].triu(1) > 0).any()  # the whole source is visible to every target position


def test_encoder_decoder_target_defaults_to_the_source(seq2seq):
    result = analyse(seq2seq)
    assert result["target_tokens"] == result["tokens"]


@pytest.mark.parametrize("which", ["decoder", "encoder", "seq2seq"])
def test_rows_sum_to_one(which, request):
    for weights in maps(analyse(request.getfixturevalue(which))).values():
        torch.testing.assert_close(weights.double().sum(-1), torch.ones(weights.shape[:-1], dtype=torch.float64))


def test_upper_triangle_exactly_zero_for_decoders_only(decoder, encoder, seq2seq):
    assert (maps(analyse(decoder))["self"].triu(1) == 0).all()
    assert (maps(analyse(seq2seq))["decoder"].triu(1) == 0).all()
    encoder_maps = maps(analyse(encoder))["self"]
    future = torch.ones(len(TEXT), len(TEXT), dtype=torch.bool).triu(1)
    assert (encoder_maps[..., future] > 0).all()  # bidirectional: every later key has weight


@pytest.mark.parametrize("temperature", [0.25, 1.0, 2.5])
def test_next_token_is_softmax_of_logits_over_temperature(decoder, temperature):
    result = analyse(decoder, temperature=temperature, top_k=7)
    with torch.no_grad():
        logits = decoder.model(ids_of(result), return_attention=True)[0][0, -1]  # (V,), the same path as the page's
    packed = unpack(result["next_token"]["logits"])
    torch.testing.assert_close(packed, logits, rtol=0, atol=0)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    top = result["next_token"]["top"]
    assert [t["id"] for t in top] == torch.topk(probs, 7).indices.tolist()
    torch.testing.assert_close(
        torch.tensor([t["prob"] for t in top], dtype=torch.float64), torch.topk(probs, 7).values, rtol=0, atol=1e-12
    )
    assert [t["logit"] for t in top] == [float(logits[t["id"]]) for t in top]


def test_temperature_keeps_the_order_and_sharpens(decoder):
    cold = analyse(decoder, temperature=0.2)["next_token"]["top"]
    hot = analyse(decoder, temperature=3.0)["next_token"]["top"]
    assert [t["id"] for t in cold] == [t["id"] for t in hot]
    assert cold[0]["prob"] > hot[0]["prob"]


@pytest.mark.parametrize(
    ("arch", "changes"),
    [("decoder", {}), ("decoder", {"norm_position": "post"}), ("decoder", {"norm": "rmsnorm", "ffn": "swiglu"})],
)
def test_logit_lens_at_the_last_layer_is_the_models_distribution(arch, changes):
    explorable = tiny(arch, **changes)
    result = analyse(explorable)
    lens = result["lens"]
    assert lens["layers"] == ["embeddings", "block 1", "block 2"]
    with torch.no_grad():
        probs = torch.softmax(explorable.model(ids_of(result))[0], dim=-1)  # (T, V)
    last = lens["predictions"][-1]
    assert [p["id"] for p in last] == probs.argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor([p["prob"] for p in last]), probs.max(-1).values, rtol=1e-6, atol=1e-7)
    assert result["next_token"]["top"][0]["id"] == last[-1]["id"]


def test_logit_lens_of_an_encoder_decoder_reads_the_decoder(seq2seq):
    result = analyse(seq2seq, target="abc")
    with torch.no_grad():
        probs = torch.softmax(seq2seq.model(ids_of(result), ids_of(result, "target_tokens"))[0], dim=-1)
    lens = result["lens"]
    assert len(lens["layers"]) == 4  # embeddings + 3 decoder blocks
    assert [p["id"] for p in lens["predictions"][-1]] == probs.argmax(-1).tolist()


def test_residual_norms_are_the_streams_norms(decoder):
    """The embeddings row is the norm of what the first block receives: token plus position embedding."""
    result = analyse(decoder)
    ids = ids_of(result)
    with torch.no_grad():
        x = decoder.model.embed(ids, torch.arange(ids.shape[1]), None)[0]  # (T, C)
    norms = torch.tensor(result["lens"]["residual_norm"])  # (L + 1, T)
    assert norms.shape == (3, ids.shape[1])
    torch.testing.assert_close(norms[0], x.norm(dim=-1))


def test_encoder_has_no_next_token_and_no_lens_predictions(encoder):
    result = analyse(encoder)
    assert result["next_token"] is None
    assert result["lens"]["predictions"] is None
    assert len(result["lens"]["residual_norm"]) == 3


def test_generate_appends_the_greedy_token(decoder):
    ids = list(TEXT.encode())
    response = client(decoder).post("/api/generate", json={"ids": ids, "greedy": True})
    assert response.status_code == 200, response.text
    result = response.json()
    with torch.no_grad():
        expected = int(decoder.model(torch.tensor([ids]))[0, -1].argmax())
    assert result["appended"]["id"] == expected
    assert [t["id"] for t in result["analysis"]["tokens"]] == [*ids, expected]


def test_generate_samples_with_the_seed(decoder):
    ids = list(TEXT.encode())
    body = {"ids": ids, "greedy": False, "seed": 11, "temperature": 2.0}
    first = client(decoder).post("/api/generate", json=body).json()["appended"]["id"]
    with torch.no_grad():
        logits = decoder.model(torch.tensor([ids]))[:, -1]
    expected = int(sample_next(logits, temperature=2.0, generator=torch.Generator().manual_seed(11))[0])
    assert first == expected
    assert client(decoder).post("/api/generate", json=body).json()["appended"]["id"] == first


def test_generate_extends_the_decoder_of_an_encoder_decoder(seq2seq):
    result = client(seq2seq).post("/api/generate", json={"text": "source", "target": "ab"}).json()
    assert [t["id"] for t in result["analysis"]["tokens"]] == list(b"source")
    assert len(result["analysis"]["target_tokens"]) == 3


def test_card_counts_and_checks(decoder):
    card = client(decoder).get("/api/card").json()
    params = card["parameters"]
    assert params["actual"] == params["total"] == sum(p.numel() for p in decoder.model.parameters())
    assert sum(bar["count"] for bar in params["bars"]) == params["total"]
    assert params["rule"]["per_block"] == 12 * 36**2
    assert params["rule"]["exact_per_block"] == params["per_block"]
    assert card["checks"] and all(check["passed"] for check in card["checks"])
    assert card["limits"]["max_tokens"] == 96  # the model's context is shorter than the default cap
    assert params["differences"] == []  # the lesson's block at other sizes


def test_card_lists_how_the_block_differs_from_the_lessons(encoder, seq2seq):
    from oneblock.analysis.block_diff import block_differences

    params = client(encoder).get("/api/card").json()["parameters"]
    assert params["differences"] == [row.as_dict() for row in block_differences(encoder.config)]
    assert [row["key"] for row in params["differences"]] == ["arch", "norm_position"]
    assert params["differences"][1]["parameters"] == -2 * 36  # post-LN drops the final LayerNorm
    rows = client(seq2seq).get("/api/card").json()["parameters"]["differences"]
    assert [row["key"] for row in rows] == ["arch"] and rows[0]["parameters"] > 0


def test_card_lists_the_rows_of_gemma_and_olmo2_options():
    from oneblock.analysis.block_diff import block_differences

    gemma = tiny("decoder", norm="rmsnorm", norm_position="sandwich", ffn="gated", activation="gelu_tanh",
                 position="rope", bias=False, n_kv_heads=1, qk_norm=True, attn_softcap=50.0, logit_softcap=30.0,
                 sliding_window=8, global_every=2, rope_local_theta=100.0)  # fmt: skip
    card = client(gemma).get("/api/card").json()
    rows = {row["key"]: row for row in card["parameters"]["differences"]}
    assert card["parameters"]["differences"] == [row.as_dict() for row in block_differences(gemma.config)]
    assert rows["norm_position"]["parameters"] == 2 * 2 * 36  # each sublayer's output norm in two blocks
    assert rows["sliding_window"]["label"] == "sliding window 8 on 1 of 2 layers"
    assert rows["rope_local_theta"]["label"] == "local layers rotate with base 100 (global: 10,000)"
    assert (rows["attn_softcap"]["parameters"], rows["logit_softcap"]["parameters"]) == (0, 0)
    assert card["parameters"]["actual"] == card["parameters"]["total"]
    olmo = tiny("decoder", norm="rmsnorm", norm_position="output", ffn="swiglu", position="rope", bias=False,
                qk_norm=True, qk_norm_span="width")  # fmt: skip
    rows = {row["key"]: row for row in client(olmo).get("/api/card").json()["parameters"]["differences"]}
    assert rows["norm_position"]["parameters"] == 0 and rows["qk_norm_span"]["parameters"] == 2 * (2 * 36 - 2 * 12)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ([1, 2], "must be a JSON object"),
        ({}, "give text"),
        ({"text": ""}, "text is empty"),
        ({"text": 5}, "text must be a string"),
        ({"text": "x" * 4001}, "4001 characters; the limit is 4000"),
        ({"text": "x" * 97}, "97 tokens long; the limit is 96"),
        ({"ids": []}, "non-empty list"),
        ({"ids": [1, "a"]}, "integers only"),
        ({"ids": [1, 300]}, r"\[300\] lie outside the model's vocabulary \[0, 300\)"),
        ({"ids": [1], "text": "a"}, "not both"),
        ({"text": "a", "temperature": 0}, r"temperature must lie in \[0\.01, 10\]; got 0"),
        ({"text": "a", "temperature": "hot"}, "temperature must be a number"),
        ({"text": "a", "top_k": 0}, r"top_k must be an integer in \[1, 50\]"),
        ({"text": "a", "greedy": "yes"}, "greedy must be true or false"),
        ({"text": "a", "target": "b"}, "apply to encoder-decoder models"),
        ({"text": "a", "colour": 1}, r"unknown field\(s\) \['colour'\]"),
    ],
)
def test_bad_requests_get_400_with_a_message(decoder, body, match):
    import re

    for path in ("/api/analyze", "/api/generate"):
        response = client(decoder).post(path, json=body)
        assert response.status_code == 400
        message = response.json()["error"]
        assert re.search(match, message), message
        assert "Traceback" not in response.text


def test_bodies_that_are_not_json_or_too_large(decoder):
    limited = client(decoder, Limits(max_body=100))
    response = limited.post("/api/analyze", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "not JSON" in response.json()["error"]
    response = limited.post("/api/analyze", json={"text": "a" * 200})
    assert response.status_code == 400 and "the limit is 100" in response.json()["error"]


def test_unknown_routes_and_methods_answer_json(decoder):
    test_client = client(decoder)
    assert test_client.get("/api/nothing").json() == {"error": "GET /api/nothing: Not Found"}
    response = test_client.get("/api/analyze")
    assert response.status_code == 405 and "Method Not Allowed" in response.json()["error"]


def test_generation_stops_at_the_cap(decoder):
    response = client(decoder, Limits(max_tokens=4)).post("/api/generate", json={"ids": [1, 2, 3, 4]})
    assert response.status_code == 400
    assert "already has 4 tokens, the limit" in response.json()["error"]


def test_a_failure_inside_gives_500_without_traceback(decoder, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("secret internals")

    monkeypatch.setattr("oneblock.explore.server.analyze", broken)
    response = client(decoder).post("/api/analyze", json={"text": "a"})
    assert response.status_code == 500
    assert response.json() == {"error": "internal error (RuntimeError); the server's log has the details"}


def test_one_computation_at_a_time(decoder, monkeypatch):
    running, overlaps = [0], []
    real = analysis_module.analyze

    def slow(*args, **kwargs):
        running[0] += 1
        overlaps.append(running[0])
        time.sleep(0.2)
        running[0] -= 1
        return real(*args, **kwargs)

    monkeypatch.setattr("oneblock.explore.server.analyze", slow)
    test_client = client(decoder)
    threads = [
        threading.Thread(target=test_client.post, args=("/api/analyze",), kwargs={"json": {"text": text}})
        for text in ("a", "b")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == [1, 1]


def test_the_page_and_its_assets_are_served_with_a_closed_policy(decoder):
    test_client = client(decoder)
    page = test_client.get("/")
    assert page.status_code == 200 and "oneblock explore" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
    for asset in ("/static/explore.js", "/static/explore.css"):
        response = test_client.get(asset)
        assert response.status_code == 200 and "https://" not in response.text


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("192.168.1.4", False),
        ("example.org", False),
    ],
)
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback
