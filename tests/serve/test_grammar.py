"""The ``grammar`` extension on completions: a Lark grammar (llguidance's dialect, ``/regex/`` terminals) that
every answer follows, on SmolLM2; a grammar that does not compile is a 400 naming ``grammar``."""

from __future__ import annotations

import re
from collections.abc import Iterator

import openai
import pytest
from serve_testing import Running, smollm2_engine

NUMBER = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,2}/\n'


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Running]:
    running = Running(smollm2_engine(), model_name="SmolLM2-135M-Instruct")
    yield running
    running.close()


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)


def test_every_sampled_answer_follows_the_grammar(smollm2):
    answer = client(smollm2).completions.create(
        model="m", prompt="What is 6 times 7?", max_tokens=24, temperature=1.0, seed=3, n=8,
        extra_body={"grammar": NUMBER},
    )  # fmt: skip
    texts = [c.text for c in answer.choices]
    assert all(re.fullmatch(r"The answer is [1-9][0-9]{0,2}\.", t) for t in texts), texts
    assert all(c.finish_reason == "stop" for c in answer.choices)
    assert len(set(texts)) > 1  # sampled, not one fixed answer


def test_alternatives_and_a_streamed_answer(smollm2):
    c = client(smollm2)
    grammar = 'start: answer " because " REASON\nanswer: "yes" | "no"\nREASON: /[a-z ]{1,20}/\n'
    whole = c.completions.create(
        model="m", prompt="Is the sky blue? ", max_tokens=32, temperature=0, extra_body={"grammar": grammar}
    )
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,20}", whole.choices[0].text), whole.choices[0].text
    chunks = c.completions.create(
        model="m", prompt="Is the sky blue? ", max_tokens=32, temperature=0, extra_body={"grammar": grammar},
        stream=True,
    )  # fmt: skip
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text


@pytest.mark.parametrize(
    ("kind", "extra", "match"),
    [
        ("text", {"grammar": "start: ((("}, "'grammar' cannot be served: the grammar Lark grammar"),
        ("text", {"grammar": "start: undefined_rule"}, "cannot be served"),
        ("text", {"grammar": NUMBER, "response_format": {"type": "json_object"}}, "send one of them"),
        ("chat", {"grammar": NUMBER}, "a Lark grammar is read on /v1/completions only"),
    ],
)
def test_a_grammar_that_cannot_be_served_is_400_naming_it(smollm2, kind, extra, match):
    c = client(smollm2)
    with pytest.raises(openai.BadRequestError) as caught:
        if kind == "text":
            c.completions.create(model="m", prompt="x", max_tokens=4, extra_body=extra)
        else:
            c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4, extra_body=extra
            )
    assert caught.value.body["param"] == "grammar" and match in caught.value.body["message"], caught.value.body
    assert c.completions.create(model="m", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def _chained_rules(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: r{i + 1} "a"\n' for i in range(n)) + f'r{n}: "b"\n'


def _nested_refs(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "string"}}}


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


@pytest.mark.parametrize(
    ("kind", "extra", "param", "match"),
    [
        ("text", {"grammar": _chained_rules(6000)}, "grammar", "has 6,002 rules; the limit is 2,000"),
        ("chat", _schema(_nested_refs(1500)), "response_format", r"nests $ref references 1,501 deep; the limit is 256"),
        ("chat", _schema({"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                     "required": [f"k{i}"]} for i in range(2100)]}),
         "response_format", "an anyOf of 2,100 branches; the limit is 1,000"),
        ("text", {"grammar": 'start: start "a"'}, "grammar", "is unsatisfiable"),
        ("chat", _schema({"$ref": "#"}), "response_format", "is unsatisfiable"),
    ],
)  # fmt: skip
def test_a_grammar_past_a_bound_or_without_a_sentence_is_a_short_400_and_the_server_goes_on(
    smollm2, kind, extra, param, match
):
    c = client(smollm2)
    with pytest.raises(openai.BadRequestError) as caught:
        if kind == "text":
            c.completions.create(model="m", prompt="x", max_tokens=4, extra_body=extra)
        else:
            c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4, extra_body=extra
            )
    body = caught.value.body
    assert body["param"] == param and match in body["message"] and len(body["message"]) < 400, body
    assert c.completions.create(model="m", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
