"""Small models of the three families for the explorer, a live server on a free loopback port, and Chromium.

The models use distinct odd sizes (d_model 36, 3 heads, d_ff 37) and a byte tokenizer, so a test builds them in
milliseconds. The browser is Debian's chromium at /usr/bin/chromium, driven by Playwright; without it the browser
tests skip on a developer machine and fail in CI (``CI=true``), where the set-up installs it.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import oneblock as ob
from oneblock.explore.loading import Explorable, codec_for
from oneblock.inference.tokenizer import ByteTokenizer

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
    cfg = ob.ModelConfig(
        arch=arch, vocab_size=300, d_model=36, n_heads=3, d_ff=37, n_layers=2, max_seq_len=96, **changes
    )
    torch.manual_seed(0)
    return Explorable(ob.build_model(cfg).eval(), codec_for(ByteTokenizer()), f"tiny {arch}", "test model")


@pytest.fixture(scope="session")
def decoder() -> Explorable:
    return tiny("decoder")


@pytest.fixture(scope="session")
def encoder() -> Explorable:
    return tiny("encoder", norm_position="post")


@pytest.fixture(scope="session")
def seq2seq() -> Explorable:
    return tiny("encoder-decoder", n_decoder_layers=3)


class LiveServer:
    """uvicorn serving an app on 127.0.0.1 in a thread; ``url`` ends with a slash."""

    def __init__(self, app) -> None:
        import uvicorn

        from oneblock.explore.server import bind, url_of

        self.sock = bind("127.0.0.1", 0)
        self.url = url_of(self.sock)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
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


@pytest.fixture
def live() -> Iterator:
    """Start a server for an Explorable: ``live(explorable)`` -> LiveServer, stopped after the test."""
    from oneblock.explore.server import create_app

    servers: list[LiveServer] = []

    def start(explorable: Explorable) -> LiveServer:
        servers.append(LiveServer(create_app(explorable)))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def _missing(message: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)  # CI installs the browser: its absence there is a broken set-up, not a skip
    pytest.skip(message)


@pytest.fixture(scope="session")
def browser():
    path = CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium")
    if not path:
        _missing(
            f"Chromium not found at {CHROMIUM}; install Debian's package: sudo apt-get install -y chromium "
            "(make test does it when run as root)"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed; pip install -e '.[dev]'")
    with sync_playwright() as driver:
        chromium = driver.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    """A fresh page that records console errors and every request it makes (``page.seen``, ``page.errors``)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    tab = context.new_page()
    tab.errors = []
    tab.seen = []
    tab.on("console", lambda msg: tab.errors.append(msg.text) if msg.type == "error" else None)
    tab.on("pageerror", lambda error: tab.errors.append(str(error)))
    tab.on("request", lambda request: tab.seen.append(request.url))
    yield tab
    context.close()
