"""``serve --cache-dtype float16``: the requests' caches are float16 (half the bytes, and the budget counts them so),
the native step decodes over them, and a served greedy completion is what ``generate`` gives with the same cache."""

from __future__ import annotations

import openai
import torch
from serve_testing import KEY, Running, tiny_model

from oneblock.cli.main import main
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.generation import generate
from oneblock.serve import engine as engine_module
from oneblock.serve.engine import Engine
from oneblock.serve.memory import CacheCost
from oneblock.text.tokenizer import ByteTokenizer

HALF = torch.float16
TOKENIZER = ByteTokenizer()


def test_the_budget_counts_float16_caches_as_allocated():
    model = tiny_model()
    decoder = BatchDecoder(model, cache_dtype=HALF)
    slot, _ = decoder.begin(list(range(1, 11)), 20)
    layers = slot.cache.layers
    assert all(layer.k.dtype == layer.v.dtype == HALF for layer in layers)
    half, full = CacheCost.of(model, HALF), CacheCost.of(model)
    assert half.request_bytes(slot.capacity) == sum(layer.k.nbytes + layer.v.nbytes for layer in layers)
    assert 2 * half.position_bytes == full.position_bytes
    engine = Engine(model, TOKENIZER, max_batch=2, max_context=100, prefix_bytes=0, cache_dtype=HALF)
    try:
        assert engine.position_bytes == half.position_bytes and engine.cache_bytes == 200 * half.position_bytes
    finally:
        engine.close(grace=1)


def test_a_served_greedy_completion_equals_generate_with_the_same_cache():
    model = tiny_model(int8=False)  # float32 products: the native step's
    engine = Engine(model, TOKENIZER, max_batch=2, cache_dtype=HALF)
    assert engine.decoder.native is not None
    running = Running(engine)
    try:
        client = openai.OpenAI(base_url=running.url, api_key=KEY, max_retries=0, timeout=60)
        prompt = "The colour of"  # one native call reads it, in the server and in generate
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        ids = TOKENIZER.encode(prompt)
        want = generate(model, ids, 20, greedy=True, cache_dtype=HALF)[len(ids) :].tolist()
        assert answer.choices[0].text == TOKENIZER.decode(want)
        assert engine.decoder.cache_dtype == HALF and len(want) == 20
    finally:
        running.close()


def test_the_flag_reaches_the_engine(monkeypatch, capsys):
    made = {}

    def fake_engine(*args, **options):
        made.update(options)
        raise KeyboardInterrupt  # stop before serving

    monkeypatch.setattr(engine_module, "Engine", fake_engine)
    assert main(["serve", "--model", "lesson", "--embedding-model", "none", "--cache-dtype", "float16"]) != 0
    assert made["cache_dtype"] == HALF
    capsys.readouterr()
    assert main(["serve", "--cache-dtype", "bfloat16"]) == 2  # the native step reads float32 and float16 only
    assert "invalid choice: 'bfloat16'" in capsys.readouterr().err
