"""OpenAI's Responses API (``POST /v1/responses``) read as a chat completion: its ``input`` (a text, or a list of
messages, function calls and their outputs), ``instructions``, ``max_output_tokens``, ``text.format`` and
function ``tools`` become the chat body that ``protocol.parse_completion`` checks, so a response is rendered,
sampled, constrained and read exactly as the chat completion of the same conversation.

Every field is honoured, accepted because its value asks for nothing (``store: false``, ``truncation:
"disabled"``, an empty ``metadata`` or ``include``), or refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oneblock.serve.checks import ApiError, bad, shown

# Fields read and honoured, then the sampling extensions chat completions accept too.
HONOURED = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "text", "tools",
    "tool_choice", "parallel_tool_calls", "user", "seed", "top_k", "min_p", "repetition_penalty", "cache_prompt",
})  # fmt: skip
# Fields accepted with the value that asks for nothing (the first is the default), refused with any other.
NO_OPS: dict[str, tuple[Any, ...]] = {
    "store": (None, False),
    "truncation": (None, "disabled"),
    "background": (None, False),
    "metadata": (None, {}),
    "include": (None, []),
    "previous_response_id": (None,),
    "reasoning": (None,),
}
WHY = {
    "store": "this server stores no responses; send 'store': false",
    "previous_response_id": "this server stores no responses; send the whole conversation as 'input'",
    "background": "responses are answered while the request waits",
    "truncation": "a conversation longer than the context is refused, never cut",
    "reasoning": "the served model has no reasoning settings",
}
# A chat field named in a refusal, as the Responses request calls it.
RENAMED = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}
ROLES = ("user", "system", "developer", "assistant")


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request as the chat completion that answers it, and the fields the response repeats.

    Attributes:
        chat: the chat completions body (``protocol.parse_completion`` checks it).
        echoed: ``instructions``, ``max_output_tokens``, ``temperature``, ``top_p``, ``tools``, ``tool_choice``,
            ``parallel_tool_calls`` and ``text`` as a response object states them.
    """

    chat: dict[str, Any]
    echoed: dict[str, Any]


def parse_responses(body: Any) -> ResponsesRequest:
    """Check a Responses request and write it as a chat completions body.

    Raises:
        ApiError: 400 naming the field: an unknown or unsupported one, an input item or content part that is
            not text, a function call or its output, a tool that is not a function, a ``text.format`` other
            than ``text``, ``json_object`` or ``json_schema``.
    """
    if not isinstance(body, dict):
        raise bad("body", f"the request body must be a JSON object; got {type(body).__name__}")
    for name, value in body.items():
        if name in HONOURED:
            continue
        if name in NO_OPS and any(value == ok and type(value) is type(ok) for ok in NO_OPS[name]):
            continue
        reason = WHY.get(name, "it is not a field this endpoint reads" if name not in NO_OPS else "only its default")
        raise bad(name, f"'{name}' is not supported by this server's /v1/responses: {reason}; leave it out")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", f"'instructions' must be a string or null; got {shown(instructions)}")
    messages = _messages(body.get("input"))
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {"messages": messages}
    for name in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "seed", "top_k", "min_p",
                 "repetition_penalty", "cache_prompt"):  # fmt: skip
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    text = body.get("text")
    response_format = _format(text)
    if response_format is not None:
        chat["response_format"] = response_format
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    echoed = {
        "instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0), "tools": tools or [],
        "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": {"format": (text or {}).get("format") or {"type": "text"}},
    }  # fmt: skip
    return ResponsesRequest(chat, echoed)


def renamed(error: ApiError) -> ApiError:
    """A refusal of the chat body, naming the Responses request's fields (``max_output_tokens``, ...)."""
    message, param = error.message, error.param
    for chat, ours in RENAMED.items():
        message = message.replace(f"'{chat}'", f"'{ours}'")
        if param is not None and param.startswith(chat):
            param = ours + param[len(chat) :]
    return ApiError(error.status, message, kind=error.kind, param=param, code=error.code, headers=error.headers)


def _messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: a text is the user's message; a list holds messages (``content`` a text or
    ``input_text``/``output_text`` parts), ``function_call`` items (consecutive ones: one assistant turn's
    calls) and ``function_call_output`` items (a tool message)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("input", f"'input' must be a string or a non-empty list of input items; got {shown(value)}")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ROLES:
            _only(item, i, {"type", "role", "content", "id", "status"})
            messages.append({"role": item["role"], "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            _only(item, i, {"type", "call_id", "name", "arguments", "id", "status"})
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad(f"input[{i}]", f"'input[{i}]', a function call, needs string 'call_id', 'name' and "
                          "'arguments'")  # fmt: skip
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _only(item, i, {"type", "call_id", "output", "id", "status"})
            if not isinstance(item.get("call_id"), str):
                raise bad(f"input[{i}]", f"'input[{i}]', a function call's output, needs a string 'call_id'")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), i)})
        else:
            raise bad(
                f"input[{i}]", f"'input[{i}]' must be a message ({{'role': one of {list(ROLES)}, 'content'}}), a "
                f"'function_call' or a 'function_call_output' item; got {shown(item)}",
            )  # fmt: skip
    return messages


def _only(item: Mapping[str, Any], i: int, known: set[str]) -> None:
    extra = sorted(set(item) - known)
    if extra:
        raise bad(f"input[{i}]", f"'input[{i}].{extra[0]}' is not supported by this server; leave it out")


def _text(content: Any, i: int) -> str:
    """A message's content: a text, or a list of ``input_text`` / ``output_text`` parts, joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
                    and isinstance(part.get("text"), str)):  # fmt: skip
                raise bad(
                    f"input[{i}].content[{j}]", f"'input[{i}].content[{j}]' must be an 'input_text' or 'output_text' "
                    f"part with a 'text' (this server reads text only); got {shown(part)}",
                )  # fmt: skip
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"input[{i}].content", f"'input[{i}].content' must be a string or a list of text parts")


def _format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as a chat's ``response_format``: ``text`` none, ``json_object``, or ``json_schema`` with
    its ``name``, ``schema``, ``description`` and ``strict`` beside ``type`` (the chat nests them)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format"}:
        extra = sorted(set(text) - {"format"}) if isinstance(text, dict) else []
        where = f"text.{extra[0]}" if extra else "text"
        raise bad(where, f"'{where}' is not supported by this server: 'text' holds only 'format'; got {shown(text)}")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object" and set(fmt) == {"type"}:
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        extra = sorted(set(fmt) - {"type", "name", "schema", "description", "strict"})
        if extra:
            raise bad("text.format", f"'text.format.{extra[0]}' is not supported by this server; leave it out")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise bad(
        "text.format", f"'text.format' must be {{'type': 'text'}}, {{'type': 'json_object'}} or {{'type': "
        f"'json_schema', 'name', 'schema'}}; got {shown(fmt)}",
    )  # fmt: skip


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools (``{"type": "function", "name", "description", "parameters", "strict"}``) as a chat's."""
    if not isinstance(tools, list):
        raise bad("tools", f"'tools' must be a list of function tools; got {shown(tools)}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad("tools", f"'tools[{i}]' must be a function tool ({{'type': 'function', 'name', 'parameters'}}"
                      f"; this server runs no built-in tools); got {shown(tool)}")  # fmt: skip
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(choice: Any) -> Any:
    """``tool_choice``: ``none``, ``auto``, ``required``, or ``{"type": "function", "name"}`` as a chat's."""
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice in ("none", "auto", "required"):
        return choice
    raise bad("tool_choice", f"'tool_choice' must be 'none', 'auto', 'required' or {{'type': 'function', 'name'}}; "
              f"got {shown(choice)}")  # fmt: skip
