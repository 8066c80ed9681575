"""The native decode step with LoRA adapters per row computes what the Python step computes.

Two peft adapters of different ranks (5 and 3: not multiples of the four rows the float routine reads at once),
scales and layers go on one base with ``load_adapters``: on the Llama-style model q, v, up and k, o, gate, down
(every matrix of the step, q/k/v and gate/up split from their stacks where the base had them stacked); on the
GPT-2-style model the fused query/key/value matrix (``c_attn``) and up, then o and down. A batch mixes rows of
both adapters and of the base that join between steps, each at its own position.

Float32: logits within 1e-5 of their scale of the Python step's and the same greedy tokens; each row bit-equal to
the same row decoded alone by the native step, and within 1e-5 of a model carrying that adapter alone (its
``LoraLinear``s, the Python step). Block weights (q4_1), where 8-bit activations make any two summation orders
differ now and then: as faithful to the float32 adapted model as the Python step (the bound of
``test_native_step.py``: mean KL divergence within 10%, top-1 agreement 95%).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from native_testing import FAMILIES, WIDE, build, decode_across_threads_and_isas, decode_both, kl_to, relative

import oneblock as ob
from oneblock import kernels
from oneblock.adapters.apply import apply_lora, lora_modules
from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.multi import MultiLoraLinear, load_adapters
from oneblock.adapters.peft import load_adapter, save_adapter
from oneblock.errors import ConfigError
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.native_step import ENV, NativeStep
from oneblock.inference.quantize import quantize_int8

pytestmark = pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library")

ADAPTERS = {
    "llama-style": {
        "terse": LoraConfig(rank=5, alpha=8.0, targets=("q", "v", "up")),
        "chatty": LoraConfig(rank=3, alpha=6.0, targets=("k", "o", "gate", "down")),
    },
    "gpt2-style": {
        "terse": LoraConfig(rank=5, alpha=8.0, targets=("q", "k", "v", "up")),
        "chatty": LoraConfig(rank=3, alpha=6.0, targets=("o", "down")),
    },
}
PROMPTS = [[5, 17, 3], [42, 8], [7, 7, 9, 100, 2, 61, 13], [88, 1, 30, 30, 4], [11]]
CHOSEN = [1, 0, 2, 1, 2]  # each prompt's adapter: 0 the base, k the k-th of the family's ADAPTERS
JOINS = [0, 0, 2, 3, 5]  # the step before which each prompt joins the batch
STEPS = 9
SEED = {None: 0, "wide": 5}


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict[tuple[str, str | None], list[str]]:
    """Per (family, sizes), the family's adapters saved in peft's format, trained-looking (random B)."""
    root = tmp_path_factory.mktemp("adapters")
    out: dict[tuple[str, str | None], list[str]] = {}
    for family in FAMILIES:
        for sizes in (None, "wide"):
            paths = []
            for seed, (name, cfg) in enumerate(ADAPTERS[family].items(), start=1):
                model = apply_lora(base(family, sizes), cfg)
                gen = torch.Generator().manual_seed(seed)
                with torch.no_grad():
                    for module in lora_modules(model).values():
                        module.lora_B.weight.copy_(0.3 * torch.randn(module.lora_B.weight.shape, generator=gen))
                paths.append(str(save_adapter(model, root / f"{family}-{sizes}-{name}", cfg=cfg)))
            out[family, sizes] = paths
    return out


def base(family: str, sizes: str | None = None) -> torch.nn.Module:
    return build(family, seed=SEED[sizes], sizes=WIDE if sizes == "wide" else None)


def adapted(directories, family: str, sizes: str | None = None, fmt: str | None = None):
    """The base (in ``fmt`` blocks if given) with both adapters per row, and its ``ServedAdapters``."""
    model = base(family, sizes)
    if fmt is not None:
        model = ob.quantize(model, fmt)
    pairs = list(zip(ADAPTERS[family], directories[family, sizes], strict=True))
    return model, load_adapters(model, pairs)


def staggered(decoder: BatchDecoder, served, feed: list[list[int]] | None = None) -> list[torch.Tensor]:
    """Every prompt through ``decoder``, joining at ``JOINS``, each row with its adapter; each row's (STEPS, V)
    logits. Rows are fed ``feed[i]`` (one id per step) or their own greedy tokens."""
    slots: list = []
    rows: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    active: list[int] = []
    for step in range(STEPS + max(JOINS)):
        for i, join in enumerate(JOINS):
            if join == step:
                served.rows.select([CHOSEN[i]])
                slot, logits = decoder.prefill(PROMPTS[i], STEPS + 1)
                slots.append(slot)
                active.append(i)
                rows[i].append(logits)
        live = [n for n, i in enumerate(active) if len(rows[i]) < STEPS]
        if not live:
            break
        fed = [feed[active[n]][len(rows[active[n]]) - 1] if feed else int(rows[active[n]][-1].argmax()) for n in live]
        served.rows.select([CHOSEN[active[n]] for n in live])
        out = decoder.step([slots[n] for n in live], fed)  # (B, V): rows of three models, at their own positions
        for j, n in enumerate(live):
            rows[active[n]].append(out[j])
    return [torch.stack(r) for r in rows]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixed_batch_equals_the_python_step(directories, family):
    model, served = adapted(directories, family)
    held = {type(m.base).__name__ for m in model.modules() if isinstance(m, MultiLoraLinear)}
    assert held == {"Linear"}
    if family == "gpt2-style":  # c_attn: one adapter over the stacked q, k and v
        assert isinstance(model.blocks[0].attn.qkv_proj, MultiLoraLinear)
    native, python = BatchDecoder(model), BatchDecoder(model, native=False)
    assert native.native is not None and native.native.adapted and python.native is None
    want = staggered(python, served)
    got = staggered(native, served, feed=[r.argmax(-1).tolist() for r in want])
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape == (STEPS, model.config.vocab_size)
        assert relative(a, b) <= 1e-5
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_row_equals_its_adapter_served_alone(directories, family):
    model, served = adapted(directories, family)
    decoder = BatchDecoder(model)
    together = staggered(decoder, served)
    tokens = [r.argmax(-1).tolist() for r in together]
    singles = [base(family)]
    for directory in directories[family, None]:
        singles.append(base(family))
        load_adapter(singles[-1], directory)
    for i, (prompt, k) in enumerate(zip(PROMPTS, CHOSEN, strict=True)):
        served.rows.select([k])
        slot, first = decoder.prefill(prompt, STEPS + 1)
        alone = [first] + [decoder.step([slot], [t])[0] for t in tokens[i][: STEPS - 1]]
        assert torch.equal(torch.stack(alone), together[i])  # a row never depends on the others
        reference = BatchDecoder(singles[k])
        assert reference.native is None or k == 0  # a single adapter's LoraLinear runs the Python step
        slot, first = reference.prefill(prompt, STEPS + 1)
        want = torch.stack([first] + [reference.step([slot], [t])[0] for t in tokens[i][: STEPS - 1]])
        assert relative(together[i], want) <= 1e-5
        assert together[i].argmax(-1).tolist() == tokens[i] == want.argmax(-1).tolist()
        if k:  # the adapters change what their rows compute
            served.rows.select([0])
            slot, first = decoder.prefill(prompt, STEPS + 1)
            assert (first - together[i][0]).abs().max() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_block_weights_with_adapters_are_as_faithful_as_the_python_step(directories, family):
    exact, exact_served = adapted(directories, family, "wide")
    quantized, served = adapted(directories, family, "wide", fmt="q4_1")
    held = {type(m.base).__name__ for m in quantized.modules() if isinstance(m, MultiLoraLinear)}
    assert held == {"BlockLinear"}
    plan = NativeStep.of(quantized)
    assert plan is not None and plan.adapted
    text = torch.randint(0, 211, (3, 41), generator=torch.Generator().manual_seed(6))
    chosen = [1, 2, 0]
    served.rows.select(chosen)
    exact_served.rows.select(chosen)
    native, python = decode_both(quantized, text[:, :1], steps=40, feed=text[:, 1:].T.tolist())
    with torch.no_grad():
        reference = exact(text[:, :40]).transpose(0, 1)  # (40, 3, V), each row with its adapter
    kl_native = kl_to(reference.flatten(0, 1), native.flatten(0, 1))
    kl_python = kl_to(reference.flatten(0, 1), python.flatten(0, 1))
    assert kl_native <= 1.1 * kl_python + 1e-4, (kl_native, kl_python)
    assert (native.argmax(-1) == python.argmax(-1)).float().mean().item() >= 0.95
    decoder = BatchDecoder(quantized)  # block and low-rank products alike: a row never depends on the others
    together = staggered(decoder, served)
    served.rows.select([CHOSEN[2]])
    slot, first = decoder.prefill(PROMPTS[2], STEPS + 1)
    alone = [first] + [decoder.step([slot], [t])[0] for t in together[2].argmax(-1).tolist()[: STEPS - 1]]
    assert torch.equal(torch.stack(alone), together[2])


def test_threads_and_instruction_sets_agree_with_adapters(directories):
    model, served = adapted(directories, "llama-style")
    served.rows.select([2, 1, 0])
    prompts = [[5, 17, 3], [7, 8, 9, 10], [60, 61]]
    scalar, python = decode_across_threads_and_isas(model, prompts)
    assert relative(scalar, python) <= 1e-5


def test_the_python_step_stays_where_the_native_one_does_not_apply(directories, monkeypatch):
    pairs = list(zip(ADAPTERS["llama-style"], directories["llama-style", None], strict=True))
    model, _ = adapted(directories, "llama-style")
    monkeypatch.setenv(ENV, "0")
    assert NativeStep.of(model) is None and BatchDecoder(model).native is None
    monkeypatch.delenv(ENV)
    int8 = quantize_int8(base("llama-style"))
    load_adapters(int8, pairs)
    assert NativeStep.of(int8) is None  # adapters over int8 layers


def test_rows_and_adapters_that_disagree_are_refused(directories):
    model, served = adapted(directories, "llama-style")
    decoder = BatchDecoder(model)
    slots = [decoder.prefill([1, 2, 3], 4)[0], decoder.prefill([4, 5], 4)[0]]
    served.rows.select([1, 2, 0])  # three rows selected, two stepped
    with pytest.raises(ConfigError, match="selected for 3 rows and this step has 2"):
        decoder.step(slots, [7, 8])
    served.rows.select([0, 0, 0])  # every row the base: nothing to misassign, as in the Python step's layers
    assert decoder.step(slots, [7, 8]).shape == (2, model.config.vocab_size)
    plan = decoder.native
    assert plan is not None
    first = plan.fields.lora[0]
    short = dataclasses.replace(first, b=first.b[:, :-1].contiguous())  # B of the first update, one rank short
    with pytest.raises(RuntimeError, match=r"LoRA update 0: B must be a contiguous float32 \(36, 5\)"):
        dataclasses.replace(plan.fields, lora=[short, *plan.fields.lora[1:]]).build()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_read_natively_runs_its_adapter(directories, family):
    """``NativeStep.prompt``: the tokens of one row's prompt in one call, each with the row's adapter."""
    model, served = adapted(directories, family)
    plan = NativeStep.of(model)
    assert plan is not None and plan.adapted
    ids = [9, 8, 7, 6, 5, 4]
    for adapter in range(len(ADAPTERS[family]) + 1):
        served.rows.select([adapter])
        ours, theirs = (model.new_cache(1, max_len=8, chunk=8) for _ in range(2))
        with torch.inference_mode():
            want = model.logits(model.run(torch.tensor([ids]), cache=theirs)[:, -1])[0]
            got = plan.prompt(torch.tensor(ids), 0, ours)
        assert relative(got, want) <= 1e-5, adapter
