"""Failing storage on purpose, and surviving it: a fault-injecting wrapper and a breaker.

`FaultyBackend` wraps any backend and, drawing from a seeded RNG, adds latency, errors,
timeouts, corrupted reads and partial batches, so tests (and chaos runs) check that the cache
stays correct-or-miss. `Breaker` is what a controller uses to stop calling a backend that
keeps failing, for a cool-down, then try it again with a single probe.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import partial
from typing import Literal, Self, TypeVar, cast

import anyio

from .._validate import check_int, check_number
from ..errors import ConfigError, HiCacheError
from ._common import check_buffers, check_keys
from .base import HEADER_SIZE, BackendStats, StorageBackend, decode_page, encode_header
from .errors import StorageError, StorageReadError, StorageWriteError

__all__ = ("Breaker", "BreakerState", "FaultyBackend")

log = logging.getLogger(__name__)

ErrorPoint = Literal["before", "after"] | None
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class _Plan:
    """The faults of one call, drawn all at once when it starts (so a seed replays them)."""

    timeout: bool
    error: ErrorPoint
    """Raise before touching the inner backend, or after it did its work."""
    delays: list[float]
    """Latency of each key (one shared delay for `exists` and `delete`)."""
    partial: list[bool]
    """Keys that fail on their own: a miss, or not stored."""
    corrupt: list[int | None]
    """For a read, the byte of the object to flip in transit, per key (None: intact)."""


class FaultyBackend:
    """A `StorageBackend` that wraps `inner` and injects faults, reproducibly by `seed`.

    Args:
        inner: the backend that really stores the pages.
        seed: seeds the RNG; the same seed and the same calls give the same faults.
        error_rate: chance that a call raises `StorageReadError` (exists, get) or
            `StorageWriteError` (set, delete), half the time after the inner call ran (a
            write may then have landed).
        latency: (low, high) seconds of uniform delay, per key for get and set (so keys of
            one batch finish at different times), per call otherwise.
        timeout_rate: chance that a call hangs for `timeout_s`, then raises as above.
        corrupt_rate: chance that a page read is flipped in transit; the wrapper checks it
            with `decode_page` like a backend would, so it must turn into a miss.
        partial_rate: chance that a key fails alone (get: a miss, set: not stored, exists:
            the count stops there).
        timeout_s: how long an injected timeout hangs.

    Validation (keys, buffers) happens before any fault, as in every backend.
    """

    def __init__(self, inner: StorageBackend, *, seed: int, error_rate: float = 0.0,
                 latency: tuple[float, float] = (0.0, 0.0), timeout_rate: float = 0.0,
                 corrupt_rate: float = 0.0, partial_rate: float = 0.0,
                 timeout_s: float = 1.0) -> None:
        for name, rate in (("error_rate", error_rate), ("timeout_rate", timeout_rate),
                           ("corrupt_rate", corrupt_rate), ("partial_rate", partial_rate)):
            check_number(name, rate, low=0.0, high=1.0)
        _check_latency(latency)
        check_number("timeout_s", timeout_s, low=0.0)
        self.inner = inner
        self.fmt = inner.fmt
        self.error_rate = error_rate
        self.latency = latency
        self.timeout_rate = timeout_rate
        self.corrupt_rate = corrupt_rate
        self.partial_rate = partial_rate
        self.timeout_s = timeout_s
        self._rng = random.Random(seed)
        self._injected = dict.fromkeys(("errors", "timeouts", "corrupt", "partial"), 0)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<FaultyBackend around {self.inner!r} [injected {self._injected}]>"

    # ---------------------------------------------------------------------------- the protocol

    async def exists(self, keys: Sequence[str]) -> int:
        """The inner count, cut at the first key that fails alone.

        Cancellation: as the inner backend's.
        """
        check_keys(keys)
        plan = self._plan(len(keys), per_key=False, read=True)

        async def work() -> int:
            await anyio.sleep(plan.delays[0])
            return await self.inner.exists(keys)

        num = await self._call(plan, StorageReadError, work)
        for i, failed in enumerate(plan.partial[:num]):
            if failed:
                self._injected["partial"] += 1
                return i
        return num

    async def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Each key read on its own, after its own delay, into a scratch page; True where a
        verified payload was copied into its buffer.

        Cancellation: reads in flight are cancelled (the inner backend decides what that
        means); no buffer is written (payloads are copied only after the last read).
        """
        views = check_buffers(self.fmt, keys, buffers, to_fill=True)
        plan = self._plan(len(keys), per_key=True, read=True)
        scratch = [memoryview(bytearray(view.nbytes)) for view in views]
        hits = await self._call(plan, StorageReadError, partial(
            self._per_key, plan, lambda i: self.inner.get_into([keys[i]], [scratch[i]])))
        for i, flip in enumerate(plan.corrupt):
            if hits[i] and flip is not None:
                hits[i] = self._survives_transit(keys[i], scratch[i], flip)
        for view, page, hit in zip(views, scratch, hits, strict=True):
            if hit:
                view[:] = page
        return hits

    async def set_from(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Each key stored on its own, after its own delay; True where the inner store did.

        Cancellation: writes in flight are cancelled (the inner backend keeps every object
        whole or absent).
        """
        views = check_buffers(self.fmt, keys, buffers)
        plan = self._plan(len(keys), per_key=True, read=False)
        return await self._call(plan, StorageWriteError, partial(
            self._per_key, plan, lambda i: self.inner.set_from([keys[i]], [views[i]])))

    async def delete(self, keys: Sequence[str]) -> int:
        """The inner delete, with the call's faults. Cancellation: as the inner backend's."""
        check_keys(keys)
        plan = self._plan(len(keys), per_key=False, read=False)

        async def work() -> int:
            await anyio.sleep(plan.delays[0])
            return await self.inner.delete(keys)

        return await self._call(plan, StorageWriteError, work)

    def stats(self) -> BackendStats:
        """The inner stats, with injected corruption in `corrupt`, injected errors and
        timeouts in `errors`, and each kind of fault in `extra` (``injected_*``)."""
        inner = self.inner.stats()
        injected = {f"injected_{kind}": num for kind, num in self._injected.items()}
        return replace(inner, corrupt=inner.corrupt + self._injected["corrupt"],
                       errors=inner.errors + self._injected["errors"]
                       + self._injected["timeouts"], extra={**inner.extra, **injected})

    async def aclose(self) -> None:
        """Close the inner backend."""
        await self.inner.aclose()

    # ---------------------------------------------------------------------------- injection

    def _plan(self, num: int, *, per_key: bool, read: bool) -> _Plan:
        rng = self._rng
        timeout = rng.random() < self.timeout_rate
        error: ErrorPoint = None
        if rng.random() < self.error_rate:
            error = "before" if rng.random() < 0.5 else "after"
        delays = [rng.uniform(*self.latency) for _ in range(num if per_key else 1)]
        alone = [rng.random() < self.partial_rate for _ in range(num)]
        size = HEADER_SIZE + self.fmt.payload_bytes
        corrupt = [rng.randrange(size) if read and rng.random() < self.corrupt_rate else None
                   for _ in range(num)]
        return _Plan(timeout, error, delays, alone, corrupt)

    async def _call(self, plan: _Plan, error: type[StorageError],
                    work: Callable[[], Awaitable[R]]) -> R:
        """Run `work` between the call's injected timeout and errors."""
        if plan.timeout:
            self._injected["timeouts"] += 1
            await anyio.sleep(self.timeout_s)
            raise error(f"storage: injected timeout after {self.timeout_s}s")
        self._raise_if(plan.error == "before", error)
        result = await work()
        self._raise_if(plan.error == "after", error)
        return result

    def _raise_if(self, when: bool, error: type[StorageError]) -> None:
        if when:
            self._injected["errors"] += 1
            raise error("storage: injected error")

    async def _per_key(self, plan: _Plan,
                       call: Callable[[int], Awaitable[list[bool]]]) -> list[bool]:
        """`call` for every key on its own, after its own delay, all concurrently."""
        results = [False] * len(plan.partial)
        failed: list[HiCacheError] = []

        async def one(i: int) -> None:
            await anyio.sleep(plan.delays[i])
            if plan.partial[i]:
                self._injected["partial"] += 1
                return
            try:
                (results[i],) = await call(i)
            except HiCacheError as exc:  # raised once, below: no ExceptionGroup
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(len(results)):
                tg.start_soon(one, i)
        if failed:
            raise failed[0]
        return results

    def _survives_transit(self, key: str, page: memoryview, flip: int) -> bool:
        """Whether `page`, framed as `key`'s object with the byte at `flip` flipped, still
        decodes (it must not: the checksum catches it)."""
        blob = bytearray(encode_header(self.fmt, key, page))
        blob += page
        blob[flip] ^= 0xFF
        self._injected["corrupt"] += 1
        return decode_page(self.fmt, key, memoryview(blob)) is not None


def _check_latency(latency: object) -> None:
    try:
        low, high = cast(tuple[float, float], latency)
        check_number("latency", high, low=check_number("latency", low, low=0.0))
    except (TypeError, ValueError):  # ConfigError is a ValueError
        raise ConfigError(f"latency: must be (low, high) seconds with 0 <= low <= high, "
                          f"got {latency!r}") from None


# ---------------------------------------------------------------------------- circuit breaker

class BreakerState(StrEnum):
    CLOSED = "closed"
    """Calls go through; failures in a row are counted."""
    OPEN = "open"
    """Calls are refused until the cool-down has passed."""
    HALF_OPEN = "half_open"
    """The cool-down has passed: one probe call may go through; its outcome decides."""


class Breaker:
    """A circuit breaker: bypass a backend that keeps failing, for a cool-down.

    ``closed --failures_to_open failures in a row--> open --cooldown_s--> half_open``;
    in half_open `allow` lets one probe through: its success closes the breaker, its failure
    opens it for another cool-down. A probe whose outcome is never recorded (its caller was
    cancelled) is given up after `cooldown_s`, and another probe is allowed.

        breaker = Breaker(failures_to_open=3, cooldown_s=5.0)
        if breaker.allow():
            try:
                hits = await backend.get_into(keys, buffers)
            except StorageError:
                breaker.record_failure()
            else:
                breaker.record_success()

    Sync and loop-free; `clock` (seconds, monotonic) is injectable for tests.
    """

    def __init__(self, *, failures_to_open: int = 5, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.failures_to_open = check_int("failures_to_open", failures_to_open, low=1)
        self.cooldown_s = check_number("cooldown_s", cooldown_s, low=0.0)
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_at: float | None = None
        self.times_opened = 0
        """How many times the breaker has opened."""

    def __repr__(self) -> str:
        return (f"<Breaker {self.state.value} [{self._failures}/{self.failures_to_open} "
                f"failures, opened {self.times_opened} times]>")

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and (
                self._clock() - self._opened_at >= self.cooldown_s):
            self._state = BreakerState.HALF_OPEN
            self._probe_at = None
            log.info("L3 breaker half-open: probing storage again",
                     extra={"tier": "L3", "event": "breaker_half_open"})
        return self._state

    def allow(self) -> bool:
        """Whether a call may go to the backend now (in half_open: whether it is the probe)."""
        state = self.state
        if state is not BreakerState.HALF_OPEN:
            return state is BreakerState.CLOSED
        now = self._clock()
        if self._probe_at is not None and now - self._probe_at < self.cooldown_s:
            return False
        self._probe_at = now
        return True

    def release(self) -> None:
        """An allowed call did not reach the backend after all (nothing to send): in
        half_open its probe goes to the next caller; nothing is counted."""
        if self._state is BreakerState.HALF_OPEN:
            self._probe_at = None

    def record_success(self) -> None:
        """A call succeeded: count from zero again; a probe's success closes the breaker."""
        if self.state is BreakerState.OPEN:
            return  # a late call that started before the breaker opened proves little
        if self._state is BreakerState.HALF_OPEN:
            log.info("L3 breaker closed: storage is back",
                     extra={"tier": "L3", "event": "breaker_closed"})
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._probe_at = None

    def record_failure(self) -> None:
        """A call failed: the last straw, or a probe's failure, opens the breaker."""
        state = self.state
        if state is BreakerState.OPEN:
            return
        self._failures += 1
        if state is BreakerState.HALF_OPEN or self._failures >= self.failures_to_open:
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self._probe_at = None
            self.times_opened += 1
            log.warning("L3 breaker open after %d failures: storage bypassed for %.1f s",
                        self._failures, self.cooldown_s,
                        extra={"tier": "L3", "event": "breaker_open", "failures": self._failures,
                               "cooldown_s": self.cooldown_s})
