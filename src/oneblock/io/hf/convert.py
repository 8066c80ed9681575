"""Hugging Face transformers <-> oneblock: ``from_hf``, ``to_hf`` and ``save_hf``.

Five families are understood, each in its own module: GPT-2 (``gpt2``), BERT (``bert``), BART
(``bart``), Llama (``llama``) and T5 (``t5``). Conversion is exact or it fails: every tensor of the source is copied
or the call raises ``ConversionError`` naming the tensor, and a config option oneblock cannot reproduce (say
GPT-2's ``scale_attn_by_inverse_layer_idx``) is refused by name rather than dropped.

transformers is optional. Reading a directory needs only ``safetensors`` (pickles are refused), and ``save_hf``
writes files without it; only ``to_hf`` imports it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath, PureWindowsPath
from types import ModuleType
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors_bytes
from torch import Tensor, nn

from oneblock import jsontext
from oneblock.config import ModelConfig
from oneblock.errors import ConfigError, ConversionError
from oneblock.io import files, limits
from oneblock.io.hf import t5
from oneblock.io.hf.common import TensorSource, load_exact
from oneblock.io.hf.families import FAMILIES
from oneblock.models.build import Model, build_model


def from_hf(source: Any, *, context: int | None = None) -> Model:
    """Copy a Hugging Face model into the oneblock model that computes the same function.

    Accepted sources: a transformers model object, or a directory holding ``config.json`` and the weights
    (``model.safetensors`` or a sharded ``model.safetensors.index.json`` whose shards lie inside the directory;
    a pickled ``pytorch_model.bin`` is refused, never unpickled). The config's size is checked
    (``oneblock.io.limits``) before the model is built. Per family:

    - GPT-2: ``GPT2Model``, ``GPT2LMHeadModel`` -> ``Decoder`` (logits (B, T, V)).
    - BERT: ``BertModel`` -> ``Encoder`` (hidden states (B, T, C); ``.pool`` when the source has a pooler).
      For ``BertFor*`` task models only the ``bert`` body is taken: the task head (``cls.*``, ``classifier.*``,
      ``qa_outputs.*``) has no oneblock equivalent and is dropped.
    - BART: ``BartModel``, ``BartForConditionalGeneration`` -> ``EncoderDecoder`` (logits (B, T, V)).
    - Llama: ``LlamaModel``, ``LlamaForCausalLM`` -> ``Decoder``.
    - T5: ``T5ForConditionalGeneration``, ``T5Model`` -> ``EncoderDecoder``; ``T5EncoderModel`` -> ``Encoder``.

    A bare body (``GPT2Model``, ``BartModel``, ``LlamaModel``) has no LM head of its own; the oneblock model then
    gets a head tied to the token embeddings, whatever ``tie_word_embeddings`` says, so its hidden states are the
    source's exactly and its logits are those of the tied head.

    Args:
        source: the model object, or a path to a directory.
        context: the positions to run the model for (``ModelConfig.at_context``), at most and by default its
            ``max_position_embeddings``; Phi-3's LongRoPE runs its short factors up to its original context.

    Returns:
        The oneblock model, in eval mode, in the dtype and on the device of the source's weights.
        ``model.config.extra`` records ``hf_model_type`` and ``hf_architectures``.

    Raises:
        ConversionError: unknown model type, unsupported config option, missing or unused tensor, wrong shape,
            or a directory without the expected files.
        ConfigError: a ``context`` beyond the model's, or for a model with a learned position table.
    """
    hf_config, tensors = _read_source(source)
    family = _family(hf_config)
    src = TensorSource(family.FAMILY, tensors, prefix=family.PREFIX, ignore=family.IGNORE)
    try:
        cfg = family.config_from_hf(hf_config, src.keys())
        architectures = hf_config.get("architectures") or []
        cfg = cfg.replace(extra={"hf_model_type": family.MODEL_TYPE, "hf_architectures": list(architectures)})
    except ConversionError:
        raise
    except (ConfigError, TypeError, ValueError, KeyError, AttributeError) as error:  # a string where a number goes
        raise ConversionError(f"from_hf: the {family.FAMILY} config cannot describe a model: {error}") from None
    cfg = cfg.at_context(context)
    limits.check_model_size(cfg, what=f"the {family.FAMILY} config", dtype=_dtype_of(tensors), error=ConversionError)
    mapped = family.weights_from_hf(cfg, src)
    src.check_all_taken()
    model = build_model(cfg, dtype=_dtype_of(tensors), device=_device_of(tensors))
    load_exact(model, mapped, f"the oneblock {cfg.arch} built from the {family.FAMILY} config")
    return model.eval()


def to_hf(model: nn.Module) -> Any:
    """The transformers model that computes what ``model`` computes, with every tensor copied.

    The class is ``GPT2LMHeadModel``, ``BertModel`` (with a pooler iff ``cfg.pooler``),
    ``BartForConditionalGeneration`` (``final_logits_bias`` zeros when ``cfg.final_logits_bias`` is off) or
    ``LlamaForCausalLM``, ``T5ForConditionalGeneration`` or ``T5EncoderModel`` (or the ``*ForCausalLM`` of
    another family in ``families.FAMILIES``), chosen by which family ``model.config`` fits: the one it was read
    from (``extra["hf_model_type"]``) when that still fits, so adapters keep their module names.

    Raises:
        ConversionError: the config fits no family (the message lists, per family, what differs).
        ImportError: transformers is not installed.
    """
    import transformers

    cfg = _config_of(model)
    family = _family_for(cfg)
    hf_dict = family.config_to_hf(cfg)
    architecture = hf_dict["architectures"][0]
    hf_config = transformers.AutoConfig.for_model(
        hf_dict["model_type"], **{k: v for k, v in hf_dict.items() if k != "model_type"}
    )
    model_class = getattr(transformers, architecture)
    kwargs = {"add_pooling_layer": cfg.pooler} if architecture == "BertModel" else {}
    hf_model = model_class(hf_config, **kwargs)
    if family is t5:
        t5.check_untied(cfg, hf_model)
    state = model.state_dict()
    hf_model.to(dtype=_dtype_of(state), device=_device_of(state))
    load_exact(hf_model, family.weights_to_hf(cfg, state), f"transformers {architecture}")
    return hf_model.eval()


def save_hf(model: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` that ``transformers.AutoModel*.from_pretrained`` loads.

    transformers is not needed. Tied tensors are written once, under the name transformers ties the others to.
    A BERT without a pooler is saved as ``BertModel``; loading it creates a fresh pooler, which the hidden states
    do not use.

    Args:
        model: a oneblock model whose config fits a family (see ``to_hf``).
        directory: created if needed; existing files of the same names are replaced, both or neither (other files
            there are kept).

    Returns:
        The directory.

    Raises:
        ConversionError: the model fits no family, or the files cannot be written (disk full, permission), in
            which case the directory's files are as they were.
    """
    cfg = _config_of(model)
    family = _family_for(cfg)
    state = model.state_dict()
    hf_dict = family.config_to_hf(cfg)
    hf_dict["torch_dtype"] = str(_dtype_of(state)).removeprefix("torch.")
    tensors = {key: t.detach().cpu().contiguous() for key, t in family.weights_to_hf(cfg, state).items()}
    path = Path(directory)
    try:
        weights = save_safetensors_bytes(_unshare(tensors), metadata={"format": "pt"})
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise ConversionError(f"cannot serialise the weights for {str(path)!r}: {error}") from None
    config = (json.dumps(hf_dict, indent=2, sort_keys=True) + "\n").encode()
    # Both files complete on disk before either replaces an old one: a full disk leaves the old pair whole.
    contents = {"model.safetensors": [weights], "config.json": [config]}
    files.replace_files(path, contents, what="Hugging Face model", error=ConversionError)
    return path


def _read_source(source: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config dict, state dict) of a model object or a directory."""
    if isinstance(source, (str, os.PathLike)):
        return _read_directory(Path(source))
    state_dict = getattr(source, "state_dict", None)
    to_dict = getattr(getattr(source, "config", None), "to_dict", None)
    if callable(state_dict) and callable(to_dict):
        return to_dict(), dict(state_dict())
    raise ConversionError(
        f"from_hf expects a transformers model or a directory with config.json; got {type(source).__name__}"
    )


def _read_directory(path: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The config and tensors of a directory, every problem a ``ConversionError`` naming the file."""
    if not path.is_dir():
        raise ConversionError(f"from_hf: {str(path)!r} is not a directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConversionError(
            f"from_hf: {str(path)!r} has no config.json; found {sorted(p.name for p in path.iterdir())}"
        )
    config = _read_json(config_path)
    _family(config)  # an unsupported model type fails before its weights are read
    if (path / "model.safetensors").is_file():
        return config, _read_safetensors(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConversionError(
                f"from_hf: {str(index)!r} has no 'weight_map' object mapping tensor names to shard files"
            )
        tensors: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(_read_safetensors(_inside(path, shard, index)))
        return config, tensors
    if (path / "pytorch_model.bin").is_file():
        raise ConversionError(
            f"from_hf: {str(path)!r} holds its weights as pytorch_model.bin, a pickle; oneblock never unpickles "
            "(unpickling can run arbitrary code). Convert it to model.safetensors where you trust the file, e.g. "
            "with transformers: AutoModel.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
        )
    raise ConversionError(
        f"from_hf: {str(path)!r} has no model.safetensors or model.safetensors.index.json; "
        f"found {sorted(p.name for p in path.iterdir())}"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            text = f.read(jsontext.MAX_BYTES + 1)  # the limit's own message for a larger file, without reading it
    except OSError as error:
        raise ConversionError(f"from_hf: cannot read {str(path)!r}: {error.strerror or error}") from None
    data = jsontext.loads(text, what=f"from_hf: {str(path)!r}", error=ConversionError)
    if not isinstance(data, dict):
        raise ConversionError(f"from_hf: {str(path)!r} must hold a JSON object; got a {type(data).__name__}")
    return data


def _inside(directory: Path, name: str, index: Path) -> Path:
    """A shard named by an index, refused unless its *name* stays inside the model's directory.

    The name is checked, not the file it resolves to: in the Hugging Face hub cache every file of
    ``snapshots/<revision>/`` is a symlink to ``../../blobs/<sha256>``, and following it is what the user asked for.
    What the index may not do is name a path of its own choosing (absolute, or climbing out with ``..``).
    """
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not parts or PurePosixPath(name).is_absolute() or PureWindowsPath(name).anchor or ".." in parts:
        raise ConversionError(
            f"from_hf: {str(index)!r} names the shard {name!r}, outside {str(directory)!r}; an index names its "
            "shards by file names relative to its own directory"
        )
    shard = directory / name
    if not shard.is_file():
        raise ConversionError(f"from_hf: {str(index)!r} names the shard {name!r}, which does not exist")
    return shard


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    """The tensors of a foreign safetensors file (safetensors checks its layout against the file's size)."""
    try:
        tensors = load_file(str(path))
    except OSError as error:
        raise ConversionError(f"from_hf: cannot read {str(path)!r}: {error.strerror or error}") from None
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise ConversionError(f"from_hf: {str(path)!r} is not a readable safetensors file: {error}") from None
    return tensors


def _family(hf_config: Mapping[str, Any]) -> ModuleType:
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise ConversionError(
            f"from_hf supports model_type {sorted(FAMILIES)}; got {model_type!r} "
            f"(architectures {hf_config.get('architectures')})"
        )
    return FAMILIES[model_type]


def _family_for(cfg: ModelConfig) -> ModuleType:
    """The family ``cfg`` was read from (``hf_model_type``) when its format can still hold it, else the first one
    that can: a plain Phi-3 is also a Llama, but its adapters name Phi-3's stacked ``qkv_proj``."""
    recorded = cfg.extra.get("hf_model_type") if isinstance(cfg.extra, dict) else None
    if recorded in FAMILIES and not FAMILIES[recorded].mismatches(cfg):
        return FAMILIES[recorded]
    reasons = {}
    for family in FAMILIES.values():
        differences = family.mismatches(cfg)
        if not differences:
            return family
        reasons[family.FAMILY] = differences
    listed = "; ".join(f"{name}: {', '.join(diff)}" for name, diff in reasons.items())
    raise ConversionError(f"this config fits no Hugging Face family oneblock can write. {listed}")


def _config_of(model: nn.Module) -> ModelConfig:
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise ConversionError(f"expected a oneblock model (with a ModelConfig .config); got {type(model).__name__}")
    return cfg


def _dtype_of(tensors: Mapping[str, Tensor]) -> torch.dtype:
    """The dtype of the first floating-point tensor (float32 if none)."""
    return next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)


def _device_of(tensors: Mapping[str, Tensor]) -> torch.device:
    return next((t.device for t in tensors.values()), torch.device("cpu"))


def _unshare(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Clone tensors that share memory with an earlier one: safetensors refuses shared storage."""
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[key] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out
