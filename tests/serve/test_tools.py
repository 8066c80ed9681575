"""Tools on chat completions, in the generic format (``oneblock.serve.tools``), on SmolLM2 with the ``openai``
client: the full round trip (a call, the tool's result, the final answer), streamed and not, ``tool_choice`` in
its four forms, ``parallel_tool_calls``, and refusals naming the field.

SmolLM2-135M calls the tool again when asked with ``auto`` after a result (too small to decide it has what it
needs), so the final answers here are asked for with ``tool_choice: "none"``, which constrains the answer to a
reply; the calls are checked against the tools' schemas. Whether its reply uses the tool's result, or whether it
calls or answers under ``auto``, is a near-tie that moves with the CPU's rounding: the round trip checks that the
result reaches the prompt, not the small model's reading of it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from serve_testing import Running, smollm2_engine
from tool_testing import collect

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False},
    },
}  # fmt: skip
TIME = {
    "type": "function",
    "function": {
        "name": "get_time", "description": "The current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False},
    },
}  # fmt: skip
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = "Sunny, 24 degrees Celsius"


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Running]:
    running = Running(smollm2_engine(), model_name="SmolLM2-135M-Instruct")
    yield running
    running.close()


def client(running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)


def ask(running, messages, **options):
    options = {"temperature": 0, "max_tokens": 64, "tools": [WEATHER], **options}
    return client(running).chat.completions.create(model="m", messages=messages, **options)


def streamed(running, messages, **options):
    """A streamed answer put together as the ``openai`` client's users do: content, calls and finish reason."""
    return collect(ask(running, messages, stream=True, **options))


def check_weather_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str) and len(arguments["city"]) <= 20


def test_the_full_round_trip(smollm2):
    first = ask(smollm2, QUESTION, tool_choice="required", parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    check_weather_call(call)
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    history = [*QUESTION, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": RESULT}]  # fmt: skip
    final = ask(smollm2, history, tool_choice="none")
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    assert final.choices[0].message.content and final.usage.completion_tokens > 0
    longer = [*history[:-1], {**history[-1], "content": RESULT + ", light wind from the west, no rain all day"}]
    assert ask(smollm2, longer, tool_choice="none").usage.prompt_tokens > final.usage.prompt_tokens  # rendered


def test_streamed_answers_equal_the_whole_ones(smollm2):
    whole = ask(smollm2, QUESTION, tool_choice="required").choices[0]
    content, calls, finish = streamed(smollm2, QUESTION, tool_choice="required")
    assert content == "" and finish == "tool_calls" == whole.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls)
    history = [*QUESTION, whole.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": whole.message.tool_calls[0].id, "content": RESULT}]  # fmt: skip
    reply, none, finish = streamed(smollm2, history, tool_choice="none")
    assert (
        none == []
        and finish == "stop"
        and reply == ask(smollm2, history, tool_choice="none").choices[0].message.content
    )


def test_history_is_written_in_the_answer_format(smollm2):
    from oneblock.serve.prompts import chat_prompt
    from oneblock.serve.tools import parse_tools

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = [*QUESTION, {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]  # fmt: skip
    body = {"messages": messages, "tools": [WEATHER], "tool_choice": "none"}
    tokenizer = smollm2.engine.tokenizer
    text = tokenizer.decode(chat_prompt(body, tokenizer, parse_tools(body)).ids)
    assert 'Let me look.\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}' in text
    assert f"<|im_start|>user\nThe tool get_weather returned: {RESULT}<|im_end|>" in text
    assert text.startswith("<|im_start|>system\nYou can call these tools: ") and "Do not call a tool now" in text


def test_a_named_function_is_the_one_called(smollm2):
    answer = ask(
        smollm2, QUESTION, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_sampled_calls_follow_the_schemas_and_parallel_tool_calls(smollm2):
    answer = ask(
        smollm2, QUESTION, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=5, n=6,
        parallel_tool_calls=False, max_tokens=80,
    )  # fmt: skip
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls  # one call at most
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            check_weather_call(call)
        else:
            assert (
                call.function.name == "get_time" and set(arguments) == {"zone"} and arguments["zone"] in ("UTC", "CET")
            )


@pytest.mark.parametrize(
    ("change", "param", "match"),
    [
        ({"tools": {"a": 1}}, "tools", "'tools' must be a list"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "'tools[0].function.name'"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "names 'get_weather' more than once"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "tools",
         "'tools' cannot be served (a function's parameters)"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", "'tool_choice' must be 'none', 'auto', 'required'"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be true or false"),
        ({"logprobs": True}, "logprobs", "'logprobs' with tools is not implemented"),
        ({"response_format": {"type": "json_object"}}, "response_format", "cannot be combined with tools"),
        ({"messages": [*QUESTION, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id",
         "needs a 'tool_call_id'"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
         "messages[1].tool_calls", "tool_calls must be a list of"),
        ({"functions": [{"name": "f"}]}, "functions", "send 'tools'"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(smollm2, change, param, match):
    body = {"messages": QUESTION, "tools": [WEATHER], **change}
    with pytest.raises(openai.BadRequestError) as caught:
        client(smollm2).chat.completions.create(model="m", max_tokens=4, extra_body=body, messages=body["messages"])
    assert caught.value.body["param"] == param and match in caught.value.body["message"], caught.value.body
    assert ask(smollm2, QUESTION, max_tokens=2, tools=[]).usage.completion_tokens >= 1


def test_the_generic_reader_returns_only_calls_the_request_allows():
    from oneblock.serve.tools import parse_tools, read_answer

    auto, none = parse_tools({"tools": [WEATHER, TIME]}), parse_tools({"tools": [WEATHER, TIME], "tool_choice": "none"})
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    text = json.dumps({"tool_calls": [call]})
    content, calls = read_answer(text, auto)
    assert content is None and calls is not None and calls[0]["function"]["name"] == "get_weather"
    assert read_answer(text, none) == (text, None)
    for wrong in ({"name": "delete_everything", "arguments": {}}, {"name": "get_weather", "arguments": {}}):
        other = json.dumps({"tool_calls": [call, wrong]})
        assert read_answer(other, auto) == (other, None)
