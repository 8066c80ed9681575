"""The default GGUF path computes what llama.cpp computes, checked against llama.cpp itself (llama-cpp-python).

SmolLM2-135M-Instruct Q4_1, llama.cpp with its key/value cache in float32 (``type_k = type_v = 0``, GGML_TYPE_F32)
and every position's logits kept (``logits_all``), 2 threads; the same token ids on both sides, five prompts:

* oneblock's logits at every prompt position lie within 1% of llama.cpp's logit range at that position;
* the first greedy token is the same on every prompt;
* on each prompt, at least 90% of 64 greedy tokens agree before the first divergence (near-ties may flip with
  the summation order).

Without llama-cpp-python the tests skip with a message; under ``CI=true`` they fail (CI builds it).
"""

from __future__ import annotations

import os

import pytest
import torch

from oneblock.inference.generation import generate

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a",
    "The three primary colors are",
    "<|im_start|>user\nWhat is a transformer block?<|im_end|>\n<|im_start|>assistant\n",
]
NEW = 64
F32 = 0  # GGML_TYPE_F32


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        message = (
            "llama-cpp-python is not installed (make test builds it into the venv); the llama.cpp reference is missing"
        )
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)  # CI builds it: its absence there is a broken set-up, not a skip
        pytest.skip(message)
    return llama_cpp


@pytest.fixture(scope="module")
def both():
    llama_cpp = _llama_cpp()
    from oneblock.io.gguf.smollm2 import load_smollm2, smollm2_gguf_path

    path = smollm2_gguf_path()
    theirs = llama_cpp.Llama(
        model_path=str(path), n_ctx=256, n_batch=256, n_threads=2, n_threads_batch=2, logits_all=True,
        type_k=F32, type_v=F32, verbose=False,
    )  # fmt: skip
    ours, tokenizer = load_smollm2()  # the default path: block matrices through oneblock's kernels
    return ours, tokenizer, theirs


def llama_cpp_run(llm, prompt: list[int], new: int) -> tuple[torch.Tensor, list[int]]:
    """llama.cpp's logits at every prompt position (T, V) and its ``new`` greedy tokens."""
    llm.reset()
    llm.eval(prompt)
    logits = torch.tensor(llm.scores[: len(prompt)]).float()  # (T, V)
    tokens: list[int] = []
    for _ in range(new):
        tokens.append(int(llm.scores[llm.n_tokens - 1].argmax()))
        if len(tokens) < new:
            llm.eval([tokens[-1]])
    return logits, tokens


def test_logits_and_greedy_tokens_match_llama_cpp(both):
    ours, tokenizer, theirs = both
    figures = []
    for text in PROMPTS:
        prompt = tokenizer.encode(text)
        reference, expected = llama_cpp_run(theirs, prompt, NEW)
        with torch.no_grad():
            logits = ours(torch.tensor([prompt]))[0]  # (T, V)
        spread = reference.amax(-1) - reference.amin(-1)  # (T,) llama.cpp's logit range per position
        worst = ((logits - reference).abs().amax(-1) / spread).max().item()
        tokens = generate(ours, prompt, NEW, greedy=True)[len(prompt) :].tolist()
        agree = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b), NEW)
        figures.append((text[:24], worst, agree))
        assert worst <= 0.01, (text, worst)
        assert tokens[0] == expected[0], (text, tokenizer.decode(tokens), tokenizer.decode(expected))
        assert agree >= 0.9 * NEW, (text, agree, tokenizer.decode(tokens), tokenizer.decode(expected))
    print("\n".join(f"{t!r}: logits within {w:.2%} of the range, {a}/{NEW} tokens agree" for t, w, a in figures))
