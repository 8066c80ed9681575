"""OpenAI's error shape and the checks every request field goes through.

Every refusal is an ``ApiError`` whose body has OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, so the ``openai`` client raises its usual exceptions (``BadRequestError`` for 400, ...). Every string is
checked as Unicode and every number as a number before it is used, so a hostile value is a 400 naming its field,
never an exception.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from oneblock.errors import InputError
from oneblock.text.checks import check_text


class ApiError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def shown(value: Any) -> str:
    """``repr(value)`` in at most 40 characters: a 401-digit integer or a megabyte string is not echoed whole."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def flag(body: Mapping[str, Any], name: str, where: str | None = None) -> bool:
    """``body[name]`` as a bool (absent or null: False); the refusal names ``where`` (default ``name``)."""
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(where or name, f"'{where or name}' must be true or false; got {shown(value)}")
    return value


def text(param: str, value: str, where: str | None = None) -> str:
    """``value`` if it is valid Unicode (a JSON ``\\ud800`` escape decodes to a lone surrogate, which no
    tokenizer can encode); the refusal names ``where`` (default: the field ``param``)."""
    try:
        return check_text(value, f"'{where or param}'")
    except InputError as error:
        raise bad(param, str(error)) from None


def number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    """``body[name]`` as a float in ``[low, high]`` (absent or null: ``default``)."""
    value = body.get(name)
    if value is None:
        return default
    # An int is compared exactly, never converted: math.isfinite(10**400) raises OverflowError.
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (finite and low <= value <= high):
        raise bad(name, f"'{name}' must be a number in [{low:g}, {high:g}]; got {shown(value)}")
    return float(value)


def integer(body: Mapping[str, Any], name: str, low: int, high: int, why: str = "") -> int | None:
    """``body[name]`` as an int in ``[low, high]``, or ``None`` when absent or null; ``why`` ends the refusal."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(name, f"'{name}' must be an integer in [{low}, {high}]{why}; got {shown(value)}")
    return value
