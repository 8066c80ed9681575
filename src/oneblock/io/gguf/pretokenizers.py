"""How a GGUF byte-level BPE vocabulary cuts text into words before its merges, by ``tokenizer.ggml.pre``, as
llama.cpp names the rules: GPT-2's regex, SmolLM's digits first, Llama 3's and Qwen2's regexes.
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers

# Word-splitting regex of Llama 3 and its descendants (llama.cpp's "llama-bpe"): digits in groups of up to 3,
# case-insensitive English contractions.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2 and Qwen3 (llama.cpp's "qwen2"): Llama 3's regex with every digit on its own.
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    # GPT-2's own regex ('s|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) followed by the byte map.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm_split() -> pre_tokenizers.PreTokenizer:
    # SmolLM's tokenizer isolates every digit first, then applies GPT-2's split (llama.cpp: "smollm").
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _regex_split(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _llama3_split() -> pre_tokenizers.PreTokenizer:
    return _regex_split(LLAMA3_SPLIT)


def _qwen2_split() -> pre_tokenizers.PreTokenizer:
    return _regex_split(QWEN2_SPLIT)


# tokenizer.ggml.pre -> how text is cut into words before BPE. A missing key means "default" (GPT-2's regex).
PRE_TOKENIZERS = {
    "default": _gpt2_split,
    "gpt2": _gpt2_split,
    "gpt-2": _gpt2_split,  # llama.cpp's name for GPT-2's regex
    "smollm": _smollm_split,
    "llama-bpe": _llama3_split,
    "llama3": _llama3_split,
    "llama-v3": _llama3_split,
    "qwen2": _qwen2_split,
    "smaug-bpe": _llama3_split,
}
