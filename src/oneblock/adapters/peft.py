"""LoRA adapters in peft's format, both ways: ``save_adapter`` writes what ``PeftModel.from_pretrained`` loads,
``load_adapter`` reads what peft's ``save_pretrained`` wrote.

A peft adapter is a directory of two files:

* ``adapter_config.json``: ``peft_type: LORA``, ``r``, ``lora_alpha``, ``lora_dropout``, ``use_rslora``,
  ``target_modules`` (Hugging Face module names), ``bias: none``, ``task_type``, ``base_model_name_or_path``...;
* ``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight`` (r, in) and ``.lora_B.weight``
  (out, r) per adapted module, ``<module>`` its name in the transformers model
  (``model.layers.0.self_attn.q_proj`` for Llama, ``transformer.h.0.attn.c_attn`` for GPT-2).

What oneblock writes also carries, in the safetensors metadata, the digest of every byte of that file (checked
on load, like every file oneblock writes), the digest of ``adapter_config.json``, and the identity of the base:
its family, sizes and a digest of its linear layers' names and shapes. An adapter loaded onto another base is
refused with both named. Both files are written to temporary names first and renamed only once both are
complete, so a full disk leaves the previous adapter as it was.

peft features a ``LoraLinear`` cannot represent are refused by name: DoRA (``use_dora``), per-layer ranks or
alphas (``rank_pattern``, ``alpha_pattern``), ``modules_to_save``, biases (``bias`` other than ``none``,
``lora_bias``), ``layers_to_transform``, and adapters on anything but the linear layers (embeddings, the head).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from oneblock import jsontext
from oneblock.adapters.apply import apply_lora, lora_modules
from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.targets import HF_PREFIX, Site, family_of, hf_target_modules, sites, split_fused, wrap_fused
from oneblock.errors import CheckpointError, ConversionError
from oneblock.io import integrity
from oneblock.io.files import map_file, read_bytes, replace_files
from oneblock.io.hf.families import FAMILIES
from oneblock.models.inputs import config_of

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
BASE_KEY = "oneblock.base"
CONFIG_DIGEST_KEY = "oneblock.adapter_config.sha256"
TASK_TYPES = {"decoder": "CAUSAL_LM", "encoder-decoder": "SEQ_2_SEQ_LM", "encoder": "FEATURE_EXTRACTION"}
# peft options that change what the adapter computes, with the value that means "off".
REFUSED_OPTIONS: dict[str, Any] = {
    "use_dora": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "bias": "none",
    "lora_bias": False,
    "layers_to_transform": None,
    "layer_replication": None,
    "use_qalora": False,
    "trainable_token_indices": None,
}


def base_identity(model: nn.Module) -> dict[str, Any]:
    """What an adapter needs of its base: family, sizes, and a digest of every adaptable layer's name and shape.

    The same for a model loaded 4-bit or in float32 from the same file: it comes from the config.
    """
    cfg = config_of(model)
    lines = [f"{s.hf or s.ours}:{s.out_features}x{s.in_features}" for s in sites(cfg)]
    lines.append(f"embedding:{cfg.vocab_size}x{cfg.d_model}")
    return {
        "family": family_of(cfg) or "oneblock",
        "arch": cfg.arch,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "vocab_size": cfg.vocab_size,
        "linears_sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(),
    }


def save_adapter(
    model: nn.Module, directory: str | os.PathLike[str], *, cfg: LoraConfig, base: str | None = None
) -> Path:
    """Write the adapters of ``model`` as a peft LoRA adapter directory.

    Args:
        model: a oneblock model with adapters (``apply_lora``), unmerged or merged alike.
        directory: created if needed; an adapter already there is replaced only once the new one is complete.
        cfg: the adapters' settings (written as peft's ``r``, ``lora_alpha``, ``lora_dropout``, ``use_rslora``).
        base: ``base_model_name_or_path``, the base model's name or path for the reader's information.

    Returns:
        The directory.

    Raises:
        ConversionError: no adapters, a model that fits no Hugging Face family, or adapters that differ from
            ``cfg``.
    """
    if not isinstance(cfg, LoraConfig):
        raise ConversionError(f"save_adapter needs the LoraConfig the adapters were built with; got {cfg!r}")
    modules = lora_modules(model)
    if not modules:
        raise ConversionError("this model has no LoRA adapters to save; apply_lora(model, cfg) first")
    model_cfg = config_of(model)
    family = family_of(model_cfg)
    if family is None:
        raise ConversionError(
            f"this model's config fits no Hugging Face family ({', '.join(sorted(FAMILIES))}), so its adapters have "
            "no peft names; save them with oneblock.adapters.apply.adapter_state_dict instead"
        )
    by_ours = {s.ours: s for s in sites(model_cfg)}
    tensors: dict[str, Tensor] = {}
    chosen: list[Site] = []
    for name, module in modules.items():
        site = by_ours.get(name)
        if site is None or site.hf is None:
            raise ConversionError(f"the adapter on {name} has no place in a {family} checkpoint")
        if module.rank != cfg.rank or module.scale != cfg.scale:
            raise ConversionError(
                f"the adapter on {name} has rank {module.rank} and scale {module.scale:g}; cfg says rank {cfg.rank} "
                f"and scale {cfg.scale:g}: give the LoraConfig the adapters were built with"
            )
        chosen.append(site)
        for part in ("lora_A", "lora_B"):
            weight = getattr(module, part).weight.detach()
            tensors[f"{KEY_PREFIX}{site.hf}.{part}.weight"] = weight.to("cpu", torch.float32).contiguous()
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": TASK_TYPES[model_cfg.arch],
        "base_model_name_or_path": base,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "use_rslora": cfg.rslora,
        "target_modules": hf_target_modules(model_cfg, chosen),
        "bias": "none",
        "fan_in_fan_out": family == "gpt2",  # GPT-2's Conv1D stores its weight (in, out)
        "inference_mode": True,
        "init_lora_weights": True,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
        "layers_to_transform": None,
    }
    config_bytes = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    metadata = {
        "format": "pt",
        BASE_KEY: json.dumps(base_identity(model), sort_keys=True),
        CONFIG_DIGEST_KEY: hashlib.sha256(config_bytes).hexdigest(),
    }
    weights = integrity.dump_safetensors(tensors, metadata)
    path = Path(directory)
    replace_files(path, {WEIGHTS_NAME: weights, CONFIG_NAME: [config_bytes]}, what="LoRA adapter")
    return path


def load_adapter(model: nn.Module, directory: str | os.PathLike[str]) -> LoraConfig:
    """Read a peft LoRA adapter (written by peft or by ``save_adapter``) onto ``model``, unmerged, in place.

    Every non-adapter parameter is frozen, as by ``apply_lora``.

    Returns:
        The adapter's settings; ``targets`` are the peft ``target_modules`` of the layers it adapts.

    Raises:
        CheckpointError: a missing or unreadable directory or file, a pickle, or a digest that does not match.
        ConversionError: a peft option that oneblock cannot represent (named), keys of no linear layer, shapes
            or a recorded base identity that differ from ``model``'s.
    """
    path = Path(directory)
    config, config_bytes = _read_config(path)
    weights_path = path / WEIGHTS_NAME
    # Mapped, as checkpoints are: the header's sizes are checked against the file's before any other byte is read.
    blob = map_file(weights_path, "adapter weights")
    name = repr(str(weights_path))
    entries, metadata, _ = integrity.parse_header(blob, name)
    if any(key.startswith("oneblock.") for key in metadata):  # written by oneblock: every byte checked, config too
        integrity.verify_sealed(blob, name)
        config_digest = hashlib.sha256(config_bytes).hexdigest()
        if metadata.get(CONFIG_DIGEST_KEY) != config_digest:
            raise CheckpointError(
                f"{str(path / CONFIG_NAME)!r} is not the config written with {name}: its SHA-256 differs from the "
                "one the weights record (edited, or the two files come from different saves)"
            )
        if BASE_KEY in metadata:
            recorded = jsontext.loads(metadata[BASE_KEY], what=f"the base identity in {name}", error=CheckpointError)
            _check_base(recorded, base_identity(model), path)
    cfg = _lora_config(config, path)
    modules = _adapted_modules(entries, path)
    model_cfg = config_of(model)
    chosen = _match_sites(model, modules, path)
    for hf_name, site in chosen.items():
        a_shape, b_shape = (
            tuple(entries[_key(hf_name, "lora_A")]["shape"]),
            tuple(entries[_key(hf_name, "lora_B")]["shape"]),
        )
        if a_shape != (cfg.rank, site.in_features) or b_shape != (site.out_features, cfg.rank):
            raise ConversionError(
                f"adapter {str(path)!r} holds {hf_name} A {a_shape} and B {b_shape}; this model's layer needs A "
                f"({cfg.rank}, {site.in_features}) and B ({site.out_features}, {cfg.rank}): it was trained for "
                "another base model"
            )
    tensors = integrity.tensors_of(blob, name)
    for key, value in tensors.items():
        if not value.is_floating_point() or not torch.isfinite(value).all():
            raise ConversionError(f"adapter {str(path)!r}: {key} holds NaN, inf or integers")
    separate, fused = split_fused(model, chosen)
    if separate:
        targets = tuple(s.hf for s in separate.values() if s.hf is not None)
        apply_lora(model, LoraConfig(cfg.rank, cfg.alpha, cfg.dropout, cfg.rslora, targets), limit_rank=False)
    else:
        for parameter in model.parameters():
            parameter.requires_grad_(False)
    wrapped = lora_modules(model)
    with torch.no_grad():
        for hf_name, site in separate.items():
            for part in ("lora_A", "lora_B"):
                getattr(wrapped[site.ours], part).weight.copy_(tensors[_key(hf_name, part)])
    for attention, parts in fused.items():
        wrap_fused(
            model,
            attention,
            {role: (tensors[_key(n, "lora_A")], tensors[_key(n, "lora_B")]) for role, n in parts.items()},
            cfg,
        )
    return LoraConfig(
        cfg.rank, cfg.alpha, cfg.dropout, cfg.rslora, tuple(hf_target_modules(model_cfg, chosen.values()))
    )


def _key(module: str, part: str) -> str:
    return f"{KEY_PREFIX}{module}.{part}.weight"


def _read_config(path: Path) -> tuple[dict[str, Any], bytes]:
    """The adapter's config and its bytes (read once: the weights of a oneblock adapter record their digest)."""
    if not path.is_dir():
        raise CheckpointError(f"no LoRA adapter at {str(path)!r}: not a directory (peft writes a directory)")
    if not (path / WEIGHTS_NAME).is_file() and (path / "adapter_model.bin").is_file():
        raise CheckpointError(
            f"{str(path)!r} holds its adapter as adapter_model.bin, a pickle; oneblock never unpickles. Save it "
            "with peft's save_pretrained(dir, safe_serialization=True) where you trust it"
        )
    for needed in (CONFIG_NAME, WEIGHTS_NAME):
        if not (path / needed).is_file():
            found = sorted(p.name for p in path.iterdir())
            raise CheckpointError(f"{str(path)!r} is not a peft LoRA adapter: it has no {needed} (found {found})")
    raw = read_bytes(path / CONFIG_NAME, "adapter config", limit=jsontext.MAX_BYTES)
    config = jsontext.loads(raw, what=repr(str(path / CONFIG_NAME)), error=CheckpointError)
    if not isinstance(config, dict):
        raise CheckpointError(f"{str(path / CONFIG_NAME)!r} must hold a JSON object")
    return config, raw


def _lora_config(config: dict[str, Any], path: Path) -> LoraConfig:
    """The settings of a peft config, after refusing what a ``LoraLinear`` cannot compute."""
    where = str(path / CONFIG_NAME)
    if config.get("peft_type") != "LORA":
        raise ConversionError(f"{where!r} is a {config.get('peft_type')!r} adapter; oneblock reads LORA adapters")
    for option, off in REFUSED_OPTIONS.items():
        value = config.get(option, off)
        if value != off and not (off is None and value in ([], {})) and not (off == {} and value is None):
            raise ConversionError(
                f"{where!r} sets {option}={value!r}, which oneblock's LoRA cannot represent (it supports plain LoRA: "
                f"{option}={off!r}); merge the adapter with peft (merge_and_unload) and load the merged model instead"
            )
    try:
        return LoraConfig(
            rank=config.get("r", 8),
            alpha=config.get("lora_alpha", 8),
            dropout=config.get("lora_dropout", 0.0),
            rslora=bool(config.get("use_rslora", False)),
        )
    except ValueError as error:
        raise ConversionError(f"{where!r}: {error}") from None


def _adapted_modules(entries: dict[str, Any], path: Path) -> set[str]:
    """The module names the tensors adapt; any other tensor (DoRA magnitudes, embeddings, biases) is refused."""
    modules: set[str] = set()
    for key in entries:
        module, dot, part = key.removeprefix(KEY_PREFIX).rpartition(".lora_")
        if not key.startswith(KEY_PREFIX) or not dot or part not in ("A.weight", "B.weight"):
            raise ConversionError(
                f"adapter {str(path)!r} holds {key!r}, which is not a LoRA A or B weight of a linear layer "
                "(DoRA magnitudes, embedding adapters, biases and saved modules are not supported)"
            )
        modules.add(module)
    for module in sorted(modules):
        for part in ("lora_A", "lora_B"):
            if _key(module, part) not in entries:
                raise ConversionError(f"adapter {str(path)!r} has no {_key(module, part)!r}")
    if not modules:
        raise ConversionError(f"adapter {str(path)!r} holds no tensors")
    return modules


def _match_sites(model: nn.Module, modules: set[str], path: Path) -> dict[str, Site]:
    """Hugging Face module name in the adapter -> the site of ``model`` it adapts (a body's names inside a head's
    class, ``layers.0...`` for ``model.layers.0...``, are accepted)."""
    cfg = config_of(model)
    family = family_of(cfg)
    if family is None:
        raise ConversionError("this model fits no Hugging Face family, so a peft adapter cannot name its layers")
    by_hf = {s.hf: s for s in sites(cfg)}
    prefix, reading_prefix = HF_PREFIX[family], FAMILIES[family].PREFIX
    out: dict[str, Site] = {}
    for module in sorted(modules):
        bare = module.removeprefix(reading_prefix) if reading_prefix else module
        for candidate in (module, prefix + module, prefix + bare, bare):
            if candidate in by_hf:
                out[module] = by_hf[candidate]
                break
        else:
            leaf = module.rsplit(".", 1)[-1]
            raise ConversionError(
                f"adapter {str(path)!r} adapts {module!r}, which is no linear layer of this {family} model that LoRA "
                f"can adapt{' (an embedding or the head)' if leaf in EMBEDDING_LEAVES else ''}; it was trained for "
                "another base model"
            )
    return out


EMBEDDING_LEAVES = {"embed_tokens", "wte", "wpe", "shared", "lm_head", "word_embeddings"}


def _check_base(recorded: dict[str, Any], actual: dict[str, Any], path: Path) -> None:
    if recorded != actual:
        raise ConversionError(
            f"adapter {str(path)!r} was made for another base: {_describe(recorded)}; this model is {_describe(actual)}"
        )


def _describe(identity: dict[str, Any]) -> str:
    return (
        f"{identity.get('family')} {identity.get('arch')} d_model {identity.get('d_model')}, "
        f"{identity.get('n_layers')} layers, vocab {identity.get('vocab_size')}, layers digest "
        f"{str(identity.get('linears_sha256'))[:12]}"
    )
