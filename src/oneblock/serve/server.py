"""Running the server: bind, serve with uvicorn, stop gracefully.

The transport is ``oneblock.web.transport``'s, as the explorer's: a connection must send its request line and
headers within ``header_seconds`` (a stalled or hostile one is closed), at most ``max_connections`` are open at
once, and an idle keep-alive connection is closed after 5 s; a body must arrive within ``Limits.body_seconds``.

Ctrl-C or SIGTERM stops accepting connections and requests at once; requests in flight get ``grace`` seconds to
finish (the engine keeps decoding them), then the engine ends the rest with an error (a stream gets an error
event and ``data: [DONE]``), and the process exits with status 0.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import uvicorn

from oneblock.inference.embedding import SentenceEncoder
from oneblock.serve.app import Limits, create_app
from oneblock.serve.engine import Engine
from oneblock.web.guards import HostPolicy
from oneblock.web.sockets import bind, is_loopback, url_of
from oneblock.web.transport import HEADER_SECONDS, check_bind_host, server_config

ENDING_SECONDS = 5  # after the grace period: time for the error events to reach the clients before uvicorn cancels


class GracefulServer(uvicorn.Server):
    """uvicorn's server, told when shutdown begins, and exiting normally on the signal that stopped it (uvicorn
    raises the signal again after its shutdown, which would turn SIGTERM into a killed process)."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_stop = on_stop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a signal is how this server is meant to stop
        self.on_stop()

    async def shutdown(self, sockets: Any = None) -> None:
        self.on_stop()
        await super().shutdown(sockets)


def max_connections_of(engine: Engine) -> int:
    """The default bound on open connections: four per request the engine may hold, running or waiting."""
    return 4 * (engine.max_batch + engine.max_queue)


def make_server(
    app: Any, engine: Engine, *, grace: float, max_connections: int | None = None,
    header_seconds: float = HEADER_SECONDS,
) -> GracefulServer:  # fmt: skip
    """A uvicorn server for ``app``: bounded connections, a deadline for request heads, ``grace`` seconds for the
    requests in flight when it stops (then the engine ends them)."""
    config = server_config(
        app, max_connections=max_connections or max_connections_of(engine), header_seconds=header_seconds,
        graceful_seconds=math.ceil(grace) + ENDING_SECONDS,
    )  # fmt: skip
    return GracefulServer(config, lambda: engine.stop(grace))


def serve(
    engine: Engine,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    embedder: SentenceEncoder | None = None,
    api_key: str | None = None,
    limits: Limits | None = None,
    grace: float = 10.0,
    max_connections: int | None = None,
    header_seconds: float = HEADER_SECONDS,
    cors_origins: Sequence[str] = (),
) -> None:
    """Serve until Ctrl-C or SIGTERM; prints the URL first, and a warning when ``host`` is not loopback.

    On a loopback ``host`` only requests addressed to a loopback name and the bound port are answered (against
    DNS rebinding); off loopback any ``Host`` is, and the API key is the protection.
    """
    check_bind_host(host)
    loopback = is_loopback(host)
    if not loopback:
        key = "requests need the API key" if api_key else "no API key is set (--api-key)"
        print(f"warning: serving on {host}, reachable from other machines; {key}", file=sys.stderr)
    sock = bind(host, port)
    hosts = HostPolicy(host, sock.getsockname()[1]) if loopback else None
    app = create_app(
        engine, model_name=model_name, embedder=embedder, api_key=api_key, hosts=hosts, limits=limits,
        cors_origins=cors_origins,
    )  # fmt: skip
    print(f"oneblock serve: {model_name} at {url_of(sock)}v1 (Ctrl-C stops)", flush=True)
    server = make_server(app, engine, grace=grace, max_connections=max_connections, header_seconds=header_seconds)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close(grace)
