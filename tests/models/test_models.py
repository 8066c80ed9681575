import pytest
import torch

import oneblock as ob
from oneblock.errors import InputError

SMALL = {"vocab_size": 101, "d_model": 36, "n_heads": 3, "d_ff": 37, "max_seq_len": 11}
VARIANTS = [
    {},
    {"norm_position": "post"},
    {"norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "n_kv_heads": 1, "bias": False},
]


def build(arch="decoder", **kwargs):
    torch.manual_seed(0)
    return ob.build_model(ob.ModelConfig(arch=arch, **{**SMALL, **kwargs})).eval()


def tokens(b=3, t=7, vocab=101, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_lesson_tiny_forward_pass_shapes():
    model = ob.build_model(ob.get_preset("tiny"))
    ids = torch.randint(0, 10, (2, 4))
    assert model.embed(ids, torch.arange(4)).shape == (2, 4, 8)
    logits, attn = model(ids, return_attention=True)
    assert logits.shape == (2, 4, 10)
    assert [w.shape for w in attn] == [(2, 2, 4, 4)]
    torch.testing.assert_close(attn[0].sum(-1), torch.ones(2, 2, 4))
    assert (attn[0].triu(1) == 0).all()


def test_model_interfaces_and_config():
    cfg = ob.ModelConfig()
    model = ob.build_model(cfg)
    assert model.config is cfg
    assert model.lm_head.weight is model.embed.tok.weight
    untied = ob.build_model(cfg.replace(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.tok.weight
    ed = ob.build_model(cfg.replace(arch="encoder-decoder"))
    assert ed.decoder.embed.tok is ed.encoder.embed.tok and ed.decoder.lm_head.weight is ed.encoder.embed.tok.weight


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_causality(variant):
    model = build(**variant)
    ids = tokens()
    changed = ids.clone()
    changed[:, 4] = (changed[:, 4] + 1) % 101
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :4], b[:, :4])
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_encoder_is_bidirectional(variant):
    model = build("encoder", **variant)
    ids = tokens()
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 101
    with torch.no_grad():
        assert (model(ids)[:, 0] - model(changed)[:, 0]).abs().max() > 0


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_right_padding_with_mask_leaves_real_positions_unchanged(arch, variant):
    model = build(arch, **variant)
    ids = tokens(b=1, t=5)
    padded = torch.cat([ids, torch.tensor([[7, 7, 7]])], 1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    with torch.no_grad():
        alone = model(ids)
        with_pad = model(padded, padding_mask=mask)
    torch.testing.assert_close(with_pad[:, :5], alone, atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_encoder_padding_does_not_move_the_decoder(variant):
    model = build("encoder-decoder", **variant)
    src, tgt = tokens(b=1, t=5), tokens(b=1, t=4, seed=1)
    src_padded = torch.cat([src, torch.tensor([[3, 3]])], 1)
    mask = torch.tensor([[True] * 5 + [False] * 2])
    with torch.no_grad():
        torch.testing.assert_close(
            model(src_padded, tgt, src_padding_mask=mask), model(src, tgt), atol=1e-5, rtol=1.3e-6
        )


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder-decoder"])
def test_batch_row_equals_the_sequence_alone(arch):
    model = build(arch)
    ids = tokens()
    with torch.no_grad():
        if arch == "encoder-decoder":
            src = tokens(seed=3)
            batched, alone = model(src, ids)[1:2], model(src[1:2], ids[1:2])
        else:
            batched, alone = model(ids)[1:2], model(ids[1:2])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1.3e-6)


def test_attention_structure_of_encoder_decoder():
    model = build("encoder-decoder", n_layers=2, n_decoder_layers=3)
    logits, attn = model(tokens(t=5), tokens(t=3), return_attention=True)
    assert logits.shape == (3, 3, 101)
    assert [w.shape for w in attn["encoder"]] == [(3, 3, 5, 5)] * 2
    assert [w.shape for w in attn["decoder"]] == [(3, 3, 3, 3)] * 3
    assert [w.shape for w in attn["cross"]] == [(3, 3, 3, 5)] * 3
    assert all((w.triu(1) == 0).all() for w in attn["decoder"])
    assert all((w.triu(1) > 0).any() for w in attn["cross"])  # no causal mask on the source


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder-decoder"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_parameter_gets_a_finite_gradient(arch, variant):
    model = build(arch, **variant).train()
    ids = tokens()
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[2, :] = False  # a fully padded row must not poison the batch with NaN
    mask[2, 0] = arch != "encoder"
    if arch == "encoder-decoder":
        out = model(ids, ids, src_padding_mask=mask)
    elif arch == "encoder":
        out = model(ids, padding_mask=mask)
    else:
        out = model(ids, padding_mask=mask)
    out.float().pow(2).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_tiny_model_overfits_one_batch(arch):
    model = build(arch).train()
    ids = tokens(b=4, t=8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        logits = model(ids[:, :-1]) if arch == "decoder" else model(ids, ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 101), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


def test_cache_equals_full_forward_for_each_family():
    for variant in VARIANTS:
        model = build(**variant)
        ids = tokens()
        cache = model.new_cache(3)
        with torch.no_grad():
            full = model(ids)
            parts = [model(ids[:, :3], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(3, 7)]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1.3e-6)
    ed = build("encoder-decoder")
    src, tgt = tokens(t=5), tokens(t=6, seed=2)
    with torch.no_grad():
        memory = ed.encode(src)
        cache = ed.new_cache(3)
        steps = torch.cat([ed.decode(tgt[:, t : t + 1], memory, cache=cache) for t in range(6)], 1)
        torch.testing.assert_close(steps, ed(src, tgt), atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_forward_stays_close_to_fp32(variant):
    model = build(**variant)
    ids = tokens()
    with torch.no_grad():
        ref = model(ids)
        low = ob.build_model(model.config, dtype=torch.bfloat16)
        low.load_state_dict(model.state_dict())
        out = low(ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_last_only_gives_the_last_row():
    model = build()
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, last_only=True), model(ids)[:, -1:])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (torch.tensor([[1, 2, 101]]), r"contains id 101, outside the vocabulary \[0, 101\)"),
        (torch.tensor([[1, -1, 3]]), r"contains id -1, outside the vocabulary \[0, 101\)"),
        (torch.tensor([[1.0, 2.0]]), "must hold integer token ids; got dtype torch.float32"),
        (torch.tensor([1, 2, 3]), r"must have shape \(B, T\); got \(3,\) \(add a batch axis"),
        (torch.zeros(2, 0, dtype=torch.long), r"is empty, shape \(2, 0\)"),
        (torch.zeros(1, 12, dtype=torch.long), r"sequence length 12 exceeds max_seq_len \(11\)"),
        ([[1, 2]], "must be a torch.Tensor of token ids; got list"),
    ],
)
@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_bad_tokens_are_refused(arch, bad, message):
    with pytest.raises(InputError, match=message):
        build(arch)(bad)


def test_bad_masks_and_memory_are_refused():
    dec, enc, ed = build(), build("encoder"), build("encoder-decoder")
    ids = tokens()
    with pytest.raises(InputError, match="padding_mask must be a bool tensor"):
        dec(ids, padding_mask=torch.ones(3, 7))
    with pytest.raises(InputError, match=r"padding_mask must have shape \(B, S\) = \(3, 7\); got \(3, 6\)"):
        enc(ids, padding_mask=torch.ones(3, 6, dtype=torch.bool))
    with pytest.raises(InputError, match="src and tgt must have the same batch size; got 3 and 2"):
        ed(ids, ids[:2])
    with pytest.raises(InputError, match=r"memory must have shape \(3, S, 36\)"):
        ed.decode(ids, torch.randn(3, 5, 35))
    with pytest.raises(InputError, match="type_vocab_size=0"):
        enc(ids, token_type_ids=torch.zeros_like(ids))
    cache = dec.new_cache(3)
    dec(ids, cache=cache)
    with pytest.raises(InputError, match=r"sequence length 7 cached \+ 5 new = 12 exceeds max_seq_len \(11\)"):
        dec(ids[:, :5], cache=cache)


def test_token_type_ids_select_segment_embeddings():
    model = build("encoder", type_vocab_size=2, embed_norm=True, pooler=True)
    ids = tokens()
    types = torch.zeros_like(ids)
    types[:, 4:] = 1
    with torch.no_grad():
        default, explicit, second = (
            model(ids),
            model(ids, token_type_ids=torch.zeros_like(ids)),
            model(ids, token_type_ids=types),
        )
        assert torch.equal(default, explicit)
        assert (second - default).abs().max() > 0
        assert model.pool(default).shape == (3, 36)
    with pytest.raises(InputError, match=r"token_type_ids must lie in \[0, type_vocab_size=2\)"):
        model(ids, token_type_ids=types + 1)


def test_memory_mask_without_memory_is_refused():
    ed = build("encoder-decoder")
    src, tgt = tokens(t=5), tokens(t=4, seed=1)
    real = torch.ones(3, 5, dtype=torch.bool)
    with torch.no_grad():
        memory = ed.encode(src)
        cache = ed.new_cache(3)
        ed.decode(tgt[:, :1], memory, memory_mask=real, cache=cache)  # fills the cross-attention keys and values
        with pytest.raises(InputError, match="memory_mask is the padding mask of memory, but memory is None"):
            ed.decoder(tgt[:, 1:2], memory=None, memory_mask=real, cache=cache)
        # Without a mask the filled cache is enough, and the step equals the full pass.
        step = ed.decoder(tgt[:, 1:2], cache=cache)
        torch.testing.assert_close(step, ed(src, tgt[:, :2])[:, 1:], atol=1e-5, rtol=1.3e-6)
