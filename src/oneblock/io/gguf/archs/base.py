"""What a GGUF architecture module tells the loader, and the reading of the metadata keys they all share.

Every architecture oneblock opens from a GGUF file is the Llama block with options (``ModelConfig``'s
``qkv_bias``, ``qk_norm``, ``rope_scaling``, ...). An :class:`Architecture` names them: the file's
``general.architecture``, whether the converter permuted the query and key rows (only the ``llama`` layout does),
which tensors feed the config rather than the model, and a function reading the architecture's own options.
Writing is the inverse (:mod:`oneblock.io.gguf.archs.writing`): each architecture also names the Hugging Face
family whose configs it holds and a function turning a config's options back into its keys and tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from oneblock.config import ModelConfig
from oneblock.errors import ConfigError, ConversionError
from oneblock.io.gguf.layout import GGUFLayout
from oneblock.io.gguf.writer import Entry

Split = Callable[[GGUFLayout, ModelConfig], GGUFLayout]


@dataclass(frozen=True)
class Written:
    """What a config's options add to a file: metadata entries beyond the shared sizes, tensors beyond the
    model's weights (``rope_freqs.weight``), and the refusals of options the architecture cannot state."""

    metadata: list[Entry]
    tensors: dict[str, Tensor]
    problems: list[str]


Write = Callable[[ModelConfig], Written]
Stack = Callable[[ModelConfig, dict[str, Tensor]], dict[str, Tensor]]


@dataclass(frozen=True)
class Architecture:
    """One ``general.architecture`` oneblock runs.

    Attributes:
        name: the value of ``general.architecture``, the prefix of its metadata keys.
        family: the models users know it by, for messages.
        permuted: llama.cpp's converter interleaved the rotary halves of the q/k rows (the ``llama`` layout);
            the loader undoes it. Families that rotate halves are stored as they are.
        options: the ``ModelConfig`` fields the file sets beyond the Llama block, read from the layout.
        consumed: tensors read into the config (``rope_freqs.weight``), not loaded as weights.
        split: cuts a file's stacked matrices into the usual records (Phi-3's ``attn_qkv``), or ``None``.
        hf_type: the Hugging Face ``model_type`` whose configs this architecture holds (its ``mismatches``).
        write: the keys and tensors of a config's options, as llama.cpp's converter writes them.
        stack: the inverse of ``split`` on GGUF-named float tensors, or ``None``.
        stacked: the stacked matrices ``stack`` makes, each from its parts in row order (``("attn_qkv",
            ("attn_q", "attn_k", "attn_v"))``): what a LoRA adapter for the file must adapt whole.
    """

    name: str
    family: str
    permuted: bool
    options: Callable[[GGUFLayout], dict[str, Any]]
    consumed: tuple[str, ...] = ()
    split: Split | None = None
    hf_type: str = ""
    write: Write | None = None
    stack: Stack | None = None
    stacked: tuple[tuple[str, tuple[str, ...]], ...] = ()


def need(metadata: dict[str, Any], key: str) -> Any:
    """A metadata value the file must have."""
    if metadata.get(key) is None:
        raise ConversionError(f"GGUF metadata lacks {key!r}, which every such file must have")
    return metadata[key]


def per_model(key: str, value: Any) -> int:
    """A value llama.cpp may store per layer; oneblock needs it equal in every layer."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ConversionError(f"{key} differs between layers ({value}); oneblock needs one value for all")
        value = value[0]
    return int(value)


def _check_common(arch: str, metadata: dict[str, Any]) -> None:
    """Refuse the variants no architecture here computes: experts, and rotary scaling kinds other than linear."""
    if per_model(f"{arch}.expert_count", metadata.get(f"{arch}.expert_count") or 0) > 0:
        raise ConversionError(
            f"mixture-of-experts models ({arch}.expert_count={metadata[f'{arch}.expert_count']}) are not "
            "supported: oneblock's feed-forward is one dense SwiGLU"
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ConversionError(
            f"RoPE scaling {arch}.rope.scaling.type={scaling!r} is not supported; oneblock rescales rotary "
            "frequencies linearly or by a rope_freqs table (Llama 3)"
        )


def linear_scaling(arch: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """``rope_scaling`` of a file with ``rope.scaling.type = linear``, else ``{}``."""
    if metadata.get(f"{arch}.rope.scaling.type") != "linear":
        return {}
    factor = float(need(metadata, f"{arch}.rope.scaling.factor"))
    return {} if factor == 1.0 else {"type": "linear", "factor": factor}


def decoder_config(arch: Architecture, layout: GGUFLayout) -> ModelConfig:
    """The ``ModelConfig`` a file of ``arch`` describes: the Llama block's sizes and the architecture's options.

    Raises:
        ConversionError: a missing key, a variant oneblock cannot run, or sizes that describe no model.
    """
    metadata, name = layout.metadata, arch.name
    shapes = {key: t.shape for key, t in layout.tensors.items()}
    _check_common(name, metadata)
    d_model = int(need(metadata, f"{name}.embedding_length"))
    n_heads = per_model(f"{name}.attention.head_count", need(metadata, f"{name}.attention.head_count"))
    n_kv_heads = per_model(f"{name}.attention.head_count_kv", metadata.get(f"{name}.attention.head_count_kv", n_heads))
    if n_heads <= 0 or d_model <= 0:
        raise ConversionError(f"{name}.attention.head_count ({n_heads}) and embedding_length ({d_model}) must be > 0")
    d_head = int(metadata.get(f"{name}.attention.key_length", d_model // n_heads))
    value_length = int(metadata.get(f"{name}.attention.value_length", d_head))
    if value_length != d_head:
        raise ConversionError(
            f"{name}.attention.value_length ({value_length}) differs from key_length ({d_head}); "
            "oneblock's attention uses one head width for keys and values"
        )
    if "token_embd.weight" not in shapes:
        raise ConversionError("the GGUF file has no token_embd.weight tensor")
    vocab_size = shapes["token_embd.weight"][0]
    stated_vocab = metadata.get(f"{name}.vocab_size")
    if stated_vocab is not None and int(stated_vocab) != vocab_size:
        raise ConversionError(
            f"{name}.vocab_size ({stated_vocab}) disagrees with token_embd.weight ({vocab_size} rows)"
        )
    d_ff = per_model(f"{name}.feed_forward_length", need(metadata, f"{name}.feed_forward_length"))
    fields: dict[str, Any] = {
        "arch": "decoder",
        "vocab_size": vocab_size,
        "d_model": d_model,
        "n_heads": n_heads,
        "n_layers": int(need(metadata, f"{name}.block_count")),
        "d_ff": d_ff,
        "max_seq_len": int(need(metadata, f"{name}.context_length")),
        "norm_position": "pre",
        "norm": "rmsnorm",
        "activation": "silu",  # unused by SwiGLU, which always gates with SiLU; recorded for readers
        "bias": False,
        "tie_embeddings": "output.weight" not in shapes,
        "rope_dims": int(metadata.get(f"{name}.rope.dimension_count", d_head)),
        "dropout": 0.0,
        "norm_eps": float(need(metadata, f"{name}.attention.layer_norm_rms_epsilon")),
        "ffn": "swiglu",
        "position": "rope",
        "rope_theta": float(metadata.get(f"{name}.rope.freq_base", 10000.0)),
        "n_kv_heads": n_kv_heads,
        "d_head": d_head,
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "extra": {"source": "gguf", "name": metadata.get("general.name"), "gguf_architecture": name},
    }
    fields.update(arch.options(layout))
    try:
        return ModelConfig(**fields)
    except ConfigError as error:
        raise ConversionError(f"the GGUF metadata describes an impossible model: {error}") from error
