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
