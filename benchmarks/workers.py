"""Steps taken in worker processes: each contender's model in a process of its own, one step at a time.

The parent starts a worker with a command line; the worker builds its steps, says their names (one JSON line on
its stdout) and then, for each name the parent writes to its stdin, takes that step and answers its seconds. Only
one step runs at a time, so the workers never compete for the cores, and each keeps the heap and the allocator
state its own steps left, as a user's training process has them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TextIO


class Worker:
    """A child process, ``python ARGS...``, that serves :func:`serve`'s protocol."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        ready = self.stdout.readline()
        if not ready:
            raise RuntimeError(f"worker {' '.join(args)} exited with {self.process.wait()} before naming its steps")
        self.names: list[str] = json.loads(ready)

    def step(self, name: str) -> float:
        """Take the step ``name``; its seconds, as the worker timed them."""
        self.stdin.write(name + "\n")
        self.stdin.flush()
        answer = self.stdout.readline()
        if not answer:
            raise RuntimeError(f"the worker of step {name!r} exited with {self.process.wait()} during it")
        return float(answer)

    def close(self) -> None:
        self.stdin.close()
        self.process.wait()


def take_stdout() -> TextIO:
    """The protocol's channel (the process's stdout); from now on ``print`` and the libraries write to stderr."""
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    return channel


def serve(steps: dict[str, Callable[[], object]], channel: TextIO) -> None:
    """The worker's side: name ``steps``, then take each one named on stdin and answer its seconds."""
    print(json.dumps(list(steps)), file=channel, flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        steps[line.strip()]()
        print(time.perf_counter() - start, file=channel, flush=True)
