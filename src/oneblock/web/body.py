"""A request's JSON body, read with limits: bytes (before they are all read), time, nesting depth, digits (through
``oneblock.jsontext``, the one JSON reader), and Unicode.

Python's ``json`` recurses once per ``[`` or ``{`` (a body nested 100,000 deep raises ``RecursionError``) and
turns any run of digits into an ``int`` (past 4,300 digits a ``ValueError``; below that, quadratic time). Both are
checked before or while parsing, and every problem is one ``InputError`` that the server answers with a 400.
"""

from __future__ import annotations

import re
from typing import Any

import anyio
from starlette.requests import Request

from oneblock import jsontext
from oneblock.errors import InputError
from oneblock.text.checks import check_text

MAX_DEPTH = 32
MAX_DIGITS = 40  # an int64 has 19; a float's mantissa 17
BODY_SECONDS = 30.0
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")
# A string (consumed whole, so digits inside it are skipped) or a number.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|-?[0-9][0-9.eE+-]*')


class BadField(InputError):
    """A value of the body refused where it stands; ``field`` is its top-level key (an API names it)."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.field = field


def nesting_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (brackets inside strings ignored)."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub(b"", body)):
        depth += 1 if bracket in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _checked(value: Any, where: str = "body", field: str | None = None) -> Any:
    """``value`` with every string (keys too) checked to be valid Unicode (no lone surrogates from ``\\ud800``).

    Raises:
        BadField: naming where the string stands (``body.messages[0].content``) and its top-level key.
    """
    try:
        if isinstance(value, str):
            return check_text(value, where)
        if isinstance(value, dict):
            for k in value:
                check_text(k, f"a key of {where}")
    except InputError as error:
        raise BadField(str(error), field) from None
    if isinstance(value, list):
        return [_checked(v, f"{where}[{i}]", field) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _checked(v, f"{where}.{k}", k if field is None else field) for k, v in value.items()}
    return value


def _long_number(body: bytes) -> str | None:
    """The key of the first number longer than the reader accepts (``None``: none, or one in an array)."""
    key, key_end = None, -1
    for token in _TOKENS.finditer(body):
        text = token.group()
        if text.startswith(b'"'):
            key, key_end = text, token.end()
            continue
        fractional = any(c in text for c in b".eE")
        if len(text) > MAX_DIGITS + (10 if fractional else 0):  # the limits ``jsontext`` is given below
            if key is None or body[key_end : token.start()].strip() != b":":
                return None
            return key[1:-1].decode("utf-8", "replace")[:64]
    return None


def parse_json(body: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """Decode a JSON body with the depth, digit and Unicode limits.

    Raises:
        InputError: not UTF-8, not JSON, nested deeper than ``max_depth``, a number too long, a lone surrogate.
    """
    depth = nesting_depth(body)
    if depth > max_depth:
        raise InputError(
            f"the request body nests arrays or objects too deeply: nested {depth} deep; the limit is {max_depth}"
        )
    try:
        value = jsontext.loads(
            body, what="the request body", error=InputError, max_depth=max_depth, max_digits=MAX_DIGITS
        )
    except InputError as error:
        name = _long_number(body) if "too long" in str(error) else None
        if name is None:
            raise
        raise BadField(str(error).replace("the request body", f"the request body's '{name}'", 1), name) from None
    return _checked(value)


class BodyTooLarge(InputError):
    """The body is larger than the server accepts (a 413 for an API that distinguishes it)."""


class BodyTooSlow(InputError):
    """The body did not arrive in time: a stalled or hostile client (a 408 for an API that distinguishes it)."""


async def read_body(request: Request, limit: int, *, seconds: float = BODY_SECONDS) -> bytes:
    """The request's body bytes, refused past ``limit`` bytes before they are all read, or after ``seconds``.

    The deadline covers the whole body: a client that sends a byte a second cannot hold its connection and a
    coroutine for longer than ``seconds``.

    Raises:
        BodyTooLarge: a ``Content-Length`` over ``limit`` (nothing is read), or more bytes than that arrived.
        BodyTooSlow: the body was not complete after ``seconds``.
    """
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise BodyTooLarge(f"the request body is {declared[:20]} bytes; the limit is {limit}")
    body = bytearray()
    with anyio.move_on_after(seconds) as scope:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise BodyTooLarge(f"the request body is over the limit of {limit} bytes")
    if scope.cancelled_caught:
        raise BodyTooSlow(f"the request body took more than {seconds:g} s to arrive")
    return bytes(body)


async def read_json(request: Request, limit: int, *, seconds: float = BODY_SECONDS) -> Any:
    """The request's JSON body: ``read_body``, then ``parse_json``.

    Raises:
        InputError: too large, too slow (the subclasses above), or refused by ``parse_json``.
    """
    return parse_json(await read_body(request, limit, seconds=seconds))
