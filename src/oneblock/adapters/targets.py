"""Which linear layers a LoRA target name selects, in oneblock's modules and under Hugging Face's names.

Every linear layer of a oneblock model but the embedding and the head is a ``Site``: its oneblock module name, the
roles it plays (``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down``, ``pooler``), its widths, and, when the
config fits a Hugging Face family, the module name transformers gives it (in the class ``oneblock.to_hf``
builds). The roles per family:

=========  =====================  ================  ================  ===================  =================
family     q, k, v                o                 gate              up                   down
=========  =====================  ================  ================  ===================  =================
Llama [1]  self_attn.q/k/v_proj   self_attn.o_proj  mlp.gate_proj     mlp.up_proj          mlp.down_proj
Phi-3      self_attn.qkv_proj     self_attn.o_proj  mlp.gate_up_proj  (with gate)          mlp.down_proj
GPT-2      attn.c_attn (fused)    attn.c_proj       -                 mlp.c_fc             mlp.c_proj
BERT       attention.self.query   attention.        -                 intermediate.dense   output.dense
           /key/value             output.dense
BART       self_attn/encoder_     out_proj          -                 fc1                  fc2
           attn.q/k/v_proj
T5         SelfAttention/         o                 DenseReluDense    DenseReluDense.wi_1  DenseReluDense.wo
           EncDecAttention.q/k/v                    .wi_0             (wi)
=========  =====================  ================  ================  ===================  =================

[1] and every family of Llama's module names: Qwen2, Qwen3, Gemma 2, Gemma 3, Granite, SmolLM3, OLMo 2.

A name selects a site when it is one of its roles, or (as peft matches ``target_modules``) its Hugging Face module
name or a dotted suffix of it: ``q_proj``, ``c_attn``, ``attn.c_proj``. ``all-linear`` selects every site, as
peft's does (which spares only the output layer). A role the family lacks (``gate`` in GPT-2) selects nothing;
a name that selects nothing in any family is refused.

GPT-2 computes queries, keys and values with one matrix, ``c_attn``, and peft puts one adapter on it: A (r, C)
shared by the three, B (3C, r). oneblock does the same on a fused ``qkv_proj`` (``fuse_qkv``), so a GPT-2 adapter
is all of q, k and v or none of them. Phi-3 stacks q, k and v (``qkv_proj``), and gate and up (``gate_up_proj``,
gate first; oneblock's ``w13``, ``fuse_gate_up``), each adapted whole the same way. Every other family has
separate adapters; a model whose projections were fused (``fuse_qkv``) is split back before wrapping, a stacked
4-bit one (``BlockLinear``: a GGUF file's q/k/v or gate/up) by row slices of its blocks, exactly and without
dequantizing; another quantized fused kind is refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor, nn

from oneblock.adapters.lora import ALL_LINEAR, DEFAULT_TARGETS, LoraConfig
from oneblock.config import ModelConfig
from oneblock.errors import ConfigError
from oneblock.io.hf.families import FAMILIES
from oneblock.models.inputs import config_of

ROLES = (*DEFAULT_TARGETS, "pooler")
# The module prefix of the transformers class ``to_hf`` builds, per family: ``model.layers.0...`` in every
# ``*ForCausalLM`` but GPT-2's and in BART's; GPT-2 ``transformer.h.0...``; BertModel and T5 none.
HF_PREFIX = {**{name: "model." for name in FAMILIES}, "gpt2": "transformer.", "bert": "", "t5": ""}
# Per family whose checkpoints stack projections: oneblock's fused module in block ``i`` -> its Hugging Face name
# (less the prefix). peft adapts such a matrix whole, so oneblock fuses its projections to adapt them as one.
FUSED = {
    "gpt2": {"attn.qkv_proj": "h.{i}.attn.c_attn"},
    "phi3": {"attn.qkv_proj": "layers.{i}.self_attn.qkv_proj", "ffn.w13": "layers.{i}.mlp.gate_up_proj"},
}


@dataclass(frozen=True)
class Site:
    """One linear layer that can carry an adapter.

    Attributes:
        ours: the oneblock module name, e.g. ``blocks.0.attn.q_proj`` (``blocks.0.attn.qkv_proj`` when fused).
        roles: the short names it answers to; ``("q", "k", "v")`` for a fused projection.
        in_features, out_features: its widths.
        hf: its Hugging Face module name, e.g. ``model.layers.0.self_attn.q_proj``; ``None`` without a family.
    """

    ours: str
    roles: tuple[str, ...]
    in_features: int
    out_features: int
    hf: str | None = None

    @property
    def adapter_parameters(self) -> int:
        """A and B at rank 1; a rank-r adapter has ``r`` times this."""
        return self.in_features + self.out_features


def family_of(cfg: ModelConfig) -> str | None:
    """The Hugging Face ``model_type`` whose checkpoints can hold ``cfg`` exactly, or ``None``."""
    recorded = cfg.extra.get("hf_model_type") if isinstance(cfg.extra, dict) else None
    if recorded in FAMILIES and not FAMILIES[recorded].mismatches(cfg):
        return str(recorded)
    return next((name for name, family in FAMILIES.items() if not family.mismatches(cfg)), None)


def sites(cfg: ModelConfig) -> list[Site]:
    """Every linear layer but the embedding and the head of ``build_model(cfg)``, from the config alone."""
    family = family_of(cfg)
    fused = FUSED.get(family or "", {})
    c, q_width, kv_width = cfg.d_model, cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    if cfg.arch == "encoder-decoder":
        stacks = [("encoder.", cfg.n_layers, False), ("decoder.", cfg.n_decoder_layers, True)]
    else:
        stacks = [("", cfg.n_layers, False)]
    ffn_roles: dict[str, tuple[str, ...]] = (
        {"w1": ("gate",), "w3": ("up",), "w2": ("down",)} if cfg.ffn != "mlp" else {"w1": ("up",), "w2": ("down",)}
    )
    if "ffn.w13" in fused:  # gate and up as one matrix, gate first
        ffn_roles = {"w13": ("gate", "up"), "w2": ("down",)}
    ffn_sizes = {"w1": (c, cfg.d_ff), "w3": (c, cfg.d_ff), "w13": (c, 2 * cfg.d_ff), "w2": (cfg.d_ff, c)}
    out: list[Site] = []
    for prefix, n_layers, cross in stacks:
        for i in range(n_layers):
            block = f"{prefix}blocks.{i}"
            for attn in ("attn", "cross_attn") if cross else ("attn",):
                if "attn.qkv_proj" in fused and attn == "attn":
                    out.append(Site(f"{block}.attn.qkv_proj", ("q", "k", "v"), c, q_width + 2 * kv_width))
                else:
                    for role, width in (("q", q_width), ("k", kv_width), ("v", kv_width)):
                        out.append(Site(f"{block}.{attn}.{role}_proj", (role,), c, width))
                out.append(Site(f"{block}.{attn}.o_proj", ("o",), q_width, c))
            for name, roles in ffn_roles.items():
                out.append(Site(f"{block}.ffn.{name}", roles, *ffn_sizes[name]))
    if cfg.arch == "encoder" and cfg.pooler:
        out.append(Site("pooler", ("pooler",), c, c))
    if family is None:
        return out
    names = hf_names(cfg, family)
    return [Site(s.ours, s.roles, s.in_features, s.out_features, names[s.ours]) for s in out]


def hf_names(cfg: ModelConfig, family_name: str) -> dict[str, str]:
    """oneblock module name -> Hugging Face module name, for every site of a config that fits ``family_name``."""
    family: ModuleType = FAMILIES[family_name]
    prefix = HF_PREFIX[family_name]
    out = {}
    for pair in family._pairs(cfg):  # the converter's own one-to-one tensor names
        if pair.ours.endswith(".weight") and pair.theirs.endswith(".weight"):
            out[pair.ours.removesuffix(".weight")] = prefix + pair.theirs.removesuffix(".weight")
    for i in range(cfg.n_layers):
        for ours, theirs in FUSED.get(family_name, {}).items():
            out[f"blocks.{i}.{ours}"] = prefix + theirs.format(i=i)
    return out


def select(cfg: ModelConfig, targets: Sequence[str] | str) -> list[Site]:
    """The sites ``targets`` names (see the module docstring); a regex string selects by full match of the
    Hugging Face name, as peft's ``target_modules`` does.

    Raises:
        ConfigError: a name that no family knows, targets that select nothing, or part of a fused q/k/v.
    """
    everything = sites(cfg)
    if isinstance(targets, str) and targets != ALL_LINEAR:
        pattern = re.compile(targets)
        chosen = [s for s in everything if s.hf is not None and pattern.fullmatch(s.hf)]
        return _nonempty(chosen, cfg, [targets], everything)
    names = [targets] if isinstance(targets, str) else list(targets)
    if names == [ALL_LINEAR]:
        return everything
    unknown = [n for n in names if n not in ROLES and not any(_matches_hf(s, n) for s in everything)]
    if unknown:
        raise ConfigError(
            f"unknown LoRA target(s) {unknown}; use {','.join(DEFAULT_TARGETS)}, {ALL_LINEAR}, or the model's "
            f"Hugging Face module names, e.g. {_examples(everything)}"
        )
    chosen = []
    for site in everything:
        by_role = [role for role in site.roles if role in names]
        if 0 < len(by_role) < len(site.roles) and not any(_matches_hf(site, n) for n in names):
            missing = [r for r in site.roles if r not in by_role]
            raise ConfigError(
                f"{site.hf or site.ours} computes {', '.join(site.roles)} with one matrix and peft adapts it whole; "
                f"targets {by_role} leave out {missing}: name all of {', '.join(site.roles)} (or none)"
            )
        if by_role or any(_matches_hf(site, n) for n in names):
            chosen.append(site)
    return _nonempty(chosen, cfg, names, everything)


def hf_target_modules(cfg: ModelConfig, chosen: Iterable[Site]) -> list[str]:
    """peft ``target_modules`` that select exactly ``chosen``: for each, the shortest dotted suffix of its
    Hugging Face name that no other (unchosen) site's name ends with."""
    everything = sites(cfg)
    chosen_names = {s.hf for s in chosen}
    if None in chosen_names:
        raise ConfigError("this model fits no Hugging Face family, so its adapters have no peft module names")
    others = [s.hf for s in everything if s.hf not in chosen_names and s.hf is not None]
    out: list[str] = []
    for name in sorted(n for n in chosen_names if n is not None):
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            suffix = ".".join(parts[-k:])
            if not any(o == suffix or o.endswith("." + suffix) for o in others):
                break
        if suffix not in out:
            out.append(suffix)
    return sorted(out)


def prepare_sites(model: nn.Module, targets: Sequence[str] | str) -> list[str]:
    """The oneblock module names to wrap, after fusing (GPT-2, Phi-3) or splitting (others) query/key/value and
    gate/up projections so that the model's modules are the sites'.

    Raises:
        ConfigError: the names select nothing, or a fused projection is of a kind that cannot be split (not
            ``nn.Linear`` nor ``BlockLinear``).
    """
    from oneblock.layers.attention import MultiHeadAttention
    from oneblock.layers.feedforward import FeedForward

    cfg = config_of(model)
    chosen = select(cfg, targets)
    for site in chosen:
        parent, _, child = site.ours.rpartition(".")
        owner = model.get_submodule(parent)
        if isinstance(owner, MultiHeadAttention):
            fused = owner.qkv_proj is not None
            if child == "qkv_proj" and not fused:
                owner.fuse_qkv()
            elif child in ("q_proj", "k_proj", "v_proj") and fused:
                owner.unfuse_qkv()  # a 4-bit BlockLinear splits by rows, exactly
        elif isinstance(owner, FeedForward) and child == "w13" and owner.w13 is None:
            owner.fuse_gate_up()
        elif isinstance(owner, FeedForward) and child in ("w1", "w3") and owner.w13 is not None:
            owner.unfuse_gate_up()
        module = model.get_submodule(site.ours)
        if not isinstance(getattr(module, "in_features", None), int):
            raise ConfigError(f"{site.ours} is a {type(module).__name__}, not a linear layer LoRA can wrap")
    return [site.ours for site in chosen]


def unfuse_after_unload(model: nn.Module) -> None:
    """Split back the float projections of a GPT-2 or Phi-3 (fused by ``apply_lora`` for its ``c_attn``,
    ``qkv_proj`` and ``gate_up_proj`` adapters) once the adapters are merged away, so the model's state dict is the
    usual one again."""
    from oneblock.layers.attention import MultiHeadAttention
    from oneblock.layers.feedforward import FeedForward

    if family_of(config_of(model)) not in FUSED:
        return
    for module in model.modules():
        if isinstance(module, MultiHeadAttention) and isinstance(module.qkv_proj, nn.Linear):
            module.unfuse_qkv()
        elif isinstance(module, FeedForward) and isinstance(module.w13, nn.Linear):
            module.unfuse_gate_up()


def split_fused(model: nn.Module, chosen: dict[str, Site]) -> tuple[dict[str, Site], dict[str, dict[str, str]]]:
    """The adapted sites whose layer the model has as such (or gets by a split: a stacked ``nn.Linear`` or
    ``BlockLinear``, such as a GGUF file's 4-bit ``qkv_proj``), and, per attention layer whose q, k and v are one
    matrix of a kind that cannot be split, the roles adapted there."""
    from oneblock.layers.attention import MultiHeadAttention
    from oneblock.layers.quantized import BlockLinear

    separate: dict[str, Site] = {}
    fused: dict[str, dict[str, str]] = {}
    for hf_name, site in chosen.items():
        parent, _, child = site.ours.rpartition(".")
        attn = model.get_submodule(parent)
        opaque = isinstance(attn, MultiHeadAttention) and not isinstance(
            attn.qkv_proj, (type(None), nn.Linear, BlockLinear)
        )
        if opaque and child in ("q_proj", "k_proj", "v_proj"):
            fused.setdefault(parent, {})[child[0]] = hf_name
        else:
            separate[hf_name] = site
    return separate, fused


def wrap_fused(model: nn.Module, attention: str, parts: dict[str, tuple[Tensor, Tensor]], cfg: LoraConfig) -> None:
    """Put the q, k and v adapters ``parts`` (role -> (A (r, C), B (out, r))) on one fused quantized projection as
    one adapter of rank ``len(parts) r``: A stacked (k r, C), B block-diagonal ((H + 2 Hkv) Dh, k r). It computes
    exactly what the separate adapters do, for inference; it is frozen, since training it would fill the zero
    blocks, and ``save_adapter`` refuses it."""
    from oneblock.adapters.lora import LoraLinear
    from oneblock.layers.attention import MultiHeadAttention

    attn = model.get_submodule(attention)
    if not isinstance(attn, MultiHeadAttention) or attn.qkv_proj is None:
        raise ConfigError(f"{attention} has no fused query/key/value projection to adapt")
    sizes = {"q": attn.n_heads * attn.d_head, "k": attn.n_kv_heads * attn.d_head, "v": attn.n_kv_heads * attn.d_head}
    offsets = {"q": 0, "k": sizes["q"], "v": sizes["q"] + sizes["k"]}
    roles = [role for role in "qkv" if role in parts]
    r = cfg.rank
    layer = LoraLinear(attn.qkv_proj, rank=r * len(roles), alpha=cfg.alpha, dropout=cfg.dropout, rslora=cfg.rslora)
    layer.scale = cfg.scale  # each part's own alpha / r, not the stacked rank's
    with torch.no_grad():
        layer.lora_A.weight.zero_()
        layer.lora_B.weight.zero_()
        for j, role in enumerate(roles):
            a, b = parts[role]
            layer.lora_A.weight[j * r : (j + 1) * r].copy_(a)  # (r, C)
            layer.lora_B.weight[offsets[role] : offsets[role] + sizes[role], j * r : (j + 1) * r].copy_(b)
    layer.requires_grad_(False)
    attn.qkv_proj = layer


def _matches_hf(site: Site, name: str) -> bool:
    return site.hf is not None and (site.hf == name or site.hf.endswith("." + name))


def _nonempty(chosen: list[Site], cfg: ModelConfig, names: Sequence[str], everything: list[Site]) -> list[Site]:
    if not chosen:
        family = family_of(cfg) or "this model"
        raise ConfigError(
            f"LoRA targets {list(names)} select no linear layer of {family}; it has the roles "
            f"{sorted({r for s in everything for r in s.roles})} and modules such as {_examples(everything)}"
        )
    return chosen


def _examples(everything: list[Site]) -> list[str]:
    leaves = []
    for site in everything:
        leaf = (site.hf or site.ours).rsplit(".", 1)[-1]
        if leaf not in leaves:
            leaves.append(leaf)
    return leaves[:8]
