"""A request's JSON body, read with limits: bytes (before they are all read), time, nesting depth, digits (through
``oneblock.io.jsontext``, the one JSON reader), and Unicode.

Python's ``json`` recurses once per ``[`` or ``{`` (a body nested 100,000 deep raises ``RecursionError``) and
turns any run of digits into an ``int`` (past 4,300 digits a ``ValueError``; below that, quadratic time). Both are
checked before or while parsing, and every problem is one ``InputError`` that the server answers with a 400.
"""

from __future__ import annotations

import re
from typing import Any

import anyio
from starlette.requests import Request

from oneblock.errors import InputError
from oneblock.inference.text import check_text
from oneblock.io import jsontext

MAX_DEPTH = 32
MAX_DIGITS = 40  # an int64 has 19; a float's mantissa 17
BODY_SECONDS = 30.0
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


def nesting_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (brackets inside strings ignored)."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub(b"", body)):
        depth += 1 if bracket in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _checked(value: Any, where: str = "body") -> Any:
    """``value`` with every string (keys too) checked to be valid Unicode (no lone surrogates from ``\\ud800``)."""
    if isinstance(value, str):
        return check_text(value, where)
    if isinstance(value, list):
        return [_checked(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {check_text(k, f"a key of {where}"): _checked(v, f"{where}.{k}") for k, v in value.items()}
    return value


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
    value = jsontext.loads(body, what="the request body", error=InputError, max_depth=max_depth, max_digits=MAX_DIGITS)
    return _checked(value)


async def read_json(request: Request, limit: int, *, seconds: float = BODY_SECONDS) -> Any:
    """The request's JSON body, refused past ``limit`` bytes before it is all read, or after ``seconds``.

    Raises:
        InputError: too large, too slow, or refused by ``parse_json``.
    """
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise InputError(f"the request body is {declared[:20]} bytes; the limit is {limit}")
    body = bytearray()
    with anyio.move_on_after(seconds) as scope:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise InputError(f"the request body is over the limit of {limit} bytes")
    if scope.cancelled_caught:
        raise InputError(f"the request body took more than {seconds:g} s to arrive")
    return parse_json(bytes(body))
