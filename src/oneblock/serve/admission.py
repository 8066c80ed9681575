"""The requests' side of the serving engine: the bounded queue, the cache positions each request reserves, refusing
and stopping. The engine's thread (``oneblock.serve.engine.Engine``) takes requests from ``waiting`` and keeps
those it runs in ``reading`` (reading their prompts) and ``active`` (decoding).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any

from oneblock.errors import InputError
from oneblock.serve.jobs import CacheFull, Job, QueueFull, Stopping


class Admission:
    """Admission and shutdown, shared with the engine's thread under ``wake``.

    Args:
        limit: the model's context.
        max_batch, max_queue, max_context, cache_positions: as ``Engine``'s.
        adapter_count: adapters a job may name (1 to ``adapter_count``; 0 is the base).

    Raises:
        InputError: a bound that is not a positive integer, or a budget smaller than one request of
            ``max_context``.
    """

    def __init__(
        self, limit: int, max_batch: int, max_queue: int, max_context: int | None, cache_positions: int | None,
        adapter_count: int,
    ) -> None:  # fmt: skip
        self.max_batch, self.max_queue = positive("max_batch", max_batch), positive("max_queue", max_queue)
        self.max_context = min(limit, positive("max_context", limit if max_context is None else max_context, 2))
        budget = self.max_batch * self.max_context if cache_positions is None else cache_positions
        self.cache_positions = positive("cache_positions", budget, self.max_context)
        self.adapter_count = adapter_count
        self.reserved = 0  # cache positions held by the requests running and waiting
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []  # decoding
        self.reading: list[Job] = []  # reading their prompts, the oldest first
        self.accepting = True
        self.cutoff: float | None = None  # when stopping: the moment requests still in flight are ended
        self.running = True  # False ends the thread
        self.wake = threading.Condition()  # re-entrant: a request may leave while the thread holds it
        self.thread: threading.Thread | None = None  # the engine's, started by it

    @property
    def context(self) -> int:
        """Positions one request may fill: its prompt plus its new tokens."""
        return self.max_context

    def submit(self, job: Job) -> None:
        """Queue a request and reserve its cache positions; it joins the batch at the next step with a free row.

        Raises:
            Stopping: the engine is shutting down.
            QueueFull: the queue holds ``max_queue`` requests already.
            CacheFull: the requests running and waiting leave too few of ``cache_positions`` for this one.
            InputError: a prompt plus ``max_new`` over ``context`` (the server checks it before).
        """
        self.submit_all([job])

    def submit_all(self, jobs: Sequence[Job]) -> None:
        """``submit`` for the choices of one request: all are queued, or none (the same exceptions)."""
        for job in jobs:
            if not 0 <= job.adapter <= self.adapter_count:
                raise InputError(f"adapter {job.adapter} is not one of this engine's (0 to {self.adapter_count})")
            if len(job.prompt) + job.max_new > self.context:
                raise InputError(
                    f"the prompt ({len(job.prompt)} tokens) plus {job.max_new} new tokens is more than the context "
                    f"({self.context})"
                )
        needed = sum(job.positions for job in jobs)
        with self.wake:
            if not self.accepting:
                raise Stopping
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull
            if self.reserved + needed > self.cache_positions:
                raise CacheFull(needed, self.cache_positions - self.reserved, self.cache_positions)
            self.reserved += needed
            for job in jobs:
                job.held = job.positions
                self.waiting.append(job)
            self.wake.notify()

    def load(self) -> tuple[int, int]:
        """(active, waiting) requests now; a request reading its prompt is active, one that has ended is not (its
        slot is given back before its last event is sent, while the loop drops it from its lists after)."""
        with self.wake:
            running = sum(j.slot is not None for j in [*self.active, *self.reading])
            return running, len(self.waiting)

    def cache_use(self) -> tuple[int, int]:
        """(positions the running requests' caches hold, positions reserved by those running and waiting)."""
        with self.wake:
            return sum(j.slot.capacity for j in self.active if j.slot is not None), self.reserved

    def refuse(self) -> None:
        """Accept no more requests (``submit`` raises ``Stopping``); the running ones go on."""
        with self.wake:
            self.accepting = False

    def stop(self, grace: float) -> None:
        """Accept no more requests; those running and waiting may finish for ``grace`` seconds, then each ends
        with ``Failed`` (503), so a stream closes with an error event rather than being cut."""
        with self.wake:
            self.accepting = False
            cutoff = time.monotonic() + grace
            self.cutoff = cutoff if self.cutoff is None else min(self.cutoff, cutoff)
            self.wake.notify()

    def close(self, grace: float) -> bool:
        """``stop(grace)``, wait for the requests to end, and stop the thread. Returns whether every request
        finished within ``grace``."""
        self.stop(grace)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(self.load()):
            time.sleep(0.02)
        finished = not any(self.load())
        with self.wake:
            self.running = False
            self.wake.notify()
        if self.thread is not None:
            self.thread.join(timeout=max(grace, 1.0) + 5.0)
        return finished


def positive(name: str, value: Any, least: int = 1) -> int:
    """``value`` when it is an integer >= ``least``; else an ``InputError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InputError(f"{name} must be an integer >= {least}; got {value!r}")
    return value
