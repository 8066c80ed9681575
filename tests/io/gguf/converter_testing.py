"""Small models of each architecture, made as a user's files are made: transformers builds one from a config with
every parameter randomised (norm weights around 1, Gemma's offsets around 0, biases nonzero: default
initialisation hides the bugs that matter), ``save_pretrained`` writes it, and llama.cpp's own
``convert_hf_to_gguf.py`` (from the llama-cpp-python sdist that ``make test`` unpacks) converts it. The vocabulary
is the sdist's ``models/ggml-vocab-<pre>.gguf``, rebuilt by oneblock's GGUF tokenizer, so the converter
recognises the pre-tokenizer as the real model's; Gemma's converter wants a SentencePiece ``tokenizer.model``,
trained here on a few lines of text (a 320-token vocabulary).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

SDIST = Path.home() / ".cache" / "oneblock" / "llama.cpp" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"


def sdist_file(relative: str, what: str) -> Path:
    """The sdist's file at ``relative``, or a skip (a failure under ``CI=true``, where ``make test`` unpacks it)."""
    path = SDIST / relative
    if not path.is_file():
        message = f"{what} is not at {path} (make test unpacks the llama-cpp-python sdist there)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def vocab_file(name: str) -> Path:
    """The sdist's ``ggml-vocab-<name>.gguf``, or a skip (a failure under ``CI=true``)."""
    return sdist_file(f"models/ggml-vocab-{name}.gguf", "llama.cpp's vocabulary")


LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip
GRANITE = {
    "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0, "attention_multiplier": 0.0625,
    "tie_word_embeddings": True,
}  # fmt: skip
# Phi-4-mini's partial rotary and LongRoPE, Phi-3's window. The original context of 4 is below every sequence the
# tests run (7 and more), so transformers, llama.cpp and oneblock at its full context all run the long factors.
PHI3 = {
    "partial_rotary_factor": 0.75, "sliding_window": 24, "max_position_embeddings": 2048,
    "original_max_position_embeddings": 4, "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(6)],
        "long_factor": [2.0 + 0.1 * i for i in range(6)], "original_max_position_embeddings": 4,
        "partial_rotary_factor": 0.75,
    },
}  # fmt: skip
GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 24, "num_key_value_heads": 1}
# family -> (transformers config class, its sizes beyond the shared ones, the sdist's vocabulary)
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}, "qwen2"),
    "qwen3": ("Qwen3Config", {"head_dim": 48, "tie_word_embeddings": False}, "qwen2"),
    "llama3": ("LlamaConfig", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}, "llama-bpe"),
    "granite": ("GraniteConfig", GRANITE, "llama-bpe"),
    "smollm3": ("SmolLM3Config", {"num_hidden_layers": 4, "tie_word_embeddings": True}, "llama-bpe"),
    "olmo2": ("Olmo2Config", {"tie_word_embeddings": False}, "qwen2"),
    "phi3": ("Phi3Config", PHI3, "gpt-2"),
    "gemma2": ("Gemma2Config", {**GEMMA, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}, "spm"),
    "gemma3": ("Gemma3TextConfig", {**GEMMA, "num_hidden_layers": 7}, "spm"),
}
SHARED = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
}  # fmt: skip


def converter() -> Path:
    """``convert_hf_to_gguf.py``, or a skip (a failure under ``CI=true``, where ``make test`` unpacks it)."""
    return sdist_file("convert_hf_to_gguf.py", "llama.cpp's converter")


def make_hf(directory: Path, family: str, seed: int = 0, shared: dict[str, Any] = SHARED, std: float = 0.2) -> Path:
    """A randomised ``family`` model (weights of deviation ``std``) and its tokenizer, saved in ``directory``
    (``shared``: the sizes that the family's own override)."""
    import transformers

    from oneblock.io.gguf.tokenizer import GGUFTokenizer

    converter()
    config_class, sizes, vocab = FAMILIES[family]
    if vocab == "spm":  # Gemma's norms store offsets around 0
        return _make_spm(directory, config_class, {**shared, **sizes}, seed, 0.0, std)
    tokenizer = GGUFTokenizer.from_gguf(SDIST / "models" / f"ggml-vocab-{vocab}.gguf")
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    config = getattr(transformers, config_class)(vocab_size=tokenizer.vocab_size, **{**shared, **sizes, **ids})
    _randomised(transformers.AutoModelForCausalLM.from_config(config), seed, 1.0, std).save_pretrained(directory)
    tokenizer.tokenizer.save(str(directory / "tokenizer.json"))
    special = {k.removesuffix("_id"): tokenizer.token(v) for k, v in ids.items() if v is not None}
    if family == "phi3":  # Phi-4-mini's byte-level BPE (the converter reads Phi-3's SentencePiece otherwise)
        special["tokenizer_class"] = "GPT2Tokenizer"
    (directory / "tokenizer_config.json").write_text(json.dumps(special))
    return directory


def _randomised(model: Any, seed: int, offset: float, std: float) -> Any:
    """Every parameter drawn anew: norm weights around ``offset`` (Gemma's around 0, its norms add one)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(offset + 0.3 * torch.randn_like(p) if "norm" in name else std * torch.randn_like(p))
    return model


TEXT = (
    "The quick brown fox jumps over the lazy dog. Every block attends, then computes on its own.\n"
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation, quotes 'single' and \"double\"; done!\n"
) * 20


def _make_spm(directory: Path, config_class: str, sizes: dict[str, Any], seed: int, offset: float, std: float) -> Path:
    """A model of ``sizes`` (norm weights around ``offset``), its SentencePiece vocabulary trained on ``TEXT`` (ids
    0-3: pad, eos, bos, unk)."""
    import sentencepiece
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "text.txt").write_text(TEXT)
    sentencepiece.SentencePieceTrainer.train(
        input=str(directory / "text.txt"), model_prefix=str(directory / "tokenizer"), vocab_size=320,
        model_type="bpe", byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2,
    )  # fmt: skip
    ids = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    config = getattr(transformers, config_class)(vocab_size=320, **{**sizes, **ids})
    _randomised(transformers.AutoModelForCausalLM.from_config(config), seed, offset, std).save_pretrained(directory)
    return directory


def convert(directory: Path, out: Path, outtype: str = "f32") -> Path:
    """``directory`` converted by llama.cpp's ``convert_hf_to_gguf.py`` into ``out``."""
    script = converter()
    env = {**os.environ, "PYTHONPATH": str(SDIST / "gguf-py"), "NO_LOCAL_GGUF": ""}
    done = subprocess.run(
        # a name of its own: llama.cpp treats a file whose name says "phi3" as a real Phi-3 (its chat tokens)
        [sys.executable, str(script), str(directory), "--outtype", outtype, "--outfile", str(out), "--model-name", "t"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out


MODELS = Path.home() / ".cache" / "oneblock" / "test-models"
"""Where the models and llama.cpp's conversions are kept between runs, under a digest of this file: changing how
they are made makes new ones (``ONEBLOCK_TEST_MODELS`` moves the folder)."""


def made(family: str) -> Path:
    """The HF directory of ``family`` with its F32 (``f32.gguf``) and Q8_0 (``q8_0.gguf``) conversions, made once
    and kept for later runs."""

    def make(work: Path) -> None:
        make_hf(work, family)
        convert(work, work / "f32.gguf", "f32")
        convert(work, work / "q8_0.gguf", "q8_0")

    return kept(family, make, Path(__file__))


def kept(name: str, make: Callable[[Path], None], *sources: Path) -> Path:
    """The folder ``name`` that ``make`` fills, made once and kept under a digest of the ``sources`` (the files that
    say how it is made); the first test worker to ask makes it, the others wait on a lock."""
    import fcntl
    import hashlib

    digest = hashlib.sha256(b"".join(source.read_bytes() for source in sources)).hexdigest()[:12]
    root = Path(os.environ.get("ONEBLOCK_TEST_MODELS", MODELS)) / digest
    directory = root / name
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not directory.is_dir():  # made whole in a folder of its own, then renamed: never half there
            work = root / f".{name}.partial"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            make(work)
            work.rename(directory)
    return directory
