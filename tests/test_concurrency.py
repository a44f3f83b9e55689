"""The concurrency vocabulary (`aiohicache._concurrency`) on every backend the cache runs on.

Async tests run on asyncio and uvloop (conftest); a trio twin runs each one through
`trio.run`, as `test_trio` does.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import anyio
import pytest

from aiohicache._concurrency import finish_then_cancel, submit_to_thread

trio = pytest.importorskip("trio")


def on_trio(test: Callable[[], Awaitable[None]]) -> None:
    trio.run(test)


# ------------------------------------------------------------------------ submit_to_thread

async def test_a_call_its_executor_drops_raises_instead_of_hanging() -> None:
    """A call still queued when its executor shuts down with ``cancel_futures`` never runs:
    its waiter gets an error, not a wait for ever (and the loop gets no stray exception)."""
    with ThreadPoolExecutor(1) as executor:
        gate = threading.Event()
        running = submit_to_thread(executor, gate.wait)
        queued = submit_to_thread(executor, lambda: 42)
        executor.shutdown(wait=False, cancel_futures=True)
        gate.set()
        with anyio.fail_after(2):
            assert await running.wait() is True
            with pytest.raises(RuntimeError, match="executor shut down"):
                await queued.wait()


def test_a_call_its_executor_drops_raises_instead_of_hanging_under_trio() -> None:
    on_trio(test_a_call_its_executor_drops_raises_instead_of_hanging)


# ------------------------------------------------------------------------ finish_then_cancel

async def test_finish_then_cancel_reraises_a_deadline_that_passed_meanwhile() -> None:
    """The work runs to its end, then the caller sees its cancellation at once: a deadline
    that passed meanwhile fails the call (`fail_after` raises), it is not absorbed."""
    finished = []

    async def work() -> int:
        await anyio.sleep(0.05)
        finished.append(True)
        return 7

    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.01):
            await finish_then_cancel(work())
    assert finished == [True]
    with anyio.move_on_after(0.01) as scope:
        await finish_then_cancel(work())
        pytest.fail("the call returned into a cancelled scope")
    assert scope.cancelled_caught and finished == [True, True]


def test_finish_then_cancel_reraises_a_deadline_that_passed_meanwhile_under_trio() -> None:
    on_trio(test_finish_then_cancel_reraises_a_deadline_that_passed_meanwhile)


# ------------------------------------------------------------------------------------ Detached

INTERRUPTED_RUN = """
import asyncio, sys, uvloop
from aiohicache._concurrency import Detached

async def worker():
    await asyncio.sleep(0)
    raise {interrupt}

async def main():
    detached = Detached(worker, name="worker")
    await asyncio.sleep(0.5)
    assert detached.done.done()

with asyncio.Runner(loop_factory={loop_factory}) as runner:
    runner.run(main())
print("went on")
"""
"""Run as a program of its own: an interrupt escaping a loop leaves CPython 3.11's
recursion counter off, which breaks the test process later (``SystemError`` in ast)."""


@pytest.mark.parametrize(("interrupt", "returncode", "loop_factory"), [
    ("SystemExit(3)", 3, "asyncio.new_event_loop"),
    ("KeyboardInterrupt", -signal.SIGINT, "uvloop.new_event_loop"),
])
def test_an_interrupt_in_a_detached_task_stops_the_asyncio_loop(
        interrupt: str, returncode: int, loop_factory: str) -> None:
    """A KeyboardInterrupt (a second Ctrl-C lands in whatever code the loop runs) or
    SystemExit in a detached worker stops the run, as from any asyncio task: it is not kept
    in `done`, where nobody reads it, while the program goes on."""
    program = INTERRUPTED_RUN.format(interrupt=interrupt, loop_factory=loop_factory)
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=30, check=False)
    assert "went on" not in run.stdout
    assert run.returncode == returncode, run.stderr
