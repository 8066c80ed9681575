"""Prefix caching through the ``openai`` client: a request that shares a prefix with an earlier one reports the
whole blocks it reused in ``usage.prompt_tokens_details.cached_tokens`` (whole and streamed), and answers exactly
what a server without the cache (``prefix_bytes=0``, ``--cache-budget 0``) answers: the same text and the same
log-probabilities, greedy and seeded, alone and inside a batch; on the tiny model and on SmolLM2's 4-bit GGUF.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import openai
import pytest
import torch
from serve_testing import KEY, Running, tiny_model

import oneblock as ob
from oneblock.inference.prefill import CHUNK
from oneblock.serve.engine import Engine
from oneblock.serve.prompts import chat_prompt
from oneblock.text.tokenizer import ByteTokenizer

GENERATOR = torch.Generator().manual_seed(7)
SHARED = torch.randint(0, 256, (200,), generator=GENERATOR).tolist()  # a 200-token prefix
TAILS = [torch.randint(0, 256, (n,), generator=GENERATOR).tolist() for n in (11, 23, 40, 5)]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Running, Running]]:
    """The tiny model served twice: with the default prefix cache, and with none."""
    model = tiny_model()
    cached = Running(Engine(model, ByteTokenizer(), max_batch=8), api_key=KEY)
    plain = Running(Engine(model, ByteTokenizer(), max_batch=8, prefix_bytes=0), api_key=KEY)
    yield cached, plain
    cached.close()
    plain.close()


def client(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=KEY, max_retries=0, timeout=120)


def complete(running: Running, prompt: list[int], **options):
    options = {"max_tokens": 12, "temperature": 0, "logprobs": 3, **options}
    return client(running).completions.create(model="m", prompt=prompt, **options)


def same_answer(a, b) -> bool:
    """Text, finish reason and every token's log-probabilities (floats computed from the logits) equal."""
    ca, cb = a.choices[0], b.choices[0]
    return (ca.text, ca.finish_reason, ca.logprobs.token_logprobs, ca.logprobs.top_logprobs) == (
        cb.text, cb.finish_reason, cb.logprobs.token_logprobs, cb.logprobs.top_logprobs,
    )  # fmt: skip


def reusable(prompt_tokens: int, shared: int) -> int:
    """Positions a prompt can take from the cache: the whole blocks of what it shares, before its last chunk
    (the remainder joins the last whole chunk, read whatever is cached: ``oneblock.inference.prefill.spans``)."""
    return min(shared // CHUNK, max(prompt_tokens // CHUNK - 1, 0)) * CHUNK


def test_a_shared_prefix_is_reported_cached_and_changes_no_answer(servers):
    cached, plain = servers
    first = complete(cached, SHARED + TAILS[0])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = complete(cached, SHARED + TAILS[1])
    assert second.usage.prompt_tokens == 223
    assert second.usage.prompt_tokens_details.cached_tokens == reusable(223, 200) == 160
    want = complete(plain, SHARED + TAILS[1])
    assert want.usage.prompt_tokens_details.cached_tokens == 0
    assert same_answer(second, want)
    for seed in (1, 2):
        sampled = {"temperature": 1.0, "seed": seed, "top_p": 0.9}
        assert same_answer(
            complete(cached, SHARED + TAILS[2], **sampled), complete(plain, SHARED + TAILS[2], **sampled)
        )


def test_the_streamed_usage_reports_the_cached_tokens(servers):
    cached, plain = servers
    complete(cached, SHARED + TAILS[3])
    chunks = list(
        client(cached).completions.create(
            model="m", prompt=SHARED + TAILS[3], max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == 205
    assert usage.prompt_tokens_details.cached_tokens == reusable(205, 200) == 160
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == complete(plain, SHARED + TAILS[3]).choices[0].text


def test_cache_prompt_false_reads_nothing_from_the_cache(servers):
    cached, plain = servers
    complete(cached, SHARED + TAILS[0])
    answer = complete(cached, SHARED + TAILS[1], extra_body={"cache_prompt": False})
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    assert same_answer(answer, complete(plain, SHARED + TAILS[1]))


def test_cached_requests_inside_a_batch_answer_as_alone_without_the_cache(servers):
    cached, plain = servers
    prompts = [SHARED + tail for tail in TAILS] + [list(reversed(SHARED)), SHARED[:40]]
    want = [complete(plain, p, max_tokens=24) for p in prompts]
    got: list = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def ask(i: int) -> None:
        barrier.wait()
        got[i] = complete(cached, prompts[i], max_tokens=24)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for answer, reference in zip(got, want, strict=True):
        assert same_answer(answer, reference)
    reused = [a.usage.prompt_tokens_details.cached_tokens for a in got]
    # earlier tests left blocks of SHARED: each found what its length lets it use (how many depends on them)
    assert all(0 < r <= reusable(len(p), 200) and r % CHUNK == 0 for r, p in zip(reused[:4], prompts, strict=False))
    assert reused[4] == 0 and reused[5] == 0  # reversed: nothing shared; SHARED[:40]: one chunk, nothing before it


def test_requests_arriving_together_compute_their_shared_prefix_once(servers):
    cached, plain = servers
    shared = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(11)).tolist()  # new to the cache
    prompts = [shared + TAILS[0], shared + TAILS[1]]
    got: list = [None, None]
    barrier = threading.Barrier(2)

    def ask(i: int) -> None:
        barrier.wait()
        got[i] = complete(cached, prompts[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    # Whichever was read second found the first's blocks: prompts are read one after another, and a read looks
    # the cache up at its first chunk.
    stored = [max(len(p) // CHUNK - 1, 0) * CHUNK for p in prompts]  # what a read keeps: its chunks of 32
    found = min(reusable(len(prompts[0]), 200), reusable(len(prompts[1]), 200), *stored)
    assert sorted(a.usage.prompt_tokens_details.cached_tokens for a in got) == [0, found]
    for answer, prompt in zip(got, prompts, strict=True):
        assert same_answer(answer, complete(plain, prompt))


@pytest.fixture(scope="module")
def smollm2() -> Iterator[tuple[Running, Running]]:
    pytest.importorskip("gguf")
    from oneblock.inference.smollm2 import smollm2_gguf_path

    loaded = ob.load_model(smollm2_gguf_path())
    cached = Running(Engine(loaded.model, loaded.tokenizer, max_batch=4), model_name="smollm2")
    plain = Running(Engine(loaded.model, loaded.tokenizer, max_batch=4, prefix_bytes=0), model_name="smollm2")
    yield cached, plain
    cached.close()
    plain.close()


SYSTEM = (
    "You are a careful assistant for a small bakery. The bakery opens at seven in the morning and closes at six "
    "in the evening, every day but Monday. It sells sourdough, rye and spelt loaves, croissants, cinnamon rolls "
    "and three kinds of cake: lemon, chocolate and carrot. Loaves cost four euros, pastries two, a slice of cake "
    "three. Orders for whole cakes need two days' notice. The bakery is at 12 Mill Street, beside the river, and "
    "has no parking of its own; the public car park on Station Road is two minutes away on foot. Answer in one "
    "short sentence, politely, and never invent products or prices that are not listed here. If a customer asks "
    "about allergies, say that every product may contain traces of nuts, milk and eggs, and that the spelt loaf "
    "is the only one without wheat flour. Deliveries are made on Fridays within five kilometres, for orders over "
    "thirty euros, and the bakery takes cards and cash but not cheques."
)


def test_a_shared_system_prompt_is_computed_once_on_the_gguf_model(smollm2):
    cached, plain = smollm2
    questions = ["When do you open?", "How much is a croissant?"]
    bodies = [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]} for q in questions]
    ids = [chat_prompt(body, cached.engine.tokenizer).ids for body in bodies]
    common = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    assert common >= 200

    def ask(running: Running, body: dict, **options):
        return openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0).chat.completions.create(
            model="smollm2", max_tokens=20, temperature=0, logprobs=True, top_logprobs=2, **body, **options
        )

    assert ask(cached, bodies[0]).usage.prompt_tokens_details.cached_tokens == 0
    second = ask(cached, bodies[1])
    assert second.usage.prompt_tokens == len(ids[1])
    assert second.usage.prompt_tokens_details.cached_tokens == reusable(len(ids[1]), common) > 0
    want = ask(plain, bodies[1])
    assert second.choices[0].message.content == want.choices[0].message.content
    assert [(t.token, t.logprob) for t in second.choices[0].logprobs.content] == [
        (t.token, t.logprob) for t in want.choices[0].logprobs.content
    ]


@pytest.fixture
def engine_calls(monkeypatch) -> Iterator[tuple[Running, list[tuple[int, int]], dict]]:
    """The tiny model served, each chunk read of a prompt recorded as (prompt length, steps run before it);
    ``fail`` names a prompt length whose second chunk raises."""
    engine = Engine(tiny_model(), ByteTokenizer(), max_batch=4)
    reads: list[tuple[int, int]] = []
    fail: dict = {}
    begin = engine.decoder.begin

    def recording_begin(ids, max_new, **options):
        slot, reading = begin(ids, max_new, **options)
        advance = reading.advance

        def recorded():
            reads.append((len(ids), engine.steps))
            if fail.get("length") == len(ids) and sum(n == len(ids) for n, _ in reads) == 2:
                raise RuntimeError("a product failed while reading this prompt")
            return advance()

        reading.advance = recorded
        return slot, reading

    monkeypatch.setattr(engine.decoder, "begin", recording_begin)
    running = Running(engine, api_key=KEY)
    yield running, reads, fail
    running.close()


def stream_in_background(running: Running, max_tokens: int) -> tuple[threading.Thread, threading.Event, list[str]]:
    started, pieces = threading.Event(), []

    def read() -> None:
        for chunk in client(running).completions.create(
            model="m", prompt=[1, 2, 3], max_tokens=max_tokens, temperature=0, stream=True
        ):
            pieces.append(chunk.choices[0].text)
            started.set()

    thread = threading.Thread(target=read)
    thread.start()
    return thread, started, pieces


def test_a_long_prompt_is_read_one_chunk_per_step_beside_a_decoding_row(engine_calls):
    running, reads, _ = engine_calls
    thread, started, pieces = stream_in_background(running, 300)
    assert started.wait(60)
    prompt = SHARED + SHARED  # 400 tokens: 11 chunks of 32, then (352, 400)
    answer = complete(running, prompt, max_tokens=4)
    thread.join(120)
    mine = [steps for n, steps in reads if n == 400]
    assert len(mine) == 12
    assert all(b == a + 1 for a, b in itertools.pairwise(mine))  # one decoding step between two chunks
    alone = Running(Engine(running.engine.decoder.model, ByteTokenizer(), prefix_bytes=0), api_key=KEY)
    try:
        assert same_answer(answer, complete(alone, prompt, max_tokens=4))
        assert "".join(pieces) == complete(alone, [1, 2, 3], max_tokens=300, logprobs=None).choices[0].text
    finally:
        alone.close()


def test_a_read_that_fails_midway_fails_its_request_alone(engine_calls):
    running, _, fail = engine_calls
    fail["length"] = 300
    thread, started, pieces = stream_in_background(running, 100)
    assert started.wait(60)
    with pytest.raises(openai.InternalServerError, match=r"internal error \(RuntimeError\)"):
        complete(running, (SHARED * 2)[:300])
    thread.join(120)
    assert len("".join(pieces)) > 0 and running.engine.load() == (0, 0) and running.engine.reserved == 0
    assert complete(running, SHARED[:50], max_tokens=3).usage.completion_tokens == 3
