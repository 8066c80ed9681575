"""What a chat template's own tool format is, and the pieces every such format is built from.

A format (``tool_hermes``, ``tool_mistral``, ``tool_llama3``; the registry is ``tool_template``) is four hooks:

- ``detect``: whether a template's source (already known to read the ``tools`` variable) writes calls this way,
  by the markers llama.cpp's ``common/chat.cpp`` looks for;
- ``grammar``: the Lark grammar (llguidance's dialect) of an answer, text or calls as ``tool_choice`` allows, each
  call's JSON valid against its function's schema (``%json`` with ``JSON_LAYOUT``, as ``json.dumps`` writes);
- ``read``: an answer's text as ``(content, tool_calls)`` in OpenAI's shape, or the text as it stands: a call
  only where the grammar puts one (at the start of the answer, never under ``tool_choice: "none"``), of a
  function the request allows (``Tools.allows``), so text that merely spells a call stays text;
- ``template_ids``: the ids the template is shown for the conversation's calls (most templates take any id;
  Mistral's insist on 9 letters and digits).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from oneblock.inference.constraints import JSON_LAYOUT
from oneblock.serve.tools import Tools

READS_TOOLS = re.compile(r"\btools\b")
Answer = tuple[str | None, list[dict[str, Any]] | None]


def same_ids(ids: Sequence[str]) -> dict[str, str]:
    """Every call id as the client sent it."""
    return {i: i for i in ids}


@dataclass(frozen=True)
class TemplateFormat:
    """A chat template's own tool format.

    Attributes:
        name: the format's name, ``Tools.format``.
        detect: template source -> whether the template writes calls in this format.
        grammar: ``(tools, tokenizer)`` -> the Lark grammar of an answer (the tokenizer spells special tokens).
        read: ``(answer text, tools)`` -> ``(content, tool_calls)``; ``(text, None)`` for text that holds no whole
            call where the grammar puts calls, or a call ``tools`` does not allow.
        template_ids: the conversation's call ids, in order -> the id the template is shown for each.
    """

    name: str
    detect: Callable[[str], bool]
    grammar: Callable[[Tools, Any], str]
    read: Callable[[str, Tools], Answer]
    template_ids: Callable[[Sequence[str]], dict[str, str]] = field(default=same_ids)


def openai_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """One call in OpenAI's shape: ``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``
    (an id ``call_...`` made here unless given)."""
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}  # fmt: skip


def start_rule(tools: Tools) -> str:
    """The ``start`` rule: ``TEXT`` for ``none``, ``TEXT | calls`` for ``auto``, else ``calls``."""
    return "start: " + {"none": "TEXT", "auto": "TEXT | calls"}.get(tools.choice, "calls")


def json_alternatives(rule: str, schemas: Sequence[dict[str, Any]]) -> list[str]:
    """Lark lines of ``rule``: one JSON value valid against any of ``schemas`` (``rule_0 | rule_1 | ...``)."""
    lines = [f"{rule}: " + " | ".join(f"{rule}_{k}" for k in range(len(schemas)))]
    for k, schema in enumerate(schemas):
        lines.append(f"{rule}_{k}: %json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}")
    return lines


def renamed_schema(schema: dict[str, Any], key: str) -> dict[str, Any]:
    """A call schema of ``Tools.call_schemas`` whose ``arguments`` property is called ``key`` (Llama 3's
    ``parameters``)."""
    properties = {("name" if k == "name" else key): v for k, v in schema["properties"].items()}
    return {**schema, "properties": properties, "required": ["name", key]}
