"""``GET /metrics``: the counts in Prometheus' text equal what the ``openai`` client sent and received.

The text is read with ``prometheus_client``'s own parser. Each test starts servers of its own, so every count
starts at zero (each server has its own registry: two in one process never share a count).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_testing import KEY, Running, slow_engine, tiny_model

from oneblock.serve.engine import Engine
from oneblock.text.tokenizer import ByteTokenizer

HEADERS = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def scrape(running: Running) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (sample name, sorted labels) -> value."""
    response = httpx.get(running.base + "/metrics", headers=HEADERS, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def client(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def fresh() -> Iterator[Running]:
    running = Running(Engine(tiny_model(), ByteTokenizer(), max_batch=8), api_key=KEY)
    yield running
    running.close()


def test_tokens_requests_and_latencies_equal_what_was_sent_and_received(fresh):
    c = client(fresh)
    usages, choices = [], 0
    for max_tokens in (7, 12):
        answer = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=max_tokens, temperature=0)
        usages.append(answer.usage)
        choices += 1
    answer = c.completions.create(model="m", prompt="Once upon a time", max_tokens=9, temperature=0.8, seed=1)
    usages.append(answer.usage)
    choices += 1
    chunks = list(
        c.completions.create(model="m", prompt="abc", max_tokens=5, stream=True, stream_options={"include_usage": True})
    )
    usages.append(chunks[-1].usage)
    choices += 1
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="m", messages=MESSAGES, temperature=5)
    samples = scrape(fresh)
    prompt = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert value(samples, "oneblock:prompt_tokens_total") == prompt
    assert value(samples, "oneblock:generation_tokens_total") == generated == 7 + 12 + 9 + 5
    assert value(samples, "oneblock:requests_total", endpoint="/v1/chat/completions", status="200") == 2
    assert value(samples, "oneblock:requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert value(samples, "oneblock:requests_total", endpoint="/v1/completions", status="200") == 2
    assert value(samples, "oneblock:request_success_total", finished_reason="length") == choices
    # Every choice ran to its max_tokens (this model has no end-of-turn id): a first token each, then intervals.
    assert value(samples, "oneblock:time_to_first_token_seconds_count") == choices
    assert value(samples, "oneblock:time_per_output_token_seconds_count") == generated - choices
    assert value(samples, "oneblock:e2e_request_latency_seconds_count") == choices
    assert value(samples, "oneblock:time_to_first_token_seconds_bucket", le="+Inf") == choices
    assert value(samples, "oneblock:time_to_first_token_seconds_sum") > 0
    assert value(samples, "oneblock:decode_steps_total") == fresh.engine.steps > 0
    assert value(samples, "oneblock:num_requests_running") == value(samples, "oneblock:num_requests_waiting") == 0
    assert value(samples, "oneblock:kv_cache_usage_bytes") == value(samples, "oneblock:kv_cache_usage_perc") == 0
    engine = fresh.engine
    assert value(samples, "oneblock:kv_cache_budget_bytes") == engine.cache_positions * engine.position_bytes
    # every prompt read was looked up; what was found is whole 32-token blocks; the gauge is the cache's own count
    assert value(samples, "oneblock:prefix_cache_queries_total") == value(samples, "oneblock:prompt_tokens_total")
    hits = value(samples, "oneblock:prefix_cache_hits_total")
    assert hits % 32 == 0 and hits <= prompt
    assert value(samples, "oneblock:prefix_cache_usage_bytes") == engine.prefix.bytes > 0
    assert value(samples, "oneblock:requests_total", endpoint="/metrics", status="200") == 0  # counted once answered
    assert value(scrape(fresh), "oneblock:requests_total", endpoint="/metrics", status="200") == 1


def test_choices_of_one_prompt_each_count_their_prompt(fresh):
    answer = client(fresh).completions.create(model="m", prompt="hello there", max_tokens=4, n=3, seed=2)
    samples = scrape(fresh)
    assert answer.usage.prompt_tokens == len("hello there")  # the prompt once, as OpenAI bills it
    assert value(samples, "oneblock:prompt_tokens_total") == 3 * len("hello there")  # prefilled once per choice
    assert value(samples, "oneblock:generation_tokens_total") == answer.usage.completion_tokens == 12
    assert value(samples, "oneblock:request_success_total", finished_reason="length") == 3


def test_metrics_need_the_key_when_one_is_set():
    keyed = Running(Engine(tiny_model(), ByteTokenizer(), max_batch=2), api_key=KEY)
    open_ = Running(Engine(tiny_model(), ByteTokenizer(), max_batch=2))
    try:
        refused = httpx.get(keyed.base + "/metrics", timeout=30)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(keyed.base + "/metrics", headers={"Authorization": "Bearer other"}, timeout=30)
        assert wrong.status_code == 401
        assert httpx.get(open_.base + "/metrics", timeout=30).status_code == 200  # no key set: none needed
        client(keyed).completions.create(model="m", prompt="x", max_tokens=3)
        keyed_samples, open_samples = scrape(keyed), scrape(open_)
        assert value(keyed_samples, "oneblock:requests_total", endpoint="/metrics", status="401") == 2
        assert value(keyed_samples, "oneblock:generation_tokens_total") == 3
        assert value(open_samples, "oneblock:generation_tokens_total") == 0  # its own registry
    finally:
        keyed.close()
        open_.close()


def test_gauges_while_a_request_decodes_and_abort_when_its_client_leaves(monkeypatch):
    running = Running(slow_engine(monkeypatch, 0.02, max_batch=4), api_key=KEY)
    try:
        body = {"model": "m", "prompt": "stream me", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", running.url + "/completions", json=body, headers=HEADERS, timeout=60) as response:
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            next(events), next(events)  # text is arriving: the request holds its row
            samples = scrape(running)
            engine = running.engine
            positions = len("stream me") + 400 - 1  # its cache, allocated whole at prefill
            assert value(samples, "oneblock:num_requests_running") == 1
            assert value(samples, "oneblock:num_requests_waiting") == 0
            assert value(samples, "oneblock:kv_cache_usage_bytes") == positions * engine.position_bytes
            assert value(samples, "oneblock:kv_cache_usage_perc") == positions / engine.cache_positions
            assert value(samples, "oneblock:prompt_tokens_total") == len("stream me")
        deadline = time.monotonic() + 20
        while engine.load()[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        samples = scrape(running)
        assert value(samples, "oneblock:request_success_total", finished_reason="abort") == 1
        assert value(samples, "oneblock:num_requests_running") == 0
        assert value(samples, "oneblock:kv_cache_usage_bytes") == 0
        assert 0 < value(samples, "oneblock:generation_tokens_total") < 400
    finally:
        running.close()
