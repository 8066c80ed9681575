"""The default GGUF path computes what llama.cpp computes, checked against llama.cpp itself (llama-cpp-python).

SmolLM2-135M-Instruct Q4_1, llama.cpp with its key/value cache in float32 (``type_k = type_v = 0``, GGML_TYPE_F32)
and every position's logits kept (``logits_all``), 2 threads; the same token ids on both sides, five prompts.

Held here: the first greedy token is the same on every prompt, and the logits at every prompt position lie within
5% of llama.cpp's logit range (measured: 2.4% to 3.6%). Closer agreement of tensors is not what two correct 4-bit
paths can give: rounding every activation to 8 bits makes the model discontinuous, and SmolLM2 amplifies the flip of
a single rounding (a one-ulp perturbation of the embeddings moves the default path's logits by 1% to 3% of the
range, the float32 path's not at all; oneblock's own AVX2 and PyTorch kernel paths, equal per product within
3.5e-7, end 0.7% to 3.4% apart). Faithfulness is measured as llama.cpp measures quantization, by the KL divergence
from the float32 model and the top-1 agreement over a text, in test_llamacpp_kld.py.

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
pytestmark = pytest.mark.usefixtures("one_thread")  # oneblock's side; llama.cpp keeps its 2 threads
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
    from oneblock.inference.smollm2 import load_smollm2, smollm2_gguf_path

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


@pytest.fixture(scope="module")
def figures(both):
    """Per prompt: (text, worst logit gap / llama.cpp's range, first tokens equal, tokens agreeing before the first
    divergence, printed for the record)."""
    ours, tokenizer, theirs = both
    rows = []
    for text in PROMPTS:
        prompt = tokenizer.encode(text)
        reference, expected = llama_cpp_run(theirs, prompt, NEW)
        with torch.no_grad():
            logits = ours(torch.tensor([prompt]))[0]  # (T, V)
        spread = reference.amax(-1) - reference.amin(-1)  # (T,) llama.cpp's logit range per position
        worst = ((logits - reference).abs().amax(-1) / spread).max().item()
        tokens = generate(ours, prompt, NEW, greedy=True)[len(prompt) :].tolist()
        agree = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b), NEW)
        rows.append((text, worst, tokens[0] == expected[0], agree))
    print("\n".join(f"{t[:24]!r}: logits within {w:.2%} of the range, {a}/{NEW} tokens agree" for t, w, _, a in rows))
    return rows


def test_first_greedy_token_and_logits_match_llama_cpp(figures):
    for text, worst, first, _ in figures:
        assert first, text
        assert worst <= 0.05, (text, worst)
