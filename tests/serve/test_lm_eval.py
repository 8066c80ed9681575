"""lm-eval scores a model through ``oneblock serve`` exactly as oneblock scores it directly.

lm-eval's ``local-completions`` model, with ``tokenized_requests=True`` and nothing else, runs the two tasks in
``evaluation/`` (a local JSONL and a task YAML each; no download): a multiple-choice task (each choice's
loglikelihood, read from ``echo`` with ``logprobs``) and a generation task (greedy text up to a newline). It
needs no tokenizer of its own: it finds the server's vLLM-style ``/tokenizer_info`` and ``/tokenize``
(``tokenizer_backend=remote``). The loglikelihoods it reads equal ``oneblock.inference.logprobs.loglikelihood`` on
the float32 model within 1e-4, so its accuracy is the one computed here; the generations equal ``generate``'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from serve_testing import TINY, Running

import oneblock as ob
from oneblock.inference.generation import generate
from oneblock.inference.logprobs import loglikelihood
from oneblock.serve.engine import Engine
from oneblock.text.tokenizer import ByteTokenizer

lm_eval = pytest.importorskip("lm_eval")
TASKS = Path(__file__).parent / "evaluation"
TOL = 1e-4


def float32_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(**TINY))
    with torch.no_grad():  # away from the tiny initial values, so the choices' scores differ
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return model.eval()


def evaluate(running: Running, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` on both tasks against ``running``, with every sample logged."""
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASKS)  # the YAMLs name their JSONL files relative to this folder
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={running.url}/completions,model=tiny,tokenized_requests=True",
        tasks=["oneblock_mc", "oneblock_gen"],
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
    )


@pytest.fixture(scope="module")
def results() -> Any:
    running = Running(Engine(float32_model(), ByteTokenizer(), max_batch=2, max_queue=4))
    with pytest.MonkeyPatch.context() as monkeypatch:
        out = evaluate(running, monkeypatch)
    yield running, out
    running.close()


def docs(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines()]


def pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The ids lm-eval scores: the whole text encoded, split after the context's ids."""
    whole, head = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return head, whole[len(head) :]


def test_multiple_choice_loglikelihoods_equal_oneblocks(results):
    running, out = results
    model, tokenizer = running.engine.decoder.model, ByteTokenizer()
    samples = sorted(out["samples"]["oneblock_mc"], key=lambda s: s["doc_id"])
    truth = docs("mc.jsonl")
    assert len(samples) == len(truth) == 6
    right = 0
    for sample, doc in zip(samples, truth, strict=True):
        assert len(sample["resps"]) == len(doc["choices"])
        mine = []
        for (context, continuation), [(served, greedy)] in zip(sample["arguments"], sample["resps"], strict=True):
            assert continuation == " " + doc["choices"][len(mine)]
            want, want_greedy = loglikelihood(model, *pair(tokenizer, context, continuation))
            assert abs(served - want) < TOL and greedy == want_greedy, (context, continuation, served, want)
            mine.append(want)
        right += int(max(range(len(mine)), key=mine.__getitem__) == doc["answer"])
    assert out["results"]["oneblock_mc"]["acc,none"] == pytest.approx(right / len(truth), abs=1e-12)


def test_generations_equal_greedy_generate(results):
    running, out = results
    model, tokenizer = running.engine.decoder.model, ByteTokenizer()
    samples = sorted(out["samples"]["oneblock_gen"], key=lambda s: s["doc_id"])
    truth = docs("gen.jsonl")
    assert len(samples) == len(truth) == 3
    hits = 0
    for sample, doc in zip(samples, truth, strict=True):
        prompt = tokenizer.encode(doc["question"])
        ids = generate(model, prompt, 8, greedy=True)[len(prompt) :].tolist()
        want = tokenizer.decode(ids).split("\n")[0]
        assert sample["resps"] == [[want]]
        hits += int(want.strip() == doc["answer"].strip())
    assert out["results"]["oneblock_gen"]["exact_match,none"] == pytest.approx(hits / len(truth), abs=1e-12)


def test_smollm2_scores_equal_oneblocks_on_the_default_path(monkeypatch):
    """SmolLM2-135M-Instruct's 4-bit GGUF: the scores lm-eval reads are the ones ``loglikelihood`` computes on the
    same model (one forward over the same ids, the same kernels), and so is the accuracy."""
    pytest.importorskip("gguf")
    from oneblock.errors import CheckpointError
    from oneblock.inference.smollm2 import smollm2_gguf_path

    try:
        loaded = ob.load_model(smollm2_gguf_path())
    except (CheckpointError, ImportError) as error:
        pytest.skip(str(error))
    running = Running(Engine(loaded.model, loaded.tokenizer, max_batch=2, max_queue=4))
    try:
        out = evaluate(running, monkeypatch)
    finally:
        running.close()
    truth, right = docs("mc.jsonl"), 0
    for sample, doc in zip(sorted(out["samples"]["oneblock_mc"], key=lambda s: s["doc_id"]), truth, strict=True):
        mine = []
        for (context, continuation), [(served, greedy)] in zip(sample["arguments"], sample["resps"], strict=True):
            want, want_greedy = loglikelihood(loaded.model, *pair(loaded.tokenizer, context, continuation))
            assert abs(served - want) < TOL and greedy == want_greedy, (context, continuation, served, want)
            mine.append(want)
        right += int(max(range(len(mine)), key=mine.__getitem__) == doc["answer"])
    assert out["results"]["oneblock_mc"]["acc,none"] == pytest.approx(right / len(truth), abs=1e-12)
    print("SmolLM2 accuracy", right, "of", len(truth))
