"""Fixtures of the server tests: the tiny model served on a free loopback port."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from oneblock.serve.engine import Engine
from oneblock.text.tokenizer import ByteTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from serve_testing import KEY, Running, tiny_model


@pytest.fixture(scope="module")
def tiny() -> Iterator[Running]:
    """The tiny model behind an API key, eight rows, a queue of 32."""
    engine = Engine(tiny_model(), ByteTokenizer(), max_batch=8, max_queue=32)
    running = Running(engine, api_key=KEY)
    yield running
    running.close()
