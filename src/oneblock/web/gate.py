"""One model computation at a time, a bounded queue, and no worker thread spent on waiting.

Starlette runs blocking work in AnyIO's thread pool (40 threads by default), the same pool that serves static
files. A handler that takes a ``threading.Lock`` inside that pool holds a thread while it waits: 40 queued
analyses and the page's own script cannot load. ``Gate`` waits on the event loop instead (polling a lock that
only the computation's thread holds), lets ``queue`` requests wait at most, answers the rest at once with
``Busy`` (a 503 with ``Retry-After``), and runs the computation in a thread that does not count against the pool's
limit.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")
POLL_SECONDS = 0.01


class Busy(Exception):
    """The gate is running one computation and ``queue`` more are waiting; try again in ``retry_after`` s."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"busy; retry after {retry_after} s")
        self.retry_after = retry_after


class Gone(Exception):
    """The client hung up while its request waited: the computation was not run."""


class Gate:
    """Run blocking computations one at a time, with at most ``queue`` waiting.

    Works from any event loop (a test client runs one per request): the lock is a ``threading.Lock`` that only
    the running computation holds, and waiters poll it with ``anyio.sleep``.

    Args:
        queue: how many requests may wait while one runs (default 1).
    """

    def __init__(self, queue: int = 1) -> None:
        if queue < 0:
            raise ValueError(f"queue must be >= 0; got {queue}")
        self.queue = queue
        self._lock = threading.Lock()  # held by the thread running the computation
        self._count = threading.Lock()  # guards ``admitted``: the running request plus the waiting ones
        self.admitted = 0
        self.last_seconds = 1.0

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the work ahead of it at the last computation's pace."""
        return max(1, math.ceil(self.last_seconds * max(self.admitted, 1)))

    async def run(self, work: Callable[[], T], *, abandoned: Callable[[], Awaitable[bool]] | None = None) -> T:
        """``work()`` in a worker thread once the gate is free.

        Args:
            work: the blocking computation.
            abandoned: asked once the gate is free; ``True`` (the client hung up) skips the work.

        Raises:
            Busy: one computation runs and ``queue`` wait already.
            Gone: ``abandoned()`` said so.
        """
        with self._count:
            if self.admitted > self.queue:
                raise Busy(self.retry_after())
            self.admitted += 1
        try:
            while not self._lock.acquire(blocking=False):
                await anyio.sleep(POLL_SECONDS)
            try:
                if abandoned is not None and await abandoned():
                    raise Gone
                start = time.perf_counter()
                # A limiter of our own: the computation never takes one of the pool's tokens from static files.
                result = await anyio.to_thread.run_sync(work, limiter=anyio.CapacityLimiter(1))
                self.last_seconds = time.perf_counter() - start
                return result
            finally:
                self._lock.release()
        finally:
            with self._count:
                self.admitted -= 1
