"""``ModelConfig``: every size and switch that defines a oneblock model, validated once, stored as JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from oneblock import jsontext
from oneblock.errors import ConfigError

ARCHS = ("encoder", "decoder", "encoder-decoder")
NORM_POSITIONS = ("pre", "post", "sandwich", "output")
QK_NORM_SPANS = ("head", "width")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
FFNS = ("mlp", "swiglu", "gated")
POSITIONS = ("learned", "rope", "relative", "none")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        options = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"{name} must be one of {options}; got {value!r}")


def _check_types(cfg: ModelConfig) -> None:
    """Every field holds the type its annotation names, before any value is compared or used.

    ``bias="no"`` would build biases (a non-empty string is true) and ``n_layers=2.0`` would fail deep inside
    torch; so booleans must be ``bool``, sizes ``int`` (not ``bool``, not ``float``), floats finite numbers
    (``norm_eps=inf`` would give constant logits), strings ``str``, and ``extra`` a JSON-serialisable dict.
    A field whose default is None (derived, or optional) may be None.
    """
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        kind = str(f.type).replace(" ", "")
        if value is None and (f.default is None or kind.endswith("|None")):
            continue
        kind = kind.removesuffix("|None")
        if kind == "bool" and not isinstance(value, bool):
            raise ConfigError(f"{f.name} must be True or False; got {value!r} ({type(value).__name__})")
        if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{f.name} must be an integer; got {value!r} ({type(value).__name__})")
        if kind == "float" and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        ):
            raise ConfigError(f"{f.name} must be a finite number; got {value!r}")
        if kind == "str" and not isinstance(value, str):
            raise ConfigError(f"{f.name} must be a string; got {value!r} ({type(value).__name__})")
        if kind.startswith("dict"):
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise ConfigError(f"{f.name} must be a dict with string keys; got {value!r}")
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError) as error:
                raise ConfigError(f"{f.name} must be JSON-serialisable (it is saved with the model): {error}") from None


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer; got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """The complete description of a model; ``build_model(cfg)`` turns it into modules.

    The defaults are the small decoder of the lesson (172,288 parameters). Fields after ``dropout`` exist so that a
    config can describe published models exactly (GPT-2, BERT, BART, Llama-family); their defaults switch them off.

    Raises:
        ConfigError: on any impossible or unknown value, naming it.
    """

    arch: str = "decoder"
    vocab_size: int = 1000
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    # A field left as None is derived in __post_init__ (the comment says from what), so it always reads as an int.
    d_ff: int = None  # type: ignore[assignment]  # None means 4 * d_model, the lesson's (and GPT-2's) expansion
    max_seq_len: int = 128
    norm_position: str = "pre"
    norm: str = "layernorm"
    activation: str = "gelu"
    bias: bool = True  # biases of the Linear layers; LayerNorm always has gamma and beta
    tie_embeddings: bool = True  # the LM head reuses the token embedding matrix
    dropout: float = 0.0
    norm_eps: float = 1e-5
    n_decoder_layers: int = None  # type: ignore[assignment]  # encoder-decoder's decoder; None means n_layers
    # The modern block (Llama family).
    ffn: str = "mlp"  # "swiglu" is W2 (silu(W1 x) * W3 x) and ignores `activation`; "gated" is below
    position: str = "learned"
    rope_theta: float = 10000.0
    n_kv_heads: int = None  # type: ignore[assignment]  # grouped-query attention; None means n_heads
    d_head: int = None  # type: ignore[assignment]  # width of one head, Dh; None means d_model // n_heads
    # Options of the later decoders: the block stays the same, these switch its parts (Qwen2, Qwen3, Llama 3).
    qkv_bias: bool = None  # type: ignore[assignment]  # biases on q, k and v only (Qwen2); None means `bias`
    qk_norm: bool = False  # RMSNorm (Dh,) over each head of q and of k, before rotary (Qwen3)
    # Rotary frequencies rescaled: {} plain; {"type": "linear", "factor": f}; {"type": "llama3", "factor",
    # "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}; {"type": "factors",
    # "factors": [Dh/2 divisors]} (a GGUF file's rope_freqs); {"type": "longrope", "short_factors", "long_factors",
    # "original_max_position_embeddings", "attention_factor"} (Phi-3: divisors, the long ones when max_seq_len
    # exceeds the original context as in llama.cpp, and cos and sin times the factor). See oneblock.layers.rotary.
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    # Gemma 2 and 3. norm_position="sandwich" is pre-LN plus a norm of each sublayer's output before the add.
    attn_softcap: float | None = None  # attention scores capped as tanh(s / cap) * cap before the softmax (50)
    logit_softcap: float | None = None  # the same on the final logits (Gemma 2: 30)
    sliding_window: int | None = None  # local layers attend to the last `sliding_window` positions only
    global_every: int = 1  # with a window, layer i is global (whole context) when (i + 1) % global_every == 0
    rope_local_theta: float | None = None  # the local layers' rotary base (Gemma 3); global: rope_theta, scaling
    # norm_position="output" (OLMo 2): no norm before a sublayer, one after it, x = x + norm(f(x)).
    qk_norm_span: str = "head"  # qk_norm over each head ("head": Qwen3, Gemma 3) or the whole width ("width": OLMo 2)
    # Granite's four scalars (attention's is attn_scale) and SmolLM3's layers without rotary.
    embedding_multiplier: float = 1.0  # token embeddings times this (Granite: 12)
    residual_multiplier: float = 1.0  # each sublayer's output times this before the add (Granite: 0.22)
    logits_scaling: float = 1.0  # logits divided by this (Granite: 8)
    no_rope_every: int = 0  # layer i rotates nothing when (i + 1) % no_rope_every == 0 (SmolLM3: 4); 0: none
    rope_dims: int = None  # type: ignore[assignment]  # features of each head that rotate (Phi-4-mini: 3/4); None: Dh
    # T5. position="relative" learns one (relative_buckets, H) table of score biases per stack, indexed by the
    # bucketed distance key - query: exact for small distances, logarithmic up to relative_max_distance, beyond
    # which all distances share the last bucket (Raffel et al., 2020).
    relative_buckets: int = 32
    relative_max_distance: int = 128
    # Scores are q.k * attn_scale; None means 1/sqrt(d_head). T5 uses 1.0: it folds the scale into its init.
    attn_scale: float | None = None
    # ffn="gated" is W2 (act(W1 x) * W3 x) with `activation`: T5 v1.1's gated GELU with activation="gelu_tanh".
    # A tied LM head reads the final hidden state times d_model**-0.5 (T5 rescales because its embeddings,
    # shared with the head, are initialized at unit scale).
    scale_tied_logits: bool = False
    # Details of published checkpoints.
    type_vocab_size: int = 0  # BERT's segment embeddings
    embed_norm: bool = False  # a norm right after the embeddings (BERT, BART)
    scale_embeddings: bool = False  # token embeddings times sqrt(d_model) (BART's scale_embedding)
    position_offset: int = 0  # learned positions read row p + offset; BART keeps two unused rows
    pooler: bool = False  # BERT's tanh(Linear(h_CLS)); encoder only
    final_logits_bias: bool = False  # a (1, V) buffer added to the logits (BART); not a parameter
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # free metadata, e.g. the source model

    def __post_init__(self) -> None:
        _check_types(self)
        _choice("arch", self.arch, ARCHS)
        _choice("norm_position", self.norm_position, NORM_POSITIONS)
        _choice("norm", self.norm, NORMS)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("ffn", self.ffn, FFNS)
        _choice("position", self.position, POSITIONS)
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "max_seq_len"):
            _positive(name, getattr(self, name))
        for name in ("d_ff", "n_decoder_layers", "n_kv_heads", "d_head", "rope_dims"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.d_head is None and self.d_model % self.n_heads != 0:
            raise ConfigError(
                f"n_heads ({self.n_heads}) must divide d_model ({self.d_model}); "
                f"choose n_heads from {_divisors(self.d_model)} or set d_head explicitly"
            )
        if (
            self.n_decoder_layers is not None
            and self.arch != "encoder-decoder"
            and self.n_decoder_layers != self.n_layers
        ):
            raise ConfigError(
                f"n_decoder_layers ({self.n_decoder_layers}) only applies to arch='encoder-decoder'; "
                f"got arch={self.arch!r}"
            )
        for name, derive in _DERIVED.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, derive(self))
        if self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(
                f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}); "
                f"choose n_kv_heads from {_divisors(self.n_heads)}"
            )
        if self.position == "rope" and self.d_head % 2 != 0:
            raise ConfigError(f"rotary positions need an even head width; got d_head {self.d_head}")
        if self.position == "rope" and (self.rope_dims % 2 or self.rope_dims > self.d_head):
            raise ConfigError(f"rope_dims ({self.rope_dims}) must be even and at most d_head ({self.d_head})")
        _check_rope_scaling(self.rope_scaling, self.rope_dims)
        self._check_gemma_options()
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= float(self.dropout) < 1.0:
            raise ConfigError(f"dropout must be in [0, 1); got {self.dropout!r}")
        if not isinstance(self.norm_eps, (int, float)) or not self.norm_eps > 0:
            raise ConfigError(f"norm_eps must be a positive number; got {self.norm_eps!r}")
        if not isinstance(self.rope_theta, (int, float)) or not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be a positive number; got {self.rope_theta!r}")
        for name in ("type_vocab_size", "position_offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer; got {value!r}")
        if self.pooler and self.arch != "encoder":
            raise ConfigError(f"pooler only applies to arch='encoder'; got arch={self.arch!r}")
        self._check_t5_options()
        if self.final_logits_bias and self.arch == "encoder":
            raise ConfigError("final_logits_bias needs a language-model head; arch='encoder' has none")
        if self.position != "learned" and self.position_offset:
            raise ConfigError(
                f"position_offset ({self.position_offset}) needs position='learned'; got {self.position!r}"
            )
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"{name} ({value}) must lie in [0, vocab_size={self.vocab_size})")

    def _check_t5_options(self) -> None:
        _positive("relative_buckets", self.relative_buckets)
        _positive("relative_max_distance", self.relative_max_distance)
        # The bucket function keeps the distances below relative_buckets // 2 (a quarter of the buckets in each
        # direction when bidirectional) exact and spreads the rest on a log scale up to relative_max_distance.
        exact = self.relative_buckets // 2
        if self.position == "relative" and (self.relative_buckets < 4 or self.relative_max_distance <= exact):
            raise ConfigError(
                f"position='relative' needs relative_buckets >= 4 and relative_max_distance > relative_buckets // 2 "
                f"(the distances held exactly); got relative_buckets={self.relative_buckets}, "
                f"relative_max_distance={self.relative_max_distance}"
            )
        scale = self.attn_scale
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf")
        ):
            raise ConfigError(f"attn_scale must be a positive number or None (1/sqrt(d_head)); got {scale!r}")
        if not isinstance(self.scale_tied_logits, bool):
            raise ConfigError(f"scale_tied_logits must be True or False; got {self.scale_tied_logits!r}")
        if self.scale_tied_logits and not self.tie_embeddings:  # an encoder has no head: the option is then idle
            raise ConfigError(
                "scale_tied_logits rescales the LM head that shares the token embedding; it needs "
                "tie_embeddings=True (an untied head, as in T5 v1.1, is not rescaled)"
            )

    def _check_gemma_options(self) -> None:
        for name in ("attn_softcap", "logit_softcap", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be a positive number or None; got {value!r}")
        if self.sliding_window is not None:
            _positive("sliding_window", self.sliding_window)
        _positive("global_every", self.global_every)
        if self.rope_local_theta is not None and (self.sliding_window is None or self.position != "rope"):
            raise ConfigError("rope_local_theta is the rotary base of local layers: it needs sliding_window and rope")
        if self.norm_position in ("sandwich", "output") and self.arch != "decoder":
            raise ConfigError(f"norm_position={self.norm_position!r} is a decoder-only option; got arch={self.arch!r}")
        _choice("qk_norm_span", self.qk_norm_span, QK_NORM_SPANS)
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be a positive number; got {getattr(self, name)!r}")
        if self.embedding_multiplier != 1.0 and self.scale_embeddings:
            raise ConfigError("scale_embeddings (times sqrt(d_model)) and embedding_multiplier exclude each other")
        if isinstance(self.no_rope_every, bool) or not isinstance(self.no_rope_every, int) or self.no_rope_every < 0:
            raise ConfigError(f"no_rope_every must be a non-negative integer; got {self.no_rope_every!r}")

    # Derived values.
    def is_local(self, layer: int) -> bool:
        """Whether block ``layer`` attends within ``sliding_window`` (local) rather than to the whole context."""
        return self.sliding_window is not None and (layer + 1) % self.global_every != 0

    def rotates(self, layer: int) -> bool:
        """Whether block ``layer`` applies rotary positions (SmolLM3 leaves every ``no_rope_every``-th out)."""
        return self.position == "rope" and not (self.no_rope_every and (layer + 1) % self.no_rope_every == 0)

    @property
    def has_final_norm(self) -> bool:
        """Pre-LN leaves the residual stream unnormalized, so one norm closes each stack."""
        return self.norm_position in ("pre", "sandwich", "output")

    # Serialisation.
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build a config from a dict, refusing keys that are not fields."""
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a JSON object; got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known fields are {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as error:  # e.g. a list where an int belongs
            raise ConfigError(f"invalid config: {error}") from error

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls.from_dict(jsontext.loads(text, what="the config", error=ConfigError))

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed; a derived field (``d_ff``, ``d_head``, ``n_kv_heads``,
        ``n_decoder_layers``) that held its derived value is derived again from the new fields."""
        data = self.to_dict()
        for name, derive in _DERIVED.items():
            if name not in changes and getattr(self, name) == derive(self):
                data[name] = None
        data.update(changes)
        return ModelConfig.from_dict(data)

    def at_context(self, context: int | None) -> ModelConfig:
        """This model run for ``context`` positions (``None``: its own ``max_seq_len``), as llama.cpp's ``n_ctx``:
        the rotary tables cover that many, and LongRoPE takes its long factors only beyond its original context.

        Raises:
            ConfigError: a context that is not a positive integer up to ``max_seq_len``, or a model whose learned
                position table fixes its context.
        """
        if context is None:
            return self
        if isinstance(context, bool) or not isinstance(context, int) or not 0 < context <= self.max_seq_len:
            raise ConfigError(
                f"context must be a positive integer up to the model's max_seq_len ({self.max_seq_len}); "
                f"got {context!r}"
            )
        if self.position == "learned":
            raise ConfigError(
                f"context ({context}) cannot change a model with a learned position table of {self.max_seq_len} "
                "rows; leave context unset"
            )
        return self.replace(max_seq_len=context)


_DERIVED: dict[str, Callable[[ModelConfig], int]] = {
    "d_ff": lambda cfg: 4 * cfg.d_model,
    "d_head": lambda cfg: cfg.d_model // cfg.n_heads,
    "n_kv_heads": lambda cfg: cfg.n_heads,
    "n_decoder_layers": lambda cfg: cfg.n_layers,
    "qkv_bias": lambda cfg: cfg.bias,
    "rope_dims": lambda cfg: cfg.d_head,
}

_ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "factors": ("factors",),
    "longrope": ("short_factors", "long_factors", "original_max_position_embeddings", "attention_factor"),
}
_FACTOR_LISTS = {"factors": ("factors",), "longrope": ("short_factors", "long_factors")}


def _check_rope_scaling(scaling: dict[str, Any], d_head: int) -> None:
    """``rope_scaling`` is empty or one of the kinds of ``_ROPE_SCALING_KEYS`` with exactly its keys, numbers > 0."""
    if not scaling:
        return
    kind = scaling.get("type")
    if kind not in _ROPE_SCALING_KEYS:
        raise ConfigError(f"rope_scaling['type'] must be one of {sorted(_ROPE_SCALING_KEYS)}; got {kind!r}")
    wanted = {"type", *_ROPE_SCALING_KEYS[kind]}
    if set(scaling) != wanted:
        raise ConfigError(
            f"rope_scaling of type {kind!r} needs exactly the keys {sorted(wanted)}; got {sorted(scaling)}"
        )
    lists = [scaling[k] for k in _FACTOR_LISTS.get(kind, ())]
    values = [scaling[k] for k in _ROPE_SCALING_KEYS[kind] if k not in _FACTOR_LISTS.get(kind, ())]
    if not all(isinstance(v, list) for v in lists) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
        for v in [*values, *(f for fs in lists for f in fs)]
    ):
        raise ConfigError(f"rope_scaling {kind!r} needs positive finite numbers; got {scaling!r}")
    for key, factors in zip(_FACTOR_LISTS.get(kind, ()), lists, strict=True):
        if len(factors) != d_head // 2:
            raise ConfigError(f"rope_scaling {key!r} needs rope_dims / 2 = {d_head // 2} values; got {len(factors)}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConfigError(
            f"rope_scaling llama3 needs high_freq_factor ({scaling['high_freq_factor']}) above low_freq_factor "
            f"({scaling['low_freq_factor']})"
        )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]
