"""Loading what a user holds into the explorer, and the block diagram each config wires."""

from __future__ import annotations

import shutil

import pytest
import torch
from explore_testing import tiny

import oneblock as ob
from oneblock.errors import CheckpointError, ConfigError, InputError
from oneblock.explore.diagram import block_diagram
from oneblock.explore.loading import byte_piece, load_explore_model


def test_a_preset_is_seeded_random_weights_with_bytes():
    first, again = load_explore_model(preset="lesson", seed=3), load_explore_model(preset="lesson", seed=3)
    assert first.codec.name == "bytes" and first.codec.encode("hé") == [104, 195, 169]
    for a, b in zip(first.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)
    other = load_explore_model(preset="lesson", seed=4)
    assert not torch.equal(next(first.model.parameters()), next(other.model.parameters()))


def test_a_checkpoint_with_its_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")
    from oneblock.inference.embedding import default_model_dir

    try:
        wordpiece = default_model_dir() / "tokenizer.json"
    except ImportError as error:
        pytest.skip(str(error))
    model = tiny("decoder", vocab_size=30522).model
    path = ob.save(model, tmp_path / "wp.safetensors")
    shutil.copy(wordpiece, tmp_path / "tokenizer.json")
    explorable = load_explore_model(checkpoint=str(path))
    ids = explorable.codec.encode("hello world")
    assert [explorable.codec.piece(i) for i in ids] == ["hello", "world"]
    assert explorable.codec.name == "tokenizer.json"


def test_a_hugging_face_directory(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from oneblock.inference.embedding import default_model_dir

    try:
        wordpiece = default_model_dir()
    except ImportError as error:
        pytest.skip(str(error))
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(wordpiece / name, tmp_path / name)
    explorable = load_explore_model(hf=str(tmp_path))
    assert explorable.model.config.arch == "encoder" and explorable.model.config.d_model == 384


def test_a_directory_without_tokenizer_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"has no tokenizer\.json"):
        load_explore_model(hf=str(tmp_path))
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_explore_model(hf=str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("source", "error", "match"),
    [
        ({"preset": "lesson", "hf": "x"}, InputError, "give one model source; got hf, preset"),
        ({"model": "nothing.gguf"}, CheckpointError, "is not a file"),
        ({"checkpoint": "nothing.safetensors"}, CheckpointError, "nothing.safetensors"),
        ({"preset": "nope"}, ConfigError, "unknown preset 'nope'"),
    ],
)
def test_bad_sources(source, error, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=match):
        load_explore_model(**source)


def test_byte_pieces_show_lone_bytes():
    assert [byte_piece(i) for i in (65, 32, 10, 0, 195, 255)] == ["A", " ", "\n", "<0x00>", "<0xC3>", "<0xFF>"]


def steps(sublayer):
    return [step["op"] for step in sublayer["steps"]]


def test_pre_ln_decoder_block_with_live_shapes():
    cfg = ob.ModelConfig(d_model=36, n_heads=3, n_kv_heads=1, d_ff=37, vocab_size=301)
    diagram = block_diagram(cfg, 7)
    (stack,) = diagram["stacks"]
    assert stack["causal"] and stack["layers"] == 2
    assert [s["name"] for s in stack["sublayers"]] == ["self_attention", "feedforward"]
    assert all(steps(s) == ["norm", s["name"], "add"] for s in stack["sublayers"])  # x + f(norm(x))
    shapes = stack["sublayers"][0]["steps"][1]["shapes"]
    assert shapes["queries"] == [1, 3, 7, 12] and shapes["keys, values"] == [1, 1, 7, 12]
    assert shapes["weights"] == [1, 3, 7, 7]
    assert stack["sublayers"][1]["steps"][1]["shapes"]["inside"] == [1, 7, 37]
    assert diagram["final_norm"] and diagram["head"] == [1, 7, 301]


def test_post_ln_encoder_decoder_has_the_cross_attention_sublayer():
    cfg = ob.ModelConfig(arch="encoder-decoder", norm_position="post", ffn="swiglu", n_layers=2, n_decoder_layers=3)
    diagram = block_diagram(cfg, 5, 9)
    encoder, decoder = diagram["stacks"]
    assert [s["name"] for s in encoder["sublayers"]] == ["self_attention", "feedforward"]
    assert [s["name"] for s in decoder["sublayers"]] == ["self_attention", "cross_attention", "feedforward"]
    assert all(steps(s) == [s["name"], "add", "norm"] for s in decoder["sublayers"])  # norm(x + f(x))
    assert decoder["sublayers"][1]["steps"][0]["shapes"]["weights"] == [1, 4, 5, 9]  # T x S
    assert encoder["tokens"] == 9 and decoder["layers"] == 3 and not encoder["causal"]
    assert "SwiGLU" in decoder["sublayers"][2]["steps"][0]["label"]
    assert not diagram["final_norm"]


def test_encoder_has_no_head():
    diagram = block_diagram(ob.ModelConfig(arch="encoder"), 4)
    assert diagram["head"] is None and not diagram["stacks"][0]["causal"]


def test_sandwich_output_and_scaled_blocks_are_drawn_as_the_block_runs_them():
    rms = {"norm": "rmsnorm", "position": "rope", "bias": False, "d_model": 32, "n_heads": 2, "n_layers": 3}
    gemma = ob.ModelConfig(**rms, norm_position="sandwich", ffn="gated", activation="gelu_tanh", attn_softcap=5.0,
                           sliding_window=4, global_every=2)  # fmt: skip
    (stack,) = block_diagram(gemma, 6)["stacks"]
    assert all(steps(s) == ["norm", s["name"], "norm", "add"] for s in stack["sublayers"])  # x + norm'(f(norm(x)))
    attention, ffn = (s["steps"][1]["label"] for s in stack["sublayers"])
    assert attention == "masked self-attention (causal; scores soft-capped at 5; window 4 in 2 of 3 layers)"
    assert ffn == "gated feed-forward: W2 (gelu_tanh(W1 x) * W3 x)"
    olmo = ob.ModelConfig(**rms, norm_position="output", ffn="swiglu", qk_norm=True, qk_norm_span="width")
    (stack,) = block_diagram(olmo, 6)["stacks"]
    assert all(steps(s) == [s["name"], "norm", "add"] for s in stack["sublayers"])  # x + norm(f(x))
    assert (
        stack["sublayers"][0]["steps"][0]["label"]
        == "masked self-attention (causal; RMSNorm on q and k over the whole width)"
    )
    granite = ob.ModelConfig(**rms, ffn="swiglu", residual_multiplier=0.22)
    (stack,) = block_diagram(granite, 6)["stacks"]
    assert [s["steps"][-1]["label"] for s in stack["sublayers"]] == ["+ residual (output x 0.22)"] * 2
