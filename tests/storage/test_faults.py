"""`Breaker` (a state machine on a fake clock) and `FaultyBackend` (each fault, and the seed).

The conformance suite runs every backend under a moderate mix of faults; here each fault is
turned up alone so its effect is exact, and a long random run under heavy faults checks
correct-or-miss at every step.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from aiohicache import ConfigError
from aiohicache.storage import (
    Breaker,
    BreakerState,
    FaultyBackend,
    MemoryBackend,
    StorageError,
    StorageReadError,
    StorageWriteError,
)

from .conftest import FMT, PAYLOAD, make_keys, make_page

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------- breaker

def make_breaker(clock: FakeClock) -> Breaker:
    return Breaker(failures_to_open=3, cooldown_s=10.0, clock=clock)


def test_the_breaker_opens_after_failures_in_a_row_and_refuses_for_the_cooldown() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state is CLOSED
    breaker.record_failure()
    assert breaker.state is OPEN and breaker.times_opened == 1
    clock.now += 9.9
    assert not breaker.allow()
    assert breaker.state is OPEN


def test_a_success_resets_the_count_of_failures_in_a_row() -> None:
    breaker = make_breaker(FakeClock())
    for _ in range(5):
        breaker.record_failure()
        breaker.record_failure()
        breaker.record_success()
    assert breaker.state is CLOSED and breaker.times_opened == 0


def test_after_the_cooldown_one_probe_goes_through_and_its_success_closes() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    for _ in range(3):
        breaker.record_failure()
    clock.now += 10.0
    assert breaker.state is HALF_OPEN
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one
    breaker.record_success()
    assert breaker.state is CLOSED
    assert all(breaker.allow() for _ in range(3))


def test_a_failed_probe_opens_the_breaker_for_another_cooldown() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    for _ in range(3):
        breaker.record_failure()
    clock.now += 10.0
    assert breaker.allow()
    breaker.record_failure()  # one failure is enough in half_open
    assert breaker.state is OPEN and breaker.times_opened == 2
    clock.now += 9.0
    assert not breaker.allow()
    clock.now += 1.0
    assert breaker.allow()


def test_a_probe_never_reported_is_given_up_after_a_cooldown() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    for _ in range(3):
        breaker.record_failure()
    clock.now += 10.0
    assert breaker.allow()  # its caller is cancelled: no record_* ever comes
    clock.now += 5.0
    assert not breaker.allow()
    clock.now += 5.0
    assert breaker.allow()


def test_a_probe_released_unused_goes_to_the_next_caller_and_counts_nothing() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    for _ in range(3):
        breaker.record_failure()
    clock.now += 10.0
    assert breaker.allow()  # the probe, but its caller had nothing to send
    breaker.release()
    assert breaker.state is HALF_OPEN  # not closed: nothing reached the backend
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state is OPEN and breaker.times_opened == 2
    breaker.release()  # not half-open: nothing to give back
    assert breaker.state is OPEN and not breaker.allow()


def test_late_outcomes_while_open_change_nothing() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    for _ in range(3):
        breaker.record_failure()
    breaker.record_success()  # a call that started before the breaker opened
    breaker.record_failure()
    assert breaker.state is OPEN and breaker.times_opened == 1
    clock.now += 10.0
    assert breaker.state is HALF_OPEN  # the cooldown was not restarted


def test_the_breaker_uses_the_monotonic_clock_by_default() -> None:
    breaker = Breaker(failures_to_open=1, cooldown_s=0.0)
    breaker.record_failure()
    assert breaker.state is HALF_OPEN  # a zero cooldown has passed at once
    assert repr(breaker) == "<Breaker half_open [1/1 failures, opened 1 times]>"
    assert time.monotonic() > 0


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"failures_to_open": 0}, "failures_to_open"), ({"failures_to_open": 1.5},
                                                    "failures_to_open"),
    ({"cooldown_s": -1.0}, "cooldown_s"), ({"cooldown_s": float("inf")}, "cooldown_s"),
])
def test_bad_breaker_settings_raise_config_error(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Breaker(**kwargs)


# ---------------------------------------------------------------------------- each fault alone

def views(keys: list[str], *, version: int = 0) -> list[memoryview]:
    return [memoryview(make_page(key, version=version)) for key in keys]


def buffers(num: int) -> list[memoryview]:
    return [memoryview(bytearray(PAYLOAD)) for _ in range(num)]


async def stored(keys: list[str], **faults: Any) -> FaultyBackend:
    """A faulty backend whose inner store holds pages for `keys`."""
    inner = MemoryBackend(FMT)
    await inner.set_from(keys, views(keys))
    return FaultyBackend(inner, seed=0, **faults)


async def test_errors_raise_read_and_write_errors() -> None:
    keys = make_keys(2)
    async with await stored(keys, error_rate=1.0) as faulty:
        with pytest.raises(StorageReadError, match="injected"):
            await faulty.exists(keys)
        with pytest.raises(StorageReadError):
            await faulty.get_into(keys, buffers(2))
        with pytest.raises(StorageWriteError):
            await faulty.set_from(keys, views(keys))
        with pytest.raises(StorageWriteError):
            await faulty.delete(keys)
        assert faulty.stats().extra["injected_errors"] == 4
        assert faulty.stats().errors == 4


async def test_an_error_after_the_call_may_leave_the_write_landed() -> None:
    keys = make_keys(1)
    landed = 0
    async with FaultyBackend(MemoryBackend(FMT), seed=3, error_rate=1.0) as faulty:
        for _ in range(20):
            await faulty.inner.delete(keys)
            with pytest.raises(StorageWriteError):
                await faulty.set_from(keys, views(keys))
            landed += await faulty.inner.exists(keys)
    assert 0 < landed < 20  # raised before the inner call, or after it


async def test_a_timeout_hangs_then_raises() -> None:
    keys = make_keys(1)
    async with await stored(keys, timeout_rate=1.0, timeout_s=0.05) as faulty:
        start = time.monotonic()
        with pytest.raises(StorageReadError, match="timeout"):
            await faulty.get_into(keys, buffers(1))
        assert time.monotonic() - start >= 0.05
        assert faulty.stats().extra["injected_timeouts"] == 1


async def test_corruption_in_transit_is_caught_as_a_counted_miss() -> None:
    keys = make_keys(8)
    async with await stored(keys, corrupt_rate=1.0) as faulty:
        out = buffers(8)
        assert await faulty.get_into(keys, out) == [False] * 8
        assert all(bytes(b) == bytes(PAYLOAD) for b in out)
        assert faulty.stats().corrupt == 8
        assert await faulty.inner.get_into(keys, out) == [True] * 8  # storage is intact


async def test_partial_batches_fail_keys_alone() -> None:
    keys = make_keys(40)
    async with await stored(keys, partial_rate=0.5) as faulty:
        hits = await faulty.get_into(keys, buffers(40))
        assert 0 < sum(hits) < 40
        assert faulty.stats().extra["injected_partial"] == 40 - sum(hits)
        found = await faulty.exists(keys)
        assert found < 40


async def test_latency_delays_each_key() -> None:
    keys = make_keys(4)
    async with await stored(keys, latency=(0.02, 0.03)) as faulty:
        start = time.monotonic()
        assert await faulty.get_into(keys, buffers(4)) == [True] * 4
        elapsed = time.monotonic() - start
    assert 0.02 <= elapsed < 0.5  # keys wait concurrently, not one after another


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"error_rate": 1.5}, "error_rate"), ({"timeout_rate": -0.1}, "timeout_rate"),
    ({"corrupt_rate": True}, "corrupt_rate"), ({"partial_rate": "x"}, "partial_rate"),
    ({"latency": (0.2, 0.1)}, "latency"), ({"latency": (-1.0, 0.0)}, "latency"),
    ({"timeout_s": -1.0}, "timeout_s"),
])
def test_bad_fault_settings_raise_config_error(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        FaultyBackend(MemoryBackend(FMT), seed=0, **kwargs)


# ---------------------------------------------------------------------------- the seed

HEAVY: dict[str, Any] = {"error_rate": 0.3, "timeout_rate": 0.1, "timeout_s": 0.0,
                         "corrupt_rate": 0.3, "partial_rate": 0.3, "latency": (0.0, 0.001)}


async def run_script(faulty: FaultyBackend, *, steps: int, script_seed: int) -> list[object]:
    """Random calls on `faulty`; what each returned (or the error it raised). Every page
    read must be the page written: correct-or-miss at every step."""
    rng = random.Random(script_seed)
    keys = make_keys(12)
    outcomes: list[object] = []
    for _ in range(steps):
        batch = rng.sample(keys, rng.randint(1, 6))
        op = rng.choice(["set", "get", "exists", "delete"])
        try:
            outcomes.append(await _step(faulty, op, batch))
        except StorageError as exc:
            outcomes.append(type(exc).__name__)
    return outcomes


async def _step(faulty: FaultyBackend, op: str, batch: list[str]) -> object:
    if op == "set":
        return await faulty.set_from(batch, views(batch))
    if op == "exists":
        return await faulty.exists(batch)
    if op == "delete":
        return await faulty.delete(batch)
    out = buffers(len(batch))
    hits = await faulty.get_into(batch, out)
    for key, hit, buf in zip(batch, hits, out, strict=True):
        assert bytes(buf) == (make_page(key) if hit else bytes(PAYLOAD)), "wrong KV"
    return hits


async def test_the_same_seed_replays_the_same_faults() -> None:
    runs = []
    for _ in range(2):
        async with FaultyBackend(MemoryBackend(FMT), seed=42, **HEAVY) as faulty:
            runs.append((await run_script(faulty, steps=150, script_seed=7), faulty.stats()))
    assert runs[0] == runs[1]
    async with FaultyBackend(MemoryBackend(FMT), seed=43, **HEAVY) as faulty:
        assert await run_script(faulty, steps=150, script_seed=7) != runs[0][0]


async def test_heavy_faults_never_return_wrong_bytes() -> None:
    async with FaultyBackend(MemoryBackend(FMT), seed=5, **HEAVY) as faulty:
        outcomes = await run_script(faulty, steps=400, script_seed=11)
        extra = faulty.stats().extra
    assert {"StorageReadError", "StorageWriteError"} <= set(map(str, outcomes))
    assert all(extra[f"injected_{kind}"] > 0
               for kind in ("errors", "timeouts", "corrupt", "partial"))
