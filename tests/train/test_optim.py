"""AdamW groups (decay on Linear weight matrices only) and the warmup + cosine schedule."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from oneblock.config import ModelConfig
from oneblock.errors import ConfigError
from oneblock.models.build import build_model
from oneblock.models.heads import EncoderClassifier
from oneblock.train.optim import make_optimizer, parameter_groups
from oneblock.train.schedule import WarmupCosine


def _names(module, group) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in ids}


def test_only_linear_weight_matrices_are_decayed():
    model = build_model(ModelConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=1, max_seq_len=5))  # tied head
    decay, no_decay = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = _names(model, decay)
    assert decayed == {f"blocks.0.{m}.weight" for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                                                         "ffn.w1", "ffn.w2")}  # fmt: skip
    assert {"embed.tok.weight", "lm_head.weight", "embed.pos.weight", "final_norm.weight"} <= _names(model, no_decay)
    n_params = len(list(model.parameters()))  # a shared Parameter once
    assert len(decay["params"]) + len(no_decay["params"]) == n_params


def test_head_linears_are_decayed_too():
    encoder = build_model(ModelConfig(arch="encoder", vocab_size=7, d_model=8, n_heads=2, n_layers=1, max_seq_len=5))
    head = EncoderClassifier(encoder, 3)
    decayed = _names(head, parameter_groups(head, 0.1)[0])
    assert {"pool.weight", "out.weight"} <= decayed and "out.bias" not in decayed
    opt = make_optimizer(head, lr=1e-3, weight_decay=0.1)
    assert isinstance(opt, torch.optim.AdamW) and [g["name"] for g in opt.param_groups] == ["decay", "no_decay"]


def test_warmup_then_cosine():
    schedule = WarmupCosine(1.0, total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert [schedule(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half way down the cosine
    assert schedule(110) == pytest.approx(0.1) and schedule(500) == pytest.approx(0.1)
    lrs = [schedule(s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    assert WarmupCosine(2.0, total_steps=5)(0) == 2.0  # no warmup: full rate at once
    assert math.isclose(WarmupCosine(1.0, 10, 10)(9), 1.0)


def test_schedule_sets_every_group_and_rejects_bad_lengths():
    model = torch.nn.Linear(2, 2)
    opt = make_optimizer(model, lr=1.0, weight_decay=0.1)
    assert WarmupCosine(0.5, 10, 2).apply(opt, 0) == 0.25
    assert all(g["lr"] == 0.25 for g in opt.param_groups)
    with pytest.raises(ConfigError, match=r"warmup_steps \(20\) <= total_steps \(10\)"):
        WarmupCosine(1.0, 10, 20)
