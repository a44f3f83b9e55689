"""`RunQueue`: the runs of a batch on a thread pool, a few at a time, each started, called
and finished whole, even when the batch is cancelled."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from aiohicache.storage._common import RunQueue


class Probe:
    """A run that records what happened to it; its call waits for `gate` if given."""

    def __init__(self, log: list[str], name: str, gate: threading.Event | None = None,
                 error: BaseException | None = None, bug_in_finish: bool = False) -> None:
        self.log, self.name, self.gate = log, name, gate
        self.error, self.bug_in_finish = error, bug_in_finish
        self.running = threading.Event()

    def start(self) -> Callable[[], str]:
        self.log.append(f"start {self.name}")
        return self.call

    def call(self) -> str:
        self.running.set()
        if self.gate is not None:
            assert self.gate.wait(5)
        if self.error is not None:
            raise self.error
        return self.name

    def finish(self, result: str) -> None:
        if self.bug_in_finish:
            raise KeyError("a bug")
        self.log.append(f"finish {result}")

    def fail(self, exc: BaseException) -> None:
        self.log.append(f"fail {self.name}: {exc}")


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as executor:
        yield executor


async def test_every_run_is_started_called_and_finished_in_order(
        pool: ThreadPoolExecutor) -> None:
    log: list[str] = []
    await RunQueue(1).run(pool, [Probe(log, str(i)) for i in range(3)])
    assert log == ["start 0", "finish 0", "start 1", "finish 1", "start 2", "finish 2"]


async def test_at_most_limit_runs_are_in_flight(pool: ThreadPoolExecutor) -> None:
    log: list[str] = []
    gate = threading.Event()
    runs = [Probe(log, str(i), gate) for i in range(5)]
    batch = asyncio.ensure_future(RunQueue(2).run(pool, runs))
    await asyncio.to_thread(runs[1].running.wait, 5)
    assert log == ["start 0", "start 1"]  # the third waits for a free slot
    gate.set()
    await batch
    assert sorted(log) == sorted([f"{what} {i}" for i in range(5) for what in ("start",
                                                                            "finish")])


async def test_the_limit_holds_over_all_batches_and_they_take_turns(
        pool: ThreadPoolExecutor) -> None:
    log: list[str] = []
    gate = threading.Event()
    queue = RunQueue(2)
    first = [Probe(log, f"a{i}", gate) for i in range(3)]
    second = [Probe(log, f"b{i}", gate) for i in range(3)]
    batches = [asyncio.ensure_future(queue.run(pool, first))]
    await asyncio.to_thread(first[1].running.wait, 5)
    batches.append(asyncio.ensure_future(queue.run(pool, second)))
    await asyncio.sleep(0.05)
    assert log == ["start a0", "start a1"]  # the second batch waits for a slot
    gate.set()
    await asyncio.gather(*batches)
    starts = [entry for entry in log if entry.startswith("start")]
    assert starts[2:4] in (["start a2", "start b0"], ["start b0", "start a2"])
    assert len(starts) == 6


async def test_a_call_that_raises_fails_its_run_only(pool: ThreadPoolExecutor) -> None:
    log: list[str] = []
    runs = [Probe(log, "0"), Probe(log, "1", error=OSError(5, "EIO")), Probe(log, "2")]
    await RunQueue(1).run(pool, runs)
    assert log == ["start 0", "finish 0", "start 1", "fail 1: [Errno 5] EIO", "start 2",
                   "finish 2"]


async def test_a_closed_pool_fails_each_run(pool: ThreadPoolExecutor) -> None:
    log: list[str] = []
    pool.shutdown()
    await RunQueue(2).run(pool, [Probe(log, "0"), Probe(log, "1")])
    assert log == ["start 0", "fail 0: cannot schedule new futures after shutdown",
                   "start 1", "fail 1: cannot schedule new futures after shutdown"]


async def test_a_bug_in_finish_is_raised_after_the_runs_in_flight_end(
        pool: ThreadPoolExecutor) -> None:
    log: list[str] = []
    gate = threading.Event()
    runs = [Probe(log, "0", bug_in_finish=True), Probe(log, "1", gate), Probe(log, "2")]
    batch = asyncio.ensure_future(RunQueue(2).run(pool, runs))
    await asyncio.to_thread(runs[1].running.wait, 5)
    await asyncio.sleep(0.05)  # run 0 has finished (with its bug): the batch still waits
    assert not batch.done()
    gate.set()
    with pytest.raises(KeyError, match="a bug"):
        await batch
    assert log == ["start 0", "start 1", "finish 1"]  # run 2 never started


async def test_cancelling_skips_the_runs_not_started_and_finishes_those_in_flight(
        pool: ThreadPoolExecutor) -> None:
    log: list[str] = []
    gate = threading.Event()
    runs = [Probe(log, str(i), gate) for i in range(6)]
    batch = asyncio.ensure_future(RunQueue(2).run(pool, runs))
    await asyncio.to_thread(runs[1].running.wait, 5)
    batch.cancel()
    await asyncio.sleep(0.05)
    assert not batch.done()  # it waits for the two runs in flight
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert sorted(log) == ["finish 0", "finish 1", "start 0", "start 1"]
