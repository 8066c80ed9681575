"""Chat templates: the Jinja programs that turn a conversation into the one string a chat model was trained on.

A template comes from a downloaded file, so it is untrusted code: it runs in Jinja's immutable sandbox with every
operation that builds a string or list bounded before it runs (``oneblock.text.template_bounds``), under a
time limit (``MAX_SECONDS`` of the rendering thread's CPU time, checked on every line the template executes, so
an empty loop of 10^10 turns stops too, while a busy machine that keeps the thread waiting does not trip it) and
an output limit (``MAX_CHARS``). The template itself is at most ``MAX_TEMPLATE_CHARS`` long (published
ones are under 20 KB), its compilation is timed (``MAX_COMPILE_SECONDS``), and it is compiled once per process for
each distinct text (a chat renders every turn). Whatever goes wrong inside (``{{ 1/0 }}``, a recursive macro, a
template that does not parse) is an ``InputError``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from oneblock.errors import InputError
from oneblock.text.template_bounds import MAX_CHARS, TooLarge, bounded_concat, bounded_environment

MAX_SECONDS = 2.0
MAX_COMPILE_SECONDS = 2.0
MAX_TEMPLATE_CHARS = 65_536
__all__ = ["MAX_CHARS", "MAX_COMPILE_SECONDS", "MAX_SECONDS", "MAX_TEMPLATE_CHARS", "render_chat"]


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
        **variables: further names the template reads, e.g. ``bos_token``, ``eos_token``, ``tools``; ``tools``
            and ``documents`` are ``None`` unless given, as ``transformers`` passes them (a template's
            ``tools is not none`` is then false, as it was written against).

    Raises:
        InputError: if a message is not a mapping with ``role`` and ``content``, the template raises or fails, or
            it exceeds the time or output limit.
    """
    import jinja2

    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise InputError(f"message {i} must be a mapping with 'role' and 'content'; got {message!r}")
    if not isinstance(template, str):
        raise InputError(f"the chat template must be a str; got {type(template).__name__}")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise InputError(
            f"the chat template is {len(template):,} characters long; the limit is {MAX_TEMPLATE_CHARS:,} "
            "(published templates are under 20,000); it is broken or hostile"
        )
    try:
        compiled = _compile(template)
        context = {"tools": None, "documents": None, **variables}
        return _render_bounded(
            compiled, messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **context
        )
    except jinja2.exceptions.TemplateError as error:
        raise InputError(f"the chat template rejected the conversation: {error}") from None
    except _TimeUp as late:
        raise InputError(
            f"the chat template {late} for more than {_seconds(late)} s; it is broken or hostile"
        ) from None
    except TooLarge as error:
        raise InputError(f"the chat template is too large to run: {error}; it is broken or hostile") from None
    except RecursionError:
        raise InputError("the chat template recursed too deeply; it is broken or hostile") from None
    except InputError:
        raise
    except Exception as error:  # e.g. ZeroDivisionError from {{ 1/0 }}: the template's own bug
        raise InputError(f"the chat template failed: {type(error).__name__}: {error}") from None


def _seconds(late: _TimeUp) -> float:
    return MAX_COMPILE_SECONDS if str(late) == "compiled" else MAX_SECONDS


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """The compiled template, once per text; compilation is stopped after ``MAX_COMPILE_SECONDS``.

    Its ``~`` is bounded by replacing the compiled module's ``str_join`` (``template_bounds.bounded_concat``).
    """
    import jinja2

    def raise_exception(text: str) -> None:
        raise jinja2.exceptions.TemplateError(text)

    env = bounded_environment()
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    deadline = time.thread_time() + MAX_COMPILE_SECONDS

    def on_call(frame: Any, event: str, arg: Any) -> None:  # calls only: the lexer and parser call often
        if time.thread_time() > deadline:
            raise _TimeUp("compiled")

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        compiled = env.from_string(template)
    finally:
        sys.settrace(previous)
    namespace = compiled.root_render_func.__globals__
    namespace["str_join"] = namespace["markup_join"] = bounded_concat
    return compiled


def _render_bounded(compiled: Any, **context: Any) -> str:
    """Render under the time and output limits."""
    deadline = time.thread_time() + MAX_SECONDS

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.thread_time() > deadline:
            raise _TimeUp("ran")
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
