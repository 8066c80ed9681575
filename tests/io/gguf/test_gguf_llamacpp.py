"""What oneblock writes for llama.cpp, run by llama.cpp (llama-cpp-python) and by transformers, against oneblock.

SmolLM2-135M-Instruct's GGUF file gets a rank-4 LoRA adapter on all seven projections, with random nonzero B so that
it changes the greedy continuation. Then, 32 greedy tokens of a chat prompt:

* llama.cpp with ``lora_path=`` the GGUF adapter (over the 4-bit file) = oneblock's float32 model with the adapter;
* the merged model written as an F32 GGUF file, in llama.cpp = oneblock's merged float32 model, and llama.cpp
  tokenizes the prompt with the copied vocabulary into the same ids;
* the merged model written as a Hugging Face directory, in transformers = the same.

llama-cpp-python takes a long build; without it these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from llamacpp_testing import llama_cpp_windows

from oneblock.adapters.apply import apply_lora, lora_modules, merge_lora
from oneblock.adapters.gguf import save_gguf_adapter
from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.peft import save_adapter
from oneblock.inference.fidelity import fidelity, stepwise_logits, windows
from oneblock.inference.generation import generate
from oneblock.inference.load import load_model
from oneblock.inference.smollm2 import smollm2_gguf_path
from oneblock.io.gguf.write import save_gguf
from oneblock.io.gguf.writer import typed_metadata

NEW = 32
TEXT = Path(__file__).parent / "data" / "heldout.txt"
WINDOW, WINDOWS = 128, 2  # the adapter's KL divergence: two held-out windows of 128 tokens
B_SCALE = 0.2  # the adapter's B entries: big enough to change the continuation early, small enough to stay fluent


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        message = "llama-cpp-python is not installed (make test builds it into the venv: pip install llama-cpp-python)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)  # CI builds it: its absence there is a broken set-up, not a skip
        pytest.skip(message)
    return llama_cpp


def _llama_cpp_greedy(llama_cpp, model_path, prompt: list[int], lora_path=None) -> list[int]:
    llm = llama_cpp.Llama(
        model_path=str(model_path), lora_path=None if lora_path is None else str(lora_path), n_ctx=256, n_threads=2,
        seed=0, verbose=False,
    )  # fmt: skip
    tokens: list[int] = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == NEW:
            break
    llm.close()
    return tokens


def _ours(model, prompt: list[int]) -> list[int]:
    return generate(model, torch.tensor([prompt]), NEW, greedy=True)[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The adapter (peft and GGUF), the prompt, and oneblock's tokens before and after merging."""
    llama_cpp = _llama_cpp()
    where = tmp_path_factory.mktemp("gguf_llamacpp")
    source = smollm2_gguf_path()
    loaded = load_model(source, dtype=torch.float32)
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=True
    )
    base_tokens = _ours(model, prompt)
    vocabulary = typed_metadata(source, ("tokenizer.",))
    base_f32 = save_gguf(model, where / "base.gguf", vocabulary=vocabulary)  # the same base, float32, for llama.cpp
    cfg = LoraConfig(rank=4, alpha=8.0)
    apply_lora(model, cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.copy_(B_SCALE * torch.randn(module.lora_B.weight.shape, generator=gen))
    save_adapter(model, where / "adapter", cfg=cfg)
    save_gguf_adapter(model, where / "adapter.gguf")
    adapted = _ours(model, prompt)
    fast = load_model(source, adapter=where / "adapter").model  # the 4-bit file with the peft adapter
    adapted_fast = _ours(fast, prompt)
    merge_lora(model, unload=True)
    out = {
        "llama_cpp": llama_cpp, "source": source, "where": where, "prompt": prompt, "base": base_tokens,
        "adapted": adapted, "merged": _ours(model, prompt), "model": model, "tokenizer": tokenizer,
        "base_f32": base_f32, "adapted_fast": adapted_fast, "fast": fast,
    }  # fmt: skip
    return out


def test_llama_cpp_with_the_gguf_adapter_equals_oneblock_with_the_adapter(run):
    """The adapter file's names, shapes, row order and alpha, proven on float32 weights on both sides: llama.cpp
    multiplies F32 matrices in float, so its greedy tokens equal oneblock's exact model with the adapter."""
    assert run["adapted"] != run["base"]  # the adapter changes the continuation
    adapter = run["where"] / "adapter.gguf"
    theirs = _llama_cpp_greedy(run["llama_cpp"], run["base_f32"], run["prompt"], lora_path=adapter)
    assert theirs == run["adapted"]


@pytest.fixture(scope="module")
def adapter_kld(run):
    """On the Q4_1 file both engines round activations to 8 bits, each in its own order of operations, so their
    logits differ by what any two summation orders do (docs/performance.md). Measured as llama.cpp measures
    quantization, over held-out windows fed token by token: the mean KL divergence from llama.cpp's distribution to
    oneblock's, with the GGUF adapter (llama.cpp's ``lora_path``) and oneblock's 4-bit path with the same adapter
    from peft's files, and without it. Both of oneblock's sides take the Python decoding step (a model with
    adapters has no native step), so the adapter is the one difference."""
    source, adapter = run["source"], run["where"] / "adapter.gguf"
    parts = windows(run["tokenizer"].encode(TEXT.read_text()), WINDOW)[:WINDOWS]
    base = load_model(source).model
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONEBLOCK_NATIVE_STEP", "0")
        without = fidelity(llama_cpp_windows(source, parts, stepwise=True), [stepwise_logits(base, w) for w in parts])
        adapted = fidelity(
            llama_cpp_windows(source, parts, stepwise=True, lora_path=adapter),
            [stepwise_logits(run["fast"], w) for w in parts],
        )
    print(f"llama.cpp vs oneblock, Q4_1: KLD {without.kld:.5f} without the adapter, {adapted.kld:.5f} with it")
    assert adapted.tokens == without.tokens >= WINDOWS * (WINDOW - 1)
    return without, adapted


def test_llama_cpp_on_the_4bit_file_with_the_adapter_stays_near_oneblock(adapter_kld):
    """The adapter's tensors, names and scale reach llama.cpp's 4-bit path as they reach oneblock's: with it the two
    engines stay within a small factor of their divergence without it, and rank the same token first nearly always."""
    without, adapted = adapter_kld
    assert adapted.kld <= 1.5 * without.kld and adapted.top1 >= 0.9, (adapted, without)


@pytest.mark.xfail(
    strict=False,
    reason="not met: with the adapter the divergence is 1.30x the divergence without it on an AMD EPYC (KLD 0.00476 "
    "against 0.00366 over 254 tokens); a random adapter with B entries of 0.2 makes the model more sensitive to "
    "the rounding of activations",
)
def test_llama_cpp_on_the_4bit_file_with_the_adapter_is_as_close_to_oneblock_as_without_it(adapter_kld):
    without, adapted = adapter_kld
    assert adapted.kld <= without.kld, (adapted, without)


def test_merged_f32_gguf_in_llama_cpp_equals_oneblock_merged(run):
    assert run["merged"] == run["adapted"]
    path = save_gguf(
        run["model"], run["where"] / "merged.gguf", vocabulary=typed_metadata(run["source"], ("tokenizer.",))
    )
    llama_cpp = run["llama_cpp"]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, vocab_only=True, verbose=False)
    text = run["tokenizer"].decode(run["prompt"])
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == run["prompt"]
    llm.close()
    assert _llama_cpp_greedy(llama_cpp, path, run["prompt"]) == run["merged"]


def test_merged_hf_directory_in_transformers_equals_oneblock_merged(run):
    import transformers

    from oneblock.io.hf.convert import save_hf

    save_hf(run["model"], run["where"] / "merged-hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(run["where"] / "merged-hf", dtype=torch.float32).eval()
    ids = torch.tensor([run["prompt"]])
    with torch.no_grad():  # greedy by hand: generate() would stop at, or with min_new_tokens forbid, <|im_end|>
        for _ in range(NEW):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ids[0, len(run["prompt"]) :].tolist() == run["merged"]
