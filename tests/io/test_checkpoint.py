"""Checkpoints: save -> load is bit-exact for every family, tied weights stay tied, bad files are refused."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save as save_bytes
from safetensors.torch import save_file

from oneblock import ModelConfig, build_model
from oneblock.errors import CheckpointError
from oneblock.io import checkpoint, integrity
from oneblock.io.checkpoint import load, read_info, save

# Distinct odd sizes, so a transposed or mis-assigned tensor cannot keep its shape by accident.
SMALL = dict(vocab_size=101, d_model=36, n_heads=3, d_ff=37, n_layers=2, max_seq_len=13)
CONFIGS = {
    "decoder": ModelConfig(**SMALL),
    "encoder": ModelConfig(
        arch="encoder", norm_position="post", embed_norm=True, type_vocab_size=2, pooler=True, **SMALL
    ),
    "encoder-decoder": ModelConfig(
        arch="encoder-decoder", norm_position="post", embed_norm=True, position_offset=2,
        final_logits_bias=True, n_decoder_layers=3, **SMALL,
    ),
    "llama": ModelConfig(
        vocab_size=101, d_model=36, n_heads=6, n_kv_heads=2, d_ff=37, n_layers=2, max_seq_len=13,
        norm="rmsnorm", ffn="swiglu", position="rope", bias=False, tie_embeddings=False, activation="silu",
    ),
}  # fmt: skip


def _model(cfg: ModelConfig, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A model whose every stored tensor is random, so none can pass for a freshly built default."""
    torch.manual_seed(0)
    model = build_model(cfg, dtype=dtype)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(0.1 * torch.randn_like(tensor))
    return model.eval()


def _outputs(model: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(0, 101, (3, 7), generator=gen)
    if model.config.arch == "encoder-decoder":
        return model(src[:, :5], src)
    return model(src)


def _rewrite(path, *, tensors=None, meta=None, rehash=True) -> None:
    """Rewrite a checkpoint with some tensors or metadata changed, with a valid digest unless ``rehash=False``."""
    with safe_open(str(path), "pt") as f:
        old_meta = f.metadata()
        old = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    new = old if tensors is None else tensors(old)
    new_meta = {**old_meta, **(meta or {})}
    if rehash:  # a forger who knows the format: the file's digest is recomputed over the changed bytes
        del new_meta["oneblock.sha256"]
        path.write_bytes(b"".join(integrity.dump_safetensors(new, new_meta)))
    else:
        save_file(new, str(path), metadata=new_meta)


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "model.safetensors"
    save(_model(CONFIGS["decoder"]), path)
    return path


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_is_bit_exact(tmp_path, name):
    model = _model(CONFIGS[name])
    path = save(model, tmp_path / f"{name}.safetensors")
    loaded = load(path)
    assert loaded.config == model.config
    assert type(loaded) is type(model)
    assert not loaded.training
    with torch.no_grad():
        assert torch.equal(_outputs(loaded), _outputs(model))
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key


def test_tied_weights_stored_once_and_tied_again(tmp_path):
    dec = load(save(_model(CONFIGS["decoder"]), tmp_path / "dec.safetensors"))
    assert dec.lm_head.weight is dec.embed.tok.weight
    assert "lm_head.weight" not in read_info(tmp_path / "dec.safetensors").tensors

    encdec = load(save(_model(CONFIGS["encoder-decoder"]), tmp_path / "ed.safetensors"))
    assert encdec.decoder.embed.tok.weight is encdec.encoder.embed.tok.weight
    assert encdec.decoder.lm_head.weight is encdec.encoder.embed.tok.weight
    stored = read_info(tmp_path / "ed.safetensors").tensors
    assert "encoder.embed.tok.weight" in stored and "decoder.embed.tok.weight" not in stored
    assert "decoder.final_logits_bias" in stored

    untied = load(save(_model(CONFIGS["llama"]), tmp_path / "llama.safetensors"))
    assert untied.lm_head.weight is not untied.embed.tok.weight


def test_bfloat16_round_trip_and_cast(tmp_path):
    model = _model(CONFIGS["llama"], dtype=torch.bfloat16)
    path = save(model, tmp_path / "bf16.safetensors")
    loaded = load(path)
    assert loaded.embed.tok.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(_outputs(loaded), _outputs(model))
    as_fp32 = load(path, dtype=torch.float32, device="cpu")
    assert as_fp32.embed.tok.weight.dtype == torch.float32
    assert torch.equal(as_fp32.embed.tok.weight, model.embed.tok.weight.float())


def test_metadata_and_header(tmp_path):
    path = save(_model(CONFIGS["decoder"]), tmp_path / "m.safetensors", metadata={"step": 12, "note": "x"})
    info = read_info(path)
    assert info.metadata == {"step": 12, "note": "x"}
    assert info.config == CONFIGS["decoder"]
    assert info.format_version == checkpoint.FORMAT_VERSION
    assert re.fullmatch(r"[0-9a-f]{64}", info.sha256)
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        save(_model(CONFIGS["decoder"]), tmp_path / "n.safetensors", metadata={"bad": object()})


def test_save_refuses_non_models_and_non_finite(tmp_path):
    with pytest.raises(CheckpointError, match=r"expects a oneblock model.*Linear"):
        save(torch.nn.Linear(2, 2), tmp_path / "x.safetensors")
    model = _model(CONFIGS["decoder"])
    with torch.no_grad():
        model.blocks[0].ffn.w1.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"refusing to save .*blocks\.0\.ffn\.w1\.weight \(1 NaN"):
        save(model, tmp_path / "nan.safetensors")
    assert not (tmp_path / "nan.safetensors").exists()


# Files that are not checkpoints.


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*nope\.safetensors.*does not exist"):
        load(tmp_path / "nope.safetensors")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty\.safetensors' is empty \(0 bytes\)"):
        load(tmp_path / "empty.safetensors")
    with pytest.raises(CheckpointError, match="is not a file"):
        load(tmp_path)


@pytest.mark.parametrize("keep", [4, 100, -3])
def test_truncated_file(saved, keep):
    data = saved.read_bytes()
    saved.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match=r"model\.safetensors' is truncated"):
        load(saved)


def test_garbage_bytes(tmp_path):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(b"this is not a checkpoint at all, just text" * 10)
    with pytest.raises(CheckpointError, match=r"garbage\.safetensors' is not a safetensors file"):
        load(path)
    header = b'{"not json'
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match=r"the safetensors header of .*garbage\.safetensors. is not JSON"):
        load(path)


def test_trailing_bytes(saved):
    saved.write_bytes(saved.read_bytes() + b"\0\0\0")
    with pytest.raises(CheckpointError, match="3 unexpected bytes after its tensor data"):
        load(saved)


def test_refuses_to_unpickle(tmp_path):
    state = _model(CONFIGS["decoder"]).state_dict()
    torch.save(state, tmp_path / "zip.pt")
    with pytest.raises(
        CheckpointError, match=r"torch\.save zip archive: refusing to unpickle .*safetensors files only"
    ):
        load(tmp_path / "zip.pt")
    (tmp_path / "raw.pkl").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="is a pickle: refusing to unpickle"):
        load(tmp_path / "raw.pkl")


def test_plain_safetensors_is_not_a_checkpoint(tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(CheckpointError, match=r"not a oneblock checkpoint.*oneblock convert"):
        load(tmp_path / "plain.safetensors")


def test_header_length_that_looks_like_pickle_protocol(tmp_path):
    """A safetensors header of 640 bytes begins with 0x80 0x02, pickle protocol 2's first bytes."""
    data = next(
        data
        for pad in range(700)
        if (data := save_bytes({"w": torch.zeros(2)}, metadata={"pad": "x" * pad}))[:2] == b"\x80\x02"
    )
    path = tmp_path / "plain.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match="not a oneblock checkpoint"):
        load(path)


def test_newer_format_version(saved):
    _rewrite(saved, meta={"oneblock.format_version": "99"})
    with pytest.raises(CheckpointError, match="format version '99'; this oneblock reads version 2"):
        load(saved)


def test_flipped_byte_fails_the_checksum(saved):
    data = bytearray(saved.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor's bytes
    saved.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors' is corrupt: the SHA-256"):
        load(saved)


def test_missing_and_unexpected_tensors(saved):
    _rewrite(saved, tensors=lambda t: {k: v for k, v in t.items() if k != "blocks.1.attn.q_proj.bias"})
    with pytest.raises(CheckpointError, match=r"missing tensors blocks\.1\.attn\.q_proj\.bias"):
        load(saved)
    _rewrite(saved, tensors=lambda t: {**t, "blocks.1.attn.q_proj.bias": torch.zeros(36), "extra.w": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors extra\.w"):
        load(saved)


def test_wrong_shape(saved):
    _rewrite(saved, tensors=lambda t: {**t, "blocks.0.ffn.w1.weight": torch.zeros(36, 37)})
    with pytest.raises(CheckpointError, match=r"blocks\.0\.ffn\.w1\.weight is \(36, 37\), expected \(37, 36\)"):
        load(saved)


@pytest.mark.parametrize(("value", "what"), [(float("nan"), "1 NaN, 0 inf"), (float("inf"), "0 NaN, 1 inf")])
def test_non_finite_weights(saved, value, what):
    def poison(tensors):
        w = tensors["final_norm.weight"].clone()
        w[3] = value
        return {**tensors, "final_norm.weight": w}

    _rewrite(saved, tensors=poison)
    with pytest.raises(CheckpointError, match=rf"non-finite weights in final_norm\.weight \({what}\)"):
        load(saved)


def test_config_that_cannot_be_built(saved):
    _rewrite(saved, meta={"oneblock.config": "{not json"})
    with pytest.raises(CheckpointError, match="config that cannot be built: the config is not JSON"):
        load(saved)
    bad = json.loads(CONFIGS["decoder"].to_json())
    bad.update(n_heads=5, d_head=None, n_kv_heads=None)  # the stored config holds the derived widths
    _rewrite(saved, meta={"oneblock.config": json.dumps(bad)})
    with pytest.raises(CheckpointError, match=r"cannot be built: n_heads \(5\) must divide d_model \(36\)"):
        load(saved)
    bad = {**json.loads(CONFIGS["decoder"].to_json()), "n_experts": 8}
    _rewrite(saved, meta={"oneblock.config": json.dumps(bad)})
    with pytest.raises(CheckpointError, match=r"unknown config field\(s\) \['n_experts'\]"):
        load(saved)


def test_errors_are_value_errors(tmp_path):
    with pytest.raises(ValueError):
        load(tmp_path / "missing.safetensors")


# Atomic writes.


def _disk_fills(monkeypatch):
    """The disk fills after 100 bytes: the first write goes through, the next fails with ENOSPC."""
    real = os.write
    calls = []

    def write(fd, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bytes(data)[:100])

    monkeypatch.setattr(os, "write", write)


def test_crash_mid_write_leaves_nothing(tmp_path, monkeypatch):
    _disk_fills(monkeypatch)
    with pytest.raises(CheckpointError, match=r"cannot write the checkpoint .*new\.safetensors': the disk is full"):
        save(_model(CONFIGS["decoder"]), tmp_path / "new.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_crash_mid_write_keeps_the_old_checkpoint(saved, monkeypatch):
    before = saved.read_bytes()
    _disk_fills(monkeypatch)
    with pytest.raises(CheckpointError, match=r"the disk is full .*; free some space .*previous file there is intact"):
        save(_model(CONFIGS["encoder"]), saved)
    assert saved.read_bytes() == before
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]
    monkeypatch.undo()
    assert load(saved).config == CONFIGS["decoder"]


def test_overwrite_replaces_the_file(saved):
    save(_model(CONFIGS["encoder"]), saved)
    assert load(saved).config == CONFIGS["encoder"]
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]


@pytest.mark.parametrize("change", ["quantize_int8", "fuse_qkv", "mixed dtypes"])
def test_save_refuses_what_load_would_refuse(tmp_path, change):
    from oneblock.inference.quantize import quantize_int8

    model = _model(CONFIGS["llama"])
    if change == "quantize_int8":
        quantize_int8(model)
        expected = r"refusing to save .*load could not read it back .*non-floating tensors .*quantize_int8"
    elif change == "fuse_qkv":
        model.blocks[0].attn.fuse_qkv()
        expected = r"refusing to save .*unexpected tensors blocks\.0\.attn\.qkv_proj\.weight.*save the model before"
    else:
        model.blocks[1].ffn.to(torch.bfloat16)
        expected = r"refusing to save .*mixes tensor dtypes \['BF16', 'F32'\]"
    path = tmp_path / "changed.safetensors"
    with pytest.raises(CheckpointError, match=expected):
        save(model, path)
    assert not path.exists()


def test_save_refuses_a_config_that_disagrees_with_the_model_before_building_it(tmp_path, monkeypatch):
    """A config claiming 200,000 blocks on a model of two: refused from the counts, nothing built to find out."""

    def no_building(*args, **kwargs):
        raise AssertionError("save built a model to check a config the counts already refuse")

    model = _model(CONFIGS["decoder"])
    model.config = model.config.replace(n_layers=200_000)
    monkeypatch.setattr(checkpoint, "build_model", no_building)
    path = tmp_path / "claims.safetensors"
    with pytest.raises(
        CheckpointError, match=r"refusing to save .* 200,000 blocks .*over the limit of 1,024.*ONEBLOCK"
    ):
        save(model, path)
    monkeypatch.setenv("ONEBLOCK_MAX_LAYERS", "300000")  # within the limits now: the count still disagrees
    with pytest.raises(CheckpointError, match=r"its config \(n_layers=200000, .*\) describes [\d,]+ parameters, the"):
        save(model, path)
    model.config = model.config.replace(n_layers=3)
    with pytest.raises(CheckpointError, match=r"describes [\d,]+ parameters, the model holds [\d,]+"):
        save(model, path)
    assert not path.exists()


def test_save_applies_the_limits_load_applies(tmp_path, monkeypatch):
    model = _model(CONFIGS["decoder"])
    monkeypatch.setenv("ONEBLOCK_MAX_PARAMETERS", "1000")
    with pytest.raises(CheckpointError, match=r"refusing to save .*over the limit of 1,000 \(ONEBLOCK_MAX_PARAMETERS"):
        save(model, tmp_path / "m.safetensors")
    monkeypatch.delenv("ONEBLOCK_MAX_PARAMETERS")
    assert load(save(model, tmp_path / "m.safetensors")).config == model.config
