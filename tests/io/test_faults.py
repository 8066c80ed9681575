"""Every byte verified, sizes checked before allocation, OS errors told in one line naming the user's path.

A bit flipped anywhere in a checkpoint or a resume state is refused; a forged header (re-sealed, so its digest
is right) asking for an enormous model fails in milliseconds; integer tensors are refused, not cast; a full disk,
a permission error, a read-only file system, a name too long, a directory or an empty path each give one
``CheckpointError`` naming the path, leave an existing file intact and no temporary file behind.
"""

from __future__ import annotations

import errno
import json
import os
import time

import pytest
import torch
from safetensors import safe_open

from oneblock import ModelConfig, build_model
from oneblock.errors import CheckpointError, ConfigError
from oneblock.io import checkpoint, integrity, limits
from oneblock.train.state import load_state, save_state

TINY = ModelConfig(vocab_size=5, d_model=4, n_heads=1, n_layers=1, d_ff=3, max_seq_len=3)


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    return checkpoint.save(build_model(TINY), tmp_path / "model.safetensors", metadata={"step": 3})


def _forge(path, *, config=None, tensors=None) -> None:
    """Rewrite a checkpoint as a forger who knows the format would: changed contents, a correct digest."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        old = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    del meta[integrity.DIGEST_KEY]
    if config is not None:
        meta["oneblock.config"] = json.dumps({**json.loads(meta["oneblock.config"]), **config})
    new = old if tensors is None else tensors(old)
    path.write_bytes(b"".join(integrity.dump_safetensors(new, meta)))


def _flipped(path):
    """Flip one bit of each byte of ``path`` in turn, in place (``yield`` the byte's index), then restore it."""
    data = path.read_bytes()
    fd = os.open(path, os.O_RDWR)
    try:
        for i, byte in enumerate(data):
            os.pwrite(fd, bytes([byte ^ (1 << (i % 8))]), i)
            yield i
            os.pwrite(fd, bytes([byte]), i)
    finally:
        os.close(fd)
    assert path.read_bytes() == data


def test_every_bit_flip_in_a_checkpoint_is_refused(saved):
    reference = checkpoint.load(saved).state_dict()
    loaded = 0
    for i in _flipped(saved):
        try:
            model = checkpoint.load(saved)
        except CheckpointError:
            continue
        loaded += 1  # only acceptable if nothing that matters changed
        assert model.config == TINY, f"byte {i}"
        assert all(torch.equal(model.state_dict()[k], v) for k, v in reference.items()), f"byte {i}"
    assert loaded == 0


def test_every_bit_flip_in_a_resume_state_is_refused(tmp_path):
    layer = torch.nn.Linear(2, 3)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    path = tmp_path / "trainer.safetensors"
    save_state({"optimizer": optimizer.state_dict(), "step": 1, "data": {"position": 17}}, path)
    for i in _flipped(path):
        with pytest.raises(CheckpointError):
            load_state(path)
            pytest.fail(f"a flip at byte {i} loaded")


def test_config_and_metadata_are_covered_by_the_digest(saved):
    data = saved.read_bytes()
    assert data.count(b'\\"norm_eps\\": 1e-05') == 1  # JSON inside a JSON string
    saved.write_bytes(data.replace(b'\\"norm_eps\\": 1e-05', b'\\"norm_eps\\": 1e+05'))
    with pytest.raises(CheckpointError, match=r"model\.safetensors' is corrupt: the SHA-256 of its bytes"):
        checkpoint.load(saved)
    saved.write_bytes(data.replace(b'\\"step\\": 3', b'\\"step\\": 4'))
    with pytest.raises(CheckpointError, match="is corrupt"):
        checkpoint.read_info(saved)


def test_a_file_without_its_digest_is_refused(saved):
    with safe_open(str(saved), "pt") as f:
        meta = f.metadata()
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(saved), metadata={**meta, integrity.DIGEST_KEY: "xyz"})
    with pytest.raises(CheckpointError, match="recorded SHA-256 'xyz' is not a digest"):
        checkpoint.load(saved)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"n_layers": 200_000, "n_decoder_layers": 200_000},
            r"200,000 blocks \(n_layers=200000.*over the limit of 1,024 \(the default\)",
        ),
        ({"vocab_size": 10**10}, r"40,000,000,\d{3} parameters.*over the limit of 4,294,967,296"),
    ],
)
def test_an_enormous_config_fails_before_allocating(saved, change, match):
    _forge(saved, config=change)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load(saved)
    assert time.perf_counter() - start < 1.0


def test_size_limits_can_be_set_by_argument_and_environment(saved, monkeypatch):
    with pytest.raises(CheckpointError, match=r"over the limit of 10 \(max_parameters=10\).*raise the limit"):
        checkpoint.load(saved, max_parameters=10)
    with pytest.raises(CheckpointError, match=r"GiB \(max_bytes=100\)"):
        checkpoint.load(saved, max_bytes=100)
    monkeypatch.setenv(limits.ENV_MAX_PARAMETERS, "10")
    with pytest.raises(CheckpointError, match=r"over the limit of 10 \(ONEBLOCK_MAX_PARAMETERS=10\)"):
        checkpoint.load(saved)
    assert checkpoint.load(saved, max_parameters=10**6).config == TINY  # the argument overrides the environment
    monkeypatch.setenv(limits.ENV_MAX_PARAMETERS, "lots")
    with pytest.raises(ConfigError, match="ONEBLOCK_MAX_PARAMETERS must be a positive integer; got 'lots'"):
        checkpoint.load(saved)
    with pytest.raises(ConfigError, match="max_parameters must be a positive integer; got True"):
        checkpoint.load(saved, max_parameters=True)


def test_integer_tensors_are_refused_not_cast(saved):
    _forge(saved, tensors=lambda t: {k: v.to(torch.int32) for k, v in t.items()})
    with pytest.raises(CheckpointError, match=r"non-floating tensors .*\(I32\).*refusing to cast"):
        checkpoint.load(saved)
    _forge(saved, tensors=lambda t: {k: v.double() if k == "final_norm.weight" else v.float() for k, v in t.items()})
    with pytest.raises(CheckpointError, match=r"mixes tensor dtypes \['F32', 'F64'\]"):
        checkpoint.load(saved)


# OS errors at the boundary.


def _fail(monkeypatch, name: str, code: int) -> None:
    """Make ``os.<name>`` fail with ``code`` when it touches the temporary file."""
    real = getattr(os, name)

    def failing(*args, **kwargs):
        if any(str(a).endswith(".tmp") for a in args if isinstance(a, (str, os.PathLike))) or name == "write":
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, failing)


@pytest.mark.parametrize(
    ("name", "code", "match"),
    [
        ("write", errno.ENOSPC, "the disk is full"),
        ("open", errno.EACCES, "permission denied"),
        ("open", errno.EROFS, "the file system is read-only"),
        ("replace", errno.EDQUOT, "the disk quota is exhausted"),
    ],
)
def test_os_errors_name_the_path_and_keep_the_old_file(saved, monkeypatch, name, code, match):
    before = saved.read_bytes()
    _fail(monkeypatch, name, code)
    with pytest.raises(CheckpointError, match=rf"cannot write the checkpoint '.*model\.safetensors': {match}"):
        checkpoint.save(build_model(TINY), saved)
    monkeypatch.undo()
    assert saved.read_bytes() == before
    assert [p.name for p in saved.parent.iterdir()] == ["model.safetensors"]


def test_a_long_legal_name_saves_and_an_illegal_one_is_refused(tmp_path):
    name = "m" * (240 - len(".safetensors")) + ".safetensors"
    assert len(name.encode()) == 240
    path = checkpoint.save(build_model(TINY), tmp_path / name)
    assert checkpoint.load(path).config == TINY
    with pytest.raises(CheckpointError, match=r"'.*m{300}': a file name is too long"):
        checkpoint.save(build_model(TINY), tmp_path / ("m" * 300))
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_a_directory_and_an_empty_path_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"cannot write the checkpoint to '.*': it is a directory"):
        checkpoint.save(build_model(TINY), tmp_path)
    with pytest.raises(CheckpointError, match="the checkpoint path is empty"):
        checkpoint.save(build_model(TINY), "")
    with pytest.raises(CheckpointError, match="the checkpoint path is empty"):
        checkpoint.load("")
    with pytest.raises(CheckpointError, match=r"is not a file \(a directory or a device\)"):
        checkpoint.load(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_parent_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="a part of the path is a file, not a directory"):
        checkpoint.save(build_model(TINY), tmp_path / "file" / "m.safetensors")
