"""Fixtures of the explorer tests: small models of the three families, a live server on a free loopback port, and
Chromium.

The browser is Debian's chromium at /usr/bin/chromium, driven by Playwright; without it the browser tests skip on a
developer machine and fail in CI (``CI=true``), where the set-up installs it.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from explore_testing import CHROMIUM, CHROMIUM_ARGS, Explorable, LiveServer, tiny


@pytest.fixture(scope="session")
def decoder() -> Explorable:
    return tiny("decoder")


@pytest.fixture(scope="session")
def encoder() -> Explorable:
    return tiny("encoder", norm_position="post")


@pytest.fixture(scope="session")
def seq2seq() -> Explorable:
    return tiny("encoder-decoder", n_decoder_layers=3)


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
    path = CHROMIUM if Path(CHROMIUM).is_file() else None
    if path is None and "ONEBLOCK_CHROMIUM" not in os.environ:  # an explicit choice is not second-guessed
        path = shutil.which("chromium")
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
