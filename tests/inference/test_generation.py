"""Generation: the cache changes nothing, padding changes nothing, seeds repeat, eos stops, bad input is refused.

Sizes are small and distinct (vocabulary 101, width 36, 3 or 6 heads, d_ff 37) and the weights are perturbed away
from their tiny initial values, so that the logits are far from uniform and a mistake moves them visibly.
"""

from __future__ import annotations

import pytest
import torch

import oneblock as ob
from oneblock.errors import InputError
from oneblock.inference.generation import generate, generate_stream
from oneblock.inference.request import pad_prompts

V = 101
SMALL = {"vocab_size": V, "d_model": 36, "n_heads": 3, "d_ff": 37, "max_seq_len": 24, "n_layers": 2}
FAMILIES = {
    "pre-ln": {},
    "post-ln": {"norm_position": "post"},
    "rmsnorm-swiglu-rope-gqa": {
        "norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "n_heads": 6, "n_kv_heads": 2, "bias": False,
    },
    "encoder-decoder": {"arch": "encoder-decoder", "n_decoder_layers": 3},
}  # fmt: skip
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # small models run fastest on one thread


def build(family: str = "pre-ln", seed: int = 0, **changes) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = ob.build_model(ob.ModelConfig(**{**SMALL, **FAMILIES[family], **changes}))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def extra(model) -> dict:
    """The source arguments an encoder-decoder needs: (B=2, S=6), the second row padded on the right."""
    if not isinstance(model, ob.EncoderDecoder):
        return {}
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    return {"src": ids(2, 6, seed=9), "src_padding_mask": mask}


def full_logits(model, seq: torch.Tensor, **kw) -> torch.Tensor:
    """Logits of a single forward pass over the whole sequence (B, L, V)."""
    with torch.no_grad():
        if isinstance(model, ob.EncoderDecoder):
            return model(kw["src"], seq, src_padding_mask=kw["src_padding_mask"])
        return model(seq)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cache_equals_full_recompute(family):
    model = build(family)
    kw = extra(model)
    prompt = ids(2, 5, seed=1)
    cached, logits = generate(model, prompt, 12, greedy=True, return_logits=True, **kw)
    uncached, logits_uncached = generate(model, prompt, 12, greedy=True, use_cache=False, return_logits=True, **kw)
    assert torch.equal(cached, uncached)  # token for token
    assert cached.shape == (2, 17) and torch.equal(cached[:, :5], prompt)
    assert logits.shape == (2, 12, V) and logits.dtype == torch.float32
    # Step i's logits are the last row of a full forward pass over everything before token i.
    torch.testing.assert_close(logits, full_logits(model, cached, **kw)[:, 4:-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, logits_uncached, atol=ATOL, rtol=0)
    assert logits.std() > 1.0  # far from uniform: the comparison is not between near-zero numbers


@pytest.mark.parametrize("family", ["pre-ln", "rmsnorm-swiglu-rope-gqa", "encoder-decoder"])
def test_left_padded_rows_equal_each_prompt_alone(family):
    model = build(family, seed=3).double()  # float64: padding must change nothing, not merely little
    kw = extra(model)
    prompts = [[5, 17, 3], [8, 9, 10, 11, 12, 13, 14], [42]]
    if kw:  # three rows of source: the first two rows' and the second row again
        kw = {"src": kw["src"][[0, 1, 1]], "src_padding_mask": kw["src_padding_mask"][[0, 1, 1]]}
    batch, logits = generate(model, prompts, 9, greedy=True, return_logits=True, pad_id=7, **kw)
    assert batch.shape == (3, 7 + 9)
    assert batch[0, :4].tolist() == [7, 7, 7, 7]  # left padding with pad_id
    for row, prompt in enumerate(prompts):
        alone_kw = {k: v[row : row + 1] for k, v in kw.items()}
        alone, alone_logits = generate(model, [prompt], 9, greedy=True, return_logits=True, **alone_kw)
        assert torch.equal(batch[row, 7 - len(prompt) :], alone[0])
        torch.testing.assert_close(logits[row], alone_logits[0], atol=1e-10, rtol=0)


def test_a_padding_mask_tensor_equals_a_list_of_prompts():
    model = build(seed=4)
    prompts = [[1, 2, 3, 4], [5, 6]]
    padded, mask = pad_prompts(prompts, pad_id=0)
    assert mask.tolist() == [[True] * 4, [False, False, True, True]]
    a = generate(model, padded, 6, greedy=True, prompt_padding_mask=mask)
    b = generate(model, prompts, 6, greedy=True)
    assert torch.equal(a, b)
    uncached = generate(model, padded, 6, greedy=True, prompt_padding_mask=mask, use_cache=False)
    assert torch.equal(a, uncached)


def test_seeds_repeat_and_leave_the_global_generator_alone():
    model = build(seed=5)
    prompt = ids(3, 4, seed=2)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = generate(model, prompt, 15, temperature=1.5, top_k=50, top_p=0.95, seed=11)
    assert torch.equal(torch.get_rng_state(), before)
    b = generate(model, prompt, 15, temperature=1.5, top_k=50, top_p=0.95, seed=11)
    c = generate(model, prompt, 15, temperature=1.5, top_k=50, top_p=0.95, seed=12)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(0)
    d = generate(model, prompt, 15, temperature=1.5)
    torch.manual_seed(0)
    assert torch.equal(d, generate(model, prompt, 15, temperature=1.5))  # seed=None follows torch.manual_seed


def test_temperature_zero_is_greedy_and_top_k_one_is_greedy():
    model = build(seed=6)
    prompt = ids(2, 3, seed=3)
    greedy = generate(model, prompt, 10, greedy=True)
    assert torch.equal(generate(model, prompt, 10, temperature=0), greedy)
    assert torch.equal(generate(model, prompt, 10, top_k=1, seed=0), greedy)


def test_eos_stops_each_row_and_pads_it():
    model = build(seed=7)
    prompt = ids(2, 3, seed=4)
    free = generate(model, prompt, 12, greedy=True)[:, 3:]  # (2, 12)
    eos = int(free[0, 2])  # the third token of row 0
    first = [next((i for i, x in enumerate(row.tolist()) if x == eos), None) for row in free]
    out = generate(model, prompt, 12, greedy=True, eos_id=eos, pad_id=0)
    new = out[:, 3:]
    if first[1] is None:  # row 1 never says eos: it runs to the end, row 0 is padded after its eos
        assert new.shape[1] == 12
    else:
        assert new.shape[1] == max(first) + 1
    assert new[0, : first[0] + 1].tolist() == free[0, : first[0] + 1].tolist()
    assert (new[0, first[0] + 1 :] == 0).all()
    single = generate(model, prompt[:1], 12, greedy=True, eos_id=eos)
    assert single.shape == (1, 3 + first[0] + 1) and int(single[0, -1]) == eos  # stops right after eos


def test_a_list_of_eos_ids_stops_at_the_first_of_any():
    model = build(seed=7)
    prompt = ids(1, 3, seed=4)
    free = generate(model, prompt, 12, greedy=True)[0, 3:].tolist()
    eos = free[4]
    k = free.index(eos)
    absent = min(set(range(V)) - set(free))  # an end-of-text id the model never says here
    out = generate(model, prompt, 12, greedy=True, eos_id=[absent, eos])
    assert out[0, 3:].tolist() == free[: k + 1]
    assert torch.equal(generate(model, prompt, 12, greedy=True, eos_id=(eos,)), out)
    assert torch.equal(generate(model, prompt, 12, greedy=True, eos_id=eos), out)
    two = generate(model, ids(2, 3, seed=4), 12, greedy=True, eos_id=[absent, eos])  # a stopped row: the first id
    row = two[0, 3:].tolist()
    if eos in row:
        assert set(row[row.index(eos) + 1 :]) <= {absent}


def test_stream_callback_and_iterator_agree():
    model = build(seed=8)
    prompt = ids(1, 4, seed=5)[0]  # a 1-D prompt gives 1-D results
    seen: list[list[int]] = []
    out = generate(model, prompt, 7, greedy=True, stream=lambda new: seen.append(new.tolist()))
    assert out.shape == (11,) and [s[0] for s in seen] == out[4:].tolist()
    steps = generate_stream(model, prompt, 7, greedy=True)
    yielded = [int(new) for new in steps]
    assert yielded == out[4:].tolist()
    with pytest.raises(InputError, match="top_k must be"):
        generate_stream(model, prompt, 7, top_k=0)  # refused on the call, before any iteration


def test_context_rule_raises_or_crops():
    model = build(seed=9)  # max_seq_len 24
    prompt = ids(1, 20, seed=6)
    with pytest.raises(InputError, match=r"the prompt \(20 tokens\) plus max_new_tokens \(8\) is 28, more than"):
        generate(model, prompt, 8, greedy=True)
    out = generate(model, prompt, 8, greedy=True, crop=True)
    assert out.shape == (1, 28) and torch.equal(out[:, :20], prompt)  # the whole prompt is returned
    alone = generate(model, prompt[:, -16:], 8, greedy=True)  # the model saw the last 24 - 8 = 16 tokens
    assert torch.equal(out[:, 20:], alone[:, 16:])
    with pytest.raises(InputError, match=r"max_new_tokens \(24\) leaves no room"):
        generate(model, prompt, 24, crop=True)
    assert generate(model, prompt[:, :4], 20, greedy=True).shape == (1, 24)  # exactly the context fits


def test_mode_is_restored_and_zero_tokens_return_the_prompt():
    model = build(seed=10).train()
    prompt = ids(2, 3)
    out = generate(model, prompt, 0)
    assert torch.equal(out, prompt) and out.data_ptr() != prompt.data_ptr()
    generate(model, prompt, 3)
    assert model.training


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: generate(ob.build_model(ob.ModelConfig(arch="encoder")), ids(1, 3), 2), "needs a Decoder or an"),
        (lambda m: generate(m, ids(1, 3), 2, src=ids(1, 3)), "are for encoder-decoder models"),
        (lambda m: generate(m, ids(1, 3).float(), 2), "must hold integer token ids"),
        (lambda m: generate(m, torch.tensor([[3, V]]), 2), rf"contains id {V}, outside the vocabulary"),
        (lambda m: generate(m, torch.tensor([[3, -1]]), 2), "contains id -1"),
        (lambda m: generate(m, ids(1, 3), -1), r"max_new_tokens must be an int >= 0; got -1"),
        (lambda m: generate(m, ids(1, 3), 2.0), "max_new_tokens must be an int"),
        (lambda m: generate(m, ids(1, 3), 2, temperature=-1), "temperature must be"),
        (lambda m: generate(m, ids(1, 3), 2, top_p=2), r"top_p must lie in \(0, 1\]"),
        (lambda m: generate(m, ids(1, 3), 2, eos_id=V), rf"eos_id must be an id in \[0, {V}\)"),
        (lambda m: generate(m, ids(1, 3), 2, eos_id=[1, V]), rf"eos_id .* or None; got \[1, {V}\]"),
        (lambda m: generate(m, ids(1, 3), 2, eos_id=[1, "2"]), r"eos_id .* or None; got \[1, '2'\]"),
        (lambda m: generate(m, ids(1, 3), 2, seed=1.5), "seed must be an int"),
        (lambda m: generate(m, [], 2), "non-empty list"),
        (lambda m: generate(m, [[1, 2], []], 2), "at least one token"),
        (
            lambda m: generate(m, ids(2, 3), 2, prompt_padding_mask=torch.tensor([[1, 1, 1], [0, 1, 1]])),
            "must be a bool tensor",
        ),
        (
            lambda m: generate(m, ids(2, 3), 2, prompt_padding_mask=torch.ones(2, 4, dtype=torch.bool)),
            r"must have the prompt's shape \(2, 3\)",
        ),
        (
            lambda m: generate(m, ids(2, 3), 2, prompt_padding_mask=torch.tensor([[True] * 3, [True, True, False]])),
            "must pad on the left",
        ),
        (
            lambda m: generate(m, ids(2, 3), 2, prompt_padding_mask=torch.tensor([[True] * 3, [True, False, True]])),
            "padding token after a real one",
        ),
    ],
)
def test_bad_input_is_refused(call, match):
    with pytest.raises(InputError, match=match):
        call(build(seed=11))


def test_encoder_decoder_needs_a_matching_source():
    model = build("encoder-decoder", seed=12)
    with pytest.raises(InputError, match="needs `src`"):
        generate(model, ids(1, 1), 3)
    with pytest.raises(InputError, match=r"src must be a tensor of shape \(B, S\) with B = 2"):
        generate(model, ids(2, 1), 3, src=ids(1, 4))


def test_greedy_gpt2_matches_transformers_generate():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=V, n_embd=36, n_head=3, n_layer=2, n_inner=37, n_positions=40, bos_token_id=0, eos_token_id=V - 1,
        pad_token_id=V - 1,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model = ob.from_hf(hf)
    prompt = ids(1, 6, seed=13)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=25, do_sample=False, eos_token_id=None, pad_token_id=V - 1)
    ours = generate(model, prompt, 25, greedy=True)
    assert ours.tolist() == theirs.tolist()
    # Left-padded batch, as transformers pads it (attention_mask zeros on the left).
    padded, mask = pad_prompts([[3, 4, 5, 6, 7], [8, 9]], pad_id=V - 1)
    with torch.no_grad():
        theirs = hf.generate(
            padded, attention_mask=mask.long(), max_new_tokens=15, do_sample=False, eos_token_id=None,
            pad_token_id=V - 1,
        )  # fmt: skip
    assert generate(model, padded, 15, greedy=True, prompt_padding_mask=mask).tolist() == theirs.tolist()
