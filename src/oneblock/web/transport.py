"""uvicorn's settings for oneblock's servers: few connections, a deadline for headers, hang-ups taken calmly.

uvicorn accepts every connection and waits for its request without a deadline: a thousand half-open connections
hold a thousand file descriptors and lock everyone out at the usual limit of 1024. ``GuardedH11`` closes a
connection that has not sent complete request headers within ``header_seconds`` of opening (or of its previous
response), and closes at once a connection beyond ``max_connections``; ``server_config`` also bounds keep-alive
and the size of a request's headers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol

from oneblock.errors import InputError

MAX_CONNECTIONS = 64
HEADER_SECONDS = 10.0
KEEP_ALIVE_SECONDS = 5
MAX_HEADER_BYTES = 16384


def check_bind_host(host: str, flag: str = "host") -> str:
    """``host`` if it names an address; an empty one would bind every interface, so it is refused.

    Raises:
        InputError: an empty or blank host.
    """
    if not host or not host.strip():
        raise InputError(
            f"{flag} is empty, which would listen on every network interface; give 127.0.0.1 (this machine only) "
            "or, to be reachable from other machines, 0.0.0.0 explicitly"
        )
    return host


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap.

    Both come from the ``Config`` (``header_seconds``, ``max_connections``, set by ``server_config``).
    """

    header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limit = getattr(self.config, "max_connections", MAX_CONNECTIONS)
        if len(self.connections) >= limit:
            transport.close()  # refused before it holds anything; the client sees the connection close
            return
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        seconds = getattr(self.config, "header_seconds", HEADER_SECONDS)
        self.header_timer = self.loop.call_later(seconds, self._headers_late)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_late(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # no request line and headers in time: a stalled or hostile client

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this keep-alive connection gets the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.transport is not None:
            super().connection_lost(exc)


def server_config(
    app: Any,
    *,
    max_connections: int = MAX_CONNECTIONS,
    header_seconds: float = HEADER_SECONDS,
    keep_alive_seconds: int = KEEP_ALIVE_SECONDS,
    graceful_seconds: int | None = None,
    log_level: str = "warning",
) -> Config:
    """uvicorn's ``Config`` for ``app`` with oneblock's bounds (sockets are passed to ``Server.run``).

    Args:
        app: the ASGI app.
        max_connections: open connections at once; more are closed on arrival.
        header_seconds: time a connection has to send its request line and headers.
        keep_alive_seconds: an idle keep-alive connection is closed after this.
        graceful_seconds: on shutdown, how long requests in flight may go on before uvicorn cancels them
            (``None``: until they end).
        log_level: uvicorn's own log level.
    """
    config = Config(
        app,
        http=GuardedH11,
        log_level=log_level,
        lifespan="off",
        # uvicorn answers 503 once connections reach this; ours are closed on arrival one earlier
        limit_concurrency=max_connections + 1,
        timeout_keep_alive=keep_alive_seconds,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        access_log=False,
        timeout_graceful_shutdown=graceful_seconds,
    )
    config.header_seconds = header_seconds  # type: ignore[attr-defined]
    config.max_connections = max_connections  # type: ignore[attr-defined]
    return config
