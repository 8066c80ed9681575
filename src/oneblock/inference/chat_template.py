"""Chat templates: the Jinja programs that turn a conversation into the one string a chat model was trained on.

A template comes from a downloaded file, so it is untrusted code: it runs in Jinja's immutable sandbox, under a
time limit (``MAX_SECONDS``, checked on every line the template executes, so an empty loop of 10^10 turns stops
too), an output limit (``MAX_CHARS``), and with ``*`` and ``**`` bounded (``"x" * 10**9`` and ``10**10**10``
would allocate or compute for ever before any limit could look). Whatever goes wrong inside (``{{ 1/0 }}``, a
recursive macro, a template that does not parse) is an ``InputError``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from oneblock.errors import InputError

MAX_SECONDS = 2.0
MAX_CHARS = 1_000_000


class _TimeUp(Exception):
    """Raised inside the template's frames when the time limit has passed."""


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    template: str,
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """Render a conversation with a Jinja chat template, as ``transformers``' ``apply_chat_template`` does.

    The template runs in Jinja's immutable sandbox (a template from a downloaded file is untrusted code), with
    ``trim_blocks`` and ``lstrip_blocks`` on, the ``loopcontrols`` extension, a ``tojson`` filter that does not
    escape HTML, and the helpers ``raise_exception(msg)`` and ``strftime_now(fmt)``.

    Args:
        messages: ``[{"role": "user", "content": "Hi"}, ...]``.
        template: the Jinja source, e.g. a file's ``tokenizer.chat_template``.
        add_generation_prompt: end with the header of an assistant turn, so the model answers next.
        **variables: further names the template reads, e.g. ``bos_token``, ``eos_token``, ``tools``.

    Raises:
        InputError: if a message is not a mapping with ``role`` and ``content``, the template raises or fails, or
            it exceeds the time or output limit.
    """
    import jinja2

    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise InputError(f"message {i} must be a mapping with 'role' and 'content'; got {message!r}")

    def raise_exception(text: str) -> None:
        raise jinja2.exceptions.TemplateError(text)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = _bounded_environment()
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
        return _render_bounded(
            compiled, messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.exceptions.TemplateError as error:
        raise InputError(f"the chat template rejected the conversation: {error}") from None
    except _TimeUp:
        raise InputError(f"the chat template ran for more than {MAX_SECONDS} s; it is broken or hostile") from None
    except RecursionError:
        raise InputError("the chat template recursed too deeply; it is broken or hostile") from None
    except InputError:
        raise
    except Exception as error:  # e.g. ZeroDivisionError from {{ 1/0 }}: the template's own bug
        raise InputError(f"the chat template failed: {type(error).__name__}: {error}") from None


def _render_bounded(compiled: Any, **context: Any) -> str:
    """Render under the time and output limits."""
    deadline = time.monotonic() + MAX_SECONDS

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _TimeUp
        return trace if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        parts, size = [], 0
        for chunk in compiled.generate(**context):
            size += len(chunk)
            if size > MAX_CHARS:
                raise InputError(f"the chat template wrote more than {MAX_CHARS:,} characters; it is broken or hostile")
            parts.append(chunk)
        return "".join(parts)
    finally:
        sys.settrace(previous)


def _bounded_environment() -> Any:
    """Jinja's immutable sandbox, with ``*`` and ``**`` refused when their result would be enormous."""
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and _is_number(left) and _is_number(right) and abs(left) > 1 and abs(right) > 1024:
                raise SecurityError(f"{left!r} ** {right!r} is too large for a chat template")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and _is_number(n) and len(seq) * n > MAX_CHARS:
                        raise SecurityError(f"a sequence of {len(seq)} repeated {n} times is too long")
            return super().call_binop(context, operator, left, right)

    return Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
