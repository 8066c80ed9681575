"""The model benchmark's prompt: the same length in ids for oneblock and for llama-bench."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_models

from oneblock.inference.smollm2 import smollm2_gguf_path
from oneblock.io.gguf.tokenizer import GGUFTokenizer


def test_the_prompt_is_whole_words_of_at_most_the_asked_length_and_says_its_length() -> None:
    tokenizer = GGUFTokenizer.from_gguf(smollm2_gguf_path())
    for tokens in (17, 100, 495):
        text, length = bench_models.prompt_of(tokenizer, tokens)
        assert length == len(tokenizer.encode(text))  # the length llama-bench is given is what oneblock reads
        assert tokens - 12 <= length <= tokens  # the longest run of whole words that fits: one word short at most
        assert bench_models.PROMPT.startswith(text[:40]) and not text.endswith(" ")


def test_the_memory_bound_counts_the_cache_oneblock_allocates() -> None:
    import torch

    from oneblock.inference.smollm2 import load_smollm2

    model, _ = load_smollm2()
    cache = model.new_cache(1, max_len=100)
    held = sum(layer.k.nbytes + layer.v.nbytes for layer in cache.layers)
    assert bench_models.cache_bytes(smollm2_gguf_path(), 100) == held == 2 * 30 * 3 * 64 * 100 * 4
    half = model.new_cache(1, max_len=100, dtype=torch.float16)
    held = sum(layer.k.nbytes + layer.v.nbytes for layer in half.layers)
    assert bench_models.cache_bytes(smollm2_gguf_path(), 100, "float16") == held == 2 * 30 * 3 * 64 * 100 * 2
    assert bench_models.memory_bound(1000, 200, 50) == 50 + 1320  # torch's share, then the file and cache + 10%
    assert 50e6 < bench_models.torch_rss() < 2e9  # a process that imported torch, measured as oneblock measures


def test_ratios_are_the_median_of_each_rounds_ratio() -> None:
    samples = {"oneblock_decode": [30.0, 60.0, 50.0], "llamacpp_decode": [20.0, 60.0, 40.0]}
    assert bench_models.round_ratio(samples, "decode") == 1.25  # rounds: 1.5, 1.0, 1.25; medians' ratio: 1.25 too
    samples = {"oneblock_prefill": [100.0, 300.0, 200.0], "llamacpp_prefill": [50.0, 290.0, 210.0]}
    assert bench_models.round_ratio(samples, "prefill") == 300.0 / 290.0  # the medians' ratio would be 0.95
    assert bench_models.round_ratio({"oneblock_decode": [1.0]}, "decode") is None  # llama.cpp not built
