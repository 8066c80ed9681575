"""``POST /v1/responses`` with the ``openai`` client's ``responses.create``: the text equals the chat completion of
the same conversation at temperature 0, whole and streamed (OpenAI's typed events, in order), ``instructions``,
``max_output_tokens`` (an ``incomplete`` response), ``text.format`` with a JSON schema and function tools on
SmolLM2, refusals by name, and the error events of a stream the server ends at shutdown."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator

import httpx
import openai
import pytest
from serve_testing import KEY, Running, slow_engine, smollm2_engine, tiny_model

from oneblock.serve.engine import Engine
from oneblock.text.tokenizer import ByteTokenizer

HEADERS = {"Authorization": f"Bearer {KEY}"}
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny() -> Iterator[Running]:
    running = Running(Engine(tiny_model(), ByteTokenizer(), max_batch=4), api_key=KEY)
    yield running
    running.close()


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Running]:
    running = Running(smollm2_engine(), api_key=KEY, model_name="SmolLM2-135M-Instruct")
    yield running
    running.close()


def client(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=KEY, max_retries=0, timeout=120)


def chat(running: Running, messages: list, **options) -> openai.types.chat.ChatCompletion:
    return client(running).chat.completions.create(model="m", messages=messages, temperature=0, **options)


def events_of(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_a_text_input_answers_as_the_chat_completion_of_it(tiny):
    answer = client(tiny).responses.create(model="m", input="Hello there", max_output_tokens=30, temperature=0)
    want = chat(tiny, [{"role": "user", "content": "Hello there"}], max_tokens=30)
    assert answer.output_text == want.choices[0].message.content and len(answer.output_text) > 0
    assert answer.object == "response" and answer.id.startswith("resp_") and answer.model == "m"
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    [item] = answer.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert answer.usage.input_tokens == want.usage.prompt_tokens and answer.usage.output_tokens == 30
    assert answer.usage.total_tokens == want.usage.total_tokens and answer.max_output_tokens == 30


def test_messages_with_instructions_stream_the_chat_completions_text(tiny):
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Another "}, {"type": "input_text", "text": "one"}],
        },
    ]
    want = chat(tiny, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                       {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one"}],
                max_tokens=25).choices[0].message.content  # fmt: skip
    options = {"model": "m", "input": messages, "instructions": "Be brief.", "max_output_tokens": 25, "temperature": 0}
    whole = client(tiny).responses.create(**options)
    assert whole.output_text == want and whole.instructions == "Be brief."
    events = events_of(client(tiny).responses.create(**options, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and len(deltas) > 1
    assert kinds[4 + len(deltas) :] == ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert "".join(deltas) == want == events[-4].text == events[-3].part.text == events[-2].item.content[0].text
    assert events[0].response.status == "in_progress" and events[-1].response.output_text == want
    assert events[-1].response.usage.output_tokens == 25 and events[-1].response.id == events[0].response.id


@pytest.mark.parametrize(
    ("change", "param", "match"),
    [
        ({"frobnicate": 1}, "frobnicate", "'frobnicate' is not supported by this server's /v1/responses"),
        ({"store": True}, "store", "this server stores no responses"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation as 'input'"),
        ({"max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens' must be an integer >= 1"),
        ({"temperature": 3}, "temperature", "'temperature' must be a number in [0, 2]"),
        ({"input": []}, "input", "'input' must be a string or a non-empty list"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
         "must be an 'input_text' or 'output_text' part"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]", "must be a message"),
        ({"text": {"format": {"type": "xml"}}}, "text.format", "'text.format' must be"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "'text.verbosity' is not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools", "must be a function tool"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice", "'tool_choice' must be 'none', 'auto'"),
    ],
)  # fmt: skip
def test_unsupported_fields_are_400_naming_them(tiny, change, param, match):
    body = {"model": "m", "input": "hi", **change}
    response = httpx.post(tiny.url + "/responses", json=body, headers=HEADERS, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and match in error["message"], error
    assert client(tiny).responses.create(model="m", input="hi", max_output_tokens=2).usage.output_tokens == 2


def test_after_sigterm_a_stream_past_the_grace_period_ends_with_response_failed(monkeypatch):
    running = Running(slow_engine(monkeypatch, 0.02), api_key=KEY, grace=0.5)
    try:
        stream = client(running).responses.create(model="m", input="abc", max_output_tokens=400, stream=True)
        events = []
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta":
                running.server.handle_exit(signal.SIGTERM, None)
        assert events[-2].type == "error" and events[-2].code == "server_shutting_down"
        assert "the server is shutting down" in events[-2].message
        assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
        assert events[-1].response.error.code == "server_error"
        assert not any(e.type in ("response.completed", "response.incomplete") for e in events)
    finally:
        running.close()


def test_a_json_schema_format_constrains_the_text_as_a_chat_response_format(smollm2):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    question = "Invent a person: a name and an age."
    answer = client(smollm2).responses.create(
        model="m", input=question, temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
    )  # fmt: skip
    value = json.loads(answer.output_text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and answer.status == "completed"
    want = chat(
        smollm2,
        [{"role": "user", "content": question}],
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    assert answer.output_text == want.choices[0].message.content
    assert answer.text.format.type == "json_schema"


def test_function_tools_give_function_call_items_whole_and_streamed(smollm2):
    question = "What is the weather in Paris?"
    options = {"model": "m", "input": question, "tools": [WEATHER], "tool_choice": "required", "temperature": 0,
               "parallel_tool_calls": False,
               "max_output_tokens": 64}  # fmt: skip
    answer = client(smollm2).responses.create(**options)
    [call] = answer.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city"} and answer.status == "completed"
    tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    want = chat(
        smollm2,
        [{"role": "user", "content": question}],
        tools=[tool],
        tool_choice="required",
        max_tokens=64,
        parallel_tool_calls=False,
    )
    assert [(c.function.name, c.function.arguments) for c in want.choices[0].message.tool_calls] == [
        (call.name, call.arguments)
    ]
    events = events_of(client(smollm2).responses.create(**options, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]  # fmt: skip
    assert events[4].arguments == call.arguments == events[5].item.arguments

    # The call and its output fed back: the reply equals the chat completion of the same turns.
    back = [{"role": "user", "content": question},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 degrees"}]  # fmt: skip
    reply = client(smollm2).responses.create(**{**options, "input": back, "tool_choice": "none"})
    written = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": None, "tool_calls": [written]},
             {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees"}]  # fmt: skip
    want_reply = chat(smollm2, turns, tools=[tool], tool_choice="none", max_tokens=64, parallel_tool_calls=False)
    assert reply.output[0].type == "message" and reply.output_text == want_reply.choices[0].message.content
    assert len(reply.output_text) > 0
