"""The native step's plan (``torch.classes.oneblock.StepPlan``): built once from named fields, checked as it is
built (a bad tensor, a missing or unknown key, an unknown format refused by name), and serving every call after.

The key lists are written once in C++ (``csrc/decode_step.h``) and once in Python (``kernels/decode_step.py``):
they agree. One plan serves many calls and two generations over distinct caches, each with the Python forward's
logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from native_testing import build, relative

from oneblock import kernels
from oneblock.inference.native_step import NativeStep
from oneblock.kernels import decode_step
from oneblock.kernels.formats import FORMATS

pytestmark = pytest.mark.skipif(kernels.backend() == "torch", reason="the native step needs the C++ library")


@pytest.fixture(scope="module")
def fields() -> decode_step.StepFields:
    plan = NativeStep.of(build("llama-style", seed=2))
    assert plan is not None
    return plan.fields


def edited(fields: decode_step.StepFields, **changes) -> decode_step.StepFields:
    """A copy of ``fields`` whose dicts can be edited without touching the original's."""
    copy = dataclasses.replace(
        fields,
        sizes=dict(fields.sizes), scalars=dict(fields.scalars), tensors=dict(fields.tensors),
        layers=[dict(layer) for layer in fields.layers], layer_sizes=[dict(s) for s in fields.layer_sizes],
        layer_formats=[dict(f) for f in fields.layer_formats or []], formats=dict(fields.formats),
    )  # fmt: skip
    return dataclasses.replace(copy, **changes)


def test_the_key_lists_of_python_and_cpp_agree():
    assert decode_step.known_keys("sizes") == list(decode_step.SIZES)
    assert decode_step.known_keys("scalars") == list(decode_step.SCALARS)
    assert decode_step.known_keys("tensors") == list(decode_step.TENSORS)
    assert decode_step.known_keys("layer_sizes") == list(decode_step.LAYER_SIZES)
    assert decode_step.known_keys("layers") == list(decode_step.LAYER_TENSORS)
    assert set(decode_step.MATRICES) < set(decode_step.LAYER_TENSORS)


def test_the_plan_holds_only_the_tensors_the_model_has(fields):
    """Llama-style: no learned positions, no biases, no options; gate and up apart."""
    assert fields.tensors.keys() == {"tok", "rope_cos", "rope_sin", "final_norm_w", "head_w"}
    norms_and_matrices = {"attn_norm_w", "q_w", "k_w", "v_w", "o_w", "ffn_norm_w", "gate_w", "up_w", "down_w"}
    assert fields.layers[0].keys() == norms_and_matrices
    assert fields.layer_formats == [{}, {}]  # float32 matrices


def test_building_refuses_a_bad_tensor_by_name(fields):
    bad = edited(fields)
    bad.layers[1]["ffn_norm_w"] = bad.layers[1]["ffn_norm_w"].double()
    with pytest.raises(RuntimeError, match=r"layer 1's ffn_norm_w must be a contiguous float32 tensor of 36 values"):
        bad.build()
    bad = edited(fields)
    bad.layers[0]["o_w"] = bad.layers[0]["o_w"][:, :-1].contiguous()
    with pytest.raises(RuntimeError, match=r"layer 0's o_w must be float32 \(N, 36\); got \[36, 35\]"):
        bad.build()
    bad = edited(fields)
    bad.tensors["head_w"] = bad.tensors["head_w"][:-1]
    with pytest.raises(RuntimeError, match="the head matrices have 100 rows together; expected 101"):
        bad.build()


def test_building_refuses_unknown_and_missing_keys_by_name(fields):
    bad = edited(fields)
    bad.layers[0]["q_proj"] = bad.layers[0].pop("q_w")
    with pytest.raises(RuntimeError, match="layer 0 has an unknown tensor 'q_proj'; the tensors are attn_norm_w, "):
        bad.build()
    with pytest.raises(RuntimeError, match="scalars has an unknown key 'temperature'"):
        edited(fields, scalars={**fields.scalars, "temperature": 0.7}).build()
    sizes = {k: v for k, v in fields.sizes.items() if k != "vocab"}
    with pytest.raises(RuntimeError, match="sizes lacks 'vocab'"):
        edited(fields, sizes=sizes).build()
    with pytest.raises(RuntimeError, match="layer 1's sizes lacks 'rope'"):
        edited(fields, layer_sizes=[{"window": 0, "rope": 1}, {"window": 0}]).build()


def test_building_refuses_an_unknown_or_misplaced_format(fields):
    with pytest.raises(RuntimeError, match="layer 0's q_w: unknown block format 99"):
        edited(fields, layer_formats=[{"q_w": 99}, {}]).build()
    with pytest.raises(RuntimeError, match="layer 1's formats gives a format to 'attn_norm_w', which is not a matrix"):
        edited(fields, layer_formats=[{}, {"attn_norm_w": FORMATS["q8_0"].ggml_type}]).build()
    with pytest.raises(RuntimeError, match="formats gives a format to 'head_b', which is not a matrix it holds"):
        edited(fields, formats={"head_b": FORMATS["q8_0"].ggml_type}).build()


def test_a_lora_update_of_a_matrix_the_layer_lacks_is_refused(fields):
    a, b = torch.zeros(2, 36), torch.zeros(36, 2)
    update = decode_step.LoraUpdate(layer=0, matrix="qkv_w", adapter=1, scale=1.0, a=a, b=b)
    with pytest.raises(RuntimeError, match="LoRA update 0: 'qkv_w' is not a matrix layer 0 has"):
        edited(fields, lora=[update]).build()


def _generate(model, plan: NativeStep, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after ``ids`` and their (steps + 1, V) logits, each generation over a cache of its own."""
    cache = model.new_cache(1, max_len=16, chunk=16)
    keys, values = [layer.k for layer in cache.layers], [layer.v for layer in cache.layers]
    with torch.inference_mode():
        logits = [plan.prompt(torch.tensor(ids), 0, cache)]
        tokens = list(ids)
        for _ in range(steps):
            tokens.append(int(logits[-1].argmax()))
            at = torch.tensor([len(tokens) - 1])
            logits.append(plan(torch.tensor(tokens[-1:]), at, at, torch.zeros(1, dtype=torch.long), keys, values)[0])
    return tokens, torch.stack(logits)


def test_one_plan_serves_many_calls_and_two_generations():
    model = build("llama-style", seed=4)
    plan = NativeStep.of(model)
    assert plan is not None
    first, first_logits = _generate(model, plan, [5, 17, 3], steps=6)
    second, second_logits = _generate(model, plan, [60, 61, 62, 9], steps=6)
    again, again_logits = _generate(model, plan, [5, 17, 3], steps=6)
    assert again == first and torch.equal(again_logits, first_logits)  # nothing of a call stays in the plan
    for tokens, logits, n in ((first, first_logits, 3), (second, second_logits, 4)):
        with torch.inference_mode():
            want = model(torch.tensor([tokens]))[0, n - 1 :]  # (steps + 1, V)
        assert relative(logits, want) <= 1e-5
