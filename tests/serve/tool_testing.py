"""Tools in a chat template's own format, on the tiny model with a byte-level BPE trained here whose chat template
is the format's: the tools, a question, the ``openai`` client's calls, and the checks every format shares."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import openai
from serve_testing import Running, tiny_model

from oneblock.io.gguf.tokenizer import GGUFTokenizer
from oneblock.serve.engine import Engine
from oneblock.serve.tools import parse_tools

TIME = {
    "type": "function",
    "function": {
        "name": "get_time", "description": "The current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False},
    },
}  # fmt: skip
DAY = {
    "type": "function",
    "function": {
        "name": "get_day", "description": "Today's day of the week",
        "parameters": {"type": "object", "properties": {"short": {"type": "boolean"}}, "required": ["short"],
                       "additionalProperties": False},
    },
}  # fmt: skip
AUTO = parse_tools({"tools": [TIME, DAY]})  # the checked tools a reader is given
NONE = parse_tools({"tools": [TIME, DAY], "tool_choice": "none"})
QUESTION = [{"role": "user", "content": "What time is it in Paris?"}]
RESULT = "14:05"
VOCAB = 640  # the model's ids; the tokenizer has at most 600
OPENAI_ID = re.compile(r"call_[0-9a-f]{24}")


def trained_tokenizer(template: str, specials: Sequence[str], *, bos: bool = False) -> GGUFTokenizer:
    """A byte-level BPE trained on the template and the tools' words; ``specials[0]`` (id 0) ends an answer,
    ``specials[1]`` (id 1) begins a text when ``bos``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    corpus = [template, json.dumps(TIME), json.dumps(DAY), '{"name": "get_time", "arguments": {"zone": "UTC"}}',
              QUESTION[0]["content"]] * 20  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    return GGUFTokenizer(tok, bos_id=1 if bos else None, eos_id=0, chat_template=template, name="trained")


def serve(template: str, specials: Sequence[str], *, bos: bool = False) -> Running:
    tokenizer = trained_tokenizer(template, specials, bos=bos)
    return Running(Engine(tiny_model(vocab_size=VOCAB, max_seq_len=1024), tokenizer, max_batch=4))


def ask(running: Running, messages: list[Any] = QUESTION, **options: Any) -> Any:
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
    options = {"temperature": 1.0, "seed": 3, "max_tokens": 160, "tools": [TIME, DAY], **options}
    return client.chat.completions.create(model="m", messages=messages, **options)


def streamed(running: Running, messages: list[Any] = QUESTION, **options: Any) -> tuple[str, list[Any], Any]:
    """A streamed answer put together as the ``openai`` client's users do: content, calls and finish reason."""
    return collect(ask(running, messages, stream=True, **options))


def collect(chunks: Any) -> tuple[str, list[Any], Any]:
    """The content, calls and finish reason of a stream of the ``openai`` client's chunks."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def check_call(call: Any, ids: re.Pattern[str] = OPENAI_ID) -> None:
    """A call of TIME or DAY whose arguments are valid against its schema, its id matching ``ids``."""
    arguments = json.loads(call.function.arguments)
    assert call.type == "function" and ids.fullmatch(call.id), call
    if call.function.name == "get_time":
        assert set(arguments) == {"zone"} and arguments["zone"] in ("UTC", "CET"), arguments
    else:
        assert call.function.name == "get_day" and set(arguments) == {"short"}
        assert isinstance(arguments["short"], bool)


def check_choices(running: Running, ids: re.Pattern[str], marker: str, *, parallel: bool) -> None:
    """``tool_choice`` in its four forms: ``required`` and a named function are valid calls (several only where
    ``parallel``), ``none`` text (not beginning with the format's ``marker``), ``auto`` either."""
    for answer in (ask(running, tool_choice="required", n=4), ask(running, tool_choice="required", n=2, seed=11)):
        for choice in answer.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
            assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
            for call in choice.message.tool_calls:
                check_call(call, ids)
    named = ask(running, tool_choice={"type": "function", "function": {"name": "get_day"}}, n=2)
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert {c.function.name for c in choice.message.tool_calls} == {"get_day"}
        for call in choice.message.tool_calls:
            check_call(call, ids)
    for choice in ask(running, tool_choice="none", max_tokens=24, n=3).choices:
        assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
        assert choice.message.content and not choice.message.content.startswith(marker[0])
    for choice in ask(running, tool_choice="auto", max_tokens=160, n=6, seed=5).choices:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            for call in choice.message.tool_calls:
                check_call(call, ids)
        else:
            assert choice.message.content and not choice.message.content.startswith(marker[0])


def round_trip(running: Running, ids: re.Pattern[str], written: Any) -> None:
    """The ``openai`` client's round trip: a call, the tool's result, the final answer (``none``: text; ``auto``:
    text or a valid call). ``written(call)`` is how the template writes the call and the result in the prompt,
    which the server's count of prompt tokens must match."""
    from oneblock.serve.prompts import chat_prompt
    from oneblock.serve.tools import parse_tools

    first = ask(running, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    [call] = first.message.tool_calls
    check_call(call, ids)
    history = [*QUESTION, first.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": RESULT}]  # fmt: skip
    final = ask(running, history, tool_choice="none", max_tokens=24)
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content and final.usage.completion_tokens > 0
    body = {"messages": history, "tools": [TIME, DAY], "tool_choice": "none"}
    tok = running.engine.tokenizer
    ids_of_prompt = chat_prompt(body, tok, parse_tools(body)).ids
    assert final.usage.prompt_tokens == len(ids_of_prompt)
    assert written(call) in tok.decode(ids_of_prompt)
    again = ask(running, history, tool_choice="auto").choices[0]
    if again.message.tool_calls:
        assert again.finish_reason == "tool_calls"
        for second in again.message.tool_calls:
            check_call(second, ids)
    else:
        assert again.message.content
    # streamed, the final answer is the whole one
    content, calls, finish = streamed(running, history, tool_choice="none", max_tokens=24, temperature=0)
    whole = ask(running, history, tool_choice="none", max_tokens=24, temperature=0).choices[0]
    assert (content, calls, finish) == (whole.message.content, [], whole.finish_reason)


def check_streamed_calls(running: Running, ids: re.Pattern[str]) -> None:
    """A streamed call equals the whole one (greedy), names, arguments and the id's shape."""
    options = {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    whole = ask(running, **options).choices[0]
    content, calls, finish = streamed(running, **options)
    assert content == "" and finish == "tool_calls" == whole.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert all(ids.fullmatch(c["id"]) for c in calls)


def accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether llguidance, holding the answer to ``grammar``, lets ``text`` (as the tokenizer splits it) through
    whole and then end."""
    from oneblock.inference.constraints import Constraint

    state = Constraint.lark(tokenizer, grammar, eos_ids=[tokenizer.eos_id]).start()
    for token in tokenizer.encode(text, add_bos=False):
        if not state.allowed(tokenizer.vocab_size)[token]:
            return False
        state.consume(token)
    return state.accepting


def check_grammar(tokenizer: Any, grammar_of: Any, good: Sequence[str], bad: Sequence[str]) -> None:
    """The format's ``auto`` grammar lets each of ``good`` through and none of ``bad``; ``required`` none of the
    texts (``good[0]``) and ``none`` none of the calls (``good[1:]``)."""
    from oneblock.serve.tools import parse_tools

    def grammar(choice: str) -> str:
        return grammar_of(parse_tools({"tools": [TIME, DAY], "tool_choice": choice}), tokenizer)

    auto = grammar("auto")
    assert [accepts(tokenizer, auto, t) for t in good] == [True] * len(good)
    assert [accepts(tokenizer, auto, t) for t in bad] == [False] * len(bad)
    assert not accepts(tokenizer, grammar("required"), good[0])
    assert accepts(tokenizer, grammar("required"), good[1])
    assert not any(accepts(tokenizer, grammar("none"), t) for t in good[1:])
    assert accepts(tokenizer, grammar("none"), good[0])
