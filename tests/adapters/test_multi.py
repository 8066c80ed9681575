"""Several adapters in one batch: each row of a mixed batch equals its adapter served alone.

Two peft adapters with different ranks, scales and layers (q, v, up; k, o, gate, down) go on one base with
``load_adapters``; rows of the base and of both adapters, at different positions, share the batched decoder's
steps. Each row's logits are compared with the same request decoded alone by a model carrying only its adapter
(``load_adapter``'s ``LoraLinear``s) or none: the same greedy tokens, and logits within 1e-5 of the logits' scale
(float32 products block by the number of rows, see ``oneblock.inference.batch``: a row's last bits depend on
how many rows share the product). In float32 the batch runs the native step (``tests/inference/test_native_lora.py``
checks it against the Python step); over int8 layers the Python step (the base products row-independent; q, k and
v one opaque matrix there, its three adapters one stacked update).
"""

from __future__ import annotations

import pytest
import torch

import oneblock as ob
from oneblock.adapters.apply import apply_lora, lora_modules
from oneblock.adapters.lora import LoraConfig
from oneblock.adapters.multi import MultiLoraLinear, load_adapters
from oneblock.adapters.peft import load_adapter, save_adapter
from oneblock.errors import ConfigError
from oneblock.inference import native_step
from oneblock.inference.batch import BatchDecoder
from oneblock.inference.quantize import quantize_int8

LLAMA = {
    "vocab_size": 101, "d_model": 48, "n_heads": 6, "n_kv_heads": 2, "d_ff": 80, "max_seq_len": 40, "n_layers": 2,
    "norm": "rmsnorm", "ffn": "swiglu", "position": "rope", "bias": False, "tie_embeddings": False,
}  # fmt: skip
ADAPTERS = {
    "terse": LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "up")),
    "chatty": LoraConfig(rank=2, alpha=6.0, targets=("k", "o", "gate", "down")),
}
PROMPTS = [[5, 17, 3], [42, 8], [7, 7, 9, 100, 2, 61, 13], [88, 1, 30, 30, 4], [11]]
CHOSEN = [1, 0, 2, 1, 2]  # each prompt's adapter: 0 the base, k the k-th of ADAPTERS
STEPS = 6


def base(*, int8: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = ob.build_model(ob.ModelConfig(**LLAMA))
    with torch.no_grad():  # away from the tiny initial values, so the logits are far from uniform
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return quantize_int8(model) if int8 else model.eval()


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> list[str]:
    """The adapters of ``ADAPTERS`` saved in peft's format, trained-looking (random B)."""
    root = tmp_path_factory.mktemp("adapters")
    out = []
    for seed, (name, cfg) in enumerate(ADAPTERS.items(), start=1):
        model = apply_lora(base(), cfg)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in lora_modules(model).values():
                module.lora_B.weight.copy_(0.3 * torch.randn(module.lora_B.weight.shape, generator=gen))
        out.append(str(save_adapter(model, root / name, cfg=cfg)))
    return out


def alone(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their (STEPS, V) logits, the request decoded by itself."""
    decoder = BatchDecoder(model)
    slot, logits = decoder.prefill(prompt, STEPS)
    rows = [logits]
    for _ in range(STEPS - 1):
        rows.append(decoder.step([slot], [int(rows[-1].argmax())])[0])
    stacked = torch.stack(rows)
    return stacked.argmax(dim=-1).tolist(), stacked


def mixed(model: torch.nn.Module, served, tokens: list[list[int]], *, int8: bool) -> list[torch.Tensor]:
    """Every prompt in one batch, each row with its adapter, fed its reference tokens; each row's logits."""
    decoder = BatchDecoder(model)
    # float32: the native step with the adapters' updates (where the C++ library is built); int8 layers: Python
    assert (decoder.native is not None) == (not int8 and native_step.enabled())
    slots, got = [], []
    for prompt, k in zip(PROMPTS, CHOSEN, strict=True):
        served.rows.select([k])
        slot, logits = decoder.prefill(prompt, STEPS)
        slots.append(slot)
        got.append([logits])
    served.rows.select(CHOSEN)
    for step in range(STEPS - 1):
        rows = decoder.step(slots, [t[step] for t in tokens])  # (B, V), rows of three models in one pass
        for i in range(len(PROMPTS)):
            got[i].append(rows[i])
    return [torch.stack(rows) for rows in got]


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_each_row_of_a_mixed_batch_equals_its_adapter_alone(directories, int8):
    singles = [base(int8=int8)] + [base(int8=int8) for _ in directories]
    for model, directory in zip(singles[1:], directories, strict=True):
        load_adapter(model, directory)
    references = [alone(singles[k], prompt) for prompt, k in zip(PROMPTS, CHOSEN, strict=True)]
    model = base(int8=int8)
    served = load_adapters(model, list(zip(ADAPTERS, directories, strict=True)))
    assert served.names == tuple(ADAPTERS)
    got = mixed(model, served, [tokens for tokens, _ in references], int8=int8)
    for (tokens, want), rows in zip(references, got, strict=True):
        assert (rows - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))
        assert rows.argmax(dim=-1).tolist() == tokens
    for i, k in enumerate(CHOSEN):  # the adapters change what their rows compute
        if k:
            assert (references[i][1][0] - alone(singles[0], PROMPTS[i])[1][0]).abs().max() > 0.1


def test_layers_hold_the_adapters_that_adapt_them(directories):
    model = base()
    load_adapters(model, list(zip(ADAPTERS, directories, strict=True)))
    assert not lora_modules(model)  # no single-adapter wrapper is left
    attn, ffn = model.blocks[0].attn, model.blocks[0].ffn
    held = {name: sorted(m.scales) for name, m in model.named_modules() if isinstance(m, MultiLoraLinear)}
    assert held["blocks.0.attn.q_proj"] == [1] and held["blocks.0.attn.k_proj"] == [2]
    assert held["blocks.1.ffn.w2"] == [2] and held["blocks.1.ffn.w3"] == [1]  # down: chatty; up: terse
    assert isinstance(attn.v_proj, MultiLoraLinear) and isinstance(ffn.w1, MultiLoraLinear)
    assert attn.q_proj.scales[1] == 8.0 / 4 and attn.k_proj.scales[2] == 6.0 / 2
    assert not any(p.requires_grad for p in model.parameters())


def test_refusals_name_the_problem(directories):
    model = base()
    pairs = list(zip(ADAPTERS, directories, strict=True))
    with pytest.raises(ConfigError, match="names must differ"):
        load_adapters(model, [pairs[0], ("terse", directories[1])])
    with pytest.raises(ConfigError, match="at least one"):
        load_adapters(model, [])
    served = load_adapters(model, pairs)
    with pytest.raises(ConfigError, match=r"must lie in \[0, 2\]"):
        served.rows.select([0, 3])
    served.rows.select([1, 2])  # two rows selected, one fed
    with pytest.raises(ConfigError, match="selected for 2 rows and this input has 1"):
        model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ConfigError, match="already has LoRA adapters"):
        adapted = base()
        load_adapter(adapted, directories[0])
        load_adapters(adapted, pairs)


def test_decoding_imports_no_adapter_reader():
    """The decoding modules hold the multi-adapter layer but import the readers of peft and Hugging Face files only
    when adapters are loaded: a model served without adapters starts without them (half the import time)."""
    import subprocess
    import sys

    code = (
        "import sys, oneblock.inference.generation, oneblock.inference.batch\n"
        "print(sorted(m for m in sys.modules if m.startswith(('oneblock.io.hf', 'oneblock.adapters.peft', "
        "'safetensors'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
