"""A Hugging Face directory's byte-level BPE tokenizer as the ``tokenizer.*`` metadata of a GGUF file.

llama.cpp stores a tokenizer as ``tokenizer.ggml.model = gpt2`` (byte-level BPE), the vocabulary by id
(``tokens``), each token's type (``token_type``: 1 normal, 3 control, 4 user-defined), the merges as ``"left
right"`` strings, ``pre`` naming its word-splitting regex, the special ids, and the chat template. Everything comes
from ``tokenizer.json`` and ``tokenizer_config.json``; the word-splitting rule is recognised from the
pre-tokenizer's structure, for the four rules oneblock's reader knows (``gpt2``, ``smollm``, ``llama-bpe``,
``qwen2``), and anything else (SentencePiece, WordPiece, another regex) is refused by name rather than written wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oneblock import jsontext
from oneblock.errors import ConversionError
from oneblock.io.files import read_bytes
from oneblock.io.gguf.pretokenizers import LLAMA3_SPLIT, QWEN2_SPLIT
from oneblock.io.gguf.writer import Entry

_U32, _I32, _BOOL, _STR, _ARRAY = 4, 5, 7, 8, 9
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def _pre_name(pre: dict[str, Any] | None) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a tokenizer.json ``pre_tokenizer``."""
    if pre is None:
        raise ConversionError("tokenizer.json has no pre_tokenizer; llama.cpp's byte-level BPE needs one")
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    split = steps[0].get("pattern", {}).get("Regex") if kinds == ["Split", "ByteLevel"] else None
    if split == LLAMA3_SPLIT:
        return "llama-bpe"
    if split == QWEN2_SPLIT:
        return "qwen2"
    raise ConversionError(
        f"tokenizer.json splits words with {kinds}, which matches none of the rules oneblock writes for llama.cpp "
        "(GPT-2's ByteLevel, SmolLM's Digits + ByteLevel, Llama 3's or Qwen2's Split + ByteLevel); convert the "
        "model with "
        "llama.cpp's convert_hf_to_gguf.py instead"
    )


def _token_id(config: dict[str, Any], key: str, vocab: dict[str, int]) -> int | None:
    token = config.get(key)
    if isinstance(token, dict):  # an AddedToken written out: {"content": "<|im_end|>", ...}
        token = token.get("content")
    return vocab.get(token) if isinstance(token, str) else None


def vocabulary_from_hf(directory: str | Path, vocab_size: int | None = None) -> list[Entry]:
    """The ``tokenizer.*`` entries of a GGUF file for the tokenizer of a Hugging Face model directory.

    Args:
        directory: holds ``tokenizer.json`` (and usually ``tokenizer_config.json``, for the special tokens and
            the chat template).
        vocab_size: the model's vocabulary size; ids the tokenizer lacks up to it become ``[PAD{i}]`` entries,
            as llama.cpp's converter writes them.

    Raises:
        ConversionError: no tokenizer.json, a model other than byte-level BPE, or an unknown word-splitting rule.
    """
    path = Path(directory)
    if not (path / "tokenizer.json").is_file():
        raise ConversionError(f"{str(path)!r} has no tokenizer.json; a GGUF file needs the model's tokenizer")
    spec = _read_json(path / "tokenizer.json")
    config_path = path / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    if not isinstance(spec, dict) or not isinstance(config, dict):
        raise ConversionError(f"{str(path)!r}: tokenizer.json and tokenizer_config.json must hold JSON objects")
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("decoder", {}).get("type") != "ByteLevel":
        raise ConversionError(
            f"tokenizer.json holds a {model.get('type')!r} model; oneblock writes byte-level BPE tokenizers (GPT-2, "
            "SmolLM, Llama 3) to GGUF, not SentencePiece or WordPiece ones"
        )
    pre = _pre_name(spec.get("pre_tokenizer"))
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    types = dict.fromkeys(vocab.values(), _NORMAL)
    for added in spec.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
        types[added["id"]] = _CONTROL if added.get("special") else _USER_DEFINED
    size = max(vocab_size or 0, max(vocab.values()) + 1)
    by_id = {i: token for token, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    token_types = [types.get(i, _USER_DEFINED) for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    entries = [
        Entry("tokenizer.ggml.model", "gpt2", _STR),
        Entry("tokenizer.ggml.pre", pre, _STR),
        Entry("tokenizer.ggml.tokens", tokens, _ARRAY, _STR),
        Entry("tokenizer.ggml.token_type", token_types, _ARRAY, _I32),
        Entry("tokenizer.ggml.merges", merges, _ARRAY, _STR),
    ]
    for key, name in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = _token_id(config, key, vocab)
        if token_id is not None:
            entries.append(Entry(f"tokenizer.ggml.{name}_token_id", token_id, _U32))
    entries.append(Entry("tokenizer.ggml.add_bos_token", bool(config.get("add_bos_token", False)), _BOOL))
    template = config.get("chat_template")
    if isinstance(template, str) and template:
        entries.append(Entry("tokenizer.chat_template", template, _STR))
    return entries


def _read_json(path: Path) -> Any:
    """A JSON file of a Hugging Face directory, through the bounded reader (size, depth, digits)."""
    raw = read_bytes(path, "tokenizer file", ConversionError, limit=jsontext.MAX_BYTES)
    return jsontext.loads(raw, what=repr(str(path)), error=ConversionError)
