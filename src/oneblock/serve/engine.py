"""The scheduler: one thread owns the model and runs continuous batching.

Shape notation: B active requests, V vocabulary.

Requests wait in a bounded queue. Between two decoding steps the thread admits waiting requests (up to
``max_batch`` active), prefilling each alone, then runs one ``BatchDecoder.step`` for every active request and
samples each row with the request's own settings and its own ``torch.Generator``. A request leaves the batch when
it ends (its end-of-turn id, a stop string, its token budget, its time limit), or at the next step after its
client went away. What a request produces reaches its client through ``Job.emit``, called on this thread.

Because every row is computed independently of the others (see ``oneblock.inference.batch``) and each request
draws from its own generator, a seeded request produces the same tokens alone or in any batch.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from oneblock.errors import OneBlockError
from oneblock.inference.batch import BatchDecoder, Slot
from oneblock.inference.sampling import Sampling
from oneblock.inference.tokenizer import Tokenizer
from oneblock.serve.text import StopText

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
    """A request that could not be completed: the server is stopping (``status`` 503), or the model failed (500)."""

    message: str
    status: int = 500


Event = Delta | Done | Failed


class QueueFull(Exception):
    """``max_batch`` requests are running and ``max_queue`` are waiting."""


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
    """

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, *, max_batch: int = 8, max_queue: int = 32) -> None:
        self.decoder = BatchDecoder(model)
        self.tokenizer = tokenizer
        # A head wider than the vocabulary (padded for speed) must not pick ids the tokenizer cannot decode.
        self.vocab = min(tokenizer.vocab_size, self.decoder.model.config.vocab_size)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        self.accepting = True
        self.running = True  # False ends the thread
        self.steps = 0  # decoding steps run (each serves every active request)
        self.wake = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="oneblock-serve-engine", daemon=True)
        self.thread.start()

    @property
    def context(self) -> int:
        return self.decoder.context

    def submit(self, job: Job) -> None:
        """Queue a request; it joins the batch at the next step with a free row.

        Raises:
            Stopping: the engine is shutting down.
            QueueFull: the queue holds ``max_queue`` requests already.
        """
        with self.wake:
            if not self.accepting:
                raise Stopping
            if len(self.waiting) >= self.max_queue:
                raise QueueFull
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

    def close(self, grace: float) -> bool:
        """Stop accepting; let running and waiting requests finish for up to ``grace`` seconds, then end the rest
        with ``Failed`` and stop the thread. Returns whether everything finished in time."""
        self.refuse()
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
                room = self.max_batch - len(self.active)
                admitted = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
            try:
                self._run(admitted)
            except Exception as error:  # a bug: fail the requests, keep serving
                log.exception("serve: decoding failed")
                for job in [*admitted, *self.active]:
                    self._end(job, Failed(f"internal error ({type(error).__name__}); the server's log has details"))
                with self.wake:
                    self.active = []
        with self.wake:
            leftover, self.waiting, self.active = [*self.active, *self.waiting], collections.deque(), []
        for job in leftover:
            job.emit(Failed("the server is shutting down; retry the request", status=503))

    def _run(self, admitted: list[Job]) -> None:
        for job in admitted:
            if not job.cancelled.is_set():
                self._start(job)
        self._retire()
        if not self.active:
            return
        slots = [j.slot for j in self.active if j.slot is not None]  # every one: _retire dropped the others
        logits = self.decoder.step(slots, [j.last for j in self.active])  # (B, V)
        self.steps += 1
        for i, job in enumerate(self.active):
            self._take(job, logits[i : i + 1])
        self._retire()

    def _start(self, job: Job) -> None:
        """Prefill the request alone and sample its first token."""
        try:
            job.slot, logits = self.decoder.prefill(job.prompt, job.max_new)
        except OneBlockError as error:  # checked by the server already; a last guard
            job.emit(Failed(str(error)))
            return
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
        job.slot = None  # frees the cache
        job.emit(event)

    def _retire(self) -> None:
        """Drop ended and cancelled requests from the batch."""
        with self.wake:
            self.active = [j for j in self.active if j.slot is not None and not j.cancelled.is_set()]
