"""Sentence embeddings from the real all-MiniLM-L6-v2, against sentence-transformers as the reference."""

from __future__ import annotations

import importlib.util
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # the model is a local directory; nothing may be downloaded

import pytest
import torch

from oneblock.errors import CheckpointError, InputError
from oneblock.inference.embedding import (
    INSTALL_HINT,
    PACKAGE,
    SentenceEncoder,
    default_model_dir,
    embed,
    load_sentence_model,
    pool,
    similarity,
)

TEXTS = [
    "The cat sits on the mat.",
    "A kitten is resting on a rug.",
    "Stock markets fell sharply after the announcement.",
    "hi",
    "Ünïcödé, accents and 東京 characters; punctuation!?",
    "A longer sentence that goes on for a while, so that the batch has rows of quite different lengths in it.",
]
LONG = " ".join(f"word{i} and more" for i in range(400))  # far more than 256 tokens
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' own model on the same directory, loaded once per module."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(default_model_dir()), device="cpu")

    def encode(texts: list[str], **kwargs) -> torch.Tensor:
        return torch.from_numpy(st.encode(texts, convert_to_numpy=True, **kwargs))

    return encode


@pytest.fixture(scope="module")
def model() -> SentenceEncoder:
    return load_sentence_model()


def _check_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < ATOL
    assert torch.nn.functional.cosine_similarity(ours, theirs).min().item() > 0.99999


def test_model_is_minilm(model):
    assert model.dim == 384
    assert model.max_length == 256
    assert model.pooling == "mean"
    assert model.encoder.config.n_layers == 6


def test_batched_matches_sentence_transformers(model, reference):
    texts = [*TEXTS, LONG]
    ours = embed(texts, model=model)
    _check_close(ours, reference(texts))
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(texts)), atol=1e-6)


def test_unbatched_and_small_batches_match(model, reference):
    theirs = reference(TEXTS, batch_size=1)
    _check_close(torch.cat([embed(text, model=model) for text in TEXTS]), theirs)
    _check_close(embed(TEXTS, model=model, batch_size=4), theirs)


def test_long_text_is_truncated_at_256_tokens(model):
    # Equality with sentence-transformers on LONG is part of the batched test.
    ids = model.tokenize([LONG, LONG + " tail words"])
    assert len(ids[0]) == 256 and ids[0] == ids[1]  # only the first 256 tokens count
    assert ids[0][0] == 101 and ids[0][-1] == 102  # [CLS] ... [SEP] survive truncation
    short = model.tokenize([LONG], max_length=16)[0]
    assert len(short) == 16 and short[:15] == ids[0][:15] and short[-1] == 102
    assert embed([LONG], model=model, max_length=16).shape == (1, 384)


def test_unnormalized_is_the_mean_pool(model):
    raw = embed(TEXTS, model=model, normalize=False)
    assert not torch.allclose(raw.norm(dim=1), torch.ones(len(TEXTS)))
    assert torch.allclose(torch.nn.functional.normalize(raw, dim=1), embed(TEXTS, model=model), atol=1e-6)


def test_similarity_matrix(model, reference):
    sim = similarity(TEXTS, model=model)
    assert sim.shape == (len(TEXTS), len(TEXTS))
    assert torch.allclose(sim, sim.T, atol=1e-6)
    assert torch.allclose(sim.diagonal(), torch.ones(len(TEXTS)), atol=1e-5)
    expected = reference(TEXTS)
    assert (sim - expected @ expected.T).abs().max().item() < ATOL
    assert sim[0, 1] > 0.5 > sim[0, 2]  # cat/kitten are close, cat/stock market are not


def test_shapes_of_edge_cases(model):
    assert embed("one text", model=model).shape == (1, 384)
    assert embed([], model=model).shape == (0, 384)


def test_pool_modes():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)  # (B, T, C)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    assert torch.equal(pool(hidden, mask, "mean"), torch.tensor([[1.0, 2.0], [8.0, 9.0]]))
    assert torch.equal(pool(hidden, mask, "max"), torch.tensor([[2.0, 3.0], [10.0, 11.0]]))
    assert torch.equal(pool(hidden, mask, "cls"), hidden[:, 0])


def test_model_is_cached(model):
    assert load_sentence_model() is model
    assert load_sentence_model(default_model_dir()) is model
    assert load_sentence_model(model) is model


def test_other_directory_layout(tmp_path, model):
    """A sentence-transformers directory with its BERT in 0_Transformer/ and CLS pooling."""
    source = default_model_dir()
    body = tmp_path / "0_Transformer"
    body.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "sentence_bert_config.json"):
        (body / name).symlink_to(source / name)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    modules = [
        {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    other = load_sentence_model(tmp_path)
    assert other.pooling == "cls"
    ids = model.tokenize(["The cat sits on the mat."])
    with torch.no_grad():
        hidden = model.encoder(torch.tensor(ids))  # (1, T, C)
    expected = torch.nn.functional.normalize(hidden[:, 0], dim=1)
    assert torch.allclose(embed(["The cat sits on the mat."], model=tmp_path), expected, atol=1e-6)


def test_bad_inputs(model):
    with pytest.raises(InputError, match=r"texts\[1\] must be a string; got int"):
        embed(["fine", 3], model=model)
    with pytest.raises(InputError, match="texts must be a string or a sequence of strings; got int"):
        embed(5, model=model)
    with pytest.raises(InputError, match="batch_size must be a positive integer; got 0"):
        embed(["a"], model=model, batch_size=0)
    with pytest.raises(InputError, match=r"max_length must be an integer in \[2, 256\].*got 1000"):
        embed(["a"], model=model, max_length=1000)
    with pytest.raises(InputError, match=r"texts\[1\] holds a lone surrogate U\+D800 at character offset 2"):
        embed(["fine", "ok\ud800"], model=model)
    with pytest.raises(InputError, match=r"the text is not valid UTF-8: byte 0xff at character offset 0"):
        embed("\udcff", model=model)


def test_token_ids_embed_as_their_text(model):
    ids = model.tokenize(TEXTS)
    assert torch.equal(model.encode_ids(ids), model.encode(TEXTS))
    assert torch.allclose(model.encode_ids(ids, batch_size=2), model.encode(TEXTS), atol=ATOL)
    with pytest.raises(InputError, match=r"ids\[1\] holds token id 30522, outside the vocabulary \[0, 30522\)"):
        model.encode_ids([[101, 102], [101, 30522, 102]])
    with pytest.raises(InputError, match=r"ids\[0\] holds 0 tokens; the model reads 1 to 256"):
        model.encode_ids([[]])


def test_bad_model_directories(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist or is not a directory"):
        embed(["a"], model=tmp_path / "missing")
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        embed(["a"], model=tmp_path)


def test_missing_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == PACKAGE else real(name, *a))
    with pytest.raises(ImportError, match=f"not installed; install it with `{INSTALL_HINT}`"):
        embed(["a"])
