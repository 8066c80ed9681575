"""Hostile or broken Hugging Face directories: every problem is a ``ConversionError`` naming the file; shards stay
inside the directory; nothing is unpickled; an enormous config is refused before anything is allocated."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from hf_testing import C, H, V
from safetensors.torch import load_file, save_file

from oneblock import ConversionError
from oneblock.io.hf.convert import from_hf

transformers = pytest.importorskip("transformers")


@pytest.fixture
def gpt2_dir(tmp_path):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=C, n_head=H, n_layer=1))
    hf.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _edit_config(directory, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_corrupt_safetensors_file(gpt2_dir):
    path = gpt2_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ConversionError, match=r"model\.safetensors' is not a readable safetensors file"):
        from_hf(gpt2_dir)


def test_a_pickle_under_a_safetensors_name(gpt2_dir):
    torch.save({"w": torch.zeros(2)}, gpt2_dir / "model.safetensors")
    with pytest.raises(ConversionError, match="is not a readable safetensors file"):
        from_hf(gpt2_dir)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("[1, 2]", r"config\.json' must hold a JSON object; got a list"),
        ("{not json", r"config\.json' is not JSON"),
    ],
)
def test_config_json_that_is_not_an_object(gpt2_dir, content, match):
    (gpt2_dir / "config.json").write_text(content)
    with pytest.raises(ConversionError, match=match):
        from_hf(gpt2_dir)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"n_embd": "36"}, "config cannot describe a model"),
        ({"n_layer": 2.5}, "config cannot describe a model"),
        ({"layer_norm_epsilon": "small"}, "config cannot describe a model"),
    ],
)
def test_a_string_where_a_number_belongs(gpt2_dir, changes, match):
    _edit_config(gpt2_dir, **changes)
    with pytest.raises(ConversionError, match=match):
        from_hf(gpt2_dir)


def test_an_enormous_config_fails_before_allocating(gpt2_dir):
    _edit_config(gpt2_dir, vocab_size=10**9, n_embd=64 * H)
    start = time.perf_counter()
    with pytest.raises(ConversionError, match=r"the GPT-2 config describes a model of [\d,]+ parameters.*over the"):
        from_hf(gpt2_dir)
    assert time.perf_counter() - start < 2.0


def _shard(directory, weight_map) -> None:
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    save_file(tensors, directory.parent / "elsewhere.safetensors", metadata={"format": "pt"})
    (directory / "model.safetensors.index.json").write_text(json.dumps(weight_map))


def test_an_index_without_weight_map(gpt2_dir):
    _shard(gpt2_dir, {"metadata": {}})
    with pytest.raises(ConversionError, match=r"index\.json' has no 'weight_map' object"):
        from_hf(gpt2_dir)


def test_a_shard_outside_the_directory_is_refused(gpt2_dir):
    _shard(gpt2_dir, {"weight_map": {"transformer.wte.weight": "../elsewhere.safetensors"}})
    with pytest.raises(ConversionError, match=r"names the shard '\.\./elsewhere\.safetensors', outside"):
        from_hf(gpt2_dir)
    _shard_missing = {"weight_map": {"transformer.wte.weight": "missing.safetensors"}}
    (gpt2_dir / "model.safetensors.index.json").write_text(json.dumps(_shard_missing))
    with pytest.raises(ConversionError, match=r"names the shard 'missing\.safetensors', which does not exist"):
        from_hf(gpt2_dir)


def test_integer_tensors_are_refused_not_cast(gpt2_dir):
    tensors = load_file(gpt2_dir / "model.safetensors")
    tensors["transformer.wte.weight"] = tensors["transformer.wte.weight"].to(torch.int32)
    save_file(tensors, gpt2_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConversionError, match=r"stores tensor 'wte\.weight' as torch\.int32; weights must be floating point"
    ):
        from_hf(gpt2_dir)


def _hub_cache(tmp_path, source):
    """``source``'s files laid out as the Hugging Face hub cache does: ``snapshots/<rev>/NAME`` is a symlink to
    ``../../blobs/<digest>``."""
    import hashlib

    repo = tmp_path / "models--tiny--gpt2"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.join("..", "..", "blobs", blob.name))
    return snapshot


def test_the_hub_cache_layout_loads_sharded_and_single(tmp_path):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=C, n_head=H, n_layer=2)).eval()
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="2KB")
    hf.save_pretrained(tmp_path / "single")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    ids = torch.tensor([[1, 4, 2, 0, 3]])
    expected = hf(ids).logits
    for name in ("sharded", "single"):
        snapshot = _hub_cache(tmp_path / f"cache-{name}", tmp_path / name)
        assert all(p.is_symlink() for p in snapshot.iterdir())
        torch.testing.assert_close(from_hf(snapshot)(ids), expected, atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("name", ["/etc/passwd", "sub/../../elsewhere.safetensors", "..\\elsewhere.safetensors", ""])
def test_an_index_names_its_shards_inside_its_directory(gpt2_dir, name):
    _shard(gpt2_dir, {"weight_map": {"transformer.wte.weight": name}})
    with pytest.raises(ConversionError, match=r"names the shard .*, outside .*relative to its own directory"):
        from_hf(gpt2_dir)
