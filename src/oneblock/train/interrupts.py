"""Holding Ctrl-C back while the optimizer updates the weights.

A ``KeyboardInterrupt`` raised halfway through ``optimizer.step()`` would leave some parameters updated and others
not, and one raised just after it would leave updated weights with a step counter that does not count the update;
either way the checkpoint written on the way out could not be resumed exactly. Inside ``InterruptGuard.hold()``
a SIGINT only raises a flag; the loop checks the flag at the end of the step, when weights, counters and log agree.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class InterruptGuard:
    """Defers SIGINT during ``hold()`` blocks and remembers that it arrived.

    Only the main thread can install signal handlers; elsewhere (and where SIGINT is not handled by Python)
    ``hold`` does nothing and Ctrl-C behaves as usual.
    """

    def __init__(self) -> None:
        self.requested = False

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Run the block to its end even if Ctrl-C arrives; ``requested`` tells whether one did."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.getsignal(signal.SIGINT)
        if previous is None:  # installed outside Python: leave it alone
            yield
            return
        signal.signal(signal.SIGINT, self._note)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def check(self) -> None:
        """Raise the deferred ``KeyboardInterrupt``, if a Ctrl-C arrived during a ``hold`` block."""
        if self.requested:
            self.requested = False
            raise KeyboardInterrupt
