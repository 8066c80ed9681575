"""Running the server: bind, serve with uvicorn, stop gracefully.

Ctrl-C or SIGTERM stops accepting connections and requests at once; requests in flight get ``grace`` seconds to
finish (the engine keeps decoding them), then the rest are ended and the process exits with status 0.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from oneblock.explore.server import bind, is_loopback, url_of
from oneblock.inference.embedding import SentenceEncoder
from oneblock.serve.app import LOOPBACK_NAMES, Limits, create_app
from oneblock.serve.engine import Engine

HEADER_BYTES = 64 * 1024  # the largest request head (line and headers) uvicorn reads


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


def make_server(app: Any, engine: Engine, *, grace: float) -> GracefulServer:
    """A uvicorn server for ``app``: bounded connections, a bounded request head, ``grace`` seconds to finish."""
    config = uvicorn.Config(
        app, log_level="warning", lifespan="off", timeout_graceful_shutdown=math.ceil(grace), timeout_keep_alive=5,
        limit_concurrency=4 * (engine.max_batch + engine.max_queue), h11_max_incomplete_event_size=HEADER_BYTES,
    )  # fmt: skip
    return GracefulServer(config, engine.refuse)


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
) -> None:
    """Serve until Ctrl-C or SIGTERM; prints the URL first, and a warning when ``host`` is not loopback."""
    loopback = is_loopback(host)
    if not loopback:
        key = "requests need the API key" if api_key else "no API key is set (--api-key)"
        print(f"warning: serving on {host}, reachable from other machines; {key}", file=sys.stderr)
    app = create_app(
        engine, model_name=model_name, embedder=embedder, api_key=api_key,
        hosts=LOOPBACK_NAMES if loopback else None, limits=limits,
    )  # fmt: skip
    sock = bind(host, port)
    print(f"oneblock serve: {model_name} at {url_of(sock)}v1 (Ctrl-C stops)", flush=True)
    server = make_server(app, engine, grace=grace)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close(grace)
