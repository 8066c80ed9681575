"""Resume state as safetensors: nested optimizer state survives the trip exactly; other files are refused."""

from __future__ import annotations

import pickle

import pytest
import torch

from oneblock.errors import CheckpointError
from oneblock.train.state import load_state, rng_state, save_state, set_rng_state


def test_optimizer_state_round_trips(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"optimizer": opt.state_dict(), "step": 3, "pair": (1, "a"), "rng": rng_state(), "none": None}
    save_state(state, tmp_path / "s.safetensors")
    back = load_state(tmp_path / "s.safetensors")
    assert back["step"] == 3 and back["pair"] == (1, "a") and back["none"] is None
    assert set(back["optimizer"]["state"]) == {0, 1, 2, 3}  # integer keys restored
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(back["optimizer"])
    for key, value in opt.state_dict()["state"][2].items():
        assert torch.equal(fresh.state_dict()["state"][2][key], value)
    set_rng_state(back["rng"])
    expected = torch.rand(3)
    set_rng_state(state["rng"])
    assert torch.equal(torch.rand(3), expected)


def test_refuses_what_it_cannot_store(tmp_path):
    with pytest.raises(CheckpointError, match="cannot store a set at '/bad'"):
        save_state({"bad": {1, 2}}, tmp_path / "s.safetensors")
    assert not (tmp_path / "s.safetensors").exists()


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "does not exist"), (b"garbage", "is truncated: 7 bytes"), (b"pickle", "is a pickle: refusing to unpickle")],
)
def test_refuses_missing_garbage_and_pickles(tmp_path, content, match):
    path = tmp_path / "s.safetensors"
    if content == b"pickle":
        content = pickle.dumps({"optimizer": 1})
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        load_state(path)


def test_refuses_a_model_checkpoint(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="not a oneblock training state"):
        load_state(tmp_path / "m.safetensors")
