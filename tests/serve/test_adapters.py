"""Adapters per request: a request's ``model`` picks the base or one adapter, and rows of different adapters share
each batched step, every row as its adapter served alone.

The tiny model in float32 carries two peft adapters (``load_adapters``); the references are servers (or engines)
of the same model carrying one adapter (``load_adapter``) or none, each request alone. The batched decoder of a
server with adapters takes the native step (the adapters' updates in it) and answers as its Python step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from serve_testing import KEY, Running, save_tiny_adapter, tiny_model

from oneblock import kernels
from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.multi import load_adapters
from oneblock.adapters.peft import load_adapter
from oneblock.cli.main import main
from oneblock.inference.native_step import ENV
from oneblock.inference.sampling import Sampling
from oneblock.io.checkpoint import save
from oneblock.serve import server as serve_server
from oneblock.serve.engine import Engine
from oneblock.serve.jobs import Done, Event, Job
from oneblock.text.tokenizer import ByteTokenizer

CONFIGS = {
    "terse": LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "up")),
    "chatty": LoraConfig(rank=2, alpha=4.0, targets=("k", "o", "gate", "down")),
}
PROMPTS = ["Once upon a time", "The colour of", "abc", "In the beginning"]
CHOSEN = [1, 0, 2, 1]  # each prompt's adapter: 0 the base
NEW = 12


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("adapters")
    return [save_tiny_adapter(root / name, cfg, seed) for seed, (name, cfg) in enumerate(CONFIGS.items(), start=1)]


def multi_engine(directories: list[str], **options: Any) -> Engine:
    model = tiny_model(int8=False)
    served = load_adapters(model, list(zip(CONFIGS, directories, strict=True)))
    return Engine(model, ByteTokenizer(), adapters=served, **options)


def single_engine(directory: str | None, **options: Any) -> Engine:
    model = tiny_model(int8=False)
    if directory is not None:
        load_adapter(model, directory)
    return Engine(model, ByteTokenizer(), **options)


def run_jobs(engine: Engine, prompts: list[str], adapters: list[int]) -> list[list[tuple[int, float]]]:
    """Submit every prompt at once (greedy, with log-probabilities); each one's (token, logprob) list."""
    done = threading.Event()
    scored: list[list[tuple[int, float]]] = [[] for _ in prompts]
    ended = [0]

    def emitter(i: int):
        def emit(event: Event) -> None:
            for token in getattr(event, "tokens", ()):
                scored[i].append((token.id, token.logprob))
            if isinstance(event, Done):
                ended[0] += 1
                if ended[0] == len(prompts):
                    done.set()
            assert not hasattr(event, "status"), event  # no Failed

        return emit

    tokenizer = ByteTokenizer()
    jobs = [
        Job(tokenizer.encode(p), NEW, Sampling(temperature=0), emitter(i), top=0, adapter=k)
        for i, (p, k) in enumerate(zip(prompts, adapters, strict=True))
    ]
    engine.submit_all(jobs)
    assert done.wait(60)
    return scored


def test_each_row_of_a_mixed_batch_equals_its_adapter_served_alone(directories):
    engine = multi_engine(directories, max_batch=8)
    try:
        got = run_jobs(engine, PROMPTS, CHOSEN)
        # short prompts are read together while they fit in one chunk's positions (16 + 13 + 3 of 32 bytes), so
        # three rows start together, the fourth joins a step later, and then they share every step
        assert engine.steps == NEW - 1 + 1
    finally:
        engine.close(grace=5)
    references = {k: single_engine(directories[k - 1] if k else None, max_batch=1) for k in set(CHOSEN)}
    try:
        for i, (prompt, k) in enumerate(zip(PROMPTS, CHOSEN, strict=True)):
            (want,) = run_jobs(references[k], [prompt], [0])
            assert [t for t, _ in got[i]] == [t for t, _ in want]  # the same greedy tokens
            # Float32 products block by the number of rows: the logits agree within 1e-5 of their scale (about 16
            # here; tests/adapters/test_multi.py checks logits), and a log-probability carries that difference.
            assert max(abs(a - b) for (_, a), (_, b) in zip(got[i], want, strict=True)) <= 1e-4
    finally:
        for reference in references.values():
            reference.close(grace=5)
    base, adapted = run_jobs(single_engine(None), [PROMPTS[0]], [0])[0], got[0]
    assert base != adapted  # the adapter changes the answer


def test_one_prompt_under_two_adapters_shares_no_cached_blocks(directories):
    """The prefix cache names a prompt's blocks by its adapter too: the same 70-byte prompt read first with an
    adapter, then with the base, gives the base's own answer (its two whole blocks are not the adapter's)."""
    prompt = "A long shared prefix that fills more than two blocks of thirty-two bytes."
    engine = multi_engine(directories, max_batch=1)
    try:
        adapted, base = run_jobs(engine, [prompt], [1])[0], run_jobs(engine, [prompt], [0])[0]
        assert engine.prefix.hits == 0  # nothing of the adapter's was found for the base
    finally:
        engine.close(grace=5)
    alone = single_engine(None, max_batch=1)
    try:
        (want,) = run_jobs(alone, [prompt], [0])
    finally:
        alone.close(grace=5)
    assert [t for t, _ in base] == [t for t, _ in want] and base != adapted


@pytest.fixture(scope="module")
def servers(directories) -> Iterator[dict[str, Running]]:
    """The two-adapter server, and one server per name with that model alone."""
    running = {"multi": Running(multi_engine(directories, max_batch=8), api_key=KEY, model_name="tiny")}
    running["tiny"] = Running(single_engine(None), api_key=KEY)
    for name, directory in zip(CONFIGS, directories, strict=True):
        running[name] = Running(single_engine(directory), api_key=KEY)
    yield running
    for server in running.values():
        server.close()


def client(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=KEY, max_retries=0, timeout=60)


def test_models_lists_the_base_and_its_adapters(servers):
    c = client(servers["multi"])
    listed = c.models.list().data
    assert [m.id for m in listed] == ["tiny", "terse", "chatty"]
    raw = httpx.get(servers["multi"].url + "/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert [entry.get("parent") for entry in raw] == [None, "tiny", "tiny"]  # vLLM's: an adapter names its base
    assert c.models.retrieve("chatty").id == "chatty"


def test_the_model_field_picks_the_adapter_and_equals_it_served_alone(servers):
    c = client(servers["multi"])
    answers: dict[str, Any] = {}

    def ask(name: str) -> None:  # at once, so the rows of different adapters share steps
        answers[name] = c.completions.create(model=name, prompt=PROMPTS[0], max_tokens=NEW, temperature=0)

    threads = [threading.Thread(target=ask, args=(name,)) for name in ("tiny", "terse", "chatty")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for name in ("tiny", "terse", "chatty"):
        alone = client(servers[name]).completions.create(model="x", prompt=PROMPTS[0], max_tokens=NEW, temperature=0)
        assert answers[name].choices[0].text == alone.choices[0].text
        assert answers[name].model == name and answers[name].usage == alone.usage
    assert len({answers[name].choices[0].text for name in answers}) == 3  # three different models
    chat = c.chat.completions.create(
        model="terse", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0
    )
    alone_chat = client(servers["terse"]).chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.content == alone_chat.choices[0].message.content


def ask_at_once(c: openai.OpenAI, names: list[str]) -> dict[str, Any]:
    """PROMPTS[i] to ``names[i]``, all at once (their rows share steps), greedy with log-probabilities."""
    answers: dict[str, Any] = {}

    def ask(i: int) -> None:
        answers[names[i]] = c.completions.create(
            model=names[i], prompt=PROMPTS[i], max_tokens=NEW, temperature=0, logprobs=1
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(names))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return answers


@pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library")
def test_serve_with_adapters_decodes_in_the_native_step_as_in_the_python_step(directories, tmp_path, monkeypatch):
    """``oneblock serve --adapter NAME=DIR ...``: the batched decoder takes the native step with the adapters'
    updates, and every model answers as from the same server decoding in the Python step
    (``ONEBLOCK_NATIVE_STEP=0``), the requests of the base and both adapters at once."""
    checkpoint = tmp_path / "tiny.safetensors"
    save(tiny_model(int8=False), checkpoint)
    made: list[tuple[Engine, dict[str, Any]]] = []
    monkeypatch.setattr(serve_server, "serve", lambda engine, **options: made.append((engine, options)))
    argv = ["serve", "--model", str(checkpoint), "--embedding-model", "none", "--max-batch", "8"]
    for name, directory in zip(CONFIGS, directories, strict=True):
        argv += ["--adapter", f"{name}={directory}"]
    assert main(argv) == 0
    monkeypatch.setenv(ENV, "0")
    assert main(argv) == 0
    (native, options), (python, _) = made
    assert native.decoder.native is not None and native.decoder.native.adapted  # the native step, adapted
    assert python.decoder.native is None
    names = [options["model_name"], *CONFIGS]
    assert names == ["tiny", "terse", "chatty"]
    answers = []
    for engine in (native, python):
        running = Running(engine, api_key=KEY, model_name=options["model_name"])
        try:
            answers.append(ask_at_once(client(running), names))
        finally:
            running.close()
    for name in names:
        got, want = answers[0][name].choices[0], answers[1][name].choices[0]
        assert got.text == want.text and answers[0][name].usage == answers[1][name].usage
        # logits within 1e-5 of their scale (tests/inference/test_native_lora.py), log-probabilities within 1e-4
        pairs = zip(got.logprobs.token_logprobs, want.logprobs.token_logprobs, strict=True)
        assert max(abs(a - b) for a, b in pairs) <= 1e-4
    assert len({answers[0][name].choices[0].text for name in names}) == 3  # three different models


def test_an_unknown_model_is_404_model_not_found(servers):
    with pytest.raises(openai.NotFoundError) as refused:
        client(servers["multi"]).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
    error = refused.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'gpt-4o'" in error["message"] and "terse" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client(servers["multi"]).completions.create(model="tiny2", prompt="x", max_tokens=3)
    # Without adapters any name is the one model, as llama-server answers.
    assert client(servers["tiny"]).completions.create(model="gpt-4o", prompt="x", max_tokens=3).usage


def test_the_engine_refuses_an_adapter_it_does_not_have(directories):
    engine = multi_engine(directories, max_batch=2)
    try:
        job = Job([1, 2], 2, Sampling(temperature=0), lambda event: None, adapter=3)
        with pytest.raises(ValueError, match=r"adapter 3 is not one of this engine's \(0 to 2\)"):
            engine.submit(job)
    finally:
        engine.close(grace=5)
