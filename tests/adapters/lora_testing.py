"""Small transformers models of each family, their oneblock twins, and adapters copied between oneblock and peft.

Sizes are distinct and odd (d_model 36, 3 heads, d_ff 37, vocab 101, T 7, S 5, B 3) so a transposed or mis-split
adapter cannot keep its shape by accident.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from oneblock.adapters.apply import lora_modules
from oneblock.adapters.targets import family_of, sites

V, C, H, F, T, S, B = 101, 36, 3, 37, 7, 5, 3
MAX_POS = 13
ATOL = 1e-5
FAMILIES = ("llama", "gpt2", "bert", "bart", "t5")
# The decoder families beyond Llama, by model_type -> their name in the GGUF tests' table of transformers configs.
DECODERS = {
    "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "granite": "granite",
    "smollm3": "smollm3", "olmo2": "olmo2", "phi3": "phi3",
}  # fmt: skip


def hf_model(family: str, *, seed: int = 0) -> nn.Module:
    """A transformers model of ``family`` with perturbed random weights, float32, in eval mode (no dropout)."""
    import transformers

    torch.manual_seed(seed)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=2, num_attention_heads=H,
            num_key_value_heads=1, max_position_embeddings=MAX_POS, attn_implementation="eager",
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=V, n_embd=C, n_head=H, n_layer=2, n_inner=F, n_positions=MAX_POS, attn_implementation="eager"
        )
        model = transformers.GPT2LMHeadModel(cfg)
    elif family == "bert":
        cfg = transformers.BertConfig(
            vocab_size=V, hidden_size=C, num_attention_heads=H, num_hidden_layers=2, intermediate_size=F,
            max_position_embeddings=MAX_POS, type_vocab_size=2, attn_implementation="eager",
        )  # fmt: skip
        model = transformers.BertModel(cfg)
    elif family == "bart":
        cfg = transformers.BartConfig(
            vocab_size=V, d_model=C, encoder_attention_heads=H, decoder_attention_heads=H, encoder_layers=1,
            decoder_layers=2, encoder_ffn_dim=F, decoder_ffn_dim=F, max_position_embeddings=MAX_POS,
            attn_implementation="eager",
        )  # fmt: skip
        model = transformers.BartForConditionalGeneration(cfg)
    elif family == "t5":
        cfg = transformers.T5Config(
            vocab_size=V, d_model=C, num_heads=H, d_kv=10, d_ff=F, num_layers=1, num_decoder_layers=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
            feed_forward_proj="gated-gelu", attn_implementation="eager",
        )  # fmt: skip
        model = transformers.T5ForConditionalGeneration(cfg)
    elif family in DECODERS:
        model = _decoder(family)
    else:
        raise ValueError(family)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
        if family == "t5":
            model.shared.weight.mul_(0.2)
    return model.float().eval()


def _decoder(family: str) -> nn.Module:
    """A decoder of the GGUF tests' sizes and options (Phi-3's LongRoPE and partial rotary, Gemma's soft-caps and
    window, Granite's multipliers), with this module's vocabulary."""
    import transformers
    from converter_testing import FAMILIES as SIZES
    from converter_testing import SHARED

    config_class, sizes, _ = SIZES[DECODERS[family]]
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    cfg = getattr(transformers, config_class)(vocab_size=V, attn_implementation="eager", **{**SHARED, **sizes, **ids})
    return transformers.AutoModelForCausalLM.from_config(cfg)


def inputs(family: str, *, seed: int = 1) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=gen)
    if family in ("bart", "t5"):
        return {"src": torch.randint(0, V, (B, S), generator=gen), "tgt": x}
    return {"tokens": x}


def run_ours(model: nn.Module, family: str, batch: dict[str, Tensor]) -> Tensor:
    """Logits (B, T, V), or hidden states (B, T, C) for BERT."""
    if family in ("bart", "t5"):
        return model(batch["src"], batch["tgt"])
    return model(batch["tokens"])


def run_theirs(model: nn.Module, family: str, batch: dict[str, Tensor]) -> Tensor:
    if family in ("bart", "t5"):
        return model(input_ids=batch["src"], decoder_input_ids=batch["tgt"]).logits
    out = model(batch["tokens"])
    return out.last_hidden_state if family == "bert" else out.logits


def randomize_adapters(model: nn.Module, *, seed: int = 3) -> None:
    """Random A and B (B is zeros at first, which would make every comparison trivial)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_A.weight.copy_(0.1 * torch.randn(module.lora_A.weight.shape, generator=gen))
            module.lora_B.weight.copy_(0.1 * torch.randn(module.lora_B.weight.shape, generator=gen))


def hf_lora_pairs(model: nn.Module, hf: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(oneblock LoraLinear, peft LoRA layer) for every adapter of ``model``, matched by Hugging Face name."""
    by_ours = {s.ours: s.hf for s in sites(model.config)}
    assert family_of(model.config) is not None
    return [(module, hf.get_submodule(by_ours[name])) for name, module in lora_modules(model).items()]


def copy_adapters_to_peft(model: nn.Module, hf: nn.Module, adapter: str = "default") -> None:
    with torch.no_grad():
        for ours, theirs in hf_lora_pairs(model, hf):
            theirs.lora_A[adapter].weight.copy_(ours.lora_A.weight)
            theirs.lora_B[adapter].weight.copy_(ours.lora_B.weight)


def max_diff(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.detach().double() - b.detach().double()).abs().max().item()


def close(a: Tensor, b: Tensor) -> None:
    """Within float32's stated tolerance: ``|a - b| <= 1e-5 + 1.3e-6 |b|``."""
    torch.testing.assert_close(a.detach(), b.detach(), atol=ATOL, rtol=1.3e-6)


def probe(out: Tensor) -> Tensor:
    """A scalar loss that depends on every output with distinct weights, averaged like a token loss."""
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view(out.shape)
    return (out * weights).mean()
