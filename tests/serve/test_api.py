"""The endpoints, called by the real ``openai`` client, compute what the library computes.

The tiny model (int8 layers: rows independent of the batch) runs on a server in a thread. References are
``oneblock.generate`` on the same prompt ids, with the same sampling settings.
"""

from __future__ import annotations

import threading

import openai
import torch
from serve_testing import KEY, TINY, Running

import oneblock as ob
from oneblock.inference.generation import generate
from oneblock.serve.engine import Engine
from oneblock.serve.protocol import CHATML
from oneblock.text.chat_template import render_chat
from oneblock.text.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def client(running, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=key, max_retries=0, timeout=60)


def reference(running, prompt: list[int], n: int, **sampling) -> list[int]:
    """What ``generate`` produces alone: the new ids."""
    out = generate(running.engine.decoder.model, prompt, n, **sampling)
    return out[len(prompt) :].tolist()


def chat_ids(messages) -> list[int]:
    return TOKENIZER.encode(render_chat(messages, template=CHATML))


def test_greedy_chat_equals_generate_and_counts_tokens_exactly(tiny):
    answer = client(tiny).chat.completions.create(model="anything", messages=MESSAGES, max_tokens=24, temperature=0)
    want = reference(tiny, chat_ids(MESSAGES), 24, greedy=True)
    assert answer.choices[0].message.content == TOKENIZER.decode(want)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "length"
    assert answer.model == "anything"  # the request's name, echoed
    assert answer.object == "chat.completion"
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(chat_ids(MESSAGES)), 24)
    assert usage.total_tokens == usage.prompt_tokens + 24


def test_streamed_chunks_join_to_the_whole_answer(tiny):
    c = client(tiny)
    whole = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=30, temperature=0.9, seed=3)
    chunks = list(
        c.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=30, temperature=0.9, seed=3, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # the usage comes last, alone
    want = reference(tiny, chat_ids(MESSAGES), 30, temperature=0.9, seed=3)
    assert text == TOKENIZER.decode(want)


def test_text_completion_with_a_seed_equals_generate(tiny):
    prompt = "Once upon a time"
    answer = client(tiny).completions.create(
        model="m", prompt=prompt, max_tokens=20, temperature=0.7, top_p=0.9, seed=11
    )
    want = reference(tiny, TOKENIZER.encode(prompt), 20, temperature=0.7, top_p=0.9, seed=11)
    assert answer.choices[0].text == TOKENIZER.decode(want)
    assert answer.usage.completion_tokens == 20 and answer.usage.prompt_tokens == len(prompt)
    streamed = client(tiny).completions.create(
        model="m", prompt=prompt, max_tokens=20, temperature=0.7, top_p=0.9, seed=11, stream=True
    )
    assert "".join(ch.choices[0].text for ch in streamed) == answer.choices[0].text


def test_eight_concurrent_seeded_requests_each_return_what_they_return_alone(tiny):
    c = client(tiny)
    requests = [
        {"prompt": f"request {i}: " + "x" * (3 * i), "max_tokens": 10 + 7 * i, "temperature": 0.5 + 0.1 * i,
         "seed": 100 + i, **({"top_p": 0.8} if i % 2 else {})}
        for i in range(8)
    ]  # fmt: skip
    alone = [c.completions.create(model="m", **r).choices[0].text for r in requests]
    together: list[str | None] = [None] * 8
    start = threading.Barrier(8)

    def send(i: int) -> None:
        start.wait()
        together[i] = c.completions.create(model="m", **requests[i]).choices[0].text

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    steps = tiny.engine.steps
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    longest = max(r["max_tokens"] for r in requests)
    assert tiny.engine.steps - steps < sum(r["max_tokens"] for r in requests) - longest  # they shared steps
    first = requests[0]
    sampling = {"temperature": first["temperature"], "seed": first["seed"]}
    assert alone[0] == TOKENIZER.decode(
        reference(tiny, TOKENIZER.encode(first["prompt"]), first["max_tokens"], **sampling)
    )


def test_a_stop_string_ends_the_text_before_it_even_across_tokens(tiny):
    c = client(tiny)
    full = c.completions.create(model="m", prompt="abc", max_tokens=40, temperature=0).choices[0].text
    stop = full[10:13]  # three bytes: three tokens of the byte tokenizer
    cut = c.completions.create(model="m", prompt="abc", max_tokens=40, temperature=0, stop=[stop, "\x00never"])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    ids = reference(tiny, TOKENIZER.encode("abc"), 40, greedy=True)
    reached = next(k for k in range(41) if stop in TOKENIZER.decode(ids[:k]))  # tokens up to the stop's last
    assert cut.usage.completion_tokens == reached
    streamed = c.completions.create(model="m", prompt="abc", max_tokens=40, temperature=0, stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == cut.choices[0].text


def test_max_tokens_is_capped_to_what_the_context_leaves(tiny):
    prompt = "y" * 500  # the context is 512
    answer = client(tiny).completions.create(model="m", prompt=prompt, max_tokens=100, temperature=0)
    assert answer.usage.completion_tokens == 12 and answer.choices[0].finish_reason == "length"


def test_a_completion_past_the_first_cache_chunk_keeps_every_key():
    """250 prompt tokens and 20 new ones reach past the cache's 256-position chunk: the served tokens are the
    uncached recompute's (a float model, so the whole-sequence products agree with the one-row ones)."""
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(**TINY))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    running = Running(Engine(model.eval(), TOKENIZER, max_batch=2, max_queue=4), api_key=KEY)
    try:
        prompt = "".join(chr(ord("a") + (i * 7) % 26) for i in range(250))
        ids = TOKENIZER.encode(prompt)
        answer = client(running).completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        want = generate(model, ids, 20, greedy=True, use_cache=False)[len(ids) :].tolist()
        assert answer.choices[0].text == TOKENIZER.decode(want)
        assert answer.usage.completion_tokens == 20
    finally:
        running.close()


def test_models_and_health(tiny):
    import httpx

    ids = [m.id for m in client(tiny).models.list()]
    assert ids == ["tiny"]
    assert client(tiny).models.retrieve("tiny").id == "tiny"
    health = httpx.get(tiny.base + "/health")  # no key needed
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_the_engine_is_idle_after_the_tests_above(tiny):
    active, waiting = tiny.engine.load()
    assert (active, waiting) == (0, 0)
    assert torch.get_num_threads() >= 1
