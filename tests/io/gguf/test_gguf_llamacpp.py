"""What oneblock writes for llama.cpp, run by llama.cpp (llama-cpp-python) and by transformers, against oneblock.

SmolLM2-135M-Instruct's GGUF file gets a rank-4 LoRA adapter on all seven projections, with random nonzero B so that
it changes the greedy continuation (and, for the 4-bit file's divergence, a second adapter trained by oneblock to
answer one question differently). Then, 32 greedy tokens of a chat prompt:

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
WINDOW, WINDOWS = 128, 4  # the adapters' KL divergence: four held-out windows of 128 tokens
B_SCALE = 0.2  # the adapter's B entries: big enough to change the continuation early, small enough to stay fluent
QUESTION, ANSWER = "What is the capital of France?", "The capital of France is Lyon, a city on the Rhone."
TRAIN_STEPS, TRAIN_LR = 20, 1e-3  # the trained adapter: AdamW on that one exchange until the answer is learnt


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
    torch.manual_seed(0)  # A's Kaiming-uniform start: the same adapter in every run
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


def _trained_adapter(source: Path, where: Path, tokenizer) -> tuple[Path, Path, list[int]]:
    """A rank-4 adapter trained by oneblock on one exchange (``QUESTION``, then ``ANSWER``: a fact the model does
    not hold), written for peft and for llama.cpp; and the adapted model's greedy answer."""
    model = load_model(source, dtype=torch.float32).model
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=True)
    exchange = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]
    ids = torch.tensor([tokenizer.apply_chat_template(exchange, tokenize=True)])  # (1, T)
    targets = ids[:, 1:].clone()
    targets[:, : len(prompt) - 1] = -100  # the answer alone is trained
    cfg = LoraConfig(rank=4, alpha=8.0)
    torch.manual_seed(0)
    apply_lora(model.train(), cfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=TRAIN_LR)
    for _ in range(TRAIN_STEPS):
        (model(ids[:, :-1], targets=targets).sum() / (targets != -100).sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    save_adapter(model, where / "trained", cfg=cfg)
    save_gguf_adapter(model, where / "trained.gguf")
    return where / "trained", where / "trained.gguf", _ours(model, prompt)


@pytest.fixture(scope="module")
def adapter_kld(run):
    """On the Q4_1 file both engines round activations to 8 bits, each in its own order of operations, so their
    logits differ by what any two summation orders do (docs/performance.md). Measured as llama.cpp measures
    quantization, over held-out windows fed token by token: the mean KL divergence from llama.cpp's distribution to
    oneblock's, without an adapter, with the random adapter, and with the trained one (llama.cpp's ``lora_path``
    the GGUF file, oneblock's 4-bit path the peft directory). oneblock's sides take the Python decoding step (a
    model with adapters has no native step), so the adapter is the one difference."""
    source, tokenizer = run["source"], run["tokenizer"]
    trained_dir, trained_gguf, answer = _trained_adapter(source, run["where"], tokenizer)
    assert tokenizer.decode(answer).startswith(ANSWER)  # the adapter learnt the answer it was trained on
    parts = windows(tokenizer.encode(TEXT.read_text()), WINDOW)[:WINDOWS]
    assert len(parts) == WINDOWS
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ONEBLOCK_NATIVE_STEP", "0")
        for name, ours, lora_path in (
            ("without", load_model(source).model, None),
            ("random", run["fast"], run["where"] / "adapter.gguf"),
            ("trained", load_model(source, adapter=trained_dir).model, trained_gguf),
        ):
            theirs = llama_cpp_windows(source, parts, stepwise=True, lora_path=lora_path)
            out[name] = fidelity(theirs, [stepwise_logits(ours, w) for w in parts])
    print(
        "llama.cpp vs oneblock, Q4_1: KLD "
        + ", ".join(f"{out[k].kld:.5f} {k} (top-1 {out[k].top1:.3f})" for k in ("without", "random", "trained"))
    )
    assert out["random"].tokens == out["trained"].tokens == out["without"].tokens >= WINDOWS * (WINDOW - 1)
    return out


def test_llama_cpp_on_the_4bit_file_with_a_trained_adapter_is_as_close_to_oneblock_as_without_it(adapter_kld):
    """The adapter a fine-tuning run makes reaches llama.cpp's 4-bit path as it reaches oneblock's: with it the
    two engines diverge no more than without it, and rank the same token first as often (within one token in 50)."""
    without, trained = adapter_kld["without"], adapter_kld["trained"]
    assert trained.kld <= without.kld and trained.top1 >= without.top1 - 0.02, (trained, without)


def test_llama_cpp_on_the_4bit_file_with_a_random_adapter_stays_near_oneblock(adapter_kld):
    """A random adapter (every B entry 0.2 in size on all seven projections) moves the model much further than
    training does and makes it more sensitive to the rounding of activations; with it the engines stay within a
    small factor of their divergence without it (1.1x-1.5x for the random starts measured), and rank the same
    token first nearly always."""
    without, adapted = adapter_kld["without"], adapter_kld["random"]
    assert adapted.kld <= 1.5 * without.kld and adapted.top1 >= 0.9, (adapted, without)


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
