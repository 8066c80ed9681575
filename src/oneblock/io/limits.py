"""How big a model a file may ask for: checked from its config, before anything is allocated.

A file from elsewhere says how large its model is (``n_layers``, ``vocab_size``, a GGUF ``block_count``).
Building a model from a header that says ``n_layers: 200000`` would allocate gigabytes for minutes before
failing; ``check_model_size`` counts the parameters analytically (``count_parameters``, no model built) and
refuses, in microseconds, a model over the limits:

- ``max_parameters``: default ``DEFAULT_MAX_PARAMETERS`` (2**32, about 4.3 billion), or ``ONEBLOCK_MAX_PARAMETERS``;
- ``max_bytes``: the memory for the weights and the position tables; default the machine's physical memory, or
  ``ONEBLOCK_MAX_BYTES``;
- ``max_layers``: blocks in all stacks together, default ``DEFAULT_MAX_LAYERS`` (1024; published models have at
  most a few hundred), or ``ONEBLOCK_MAX_LAYERS``: building modules takes time even when each is small.

Two more limits bound what a file may make oneblock read into Python objects:

- ``max_vocab``: the strings of any one GGUF metadata array (the vocabulary, the merges), default
  ``DEFAULT_MAX_VOCAB`` (2**19 = 524,288; the largest published vocabularies have 262,144 tokens), or
  ``ONEBLOCK_MAX_VOCAB``;
- ``max_text_bytes``: a training text (``oneblock train --text``), default ``DEFAULT_MAX_TEXT_BYTES`` (256 MiB,
  which become 2 GiB of int64 token ids), or ``ONEBLOCK_MAX_TEXT_BYTES``.

An argument overrides the environment, which overrides the default. Raise a limit to load a genuine large model.
"""

from __future__ import annotations

import os

import torch

from oneblock.config import ModelConfig
from oneblock.errors import CheckpointError, ConfigError, OneBlockError

ENV_MAX_PARAMETERS = "ONEBLOCK_MAX_PARAMETERS"
ENV_MAX_BYTES = "ONEBLOCK_MAX_BYTES"
ENV_MAX_LAYERS = "ONEBLOCK_MAX_LAYERS"
ENV_MAX_VOCAB = "ONEBLOCK_MAX_VOCAB"
ENV_MAX_TEXT_BYTES = "ONEBLOCK_MAX_TEXT_BYTES"
DEFAULT_MAX_PARAMETERS = 2**32
DEFAULT_MAX_LAYERS = 1024
DEFAULT_MAX_VOCAB = 2**19
DEFAULT_MAX_TEXT_BYTES = 2**28


def model_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """``(parameters, bytes)`` of ``build_model(cfg, dtype=dtype)``: the weights, and the rotary tables.

    Rotary tables (cos and sin, ``max_seq_len x d_head`` float32 each per stack) are buffers, not parameters,
    but a huge ``max_seq_len`` allocates them all the same.
    """
    from oneblock.analysis.counting import count_parameters

    n = count_parameters(cfg).total
    width = torch.empty((), dtype=dtype).element_size()
    stacks = 2 if cfg.arch == "encoder-decoder" else 1
    tables = 2 * cfg.max_seq_len * cfg.d_head * 4 * stacks if cfg.position == "rope" else 0
    return n, n * width + tables


def check_model_size(
    cfg: ModelConfig,
    *,
    what: str,
    dtype: torch.dtype = torch.float32,
    max_parameters: int | None = None,
    max_bytes: int | None = None,
    max_layers: int | None = None,
    error: type[OneBlockError] = CheckpointError,
) -> int:
    """Refuse a config whose model is implausibly large, before it is built.

    Args:
        cfg: the config read from a file or given by a user.
        what: where the config came from, for the message (``"checkpoint 'm.safetensors'"``).
        dtype: the dtype the weights will have.
        max_parameters: the most parameters allowed (see the module docstring for the default).
        max_bytes: the most bytes allowed.
        max_layers: the most blocks allowed, all stacks together.
        error: the error class to raise.

    Returns:
        The parameter count.
    """
    limit_n, source_n = _limit(max_parameters, ENV_MAX_PARAMETERS, DEFAULT_MAX_PARAMETERS, "max_parameters")
    limit_b, source_b = _limit(max_bytes, ENV_MAX_BYTES, _physical_memory(), "max_bytes")
    limit_l, source_l = _limit(max_layers, ENV_MAX_LAYERS, DEFAULT_MAX_LAYERS, "max_layers")
    shape = (
        f"n_layers={cfg.n_layers}, d_model={cfg.d_model}, d_ff={cfg.d_ff}, vocab_size={cfg.vocab_size}, "
        f"max_seq_len={cfg.max_seq_len}"
    )
    layers = cfg.n_layers + (cfg.n_decoder_layers if cfg.arch == "encoder-decoder" else 0)
    if layers > limit_l:
        raise error(
            f"{what} describes a model of {layers:,} blocks ({shape}), over the limit of {limit_l:,} ({source_l}); "
            f"if it is genuine, raise the limit with max_layers= or {ENV_MAX_LAYERS}"
        )
    n, size = model_bytes(cfg, dtype)
    if n > limit_n:
        raise error(
            f"{what} describes a model of {n:,} parameters ({shape}), over the limit of {limit_n:,} ({source_n}); "
            f"if it is genuine, raise the limit with max_parameters= or {ENV_MAX_PARAMETERS}"
        )
    if size > limit_b:
        raise error(
            f"{what} describes a model needing {size / 2**30:.1f} GiB as {str(dtype).removeprefix('torch.')} "
            f"({n:,} parameters; {shape}), over the limit of {limit_b / 2**30:.1f} GiB ({source_b}); "
            f"if it is genuine, raise the limit with max_bytes= or {ENV_MAX_BYTES}"
        )
    return n


def vocab_limit(given: int | None = None) -> tuple[int, str]:
    """``(limit, where it comes from)`` for the strings of one GGUF metadata array: ``given``, else
    ``ONEBLOCK_MAX_VOCAB``, else ``DEFAULT_MAX_VOCAB``."""
    return _limit(given, ENV_MAX_VOCAB, DEFAULT_MAX_VOCAB, "max_vocab")


def text_limit(given: int | None = None) -> tuple[int, str]:
    """``(limit, where it comes from)`` for the bytes of a training text: ``given``, else
    ``ONEBLOCK_MAX_TEXT_BYTES``, else ``DEFAULT_MAX_TEXT_BYTES``."""
    return _limit(given, ENV_MAX_TEXT_BYTES, DEFAULT_MAX_TEXT_BYTES, "max_text_bytes")


def _limit(given: int | None, env: str, default: int, name: str) -> tuple[int, str]:
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given <= 0:
            raise ConfigError(f"{name} must be a positive integer; got {given!r}")
        return given, f"{name}={given}"
    text = os.environ.get(env)
    if text is None or text.strip() == "":
        return default, "the default"
    try:
        value = int(float(text)) if "e" in text.lower() else int(text.replace("_", ""))
    except (ValueError, OverflowError):
        value = 0
    if value <= 0:
        raise ConfigError(f"{env} must be a positive integer; got {text!r}")
    return value, f"{env}={text}"


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: a generous fixed bound
        return 64 * 2**30
