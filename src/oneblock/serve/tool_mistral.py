"""The Mistral ``[TOOL_CALLS]`` tool format (Mistral Nemo's template, and Small's written like it), found as
llama.cpp finds it: the template reads ``tools`` and writes ``[TOOL_CALLS]``. The model answers with text, or with
the tag and a JSON list of calls, Nemo's way:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]

Mistral's call ids are 9 letters and digits: the model writes them, and its templates refuse any other id in an
earlier call or a ``tool`` message's ``tool_call_id``. So the ids the answer is read with are such ids (the model's
own when it wrote a fresh one), and a conversation whose ids are not (OpenAI's ``call_...``) is shown to the
template with each id mapped to one, the same for a call and its result, the same on every turn.

The tag is spelled as its token when the vocabulary holds it as one (in Mistral's, a special token).
``[TOOL_CALLS]name[ARGS]{...}`` (Mistral Small 3.1's later format) is not this one: such templates are served in
the generic format.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import string
from collections.abc import Sequence
from typing import Any

from oneblock import jsontext
from oneblock.inference.constraints import lark_literal
from oneblock.serve.template_format import Answer, TemplateFormat, json_alternatives, openai_call, start_rule
from oneblock.serve.tools import Tools

MISTRAL = "mistral"
TAG = "[TOOL_CALLS]"
ID = re.compile(r"[A-Za-z0-9]{9}")
ALPHANUMERIC = string.ascii_letters + string.digits


def is_mistral(template: str) -> bool:
    """Whether the template writes ``[TOOL_CALLS]`` followed by a JSON list (not ``[ARGS]``)."""
    return TAG in template and "[ARGS]" not in template


def mistral_grammar(tools: Tools, tokenizer: Any = None) -> str:
    """The Lark grammar of an answer: text (not beginning with ``[``), the tag and a list of calls (one unless
    ``parallel_tool_calls``; ``", "`` between calls, as the template writes them), or either, as ``tool_choice``
    allows; each call ``{"name", "arguments", "id"}``, the id 9 letters and digits."""
    identifier = {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}
    schemas = [
        {**s, "properties": {**s["properties"], "id": identifier}, "required": ["name", "arguments", "id"]}
        for s in tools.call_schemas()
    ]
    lines = ["TEXT: /[^\\[](?s:.)*/"]
    if schemas:
        tag = lark_literal(tokenizer, TAG)
        more = ' (", " call)*' if tools.parallel else ""
        lines.append(f'calls: {tag} "[" call{more} "]"')
        lines += json_alternatives("call", schemas)
    return "\n".join([start_rule(tools), *lines]) + "\n"


def new_id() -> str:
    """A random call id of 9 letters and digits."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))


def read_mistral(text: str, tools: Tools) -> Answer:
    """An answer's ``(content, tool_calls)``: an answer that begins with ``[TOOL_CALLS]`` (where the grammar puts
    it) and a list of calls of functions ``tools`` allows, as calls in OpenAI's shape, each with the id the model
    wrote (a fresh one where it wrote none, an invalid or a repeated one); any other text (the tag after text, a
    list cut short or of another shape, an undeclared function, anything under ``tool_choice: "none"``) as it
    stands."""
    if tools.choice == "none" or not text.startswith(TAG):
        return text, None
    after = text[len(TAG) :]
    try:
        listed = jsontext.loads(after.strip(), what="tool calls")
    except ValueError:
        return text, None
    if not isinstance(listed, list) or not listed:
        return text, None
    calls, seen = [], set()
    for call in listed:
        if not (isinstance(call, dict) and tools.allows(call.get("name"), call.get("arguments"))):
            return text, None
        given = call.get("id")
        call_id = given if isinstance(given, str) and ID.fullmatch(given) and given not in seen else new_id()
        seen.add(call_id)
        calls.append(openai_call(call["name"], call["arguments"], call_id))
    return None, calls


def mistral_ids(ids: Sequence[str]) -> dict[str, str]:
    """Each call id of a conversation as an id of 9 letters and digits: itself when it is one, else the first 9
    hex digits of a SHA-256 of it (rehashed on a clash), so a call and its result, on every turn, get the same."""
    mapped = {i: i for i in ids if ID.fullmatch(i)}
    taken = set(mapped.values())
    for i in ids:
        if i in mapped:
            continue
        k = 0
        while (short := hashlib.sha256(f"{k}:{i}".encode()).hexdigest()[:9]) in taken:
            k += 1
        mapped[i] = short
        taken.add(short)
    return mapped


MISTRAL_FORMAT = TemplateFormat(MISTRAL, is_mistral, mistral_grammar, read_mistral, mistral_ids)
