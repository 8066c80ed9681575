"""Tool calling in one generic format, for chat templates without a tool format of their own (SmolLM2's); a
template with one is served in its own format (``oneblock.serve.tool_template``).

The approach of llama.cpp's generic tool handler: the tools and the answer's format are described in the system
message, and the answer is constrained by llguidance to one JSON object, either a call of the tools or a reply:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    {"response": "It is sunny in Paris."}

each call's ``arguments`` valid against its function's ``parameters`` schema. ``tool_choice`` picks the shapes
allowed: ``auto`` both, ``required`` a call, a named function a call of that one, ``none`` a reply only (so
a model that has seen earlier calls cannot write another one as text). The conversation's earlier calls and
results are written in the same format: an assistant message's ``tool_calls`` as its ``{"tool_calls": ...}``
object, a ``tool`` message as a user message, ``The tool NAME returned: CONTENT``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oneblock import jsontext
from oneblock.serve.checks import bad, shown

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class Tools:
    """A chat's checked ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

    Attributes:
        functions: each tool's ``function`` object (``name``, ``description``, ``parameters``), in order.
        choice: ``"none"``, ``"auto"``, ``"required"``, or the one function's name that must be called.
        parallel: whether an answer may call several tools (``parallel_tool_calls``, default true).
        format: ``"generic"`` (this module's format), or the chat template's own: ``"hermes"``
            (``<tool_call>`` blocks), ``"mistral"`` (``[TOOL_CALLS]``), ``"llama3"`` (one JSON object); see
            ``oneblock.serve.tool_template``.
    """

    functions: tuple[Mapping[str, Any], ...]
    choice: str
    parallel: bool = True
    format: str = "generic"

    @property
    def active(self) -> bool:
        """Whether the answer is constrained to a call or a reply (tools were given)."""
        return bool(self.functions)

    def call_schemas(self) -> list[dict[str, Any]]:
        """The JSON schema of one call, ``{"name": ..., "arguments": {...}}``, of each tool ``choice`` allows
        (none for ``none``), its arguments valid against the function's ``parameters``."""
        if self.choice == "none":
            return []
        allowed = [f for f in self.functions if self.choice in ("auto", "required", f["name"])]
        schemas = []
        for f in allowed:
            arguments, defs = hoisted(f["name"], f.get("parameters") or {"type": "object"})
            schema = {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": arguments},
                      "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip
            schemas.append({**schema, "$defs": defs} if defs else schema)
        return schemas

    def allows(self, name: Any, arguments: Any) -> bool:
        """Whether a call read back from an answer is one this request may return: never under ``none``; a
        function ``choice`` allows; its arguments an object holding the keys its schema requires and, where the
        schema allows no others, no other key. (The grammar checked the arguments whole where it produced them.)"""
        allowed = {f["name"]: f for f in self.functions if self.choice in ("auto", "required", f["name"])}
        if self.choice == "none" or name not in allowed or not isinstance(arguments, dict):
            return False
        schema = allowed[name].get("parameters") or {}
        required = schema.get("required", [])
        if isinstance(required, list) and not set(required) <= set(arguments):
            return False
        known = schema.get("properties")
        return (
            schema.get("additionalProperties") is not False
            or not isinstance(known, dict)
            or set(arguments) <= set(known)
        )

    def schema(self) -> dict[str, Any]:
        """The JSON schema of an answer: a call of the allowed tools, a reply (``none``), or either (``auto``)."""
        reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                 "additionalProperties": False}  # fmt: skip
        if self.choice == "none":
            return reply
        calls = self.call_schemas()
        defs = {k: v for c in calls for k, v in c.pop("$defs", {}).items()}  # each function's, at the root
        array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        array.update(minItems=1, **({} if self.parallel else {"maxItems": 1}))
        call = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
                "additionalProperties": False}  # fmt: skip
        answer = {"anyOf": [call, reply]} if self.choice == "auto" else call
        return {**answer, "$defs": defs} if defs else answer

    def instructions(self) -> str:
        """What the system message says: the tools, and the answer's format."""
        listed = json.dumps([dict(f) for f in self.functions], ensure_ascii=False)
        call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]}'
        reply = '{"response": "<reply>"}'
        if self.choice == "none":
            how = f"Do not call a tool now: respond in JSON with a reply, {reply}."
        elif self.choice == "auto":
            how = (
                f"Respond in JSON, either with a call of tools, {call}, or with a reply, {reply}. Call a tool only "
                "for what you do not know yet; once a tool has returned what the user asked for, reply with it."
            )
        elif self.choice == "required":
            how = f"Respond in JSON with a call of tools: {call}."
        else:
            how = f"Respond in JSON with a call of the tool {self.choice}: {call}."
        return f"You can call these tools: {listed}\n{how}"


def hoisted(name: str, parameters: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A function's ``parameters`` as the ``arguments`` of a call schema, and the definitions that schema's root
    must hold. Parameters that refer to themselves (pydantic's ``$defs`` and ``"$ref": "#/$defs/Inner"``) would
    point at the call schema once nested in it: they become the definition ``name`` (``#/$defs/<name>``), each
    local reference ``#<pointer>`` rewritten to ``#/$defs/<name><pointer>``; other parameters stay as they are."""

    def moved(value: Any) -> Any:
        if isinstance(value, dict):
            out = {k: moved(v) for k, v in value.items()}
            ref = value.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                out["$ref"] = f"#/$defs/{name}{ref[1:]}"
            return out
        return [moved(v) for v in value] if isinstance(value, list) else value

    if '"$ref"' not in json.dumps(parameters):
        return parameters, {}
    return {"$ref": f"#/$defs/{name}"}, {name: moved(parameters)}


def parse_tools(body: Mapping[str, Any]) -> Tools | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat, checked; ``None`` without tools.

    Raises:
        ApiError: 400 naming the field: a tool that is not ``{"type": "function", "function": {"name", ...}}``,
            a repeated name, a ``tool_choice`` naming no tool, ``required`` without tools.
    """
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"'parallel_tool_calls' must be true or false; got {shown(parallel)}")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", f"'tool_choice' {shown(choice)} needs 'tools'; send the tools it may call")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad("tools", f"'tools' must be a list of at most {MAX_TOOLS} tools; got {shown(tools)}")
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise bad("tools", f"'tools' names {repeated[0]!r} more than once; tool names must be unique")
    return Tools(tuple(functions), _choice(choice, names), parallel is not False)


def _function(tool: Any, i: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict) or set(tool) - {"type", "function"}:
        raise bad("tools", f'\'tools[{i}]\' must be {{"type": "function", "function": {{...}}}}; got {shown(tool)}')
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad("tools", f"'tools[{i}].function.name' must be 1 to 64 letters, digits, '_' or '-'; got {shown(name)}")
    extra = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if extra:
        raise bad("tools", f"'tools[{i}].function.{extra[0]}' is not supported by this server; leave it out")
    if not isinstance(function.get("description", ""), str) or not isinstance(function.get("strict", False), bool):
        raise bad("tools", f"'tools[{i}].function' needs a string 'description' and a boolean 'strict'")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad("tools", f"'tools[{i}].function.parameters' must be a JSON schema object; got {shown(parameters)}")
    return {k: function[k] for k in ("name", "description", "parameters") if k in function}


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return str(choice)
    wanted = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = wanted.get("name") if isinstance(wanted, dict) else None
    if not isinstance(name, str):
        raise bad(
            "tool_choice", f"'tool_choice' must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
            f"\"function\": {{\"name\": ...}}}}; got {shown(choice)}",
        )  # fmt: skip
    if name not in names:
        raise bad("tool_choice", f"'tool_choice' names the function {name!r}, which is not among the tools {names}")
    return name


def call_ids(messages: list[Any]) -> dict[str, str]:
    """The function name of each earlier call's id (a ``tool`` message's ``tool_call_id`` names one)."""
    names = {}
    for message in messages:
        for call in (message.get("tool_calls") or []) if isinstance(message, dict) else []:
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                names[str(call.get("id"))] = str(call["function"].get("name"))
    return names


def written_calls(calls: Any, i: int) -> str:
    """An assistant message's ``tool_calls`` as the answer format writes them: ``{"tool_calls": [...]}``.

    Raises:
        ApiError: calls that are not ``[{"id", "type": "function", "function": {"name", "arguments"}}]``.
    """
    out = []
    for call in calls if isinstance(calls, list) else [None]:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str)):  # fmt: skip
            raise bad(
                f"messages[{i}].tool_calls", f"message {i}'s tool_calls must be a list of {{\"id\", \"type\": "
                f"\"function\", \"function\": {{\"name\", \"arguments\": JSON text}}}}; got {shown(calls)}",
            )  # fmt: skip
        try:
            arguments: Any = jsontext.loads(function["arguments"], what="a tool call's arguments")
        except ValueError:
            arguments = function["arguments"]  # written as the client sent it
        out.append({"name": function["name"], "arguments": arguments})
    return json.dumps({"tool_calls": out}, ensure_ascii=False)


def written_result(content: str, call_id: str, name: str | None) -> str:
    """A ``tool`` message's content as the user message that carries it: what the tool (named by the earlier
    call with that id) returned, in plain words, which a small model reads best."""
    return f"The tool {name or call_id} returned: {content}"


def read_answer(text: str, tools: Tools) -> tuple[str | None, list[dict[str, Any]] | None]:
    """An answer's ``(content, tool_calls)``: the calls in OpenAI's shape (ids made here, arguments as JSON
    text), or the reply's text; an answer cut short (not one JSON object), or with a call ``tools`` does not
    allow (``Tools.allows``), is its text as it stands."""
    try:
        answer = jsontext.loads(text, what="the model's answer")
    except ValueError:
        return text, None
    if isinstance(answer, dict) and isinstance(answer.get("response"), str):
        return answer["response"], None
    if not isinstance(answer, dict) or not isinstance(answer.get("tool_calls"), list) or not answer["tool_calls"]:
        return text, None
    if not all(isinstance(c, dict) and tools.allows(c.get("name"), c.get("arguments")) for c in answer["tool_calls"]):
        return text, None
    calls = [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
        for c in answer["tool_calls"]
    ]  # fmt: skip
    return None, calls
