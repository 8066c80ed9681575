"""DPO's loss, reward margin and reward accuracy equal trl's ``DPOTrainer`` on the same batch and weights.

A small random Llama-family model over SmolLM2's vocabulary becomes a transformers ``LlamaForCausalLM`` with the
same weights (``to_hf``); trl tokenizes and collates the pairs, and computes its loss with ``compute_loss``; the
same collated rows, as oneblock examples, go through ``PreferenceObjective.loss``. Both references: LoRA (trl
disables peft's adapters, oneblock switches its own off) and full fine-tuning (a separate frozen model).
"""

from __future__ import annotations

import copy

import pytest
import torch

from oneblock.adapters.apply import apply_lora, lora_modules
from oneblock.adapters.lora import LoraConfig
from oneblock.finetune.pairs import PairExample
from oneblock.finetune.preference import PreferenceObjective, pair_batch
from oneblock.finetune.tokenize import Example
from oneblock.train.config import TrainConfig

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

BETA = 0.3
PAIRS = [
    {"prompt": "Ship 7 lamps from Oslo to Lima.", "chosen": "SHIP:Oslo>Lima:lamps:7",
     "rejected": "7 lamps will be shipped from Oslo to Lima."},
    {"prompt": "Send 12 kettles to Quito from Dakar.", "chosen": "SHIP:Dakar>Quito:kettles:12",
     "rejected": "Sure! 12 kettles go to Quito."},
    {"prompt": "From Perth, deliver 3 drums to Cairo.", "chosen": "SHIP:Perth>Cairo:drums:3",
     "rejected": "3 drums, Perth to Cairo."},
]  # fmt: skip


def tiny_model(seed: int = 0):
    from oneblock.models import build_model
    from oneblock.presets import get_preset

    cfg = get_preset("smollm2-135m").replace(d_model=48, n_heads=3, n_kv_heads=1, n_layers=2, d_ff=64,
                                             max_seq_len=128)  # fmt: skip
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():  # sizeable weights, so that log-probabilities and their ratios are far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.float().eval()


def hf_tokenizer(smol_tokenizer):
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=smol_tokenizer.tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def trl_loss(policy, ref, tokenizer, tmp_path, adapter=None):
    """trl's loss and metrics on one batch of all the pairs, and that batch. With ``adapter`` (a peft directory),
    trl adds a new adapter to ``policy`` (its reference: the adapters disabled), then takes that one's weights."""
    from safetensors.torch import load_file

    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=BETA, report_to="none", use_cpu=True,
                         per_device_train_batch_size=len(PAIRS), max_length=None, bf16=False)  # fmt: skip
    peft_config = None if adapter is None else peft.LoraConfig.from_pretrained(str(adapter))
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(PAIRS), peft_config=peft_config)  # fmt: skip
    if adapter is not None:  # the adapter after some training: trl's reference stays the base
        result = peft.set_peft_model_state_dict(trainer.model, load_file(str(adapter / "adapter_model.safetensors")))
        assert not result.unexpected_keys
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), metrics, batch


def as_pairs(batch) -> list[PairExample]:
    """trl's collated rows (chosen rows, then rejected rows) as oneblock pairs."""
    rows = []
    for ids, real, completion in zip(batch["input_ids"], batch["attention_mask"], batch["completion_mask"],
                                     strict=True):  # fmt: skip
        keep = real.bool()
        rows.append(Example(tuple(ids[keep].tolist()), tuple(completion[keep].bool().tolist()), "trl"))
    n = len(rows) // 2
    return [PairExample(rows[i], rows[n + i], "trl") for i in range(n)]


def ours(model, batch, *, reference_from=None):
    cfg = TrainConfig(task="finetune", steps=1, warmup_steps=0, batch_size=len(PAIRS), seq_len=128)
    objective = PreferenceObjective(cfg, as_pairs(batch), [], model=reference_from or model, vocab_size=49152,
                                    pad_id=0, beta=BETA)  # fmt: skip
    loss, _ = objective.loss(model.train(), pair_batch(as_pairs(batch), pad_id=0))
    return float(loss.detach()), objective.step_metrics()


def check(trl_figures, our_figures):
    (theirs, metrics), (mine, mine_metrics) = trl_figures, our_figures
    assert abs(mine - theirs) <= 1e-5, (mine, theirs)
    assert abs(mine_metrics["reward_margin"] - metrics["rewards/margins"]) <= 1e-5
    assert mine_metrics["reward_accuracy"] == pytest.approx(metrics["rewards/accuracies"], abs=1e-6)
    assert abs(theirs - 0.6931) > 1e-3  # the policy differs from its reference, so the loss is not log 2


def test_dpo_loss_equals_trl_with_lora_adapters(smol_tokenizer, tmp_path):
    from oneblock.adapters.peft import save_adapter
    from oneblock.io.hf.convert import to_hf

    base = tiny_model()
    hf_base = to_hf(base).float()
    model = apply_lora(copy.deepcopy(base), LoraConfig(rank=4, alpha=8))
    torch.manual_seed(1)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B.weight.normal_(0, 0.5)  # a trained adapter, so that the policy leaves the base
    save_adapter(model, tmp_path / "adapter", cfg=LoraConfig(rank=4, alpha=8), base="tiny")
    theirs, metrics, batch = trl_loss(hf_base, None, hf_tokenizer(smol_tokenizer), tmp_path, tmp_path / "adapter")
    check((theirs, metrics), ours(model, batch))


def test_dpo_loss_equals_trl_with_a_frozen_reference(smol_tokenizer, tmp_path):
    from oneblock.io.hf.convert import to_hf

    reference = tiny_model()
    model = copy.deepcopy(reference)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # the policy after some training
    theirs, metrics, batch = trl_loss(to_hf(model).float(), to_hf(reference).float(), hf_tokenizer(smol_tokenizer),
                                      tmp_path)  # fmt: skip
    check((theirs, metrics), ours(model, batch, reference_from=reference))
