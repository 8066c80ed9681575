import pytest
import torch

import oneblock as ob
from oneblock.analysis.checks import mask_after_softmax_leak, run_checks


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder-decoder"])
def test_all_checks_pass_on_oneblock_models(arch):
    results = run_checks(ob.build_model(ob.ModelConfig(arch=arch)))
    assert results and all(r.passed for r in results), [r.as_dict() for r in results if not r.passed]
    names = {r.name for r in results}
    assert "feed-forward is position-wise" in names
    if arch != "encoder":
        assert "causality" in names
    if arch == "encoder-decoder":
        assert "cross-attention is T x S, unmasked" in names


def test_tiny_model_checks_report_lesson_shapes():
    results = {r.name: r for r in run_checks(ob.build_model(ob.get_preset("tiny")))}
    assert results["attention shape"].figures["expected"] == [2, 2, 4, 4]
    assert results["future weights exactly zero"].figures["max_future_weight"] == 0.0


def test_causality_check_fails_on_a_model_that_leaks_the_future():
    emb = torch.nn.Embedding(10, 8)

    def leaky(x):
        h = emb(x)
        return h + h.mean(dim=1, keepdim=True)  # every position sees the mean of all, future included

    results = {r.name: r for r in run_checks(leaky, vocab_size=10)}
    assert not results["causality"].passed
    assert results["causality"].figures["earlier_max_change"] > 0


def test_causality_check_fails_when_the_mask_is_removed():
    model = ob.build_model(ob.ModelConfig())
    for block in model.blocks:
        block.causal = False  # a decoder with its mask forgotten
    results = {r.name: r for r in run_checks(model)}
    assert not results["causality"].passed
    assert not results["future weights exactly zero"].passed


def test_masking_after_softmax_leaks():
    out = mask_after_softmax_leak(torch.tensor([[1.0, 5.0], [1.0, 2.0]]))
    assert out["leaks"]
    torch.testing.assert_close(out["row_sums_before"], torch.ones(2))
    assert out["row_sums_after"][0].item() < 0.02  # row one kept only its own, tiny, share
    assert out["masked_before"][1].tolist() == pytest.approx([0.2689, 0.7311], abs=1e-4)


def test_plain_callable_needs_vocab_size():
    with pytest.raises(TypeError, match="vocab_size"):
        run_checks(lambda x: x)


def test_causality_on_a_single_position_is_not_applicable():
    model = ob.build_model(ob.ModelConfig(max_seq_len=1))
    results = {r.name: r for r in run_checks(model)}
    assert results["causality"].passed and results["causality"].figures == {"applicable": False}
