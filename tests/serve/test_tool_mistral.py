"""The Mistral ``[TOOL_CALLS]`` tool format (``oneblock.serve.tool_mistral``) on the tiny model, whose chat
template is Mistral Nemo's tool handling (the tools before the last user message, calls as a JSON list after
``[TOOL_CALLS]``, results in ``[TOOL_RESULTS]``, call ids of 9 characters or an error) and whose vocabulary holds
the tags as special tokens, as Mistral's does, through the ``openai`` client."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from serve_testing import Running
from tool_testing import (
    AUTO,
    DAY,
    NONE,
    QUESTION,
    RESULT,
    TIME,
    ask,
    check_choices,
    check_grammar,
    check_streamed_calls,
    round_trip,
    serve,
    streamed,
    trained_tokenizer,
)

from oneblock.serve.prompts import chat_prompt
from oneblock.serve.tool_mistral import mistral_grammar, mistral_ids, read_mistral
from oneblock.serve.tool_template import MISTRAL, tool_format
from oneblock.serve.tools import parse_tools

# Mistral Nemo's template (mistralai/Mistral-Nemo-Instruct-2407), as published.
NEMO_TEMPLATE = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS][" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST]" + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST]" + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif (message.tool_calls is defined and message.tool_calls is not none) %}
        {{- "[TOOL_CALLS][" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS]{"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}"""  # noqa: E501
SPECIALS = ["</s>", "<s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]  # fmt: skip
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
TOOLS_SHOWN = (
    '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_time", "description": "The current time in a '
    'time zone", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, '
    '"required": ["zone"], "additionalProperties": false}}}, {"type": "function", "function": {"name": "get_day", '
    '"description": "Today\'s day of the week", "parameters": {"type": "object", "properties": {"short": {"type": '
    '"boolean"}}, "required": ["short"], "additionalProperties": false}}}][/AVAILABLE_TOOLS]'
)


@pytest.fixture(scope="module")
def mistral() -> Iterator[Running]:
    running = serve(NEMO_TEMPLATE, SPECIALS, bos=True)
    yield running
    running.close()


def conversation(first_id: str, second_id: str) -> list[dict]:
    """A question, two calls in one message, their results, a follow-up question."""
    calls = [
        {"id": first_id, "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
        {"id": second_id, "type": "function", "function": {"name": "get_day", "arguments": '{"short": true}'}},
    ]
    return [{"role": "system", "content": "You tell the time."}, *QUESTION,
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": first_id, "content": RESULT},
            {"role": "tool", "tool_call_id": second_id, "content": "Mon"},
            {"role": "assistant", "content": "It is 14:05 on Monday."},
            {"role": "user", "content": "And in London?"}]  # fmt: skip


def rendered(running: Running, messages: list[dict]) -> tuple[list[int], str]:
    body = {"messages": messages, "tools": [TIME, DAY], "tool_choice": "auto"}
    tok = running.engine.tokenizer
    ids = chat_prompt(body, tok, parse_tools(body)).ids
    return ids, tok.decode(ids)


def expected(first_id: str, second_id: str) -> str:
    return (
        "<s>[INST]What time is it in Paris?[/INST]"
        f'[TOOL_CALLS][{{"name": "get_time", "arguments": {{"zone": "CET"}}, "id": "{first_id}"}}, '
        f'{{"name": "get_day", "arguments": {{"short": true}}, "id": "{second_id}"}}]</s>'
        f'[TOOL_RESULTS]{{"content": 14:05, "call_id": "{first_id}"}}[/TOOL_RESULTS]'
        f'[TOOL_RESULTS]{{"content": Mon, "call_id": "{second_id}"}}[/TOOL_RESULTS]'
        f"It is 14:05 on Monday.</s>{TOOLS_SHOWN}[INST]You tell the time.\n\nAnd in London?[/INST]"
    )


def test_the_template_is_mistrals():
    assert tool_format(NEMO_TEMPLATE) == MISTRAL


def test_the_template_renders_the_tools_the_calls_and_the_results(mistral):
    ids, text = rendered(mistral, conversation("a1B2c3D4e", "Z9y8X7w6V"))
    assert text == expected("a1B2c3D4e", "Z9y8X7w6V")  # ids of 9 letters and digits are shown as sent
    answer = ask(mistral, conversation("a1B2c3D4e", "Z9y8X7w6V"), tool_choice="auto", max_tokens=4)
    assert answer.usage.prompt_tokens == len(ids)  # the server renders the same prompt


def test_other_ids_are_shown_as_9_characters_the_same_for_a_call_and_its_result(mistral):
    ids, text = rendered(mistral, conversation("call_1", "call_2"))  # the template would refuse these ids
    shown = re.findall(r'"id": "([^"]*)"', text)
    assert len(shown) == 2 and all(MISTRAL_ID.fullmatch(i) for i in shown) and shown[0] != shown[1]
    assert text == expected(*shown)  # each result carries its call's id
    assert rendered(mistral, conversation("call_1", "call_2"))[1] == text
    later = [*conversation("call_1", "call_2"), {"role": "assistant", "content": "It is 13:05."},
             {"role": "user", "content": "Thanks."}]  # fmt: skip
    assert re.findall(r'"id": "([^"]*)"', rendered(mistral, later)[1]) == shown  # the same on every turn
    answer = ask(mistral, conversation("call_1", "call_2"), tool_choice="auto", max_tokens=4)
    assert answer.usage.prompt_tokens == len(ids)


def test_the_id_mapping_keeps_valid_ids_and_never_clashes():
    mapped = mistral_ids(["call_1", "abcdefghi", "call_1x", "toolong1234"])
    assert mapped["abcdefghi"] == "abcdefghi"
    assert len(set(mapped.values())) == 4 and all(MISTRAL_ID.fullmatch(v) for v in mapped.values())
    assert mistral_ids(["call_1"]) == {"call_1": mapped["call_1"]}  # it depends on the id alone
    clash = mistral_ids(["call_1"])["call_1"]
    remapped = mistral_ids([clash, "call_1"])  # a valid id equal to call_1's first pick: call_1 gets another
    assert remapped[clash] == clash and remapped["call_1"] != clash and MISTRAL_ID.fullmatch(remapped["call_1"])


def test_the_tag_is_the_special_token_in_the_grammar():
    tok = trained_tokenizer(NEMO_TEMPLATE, SPECIALS, bos=True)
    tag_id = tok.encode("[TOOL_CALLS]", add_bos=False)
    assert tag_id == [SPECIALS.index("[TOOL_CALLS]")]
    tools = parse_tools({"tools": [TIME, DAY], "tool_choice": "required"})
    grammar = mistral_grammar(tools, tok)
    assert grammar.startswith(f'start: calls\nTEXT: /[^\\[](?s:.)*/\ncalls: <[{tag_id[0]}]> "[" call (", " call)* "]"')
    single = mistral_grammar(parse_tools({"tools": [TIME], "tool_choice": "auto", "parallel_tool_calls": False}), tok)
    assert f'calls: <[{tag_id[0]}]> "[" call "]"\n' in single and single.startswith("start: TEXT | calls\n")
    # why: beside text (auto), the tag spelled as text cannot reach the special token, so no call could begin
    from oneblock.inference.constraints import Constraint

    auto = mistral_grammar(parse_tools({"tools": [TIME, DAY], "tool_choice": "auto"}), tok)
    as_text = Constraint.lark(tok, auto.replace(f"<[{tag_id[0]}]>", '"[TOOL_CALLS]"'), eos_ids=[0]).start()
    by_id = Constraint.lark(tok, auto, eos_ids=[0]).start()
    assert bool(by_id.allowed(tok.vocab_size)[tag_id[0]]) and not bool(as_text.allowed(tok.vocab_size)[tag_id[0]])
    # a vocabulary without the token: the tag spelled as text
    plain = trained_tokenizer(NEMO_TEMPLATE, ["</s>", "<s>"], bos=True)
    assert 'calls: "[TOOL_CALLS]" "["' in mistral_grammar(tools, plain)


def test_the_grammar_lets_text_or_valid_calls_through(mistral):
    call = '{"name": "get_time", "arguments": {"zone": "UTC"}, "id": "a1B2c3D4e"}'
    day = '{"name": "get_day", "arguments": {"short": true}, "id": "Z9y8X7w6V"}'
    good = ["It is noon.", f"[TOOL_CALLS][{call}]", f"[TOOL_CALLS][{call}, {day}]"]
    bad = [
        f"[TOOL_CALLS][{call.replace('UTC', 'PST')}]",  # not valid against the schema
        f"[TOOL_CALLS][{call.replace('a1B2c3D4e', 'a1B2c3D4')}]",  # an id of 8 characters
        f"[TOOL_CALLS][{call.replace('a1B2c3D4e', 'a1B2c3D4_')}]",  # not a letter or digit
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',  # no id
        f"[TOOL_CALLS][{call}][TOOL_CALLS][{day}]",
        f"[TOOL_CALLS]{call}",  # not a list
        "[INST]",  # text beginning like the tag
    ]
    check_grammar(mistral.engine.tokenizer, mistral_grammar, good, bad)


def test_tool_choice_in_its_four_forms(mistral):
    check_choices(mistral, MISTRAL_ID, "[", parallel=True)
    [choice] = ask(mistral, tool_choice="required", parallel_tool_calls=False, n=1, seed=8).choices
    assert len(choice.message.tool_calls) == 1


def test_a_streamed_call_equals_the_whole_one_with_the_models_id(mistral):
    check_streamed_calls(mistral, MISTRAL_ID)
    options = {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    whole = ask(mistral, **options).choices[0]
    _, calls, _ = streamed(mistral, **options)
    assert [c["id"] for c in calls] == [c.id for c in whole.message.tool_calls]  # the id the model wrote


def test_the_round_trip_with_the_openai_client(mistral):
    def written(call):
        name, arguments = call.function.name, call.function.arguments
        result = f'[TOOL_RESULTS]{{"content": {RESULT}, "call_id": "{call.id}"}}[/TOOL_RESULTS]'
        return f'[TOOL_CALLS][{{"name": "{name}", "arguments": {arguments}, "id": "{call.id}"}}]</s>{result}'

    round_trip(mistral, MISTRAL_ID, written)


def test_the_reader_takes_the_calls_and_their_ids_or_the_text():
    text = ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}, "id": "a1B2c3D4e"}, '
            '{"name": "get_day", "arguments": {"short": true}, "id": "a1B2c3D4e"}, '
            '{"name": "get_day", "arguments": {"short": false}}]')  # fmt: skip
    content, calls = read_mistral(text, AUTO)
    assert content is None and calls is not None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_time", '{"zone": "UTC"}'), ("get_day", '{"short": true}'), ("get_day", '{"short": false}')
    ]  # fmt: skip
    # the model's id where it wrote a fresh valid one; a repeated or missing one replaced by a made one
    assert calls[0]["id"] == "a1B2c3D4e" and len({c["id"] for c in calls}) == 3
    assert all(MISTRAL_ID.fullmatch(c["id"]) for c in calls)
    short = '[TOOL_CALLS][{"name": "get_day", "arguments": {"short": true}, "id": "short"}]'
    assert read_mistral(short, AUTO)[1][0]["id"] != "short"
    assert read_mistral(text, NONE) == (text, None)  # tool_choice "none": never a call
    for text in (
        "It is 14:05.",  # text
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"zo',  # cut short
        "[TOOL_CALLS][]",  # no call
        '[TOOL_CALLS]{"name": "get_time", "arguments": {}}',  # not a list
        '[TOOL_CALLS][{"name": "get_time"}]',  # no arguments
        '[TOOL_CALLS][{"name": "get_time", "arguments": "UTC"}]',  # arguments not an object
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}] and more',  # text after the list
        '[TOOL_CALLS][{"name": "delete_everything", "arguments": {"all": true}}]',  # not a declared tool
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC", "more": 1}}]',  # an argument not allowed
        'Checking. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',  # the tag after text
    ):
        assert read_mistral(text, AUTO) == (text, None), text
