"""ASGI middleware that decides whether a request may reach the app at all: who it is addressed to, what it carries.

DNS rebinding: a page on ``attacker.example`` can point that name at 127.0.0.1 and then read a local server's
answers as same-origin. Its requests still say ``Host: attacker.example:PORT``, so a server that answers only
the names it is known by (``localhost``, ``127.0.0.1``, ``[::1]``, or the host the user bound) with its own
port is out of reach. A server bound to every interface (``0.0.0.0``, ``::``) also answers IP literals and this
machine's host name: a rebinding page cannot send a numeric ``Host``.

Simple requests: a page may POST ``text/plain`` to any origin without a CORS preflight. A JSON API that
requires ``Content-Type: application/json`` (or ``application/*+json``) forces the preflight, which the server
never grants.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ErrorBody = Callable[[int, str], bytes]
"""A refusal's body from its status and message: each server answers in its own error shape."""

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::")
BODILESS = frozenset({"GET", "HEAD", "OPTIONS"})


def error_body(message: str) -> bytes:
    """The body of every refusal: ``{"error": message}``."""
    return json.dumps({"error": message}).encode()


def plain_error(status: int, message: str) -> bytes:
    """The explorer's refusal: ``{"error": message}`` whatever the status."""
    return error_body(message)


async def refuse(
    send: Send, status: int, message: str, headers: dict[str, str] | None = None, *, shape: ErrorBody = plain_error
) -> None:
    """Answer a request with ``status`` and ``shape(status, message)`` without calling the app."""
    body = shape(status, message)
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def split_host(value: str) -> tuple[str, int | None]:
    """``"[::1]:8000"`` -> ``("::1", 8000)``; ``"localhost"`` -> ``("localhost", None)``; a bad port -> ``-1``."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None if not rest else "x"
    else:
        name, sep, port_text = value.rpartition(":")
        name, port = (name, port_text) if sep else (value, None)
    if port is None:
        return name, None
    return name, int(port) if port.isdigit() and len(port) <= 5 else -1


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """Which ``Host`` headers a server bound to ``host:port`` answers.

    Args:
        host: the address the server was bound to (as the user gave it).
        port: the bound port; ``None`` accepts any port (an in-process test client has none).
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.port = port
        self.wildcard = host in WILDCARDS
        names = {*LOOPBACK_NAMES, host.strip("[]").lower()}
        if self.wildcard:
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        self.names = frozenset(names)

    def allows(self, value: str) -> bool:
        name, port = split_host(value)
        if self.port is not None and port != self.port and not (port is None and self.port == 80):
            return False
        return name in self.names or (self.wildcard and _is_ip(name))

    def describe(self) -> str:
        port = "any port" if self.port is None else f"port {self.port}"
        extra = ", an IP address" if self.wildcard else ""
        return f"{', '.join(sorted(self.names))}{extra} with {port}"


class HostCheck:
    """Refuse (400) an HTTP request whose ``Host`` header is not one ``policy`` allows; ``shape`` writes the
    refusal's body."""

    def __init__(self, app: ASGIApp, policy: HostPolicy, *, shape: ErrorBody = plain_error) -> None:
        self.app, self.policy, self.shape = app, policy, shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not self.policy.allows(host):
                shown = host[:80] if host else "(none)"
                message = f"Host {shown!r} is not this server's; use {self.policy.describe()}"
                await refuse(send, 400, message, shape=self.shape)
                return
        await self.app(scope, receive, send)


def is_json_type(value: str) -> bool:
    """``application/json`` or ``application/<anything>+json``, parameters (``; charset=utf-8``) allowed."""
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class JSONOnly:
    """Refuse (415) a request with a body-carrying method (POST, PUT, ...) not declared as JSON; ``shape`` writes
    the refusal's body."""

    def __init__(self, app: ASGIApp, *, shape: ErrorBody = plain_error) -> None:
        self.app, self.shape = app, shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in BODILESS:
            declared = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
            if not is_json_type(declared):
                shown = declared[:80] if declared else "none"
                message = f"{scope['method']} bodies must be Content-Type: application/json; got {shown}"
                await refuse(send, 415, message, shape=self.shape)
                return
        await self.app(scope, receive, send)
