"""One way in: whatever a user holds, as a model and its tokenizer.

``load_model`` accepts

* a GGUF file (``*.gguf``): the model (4-bit matrices kept 4-bit unless a ``dtype`` is given, see
  ``oneblock.io.gguf.load.from_gguf``) and the tokenizer stored in the file, from one parse of it;
* a Hugging Face model directory: ``from_hf``, and its ``tokenizer.json`` (or ``vocab.json`` + ``merges.txt``),
  whose ``stop_ids`` add the ``eos_token_id`` list of ``generation_config.json``;
* a oneblock checkpoint file: ``oneblock.load``, and a tokenizer found beside it;
* a preset name (``"gpt2"``, ``"lesson"``, ...): a freshly initialized model (seeded), with UTF-8 bytes as tokens.

Without a vocabulary file, text is UTF-8 bytes (ids 0..255). ``adapter=DIR`` puts a peft LoRA adapter on any of
them (``oneblock.adapters.peft.load_adapter``), ``merge=True`` folds it into the weights. Every command of the CLI loads
through here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from oneblock.errors import CheckpointError, ConfigError, InputError
from oneblock.inference.process import collector_paused, empty_free_lists, return_free_memory
from oneblock.models.inputs import config_of
from oneblock.text.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from torch import nn

KINDS = ("gguf", "hf", "checkpoint", "preset")


@dataclass(frozen=True)
class Loaded:
    """A model and its tokenizer, and where they came from.

    Attributes:
        model: the oneblock model, in eval mode.
        tokenizer: its tokenizer.
        source: what was loaded (the path, or the preset's name).
        kind: ``"gguf"``, ``"hf"``, ``"checkpoint"`` or ``"preset"``.
        seconds: wall time of the load, model and tokenizer together.
    """

    model: nn.Module
    tokenizer: Tokenizer
    source: str
    kind: str
    seconds: float


def load_model(
    source: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    seed: int = 0,
    adapter: str | os.PathLike[str] | None = None,
    merge: bool = False,
    context: int | None = None,
    prepare: Callable[[Tokenizer], Tokenizer] | None = None,
) -> Loaded:
    """Turn a GGUF file, a Hugging Face directory, a oneblock checkpoint or a preset name into a model and its
    tokenizer.

    Args:
        source: the path, or a preset name (see ``oneblock.PRESETS``).
        dtype: the parameters' dtype; ``None`` keeps the source's (for a GGUF file: 4-bit matrices as stored,
            the rest float32; ``torch.float32`` there is the exact dequantized model).
        device: where to put the parameters.
        tokenizer: a ``tokenizer.json`` or ``vocab.json`` to use instead of the one found with the model.
        seed: seeds the random initialization of a preset.
        adapter: a peft LoRA adapter directory (``oneblock.adapters.peft.load_adapter``) to put on the model, unmerged.
        merge: fold the adapter into the weights (``merge_lora(..., unload=True)``): a plain model, as fast as the
            base; needs float weights (load a GGUF file with ``dtype=torch.float32`` to merge).
        context: for a GGUF file or Hugging Face directory, the positions to run the model for (llama.cpp's
            ``n_ctx``; at most and by default the model's context): its rotary tables cover that many, and Phi-3's
            LongRoPE runs its long factors beyond its original context, its short ones within it.
        prepare: called with the tokenizer once it is built, before a GGUF file's weights are read; the tokenizer
            it returns is the one kept (``oneblock generate`` encodes its prompt there and keeps the decoding half,
            so that the encoder's maps and the weights are never resident together).

    Returns:
        ``Loaded(model, tokenizer, source, kind, seconds)``.

    Raises:
        CheckpointError: a path that does not exist and is no preset name, or a file that cannot be read.
        ConversionError: a file whose model oneblock cannot represent.
        InputError: a tokenizer with more ids than the model has, or a ``dtype`` that is not floating point.
        ConfigError: ``merge`` without ``adapter``, merging into 4-bit weights, or a ``context`` beyond the
            model's or for a checkpoint or preset (which run at their config's ``max_seq_len``).
    """
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise InputError(
            f"dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, torch.float16, "
            f"torch.float64) or None; got {dtype!r} (for 8-bit weights, load then call oneblock.quantize_int8)"
        )
    if merge and adapter is None:
        raise ConfigError("merge=True folds an adapter into the weights; give adapter=DIR too")
    start = time.perf_counter()
    with collector_paused():  # loading makes many objects and no garbage (oneblock.inference.process)
        model, tok, kind = _load(source, dtype, device, tokenizer, seed, context, prepare)
        if adapter is not None:
            _adapt(model, adapter, merge)
    return Loaded(model.eval(), tok, str(source), kind, time.perf_counter() - start)


def _load(
    source: str | os.PathLike[str],
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    tokenizer: str | os.PathLike[str] | None,
    seed: int,
    context: int | None,
    prepare: Callable[[Tokenizer], Tokenizer] | None,
) -> tuple[nn.Module, Tokenizer, str]:
    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return *_gguf(path, dtype, device, tokenizer, context, prepare), "gguf"
    elif path.is_dir():
        from oneblock.io.hf.convert import from_hf

        model, kind = _cast(from_hf(path, context=context), dtype, device), "hf"
        tok = _with_generation_stops(load_tokenizer(path, tokenizer=tokenizer, vocab_size=_vocab(model)), path, model)
    elif context is not None:
        raise ConfigError(
            f"context ({context}) applies to a GGUF file or a Hugging Face directory; {str(source)!r} is neither "
            "(a checkpoint or preset runs at its config's max_seq_len)"
        )
    elif path.is_file():
        from oneblock.io.checkpoint import load

        model, kind = _cast(load(path), dtype, device), "checkpoint"
        tok = load_tokenizer(path, tokenizer=tokenizer, vocab_size=_vocab(model))
    else:
        model, kind = _preset(str(source), dtype, device, seed), "preset"
        tok = load_tokenizer(None, tokenizer=tokenizer, vocab_size=_vocab(model))
    return model, tok if prepare is None else prepare(tok), kind


def _with_generation_stops(tok: Tokenizer, path: Path, model: nn.Module) -> Tokenizer:
    """``tok`` ending replies also at the ids of the directory's ``generation_config.json`` (Llama 3's
    ``<|eot_id|>``, Gemma's ``<end_of_turn>``), after its own ``eos_id`` or, without one, the config's."""
    from oneblock.io.hf.generation_config import generation_stop_ids
    from oneblock.text.tokenizer import EndOfTurn

    ids = generation_stop_ids(path, _vocab(model))
    if ids and isinstance(tok, EndOfTurn):
        eos = config_of(model).eos_token_id
        tok.end_of_turn_ids = (*([eos] if tok.eos_id is None and eos is not None else []), *ids)
    return tok


def _adapt(model: nn.Module, adapter: str | os.PathLike[str], merge: bool) -> None:
    from oneblock.adapters.apply import merge_lora
    from oneblock.adapters.peft import load_adapter

    load_adapter(model, adapter)
    if merge:
        merge_lora(model, unload=True)


def _gguf(
    path: Path,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
    tokenizer: str | os.PathLike[str] | None,
    context: int | None,
    prepare: Callable[[Tokenizer], Tokenizer] | None,
) -> tuple[nn.Module, Tokenizer]:
    from oneblock.io.gguf.layout import read_layout
    from oneblock.io.gguf.load import config_from_layout, from_gguf
    from oneblock.io.gguf.tokenizer import VOCABULARY_ARRAYS, GGUFTokenizer

    layout = read_layout(path)  # parsed once, for the weights and the vocabulary both
    empty_free_lists()  # the parse's freed tuples, not left among the tokenizer's objects (2 arenas fewer for Qwen2)
    vocab_size = config_from_layout(layout).at_context(context).vocab_size  # a file oneblock cannot run: refused first
    if tokenizer is not None:
        tok = load_tokenizer(path, tokenizer=tokenizer, vocab_size=vocab_size)
    else:
        tok = GGUFTokenizer.from_gguf(layout)
    # The tokenizer is built first and the file's vocabulary lists (a Python string per token and per merge: 50 MB
    # for Qwen2's 151,936 tokens) dropped before the weights are mapped, so that the two never add up; the memory
    # freed is handed back to the system (return_free_memory), not kept for the heap's later use.
    for key in VOCABULARY_ARRAYS:
        layout.metadata.pop(key, None)
    if prepare is not None:
        tok = prepare(tok)
    return_free_memory()
    return from_gguf(layout, dtype=dtype, device=device, context=context), tok


def _preset(name: str, dtype: torch.dtype | None, device: torch.device | str | None, seed: int) -> nn.Module:
    from oneblock.models import build_model
    from oneblock.presets import PRESETS, get_preset

    if name not in PRESETS:
        raise CheckpointError(
            f"{name!r} is neither a file, a directory nor a preset name; give a .gguf file, a Hugging Face model "
            f"directory, a oneblock checkpoint, or one of the presets {sorted(PRESETS)}"
        )
    torch.manual_seed(seed)
    return build_model(get_preset(name), dtype=dtype, device=device)


def _cast(model: nn.Module, dtype: torch.dtype | None, device: torch.device | str | None) -> nn.Module:
    return model.to(device=device, dtype=dtype) if dtype is not None or device is not None else model


def _vocab(model: nn.Module) -> int:
    return config_of(model).vocab_size
