"""Cross-origin requests: an allow-list of origins, and a proper answer to every CORS preflight.

A web page on another origin (``http://localhost:3000``) that calls the server with JSON first sends a preflight,
``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``. For an origin in the list, it is answered 204
with ``Access-Control-Allow-Origin`` (the origin itself), ``-Methods``, ``-Headers`` (those asked for) and
``-Max-Age``, and the real requests from that origin get ``Access-Control-Allow-Origin`` and ``Vary: Origin`` on
their answers, refusals included, so the page can read them. For any other origin (every origin when the list is
empty, the default) the preflight is refused with 403, never passed on to the routes (where it would be a 401 or
405 that says nothing about origins), and the browser sends nothing else. ``*`` in the list allows any origin.
"""

from __future__ import annotations

from collections.abc import Iterable

from oneblock.errors import InputError
from oneblock.web.guards import ASGIApp, ErrorBody, Message, Receive, Scope, Send, plain_error, refuse

METHODS = "GET, POST, OPTIONS"
MAX_AGE = "600"  # seconds a browser may cache a granted preflight


def check_origin(origin: str) -> str:
    """``origin`` as a browser sends it, ``scheme://host[:port]`` without a path, or ``*``.

    Raises:
        InputError: anything else, naming the value and the form expected.
    """
    scheme, sep, rest = origin.partition("://")
    if origin != "*" and (not sep or scheme not in ("http", "https") or not rest or "/" in rest or " " in rest):
        raise InputError(
            f"a CORS origin must look like 'http://localhost:3000' (scheme, host, optional port; no path) or be '*'; "
            f"got {origin!r}"
        )
    return origin.rstrip("/")


class CORS:
    """Answer CORS preflights from ``origins`` (204) and refuse all others (403); mark the answers to requests
    from ``origins`` readable by them. ``shape`` writes a refusal's body."""

    def __init__(self, app: ASGIApp, *, origins: Iterable[str] = (), shape: ErrorBody = plain_error) -> None:
        self.app, self.shape = app, shape
        self.origins = frozenset(check_origin(o) for o in origins)

    def allows(self, origin: str) -> bool:
        return origin in self.origins or "*" in self.origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        origin = headers.get(b"origin", b"").decode("latin-1")
        if scope["method"] == "OPTIONS" and origin and b"access-control-request-method" in headers:
            await self._preflight(send, origin, headers)
            return
        if not origin or not self.allows(origin):
            await self.app(scope, receive, send)
            return

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"vary", b"Origin"),
                ]
            await send(message)

        await self.app(scope, receive, marked)

    async def _preflight(self, send: Send, origin: str, headers: dict[bytes, bytes]) -> None:
        if not self.allows(origin):
            allowed = ", ".join(sorted(self.origins)) or "none"
            message = (
                f"cross-origin requests from {origin[:100]!r} are not allowed (allowed origins: {allowed}); start "
                f"the server with {origin[:100]} among its allowed origins to allow them"
            )
            await refuse(send, 403, message, {"Vary": "Origin"}, shape=self.shape)
            return
        asked = headers.get(b"access-control-request-headers", b"authorization, content-type")
        answer = [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-allow-methods", METHODS.encode()),
            (b"access-control-allow-headers", asked),
            (b"access-control-max-age", MAX_AGE.encode()),
            (b"vary", b"Origin"),
            (b"content-length", b"0"),
        ]
        await send({"type": "http.response.start", "status": 204, "headers": answer})
        await send({"type": "http.response.body", "body": b""})
