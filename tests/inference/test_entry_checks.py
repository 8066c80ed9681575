"""Bad arguments at the entry of generation are oneblock errors naming the value."""

from __future__ import annotations

import pytest
import torch

from oneblock import ModelConfig, build_model
from oneblock.errors import InputError
from oneblock.inference.generation import generate


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=1, max_seq_len=16)).eval()


def test_float_prompt_ids_are_refused(model):
    with pytest.raises(InputError, match=r"prompt_ids must be integer ids or a list of id lists; got \[1\.5, 2\.0\]"):
        generate(model, [1.5, 2.0], 3)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_the_generator_cannot_hold_is_refused(model, seed):
    with pytest.raises(InputError, match=rf"seed must lie in \[-2\*\*63, 2\*\*64\); got {seed}"):
        generate(model, [1, 2], 3, seed=seed)


def test_the_largest_seed_works(model):
    out = generate(model, [1, 2], 3, seed=2**64 - 1, temperature=1.0)
    assert out.shape == (5,)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([True, False, True], r"must hold integer token ids, not booleans; got \[True, False, True\]"),
        ([1, True], r"not booleans; got \[1, True\]"),
        ([[1, 2], [True]], "prompts must hold integer token ids; got True"),
        (torch.tensor([True, False]), "must hold integer token ids; got dtype torch.bool"),
    ],
)
def test_boolean_prompt_ids_are_refused(model, prompt, match):
    with pytest.raises(InputError, match=match):
        generate(model, prompt, 2)
    assert generate(model, [1, 0, 1], 2).shape == (5,)  # integer ids still run


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.int64, "float16", torch.complex64])
def test_load_model_refuses_a_dtype_that_is_not_floating_point(dtype):
    from oneblock.inference.load import load_model

    with pytest.raises(InputError, match=r"dtype must be a floating-point torch\.dtype .* got "):
        load_model("lesson", dtype=dtype)


def test_load_model_in_a_floating_dtype_still_works():
    from oneblock.inference.load import load_model

    loaded = load_model("lesson", dtype=torch.float16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float16}
