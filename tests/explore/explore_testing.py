"""Helpers for the explorer tests: small models of the three families, and a live server on a free loopback port.

The models use distinct odd sizes (d_model 36, 3 heads, d_ff 37) and a byte tokenizer, so a test builds them in
milliseconds. The browser is Debian's chromium at /usr/bin/chromium, driven by Playwright; without it the browser
tests skip on a developer machine and fail in CI (``CI=true``), where the set-up installs it.
"""

from __future__ import annotations

import os
import threading
import time

import torch

import oneblock as ob
from oneblock.explore.loading import Explorable, codec_for
from oneblock.text.tokenizer import ByteTokenizer

CHROMIUM = os.environ.get("ONEBLOCK_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def tiny(arch: str, **changes) -> Explorable:
    sizes = {"vocab_size": 300, "d_model": 36, "n_heads": 3, "d_ff": 37, "n_layers": 2, "max_seq_len": 96}
    cfg = ob.ModelConfig(arch=arch, **{**sizes, **changes})
    torch.manual_seed(0)
    return Explorable(ob.build_model(cfg).eval(), codec_for(ByteTokenizer()), f"tiny {arch}", "test model")


class LiveServer:
    """uvicorn serving an app on 127.0.0.1 in a thread, as ``serve`` configures it; ``url`` ends with a slash.

    ``options`` go to ``oneblock.web.transport.server_config`` (``header_seconds``, ``max_connections``).
    """

    def __init__(self, app, **options) -> None:
        import uvicorn

        from oneblock.explore.server import bind, url_of
        from oneblock.web.transport import server_config

        self.sock = bind("127.0.0.1", 0)
        self.url = url_of(self.sock)
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(server_config(app, **options))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the explore server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
