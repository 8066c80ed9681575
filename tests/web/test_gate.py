"""The gate: one computation, one waiting, 503 beyond, and no worker thread of the shared pool spent waiting."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import pytest
from async_testing import run_async

from oneblock.web.gate import Busy, Gate, Gone


def test_one_runs_one_waits_the_third_is_busy():
    gate, release, order = Gate(queue=1), threading.Event(), []

    def work(name):
        def run():
            order.append(name)
            release.wait(10)
            return name

        return run

    async def main():
        results = {}

        async def call(name):
            results[name] = await gate.run(work(name))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call, "a")
            tasks.start_soon(call, "b")
            while gate.admitted < 2 or not order:  # "a" runs in its thread, "b" waits
                await anyio.sleep(0.01)
            with pytest.raises(Busy) as busy:
                await gate.run(work("c"))
            assert busy.value.retry_after >= 1
            # The running computation does not hold one of the default pool's threads; the waiting one none.
            assert anyio.to_thread.current_default_thread_limiter().borrowed_tokens == 0
            assert order == ["a"]
            release.set()
        return results

    assert run_async(main) == {"a": "a", "b": "b"}
    assert gate.admitted == 0


def test_a_client_gone_while_waiting_skips_the_work():
    gate, ran = Gate(), []

    async def gone():
        return True

    async def main():
        await gate.run(lambda: ran.append(1), abandoned=gone)

    with pytest.raises(Gone):
        run_async(main)
    assert ran == [] and gate.admitted == 0


def test_errors_of_the_work_pass_through_and_free_the_gate():
    gate = Gate()

    def broken():
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        run_async(gate.run, broken)
    assert run_async(gate.run, lambda: 3) == 3


def test_negative_queue_refused():
    with pytest.raises(ValueError, match="queue must be >= 0; got -1"):
        Gate(queue=-1)
