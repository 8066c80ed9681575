"""build_model: the right family, tied weights, trainable end to end."""

import re

import pytest
import torch
from models_testing import VARIANTS, build, tokens

import oneblock as ob
from oneblock.models import build_decoder


def test_model_interfaces_and_config():
    cfg = ob.ModelConfig()
    model = ob.build_model(cfg)
    assert model.config is cfg
    assert model.lm_head.weight is model.embed.tok.weight
    untied = ob.build_model(cfg.replace(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.tok.weight
    ed = ob.build_model(cfg.replace(arch="encoder-decoder"))
    assert ed.decoder.embed.tok is ed.encoder.embed.tok and ed.decoder.lm_head.weight is ed.encoder.embed.tok.weight


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


def test_build_decoder_is_build_model_for_a_decoder_config():
    cfg = ob.ModelConfig(d_model=36, n_heads=3, d_ff=37, n_layers=2, vocab_size=101)
    torch.manual_seed(0)
    decoder = build_decoder(cfg)
    torch.manual_seed(0)
    reference = ob.build_model(cfg)
    assert isinstance(decoder, ob.Decoder) and decoder.config is cfg
    for (name, p), (_, q) in zip(decoder.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert decoder.block(1) is decoder.blocks[1]


@pytest.mark.parametrize("arch", ["encoder", "encoder-decoder"])
def test_build_decoder_refuses_other_families(arch):
    with pytest.raises(ob.errors.ConfigError, match=re.escape(f"(arch='decoder'); got arch='{arch}'")):
        build_decoder(ob.ModelConfig(arch=arch))


SKELETON_PROBE = """
import json, sys, torch
import oneblock as ob
from oneblock.models.build import build_skeleton
cfg = ob.ModelConfig(position="rope", norm="rmsnorm", ffn="swiglu", n_kv_heads=2)
model = build_skeleton(cfg)
print(json.dumps([sorted({str(t.device) for t in model.state_dict().values()}), "torch._dynamo" in sys.modules]))
"""


@pytest.mark.parametrize("arch", ["encoder", "decoder", "encoder-decoder"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_skeleton_is_the_model_in_shapes_only(arch, variant):
    from oneblock.models.build import build_skeleton

    model = build(arch, **variant)
    skeleton = build_skeleton(model.config, dtype=torch.bfloat16)
    assert type(skeleton) is type(model)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in skeleton.state_dict().items()} == shapes
    assert all(t.is_meta for t in [*skeleton.parameters(), *skeleton.buffers()])
    assert {p.dtype for p in skeleton.parameters()} == {torch.bfloat16}
    after = next(build(arch, **variant).parameters())  # the mode is gone: initialized as usual, reproducibly
    assert torch.equal(after, next(model.parameters()))
    assert after.std().item() == pytest.approx(0.02, rel=0.1)  # the token table: N(0, 0.02)


def test_a_skeleton_runs_no_initializer():
    """On the meta device an initializer (and the rotary tables' arithmetic) would run through PyTorch's Python
    reference implementations, whose first use imports torch._dynamo: seconds at every start of a loader."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    done = subprocess.run(
        [sys.executable, "-c", SKELETON_PROBE],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": src},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [["meta"], False]
