"""Running a coroutine function from a test, whatever the test process's main thread is doing."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import anyio


def run_async(function: Callable[..., object], *args: object) -> object:
    """``anyio.run(function, *args)`` on a thread of its own.

    Playwright's synchronous API (the browser tests) keeps an event loop running on the main thread while its
    module-scoped browser is open, and pytest-xdist may run other modules' tests in between; a loop started on a
    fresh thread never meets it.
    """
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, function, *args).result()
