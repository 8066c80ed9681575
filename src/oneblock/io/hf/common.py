"""Pieces shared by the Hugging Face converters: tensor bookkeeping, name pairs, activation names.

Each family module (``gpt2``, ``bert``, ``bart``, ``llama``) describes its checkpoint as a list of
``Pair``s, one per tensor that maps one-to-one between the two naming schemes, plus whatever cannot be a pair
(GPT-2's fused query/key/value matrix, BART's three names for one embedding). The functions here copy along
those pairs in either direction and refuse to lose a tensor on the way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from oneblock.config import ModelConfig
from oneblock.errors import ConversionError
from oneblock.io.matching import check_tensors_fill

# Hugging Face activation names (transformers.activations.ACT2FN) -> oneblock's. "gelu_new" is GPT-2's tanh
# approximation, the same function as torch's gelu(approximate="tanh").
ACT_FROM_HF = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}


class Pair(NamedTuple):
    """One tensor under its oneblock name and its Hugging Face name.

    ``transpose`` marks GPT-2's ``Conv1D`` weights, stored (in, out) where ``nn.Linear`` stores (out, in).
    """

    ours: str
    theirs: str
    transpose: bool = False


def linear_pairs(ours: str, theirs: str, *, bias: bool, transpose: bool = False) -> list[Pair]:
    """The weight (and bias) of one linear layer."""
    pairs = [Pair(f"{ours}.weight", f"{theirs}.weight", transpose)]
    if bias:
        pairs.append(Pair(f"{ours}.bias", f"{theirs}.bias"))
    return pairs


def attention_pairs(ours: str, theirs: str, names: tuple[str, str, str, str], *, bias: bool) -> list[Pair]:
    """The four projections of one attention layer; ``names`` are the source's q, k, v and output layer names."""
    mine = ("q_proj", "k_proj", "v_proj", "o_proj")
    return [
        pair
        for a, b in zip(mine, names, strict=True)
        for pair in linear_pairs(f"{ours}.{a}", f"{theirs}.{b}", bias=bias)
    ]


def norm_pairs(ours: str, theirs: str, cfg: ModelConfig) -> list[Pair]:
    """A LayerNorm (gamma and beta) or an RMSNorm (gamma only)."""
    return linear_pairs(ours, theirs, bias=cfg.norm == "layernorm")


def activation_from_hf(family: str, name: str, value: Any) -> str:
    """oneblock's name for a Hugging Face activation, or a ``ConversionError`` naming the option."""
    if value not in ACT_FROM_HF:
        raise ConversionError(
            f"{family} config {name}={value!r} has no oneblock equivalent; supported: {sorted(ACT_FROM_HF)}"
        )
    return ACT_FROM_HF[value]


def token_id(value: Any, vocab_size: int) -> int | None:
    """A special-token id as oneblock keeps it: the first of a list, ``None`` when outside the vocabulary.

    The ids are metadata; Hugging Face configs built for a small vocabulary often keep GPT-2's 50256.
    """
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
        return value
    return None


def refuse(family: str, option: str, value: Any, why: str) -> None:
    """Raise the error for a config option that oneblock cannot reproduce exactly."""
    raise ConversionError(f"{family} config option {option}={value!r} is not supported: {why}")


def same_or_refuse(family: str, options: Mapping[str, Any]) -> Any:
    """The one value that several Hugging Face options share, e.g. encoder and decoder head counts."""
    values = set(options.values())
    if len(values) != 1:
        listed = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise ConversionError(f"{family}: oneblock needs {' and '.join(options)} to be equal; got {listed}")
    return values.pop()


class TensorSource:
    """The tensors of one checkpoint, handed out once each so that any tensor left unread can be reported.

    Keys under ``prefix`` (e.g. ``"transformer."``) are stored without it, so a bare body (``GPT2Model``) and a
    body inside a head (``GPT2LMHeadModel``) read alike. Keys matching ``ignore`` (non-persistent buffers that
    older checkpoints saved, such as BERT's ``position_ids``) are dropped on arrival.
    """

    def __init__(self, family: str, tensors: Mapping[str, Tensor], *, prefix: str, ignore: Iterable[str] = ()):
        self.family = family
        patterns = [re.compile(p) for p in ignore]
        self._tensors: dict[str, Tensor] = {}
        for key, tensor in tensors.items():
            name = key[len(prefix) :] if prefix and key.startswith(prefix) else key
            if not any(p.fullmatch(name) for p in patterns):
                self._tensors[name] = tensor
        self._taken: set[str] = set()

    def keys(self) -> set[str]:
        return set(self._tensors)

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def take(self, key: str) -> Tensor:
        """The tensor named ``key``; raises ``ConversionError`` if the checkpoint lacks it."""
        if key not in self._tensors:
            raise ConversionError(
                f"{self.family} checkpoint is missing tensor {key!r} needed by its config; "
                f"it has {len(self._tensors)} tensors, e.g. {sorted(self._tensors)[:4]}"
            )
        tensor = self._tensors[key]
        if not tensor.is_floating_point():  # a weight stored as integers is damage, not something to cast
            raise ConversionError(
                f"{self.family} checkpoint stores tensor {key!r} as {tensor.dtype}; weights must be floating point "
                "(refusing to cast them)"
            )
        self._taken.add(key)
        return tensor

    def drop(self, predicate: Callable[[str], bool]) -> list[str]:
        """Mark keys for which ``predicate(key)`` holds as read without using them; returns them."""
        dropped = sorted(k for k in self._tensors if predicate(k))
        self._taken.update(dropped)
        return dropped

    def check_all_taken(self) -> None:
        """Raise ``ConversionError`` naming every tensor that no mapping read."""
        left = sorted(set(self._tensors) - self._taken)
        if left:
            raise ConversionError(
                f"{self.family} checkpoint has {len(left)} tensor(s) with no oneblock equivalent: "
                f"{left[:8]}{' ...' if len(left) > 8 else ''}; the source uses a feature oneblock does not model"
            )


def take_pairs(pairs: Iterable[Pair], source: TensorSource) -> dict[str, Tensor]:
    """Hugging Face -> oneblock along ``pairs``."""
    out = {}
    for pair in pairs:
        tensor = source.take(pair.theirs)
        out[pair.ours] = tensor.t() if pair.transpose else tensor
    return out


def give_pairs(pairs: Iterable[Pair], state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """oneblock -> Hugging Face along ``pairs``."""
    out = {}
    for pair in pairs:
        tensor = state[pair.ours]
        out[pair.theirs] = tensor.t() if pair.transpose else tensor
    return out


def take_tied(source: TensorSource, key: str, reference: Tensor, what: str, why: str = "") -> None:
    """Read a tensor that must equal one already read, e.g. a tied LM head; absent is fine."""
    if key in source and not torch.equal(source.take(key), reference):
        why = why or (
            "but the config ties them (tie_word_embeddings=True); "
            "set tie_word_embeddings=False in the source config to keep both"
        )
        raise ConversionError(f"{source.family}: {key!r} differs from {what!r}, {why}")


def take_shared_embedding(source: TensorSource, names: Sequence[str]) -> Tensor:
    """The token embedding (V, C) that an encoder-decoder checkpoint may store under several ``names`` (shared,
    encoder, decoder): present ones must hold the same values, since oneblock shares one matrix between the stacks."""
    present = [name for name in names if name in source]
    if not present:
        source.take(names[0])  # raises, naming the tensor
    embed = source.take(present[0])
    for name in present[1:]:
        take_tied(source, name, embed, present[0], "but oneblock shares one token embedding between both stacks")
    return embed


def _alias_groups(state: Mapping[str, Tensor]) -> dict[str, list[str]]:
    """Keys of a module's state_dict that name one shared tensor (tied weights), keyed by each member."""
    by_storage: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for key, tensor in state.items():
        by_storage.setdefault((tensor.data_ptr(), tuple(tensor.shape)), []).append(key)
    return {key: keys for keys in by_storage.values() for key in keys}


def load_exact(module: nn.Module, tensors: Mapping[str, Tensor], what: str) -> None:
    """Copy ``tensors`` into ``module``, requiring every parameter and persistent buffer to be covered.

    A tied tensor needs to be given under one of its names only. Values are cast to the module's dtype.

    Raises:
        ConversionError: on a missing name, an unknown name, or a shape that differs.
    """
    target = module.state_dict()
    groups = _alias_groups(target)
    full = dict(tensors)
    for key in target:
        if key not in full:
            given = [k for k in groups[key] if k in tensors]
            if given:
                full[key] = tensors[given[0]]
    check_tensors_fill({k: t.shape for k, t in target.items()}, {k: t.shape for k, t in full.items()}, what, shown=8)
    with torch.no_grad():
        module.load_state_dict(full, strict=True)


def take_head(cfg: ModelConfig, source: TensorSource, out: dict[str, Tensor], embed_key: str) -> None:
    """The LM head: checked equal to the token embedding when tied, copied as ``lm_head.weight`` otherwise."""
    if cfg.tie_embeddings:
        take_tied(source, "lm_head.weight", out["embed.tok.weight"], embed_key)
    else:
        out["lm_head.weight"] = source.take("lm_head.weight")  # (V, C)


def config_mismatches(
    cfg: ModelConfig,
    family: str,
    wanted: Mapping[str, Any],
    *,
    plain_heads: bool = True,
    options: Iterable[str] = (),
    rope_kinds: tuple[str, ...] = ("linear", "llama3"),
) -> list[str]:
    """Why ``cfg`` cannot be written as a ``family`` checkpoint: each field that differs from ``wanted``; each
    option of the later decoders (``qkv_bias``, ``qk_norm``, ``rope_scaling``) switched on that the family does
    not list in ``options``; and, for families with ordinary multi-head attention (``plain_heads``), grouped or
    resized heads. A family that holds ``rope_scaling`` holds the kinds ``rope_kinds`` of it."""
    off = {
        "qkv_bias": cfg.bias, "qk_norm": False, "rope_scaling": {}, "attn_softcap": None, "logit_softcap": None,
        "sliding_window": None, "global_every": 1, "rope_local_theta": None, "qk_norm_span": "head",
        "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0, "no_rope_every": 0,
        "rope_dims": cfg.d_head,
    }  # fmt: skip
    wanted = {**{k: v for k, v in off.items() if k not in options}, **wanted}
    out = [f"{k}={getattr(cfg, k)!r} ({family} has {v!r})" for k, v in wanted.items() if getattr(cfg, k) != v]
    kind = cfg.rope_scaling.get("type")
    if kind is not None and "rope_scaling" in options and kind not in rope_kinds:
        out.append(f"rope_scaling of type {kind!r} ({family} has {list(rope_kinds)})")
    if plain_heads and cfg.n_kv_heads != cfg.n_heads:
        out.append(f"n_kv_heads={cfg.n_kv_heads} ({family} has one key/value head per query head)")
    if plain_heads and cfg.d_head * cfg.n_heads != cfg.d_model:
        out.append(f"d_head={cfg.d_head} ({family} has d_model // n_heads = {cfg.d_model // cfg.n_heads})")
    return out
