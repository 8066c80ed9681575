"""The scheduler: one thread owns the model and runs continuous batching.

Shape notation: B active requests, V vocabulary.

Requests wait in a bounded queue. Between two decoding steps the thread admits waiting requests (up to
``max_batch`` active), prefilling each alone, then runs one ``BatchDecoder.step`` for every active request and
samples each row with the request's own settings and its own ``torch.Generator``. A request leaves the batch when
it ends (its end-of-turn id, a stop string, its token budget, its time limit), or at the next step after its
client went away. What a request produces reaches its client through ``Job.emit``, called on this thread.

Because every row is computed independently of the others (see ``oneblock.inference.batch``) and each request
draws from its own generator, a seeded request produces the same tokens alone or in any batch.

One request's failure is that request's alone: an exception while prefilling it, sampling it or decoding its
text ends it with ``Failed`` (507 for memory, else 500) and the others go on. When a batched step fails, its rows
are run again one at a time, so only the row that fails again is ended (a step that raised advanced no row:
each row's keys are rewritten at the same position). Memory is bounded before anything is allocated: each
request holds at most ``max_context`` positions of cache, and ``submit`` reserves a request's positions against
``cache_positions`` (by default ``max_batch`` requests of ``max_context``), refusing with ``CacheFull`` when
the requests already running and waiting hold them; the engine refuses to start when that bound does not fit
in the machine's memory.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from oneblock.errors import InputError, OneBlockError
from oneblock.inference.batch import BatchDecoder, Slot
from oneblock.inference.sampling import Sampling
from oneblock.serve.memory import check_fits, is_out_of_memory, position_bytes
from oneblock.serve.text import StopText
from oneblock.text.tokenizer import Tokenizer

log = logging.getLogger("oneblock.serve")


@dataclass(frozen=True)
class Delta:
    """New text of a request."""

    text: str


@dataclass(frozen=True)
class Done:
    """A request's end: ``finish_reason`` is ``"stop"`` (end-of-turn id or stop string) or ``"length"`` (token
    budget or time limit); the counts are exact."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    """A request that could not be completed: the server is stopping (``status`` 503), it ran out of memory
    (507), or serving it failed (500)."""

    message: str
    status: int = 500


Event = Delta | Done | Failed


class QueueFull(Exception):
    """``max_batch`` requests are running and ``max_queue`` are waiting."""


class CacheFull(Exception):
    """The requests running and waiting hold so much of the cache budget that this one's positions do not fit."""

    def __init__(self, needed: int, free: int, budget: int) -> None:
        super().__init__(f"the request needs {needed} cache positions; {free} of {budget} are free")
        self.needed, self.free, self.budget = needed, free, budget


class Stopping(Exception):
    """The engine no longer accepts requests."""


@dataclass(eq=False)
class Job:
    """One request as the engine sees it.

    Attributes:
        prompt: the prompt's ids.
        max_new: the most tokens to generate (>= 1; fits beside the prompt in the context).
        sampling: its settings; with a seed, its own generator.
        emit: receives the request's events, on the engine's thread; ``Done`` or ``Failed`` comes last.
        stop: stop strings, matched on the text.
        eos_ids: ids that end the reply (not part of the text, not counted).
        seconds: time limit from admission; past it the request ends with ``"length"``.
    """

    prompt: list[int]
    max_new: int
    sampling: Sampling
    emit: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()
    seconds: float = float("inf")
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Filled in by the engine:
    slot: Slot | None = None
    generator: torch.Generator | None = None
    text: StopText = field(init=False)
    last: int = 0  # the last sampled id, fed at the next step
    produced: int = 0  # completion tokens so far
    deadline: float = 0.0
    held: int = 0  # cache positions reserved for it, given back when it leaves

    @property
    def positions(self) -> int:
        """Cache positions the request can fill: the prompt and every new token but the last (never fed back)."""
        return len(self.prompt) + self.max_new - 1

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step (a client that disconnected)."""
        self.cancelled.set()


class Engine:
    """Continuous batching over one model, on a thread of its own.

    Args:
        model: a pre-LN decoder-only model (see ``BatchDecoder``), in eval mode.
        tokenizer: decodes the generated ids.
        max_batch: requests decoded together at most.
        max_queue: requests waiting for a row at most; ``submit`` raises ``QueueFull`` beyond.
        max_context: positions one request may fill (prompt plus new tokens); default and upper bound: the
            model's ``max_seq_len``.
        cache_positions: cache positions the requests running and waiting may reserve together (default
            ``max_batch * max_context``); ``submit`` raises ``CacheFull`` beyond.

    Raises:
        InputError: a bound that is not a positive integer, a budget smaller than one request of ``max_context``,
            or a budget whose cache would not fit in this machine's memory.
    """

    def __init__(
        self, model: nn.Module, tokenizer: Tokenizer, *, max_batch: int = 8, max_queue: int = 32,
        max_context: int | None = None, cache_positions: int | None = None,
    ) -> None:  # fmt: skip
        self.decoder = BatchDecoder(model)
        self.tokenizer = tokenizer
        # A head wider than the vocabulary (padded for speed) must not pick ids the tokenizer cannot decode.
        self.vocab = min(tokenizer.vocab_size, self.decoder.model.config.vocab_size)
        self.max_batch, self.max_queue = _positive("max_batch", max_batch), _positive("max_queue", max_queue)
        limit = self.decoder.context
        self.max_context = min(limit, _positive("max_context", limit if max_context is None else max_context, 2))
        budget = self.max_batch * self.max_context if cache_positions is None else cache_positions
        self.cache_positions = _positive("cache_positions", budget, self.max_context)
        self.position_bytes = position_bytes(self.decoder.model)
        check_fits(self.cache_positions, self.position_bytes, self.max_context)
        self.reserved = 0  # cache positions held by the requests running and waiting
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        self.accepting = True
        self.cutoff: float | None = None  # when stopping: the moment requests still in flight are ended
        self.running = True  # False ends the thread
        self.steps = 0  # decoding steps run (each serves every active request)
        self.wake = threading.Condition()  # re-entrant: a request may leave while the thread holds it
        self.thread = threading.Thread(target=self._loop, name="oneblock-serve-engine", daemon=True)
        self.thread.start()

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
        if len(job.prompt) + job.max_new > self.context:
            raise InputError(
                f"the prompt ({len(job.prompt)} tokens) plus {job.max_new} new tokens is more than the context "
                f"({self.context})"
            )
        with self.wake:
            if not self.accepting:
                raise Stopping
            if len(self.waiting) >= self.max_queue:
                raise QueueFull
            if self.reserved + job.positions > self.cache_positions:
                raise CacheFull(job.positions, self.cache_positions - self.reserved, self.cache_positions)
            self.reserved += job.positions
            job.held = job.positions
            self.waiting.append(job)
            self.wake.notify()

    def load(self) -> tuple[int, int]:
        """(active, waiting) requests now."""
        with self.wake:
            return len(self.active), len(self.waiting)

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
        self.thread.join(timeout=max(grace, 1.0) + 5.0)
        return finished

    # -- the thread ----------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.wake:
                while self.running and not self.waiting and not self.active:
                    self.wake.wait()
                if not self.running:
                    break
                if self.cutoff is not None and time.monotonic() >= self.cutoff:
                    self._end_all("the server is shutting down and this request ran past its grace period; retry it")
                    continue
                room = self.max_batch - len(self.active)
                admitted = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
            try:
                self._run(admitted)
            except Exception as error:  # a bug of the engine itself, outside any one request: fail them all
                log.exception("serve: the engine failed")
                failed = Failed(f"internal error ({type(error).__name__}); the server's log has details")
                with self.wake:
                    for job in [*admitted, *self.active]:
                        if job.held:  # not ended yet
                            self._end(job, failed)
                    self.active = []
        with self.wake:
            self._end_all("the server is shutting down; retry the request")

    def _end_all(self, message: str) -> None:
        """End every request running or waiting with a 503 (the caller holds ``wake``)."""
        leftover, self.waiting, self.active = [*self.active, *self.waiting], collections.deque(), []
        for job in leftover:
            self._end(job, Failed(message, status=503))

    def _run(self, admitted: list[Job]) -> None:
        for job in admitted:
            self._guarded(job, self._start)
        self._retire()
        if self.active:
            self._step(list(self.active))
            self._retire()

    def _step(self, jobs: list[Job]) -> None:
        """One token for every active request; a failed batched step is retried row by row."""
        try:
            slots = [j.slot for j in jobs if j.slot is not None]  # every one: _retire dropped the others
            logits = self.decoder.step(slots, [j.last for j in jobs])  # (B, V)
        except Exception as error:
            if len(jobs) == 1:
                self._fail(jobs[0], error)
                return
            log.warning("serve: a batched step failed (%s); running its rows one at a time", type(error).__name__)
            for job in jobs:
                self._guarded(job, self._step_alone)
            self.steps += 1
            return
        self.steps += 1
        for i, job in enumerate(jobs):
            self._guarded(job, self._take, logits[i : i + 1])

    def _step_alone(self, job: Job) -> None:
        if job.slot is not None:  # ended by an earlier row's failure in some other way: nothing to step
            self._take(job, self.decoder.step([job.slot], [job.last]))

    def _guarded(self, job: Job, work: Callable[..., None], *args: Any) -> None:
        """``work(job, *args)``; an exception ends this request alone."""
        try:
            work(job, *args)
        except Exception as error:
            self._fail(job, error)

    def _fail(self, job: Job, error: Exception) -> None:
        if is_out_of_memory(error):
            log.warning("serve: a request ran out of memory: %s", error)
            kind = type(error).__name__
            message = f"the server ran out of memory for this request ({kind}); ask for fewer tokens or retry later"
            self._end(job, Failed(message, status=507))
        elif isinstance(error, OneBlockError):  # checked by the server already; a last guard
            self._end(job, Failed(str(error)))
        else:
            log.exception("serve: a request failed", exc_info=error)
            self._end(job, Failed(f"internal error ({type(error).__name__}); the server's log has details"))

    def _start(self, job: Job) -> None:
        """Prefill the request alone and sample its first token."""
        if job.cancelled.is_set():
            self._release(job)
            return
        job.slot, logits = self.decoder.prefill(job.prompt, job.max_new)
        job.generator = job.sampling.generator()
        job.text = StopText(self.tokenizer, job.stop)
        job.deadline = time.monotonic() + job.seconds
        with self.wake:
            self.active.append(job)
        self._take(job, logits[None])

    def _take(self, job: Job, logits: Tensor) -> None:
        """Sample the request's next token from its (1, V) logits; hand out its text; end it when done."""
        token = int(job.sampling.pick(logits[:, : self.vocab], job.generator)[0])
        if token in job.eos_ids:
            self._end(job, self._done(job, "stop"))
            return
        job.produced += 1
        job.last = token
        piece = job.text.push(token)
        if piece:
            job.emit(Delta(piece))
        if job.text.stopped:
            self._end(job, self._done(job, "stop"))
        elif job.produced >= job.max_new or time.monotonic() > job.deadline:
            self._end(job, self._done(job, "length"))

    def _done(self, job: Job, reason: str) -> Done:
        rest = job.text.finish()
        if rest:
            job.emit(Delta(rest))
        return Done(reason, len(job.prompt), job.produced)

    def _end(self, job: Job, event: Event) -> None:
        """The request's last event; its cache and its reservation are given back."""
        self._release(job)
        try:
            job.emit(event)
        except Exception:  # the client's side is gone in some unexpected way: nothing more to tell it
            log.exception("serve: a request's last event could not be delivered")

    def _release(self, job: Job) -> None:
        job.slot = None  # frees the cache
        with self.wake:
            self.reserved -= job.held
            job.held = 0

    def _retire(self) -> None:
        """Drop ended and cancelled requests from the batch, giving back their reservations."""
        with self.wake:
            for job in self.active:
                if job.cancelled.is_set():
                    self._release(job)
            self.active = [j for j in self.active if j.slot is not None]


def _positive(name: str, value: Any, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InputError(f"{name} must be an integer >= {least}; got {value!r}")
    return value
