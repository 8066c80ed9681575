"""The lean per-token step computes what the model's full forward computes.

Each pre-LN decoder family (learned positions with biases, RMSNorm + SwiGLU + rotary + grouped-query heads) decodes
with ``LeanDecode`` and with ``FullDecode`` (the model's own ``run`` per step) from the same prompts, left-padded
batches included: the logits of every step agree within 1e-5 in float32 and the greedy tokens are identical.
"""

from __future__ import annotations

import pytest
import torch

import oneblock as ob
from oneblock.inference.decode import FullDecode, LeanDecode
from oneblock.inference.generation import generate
from oneblock.inference.plan import lean_supported
from oneblock.inference.request import prepare
from oneblock.kernels import GEMM_ROWS, backend

SMALL = {"vocab_size": 101, "d_model": 36, "n_heads": 3, "d_ff": 37, "max_seq_len": 32, "n_layers": 2}
FAMILIES = {
    "gpt2-style": {},
    "llama-style": {
        "norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "n_heads": 6, "n_kv_heads": 2, "bias": False,
        "tie_embeddings": False,
    },
}  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = ob.build_model(ob.ModelConfig(**{**SMALL, **FAMILIES[family]}))
    with torch.no_grad():  # away from the tiny initial values, so the logits are far from uniform
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def decode_both(model, prompts, steps: int):
    """Feed the same greedy tokens to both decoders; return their (steps, B, V) logits."""
    run = prepare(model, prompts, steps, False, None, None, None, None)
    lean, full = LeanDecode(run), FullDecode(run, use_cache=True)
    got, want, fed = [], [], None
    with torch.inference_mode():
        for _ in range(steps):
            a, b = lean.next(fed), full.next(fed)
            got.append(a)
            want.append(b)
            fed = b.argmax(-1)
    return torch.stack(got), torch.stack(want)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompts", [[[5, 17, 3, 99, 42]], [[5, 17, 3, 99, 42], [7, 8], [60, 61, 62]]])
def test_lean_step_logits_equal_the_full_forward(family, prompts):
    model = build(family)
    assert lean_supported(model)
    lean, full = decode_both(model, prompts, steps=12)
    assert lean.dtype == full.dtype == torch.float32
    assert (lean - full).abs().max().item() <= 1e-5
    assert torch.equal(lean.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_takes_the_lean_path_and_matches_the_uncached_one(family):
    model = build(family, seed=1)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    fast = generate(model, prompt, 16, greedy=True)
    slow = generate(model, prompt, 16, greedy=True, use_cache=False)  # the whole sequence recomputed each step
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("family", FAMILIES)
def test_lean_step_runs_lora_adapters_and_equals_the_full_forward(family):
    from oneblock.adapters.apply import apply_lora, lora_modules
    from oneblock.adapters.lora import LoraConfig

    model = build(family, seed=2)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, targets=("all-linear",)))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a nonzero B, so the adapters change every projection's output
        for module in lora_modules(model).values():
            module.lora_B.weight.copy_(0.3 * torch.randn(module.lora_B.weight.shape, generator=gen))
    model.eval()
    assert lean_supported(model)
    lean, full = decode_both(model, [[5, 17, 3, 99, 42], [7, 8]], steps=8)
    assert (lean - full).abs().max().item() <= 1e-5
    assert torch.equal(lean.argmax(-1), full.argmax(-1))


def test_lean_step_is_not_used_where_it_would_differ():
    post = ob.build_model(ob.ModelConfig(**SMALL, norm_position="post"))
    seq2seq = ob.build_model(ob.ModelConfig(**SMALL, arch="encoder-decoder"))
    assert not lean_supported(post) and not lean_supported(seq2seq)


def test_cache_buffers_hold_only_this_generation():
    model = build("llama-style")
    run = prepare(model, [[1, 2, 3]], 5, False, None, None, None, None)
    lean = LeanDecode(run)
    assert lean.cache.layers[0].capacity == 3 + 5 - 1  # not max_seq_len (32)
    bf16 = LeanDecode(run, cache_dtype=torch.bfloat16)
    assert bf16.cache.layers[0].k.dtype == torch.bfloat16


def test_compiled_step_equals_eager():
    """Traced by dynamo and AOTAutograd (``aot_eager``: the graph inductor would compile, run op by op), so the test
    takes seconds; ``compile=True`` adds inductor's code generation on top of the same graph."""
    model = build("llama-style", seed=2)
    prompt = torch.tensor([[11, 22, 33, 44]])
    stats: dict[str, float] = {}
    eager = generate(model, prompt, 6, greedy=True, return_logits=True)
    compiled = generate(model, prompt, 6, greedy=True, return_logits=True, compile="aot_eager", stats=stats)
    assert torch.equal(eager[0], compiled[0])
    assert (eager[1] - compiled[1]).abs().max().item() <= 1e-5
    assert stats["compile_seconds"] > 0


def test_bfloat16_cache_halves_the_memory_and_stays_close():
    model = build("llama-style", seed=3)
    prompt = torch.tensor([[9, 8, 7, 6, 5]])
    full = generate(model, prompt, 8, greedy=True, return_logits=True)
    narrow = generate(model, prompt, 8, greedy=True, return_logits=True, cache_dtype=torch.bfloat16)
    spread = (full[1].amax(-1) - full[1].amin(-1)).mean().item()
    assert (narrow[1] - full[1]).abs().max().item() <= 0.02 * spread  # keys and values rounded to bfloat16
    post = ob.build_model(ob.ModelConfig(**SMALL, norm_position="post"))
    with pytest.raises(ob.InputError, match="cache_dtype needs a pre-LN decoder-only model"):
        generate(post, prompt, 2, cache_dtype=torch.bfloat16)


@pytest.mark.parametrize("cache_dtype", [None, torch.bfloat16])
def test_prompt_is_read_in_chunks_that_equal_one_pass(cache_dtype, monkeypatch):
    """A long prompt goes through the model in chunks of ``prompt_chunk`` positions (a remainder under 32 rows
    joining the last one), left-padded rows included; the logits and greedy tokens are those of one pass."""
    torch.manual_seed(4)
    model = ob.build_model(ob.ModelConfig(**{**SMALL, **FAMILIES["llama-style"], "max_seq_len": 128}))
    model.eval()
    prompts = [torch.randint(0, 101, (75,)).tolist(), torch.randint(0, 101, (60,)).tolist()]
    run = prepare(model, prompts, 6, False, None, None, None, None)
    lengths: list[int] = []
    read = model.run
    monkeypatch.setattr(model, "run", lambda tokens, **kw: lengths.append(tokens.shape[1]) or read(tokens, **kw))
    results = []
    for chunk in (32, 4096):
        lengths.clear()
        lean, logits, fed = LeanDecode(run, cache_dtype=cache_dtype, prompt_chunk=chunk), [], None
        with torch.inference_mode():
            for _ in range(6):
                logits.append(lean.next(fed))
                fed = logits[-1].argmax(-1)
        results.append(torch.stack(logits))  # (6, B, V)
        assert lengths == ([32, 43] if chunk == 32 else [75])  # 75 = 32 + 43: the 11 after 64 join the chunk before
    chunked, whole = results
    assert (chunked - whole).abs().max().item() <= 1e-5
    assert torch.equal(chunked.argmax(-1), whole.argmax(-1))


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True])
def test_prompt_chunk_must_be_a_positive_integer(chunk):
    run = prepare(build("llama-style"), [[1, 2, 3]], 2, False, None, None, None, None)
    with pytest.raises(ob.ConfigError, match=rf"prompt_chunk is the positions .* >= 1; got {chunk!r}"):
        LeanDecode(run, prompt_chunk=chunk)


@pytest.mark.parametrize(
    ("end", "chunk", "least", "expected"),
    [
        (75, 32, 32, [(0, 32), (32, 75)]),
        (96, 32, 32, [(0, 32), (32, 64), (64, 96)]),
        (100, 32, 1, [(0, 32), (32, 64), (64, 96), (96, 100)]),
        (20, 32, 32, [(0, 20)]),
        (498, 128, 32, [(0, 128), (128, 256), (256, 384), (384, 498)]),
        (0, 128, 32, []),
    ],
)
def test_spans_with_least_cut_at_the_chunk_and_join_a_short_remainder(end, chunk, least, expected):
    from oneblock.inference.spans import spans

    assert spans(0, end, chunk, least) == expected


def test_a_chunked_prompt_s_freed_memory_goes_back_before_the_first_step(monkeypatch):
    """The heap's free memory is handed back once, after the prompt's last chunk and before the first new token's
    step: the chunks' temporaries do not stay resident beside the cache the decode fills."""
    import oneblock.inference.decode as decode

    torch.manual_seed(4)
    model = ob.build_model(ob.ModelConfig(**{**SMALL, **FAMILIES["llama-style"], "max_seq_len": 128}))
    model.eval()
    run = prepare(model, [torch.randint(0, 101, (75,)).tolist()], 3, False, None, None, None, None)
    events: list[str] = []
    read = model.run
    monkeypatch.setattr(
        model, "run", lambda tokens, **kw: events.append(f"run {tokens.shape[1]}") or read(tokens, **kw)
    )
    monkeypatch.setattr(decode, "return_free_memory", lambda: events.append("trim") or True)
    lean = LeanDecode(run, prompt_chunk=32)
    with torch.inference_mode():
        first = lean.next(None)
        events.append("step")
        lean.next(first.argmax(-1))
    assert events == ["run 32", "run 43", "trim", "step"]


def test_a_finished_generation_frees_its_decoder_without_the_collector(monkeypatch):
    """No reference cycle holds the decoder (and its key/value cache) once ``generate`` returns."""
    import gc
    import weakref

    made = []
    init = LeanDecode.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(LeanDecode, "__init__", record)
    model = build("llama-style")
    enabled = gc.isenabled()
    gc.disable()
    try:
        generate(model, torch.tensor([1, 2, 3]), 4, greedy=True)
        assert len(made) == 1 and made[0]() is None
    finally:
        if enabled:
            gc.enable()


def test_each_steps_logits_are_freed_before_the_next_step_makes_its_own(monkeypatch):
    """The generation loop keeps no step's (B, V) logits while the next step computes: one block of the C heap is
    reused step after step instead of two alternating (return_logits aside, which keeps them all)."""
    import weakref

    last: list[weakref.ref] = []
    alive_at_next: list[bool] = []
    step = LeanDecode.next

    def watched(self, fed):
        alive_at_next.append(bool(last) and last[-1]() is not None)
        logits = step(self, fed)
        last.append(weakref.ref(logits))
        return logits

    monkeypatch.setattr(LeanDecode, "next", watched)
    generate(build("llama-style"), torch.tensor([1, 2, 3]), 5, greedy=True)
    assert alive_at_next == [False] * 5


@pytest.mark.skipif(backend() == "torch", reason="the integer path needs the C++ kernels")
def test_the_prompts_feed_forward_buffer_is_freed_before_the_decode(monkeypatch):
    """The prompt's stacked gate and up product goes through the thread's scratch buffer; decoding never uses it,
    so it is freed once the prompt is read (4.75 MiB for a 0.5B model's chunk of 128 positions). The Python read's:
    the native step, which would read this prompt, keeps its own buffers."""
    from oneblock.inference.native_step import ENV as NATIVE
    from oneblock.kernels.tiles import ENV
    from oneblock.layers import scratch

    monkeypatch.setenv(ENV, "int8")
    monkeypatch.setenv(NATIVE, "0")
    torch.manual_seed(0)
    sizes = {"max_seq_len": 2 * GEMM_ROWS, "d_model": 96, "d_ff": 64}  # block rows: multiples of 32
    config = ob.ModelConfig(**{**SMALL, **FAMILIES["llama-style"], **sizes})
    model = ob.quantize(ob.build_model(config).eval(), "q4_0")
    made = []
    make = scratch.scratch
    monkeypatch.setattr("oneblock.layers.feedforward.scratch", lambda *shape: made.append(shape) or make(*shape))
    scratch.release()
    generate(model, torch.arange(GEMM_ROWS + 3) % 101, 2, greedy=True)
    assert made and made[0][-2] == GEMM_ROWS + 3  # the prompt's rows went through the buffer
    assert getattr(scratch._local, "buffer", None) is None
